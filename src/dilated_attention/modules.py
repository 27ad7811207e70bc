"""``nn.Module`` wrappers over :func:`dilated_attention.dilated_attention`."""

from __future__ import annotations

import numbers
from typing import Optional, Sequence

import torch
from torch import nn

from . import validation
from .functional import dilated_attention


class DilatedAttention(nn.Module):
    """Dilated attention over ``(B, N, H, D)`` tensors, with no parameters.

    Dropout on the attention probabilities is applied only in training mode.
    See :func:`dilated_attention.dilated_attention` for the arguments.
    """

    def __init__(
        self,
        segment_lengths: Sequence[int],
        dilation_rates: Sequence[int],
        *,
        mode: str = "mixture",
        softmax_scale: Optional[float] = None,
        dropout: float = 0.0,
    ):
        super().__init__()
        self.segment_lengths, self.dilation_rates = validation.check_branches(segment_lengths, dilation_rates)
        self.mode = validation.check_mode(mode)
        if softmax_scale is not None:
            validation.check_scale(softmax_scale, 1)
        self.softmax_scale = softmax_scale
        self.dropout = validation.check_dropout(dropout, "dropout")

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        is_causal: bool = False,
        key_padding_mask: Optional[torch.Tensor] = None,
        process_group=None,
    ) -> torch.Tensor:
        """``q, k, v`` ``(B, N, H, D)`` -> ``(B, N, H, D)``; with ``process_group``,
        this rank's shard of the sequence (see :func:`dilated_attention.dilated_attention`)."""
        return dilated_attention(
            q,
            k,
            v,
            self.segment_lengths,
            self.dilation_rates,
            mode=self.mode,
            is_causal=is_causal,
            softmax_scale=self.softmax_scale,
            dropout_p=self.dropout if self.training else 0.0,
            key_padding_mask=key_padding_mask,
            process_group=process_group,
        )

    def extra_repr(self) -> str:
        return (
            f"segment_lengths={list(self.segment_lengths)}, dilation_rates={list(self.dilation_rates)}, "
            f"mode={self.mode!r}, softmax_scale={self.softmax_scale}, dropout={self.dropout}"
        )


class MultiheadDilatedAttention(nn.Module):
    """Multi-head dilated self-attention on batch-first ``(B, N, embed_dim)`` inputs.

    ``q, k, v`` projections, :class:`DilatedAttention`, then (with ``sub_layernorm``)
    MAGNETO's LayerNorm before the output projection.

    Initialisation (MAGNETO, Wang et al. 2022): ``q_proj`` and ``k_proj`` weights
    are Xavier-normal with gain 1; ``v_proj`` and ``out_proj`` weights Xavier-normal
    with gain ``gamma_init`` (MAGNETO's ``gamma``, which the enclosing model derives
    from its depth, e.g. ``sqrt(log(2 * num_layers))`` for an encoder); biases 0.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        segment_lengths: Sequence[int],
        dilation_rates: Sequence[int],
        *,
        mode: str = "mixture",
        dropout: float = 0.0,
        bias: bool = True,
        sub_layernorm: bool = True,
        layer_norm_eps: float = 1e-5,
        gamma_init: float = 1.0,
        device=None,
        dtype=None,
    ):
        super().__init__()
        for name, value in (("embed_dim", embed_dim), ("num_heads", num_heads)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if embed_dim % num_heads:
            raise ValueError(
                f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads}): "
                "each head gets embed_dim // num_heads channels"
            )
        self.attention = DilatedAttention(segment_lengths, dilation_rates, mode=mode, dropout=dropout)
        if mode == "head_groups":
            validation.check_head_groups(num_heads, len(self.attention.segment_lengths))
        self.embed_dim, self.num_heads = int(embed_dim), int(num_heads)
        self.gamma_init = float(gamma_init)
        factory = {"device": device, "dtype": dtype}
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        self.k_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        self.v_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        self.norm = nn.LayerNorm(embed_dim, eps=layer_norm_eps, **factory) if sub_layernorm else None
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """MAGNETO initialisation (see the class docstring)."""
        for proj, gain in (
            (self.q_proj, 1.0),
            (self.k_proj, 1.0),
            (self.v_proj, self.gamma_init),
            (self.out_proj, self.gamma_init),
        ):
            nn.init.xavier_normal_(proj.weight, gain=gain)
            if proj.bias is not None:
                nn.init.zeros_(proj.bias)
        if self.norm is not None:
            self.norm.reset_parameters()

    def forward(
        self,
        query: torch.Tensor,
        key: Optional[torch.Tensor] = None,
        value: Optional[torch.Tensor] = None,
        key_padding_mask: Optional[torch.Tensor] = None,
        need_weights: bool = False,
        is_causal: bool = False,
        process_group=None,
    ) -> tuple[torch.Tensor, None]:
        """``query`` (and ``key``, ``value``, which default to it) ``(B, N, embed_dim)``
        -> ``(output (B, N, embed_dim), None)``, like ``nn.MultiheadAttention``.

        With ``process_group`` the inputs are this rank's shard of the sequence; the
        projections and the LayerNorm act per token, so the output is this rank's
        shard of the single-process output. Parameter gradients are this shard's
        part: sum them over ranks (as DistributedDataParallel does) for the
        single-process gradients."""
        if need_weights:
            raise ValueError(
                "need_weights=True is not supported: dilated attention never forms the "
                "(N, N) weight matrix; pass need_weights=False (use "
                "dilated_attention.reference.attention_weights_uniform to inspect the pattern)"
            )
        key = query if key is None else key
        value = query if value is None else value
        for name, t in (("query", query), ("key", key), ("value", value)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dim() != 3 or t.shape[-1] != self.embed_dim:
                raise ValueError(
                    f"{name} must have shape (batch, seq_len, embed_dim={self.embed_dim}) "
                    f"(batch first), got {tuple(t.shape)}"
                )
        heads = (self.num_heads, self.embed_dim // self.num_heads)
        q = self.q_proj(query).unflatten(-1, heads)
        k = self.k_proj(key).unflatten(-1, heads)
        v = self.v_proj(value).unflatten(-1, heads)
        x = self.attention(
            q, k, v, is_causal=is_causal, key_padding_mask=key_padding_mask, process_group=process_group
        ).flatten(-2)
        if self.norm is not None:
            x = self.norm(x)
        return self.out_proj(x), None
