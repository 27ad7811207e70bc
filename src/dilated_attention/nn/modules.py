"""``nn.Module`` wrappers over :func:`dilated_attention.dilated_attention`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

from ..functional import dilated_attention
from ..ops import validation
from .cache import DilatedKVCache, check_batch
from .ordering import ORDERS, grid_permutations, permute
from .rotary import RotaryEmbedding, check_rotary_positions
from .static_cache import StaticKVCache


def sequence_positions(length: int, device, cache=None, process_group=None) -> torch.Tensor:
    """Where ``length`` rows sit in their sequences: ``(length,)`` int64 ``0 ..``, this
    rank's shard positions with ``process_group``, or ``(B, length)`` after each
    sequence's ``cache.position``."""
    steps = torch.arange(length, device=device)
    if cache is not None:
        return cache.position.to(device)[:, None] + steps
    if process_group is not None:
        from ..ops.distributed import shard_start

        return steps + shard_start(process_group, length)
    return steps


def check_saved_configs(module: nn.Module, state_dict, prefix: str, *_) -> None:
    """The configurations a ``state_dict`` records for the library's layers in ``module``
    (their extra states: branches, heads, rotary base), checked before any tensor of it
    loads: a refused checkpoint leaves every weight as it was (a load_state_dict pre-hook)."""
    for name, layer in module.named_modules():
        if isinstance(layer, (DilatedAttention, MultiheadDilatedAttention, RotaryEmbedding)):
            state = state_dict.get(f"{prefix}{name}{'.' if name else ''}_extra_state")
            if state is not None:
                layer.set_extra_state(state)  # a check only: it raises or does nothing


class _Projections(NamedTuple):
    """A :class:`MultiheadDilatedAttention`'s projections in this call: their
    ``device``, the dtype they ``takes`` (their weight's; float32 for a dynamically
    quantized one, ``torch.ao.quantization.quantize_dynamic``), the dtype they
    ``gives`` (what a cache holds: inside ``torch.autocast`` its dtype, but for float64
    parameters, which it leaves as they are, and quantized ones, which give float32)
    and whether ``autocast`` is on for the device."""

    device: torch.device
    takes: torch.dtype
    gives: torch.dtype
    autocast: bool


class DilatedAttention(nn.Module):
    """Dilated attention over ``(B, N, H, D)`` tensors (``layout="bhnd"``: ``(B, H, N, D)``),
    with no parameters.

    Dropout on the attention probabilities is applied only in training mode. The
    branches, mode and scale are stored in the ``state_dict`` (as extra state), and
    loading one saved with others raises ``ValueError``.
    See :func:`dilated_attention.dilated_attention` for the arguments.
    """

    def __init__(
        self,
        segment_lengths: Sequence[int],
        dilation_rates: Sequence[int],
        *,
        mode: str = "mixture",
        head_offsets: str = "interleaved",
        softmax_scale: float | None = None,
        dropout: float = 0.0,
        layout: str = "bnhd",
    ):
        super().__init__()
        self.segment_lengths, self.dilation_rates = validation.check_branches(segment_lengths, dilation_rates)
        self.mode = validation.check_mode(mode)
        self.head_offsets = validation.check_head_offsets(head_offsets)
        if softmax_scale is not None:
            softmax_scale = validation.check_scale(softmax_scale, 1)
        self.softmax_scale = softmax_scale
        self.dropout = validation.check_dropout(dropout, "dropout")
        self.layout = validation.check_layout(layout)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        is_causal: bool = False,
        key_padding_mask: torch.Tensor | None = None,
        process_group=None,
        key_offset=0,
    ) -> torch.Tensor:
        """``q`` ``(B, Lq, H, D)``, ``k, v`` ``(B, Lk, H, D)`` -> ``(B, Lq, H, D)`` (or
        ``(B, H, L, D)`` with ``layout="bhnd"``); with ``process_group``, this rank's
        shard of the sequence; ``key_offset``: the position of ``k``'s first row (see
        :func:`dilated_attention.dilated_attention`)."""
        return dilated_attention(
            q,
            k,
            v,
            self.segment_lengths,
            self.dilation_rates,
            mode=self.mode,
            head_offsets=self.head_offsets,
            is_causal=is_causal,
            softmax_scale=self.softmax_scale,
            dropout_p=self.dropout if self.training else 0.0,
            key_padding_mask=key_padding_mask,
            key_offset=key_offset,
            layout=self.layout,
            process_group=process_group,
        )

    def get_extra_state(self) -> dict:
        return {
            "segment_lengths": list(self.segment_lengths),
            "dilation_rates": list(self.dilation_rates),
            "mode": self.mode,
            "head_offsets": self.head_offsets,
            "softmax_scale": self.softmax_scale,
        }

    def set_extra_state(self, state) -> None:
        saved = {"head_offsets": "interleaved", **dict(state)}  # saved before head_offsets existed
        validation.check_saved_config(self, saved, self.get_extra_state())

    def extra_repr(self) -> str:
        return (
            f"segment_lengths={list(self.segment_lengths)}, dilation_rates={list(self.dilation_rates)}, "
            f"mode={self.mode!r}, head_offsets={self.head_offsets!r}, softmax_scale={self.softmax_scale}, "
            f"dropout={self.dropout}, layout={self.layout!r}"
        )


class MultiheadDilatedAttention(nn.Module):
    """Multi-head dilated self-attention on ``(B, N, embed_dim)`` inputs, or
    ``(N, B, embed_dim)`` with ``batch_first=False``.

    Unlike ``nn.MultiheadAttention``, ``batch_first`` defaults to ``True``, as everywhere
    in this library; pass ``batch_first=False`` for sequence-first tensors. ``q, k, v``
    projections, :class:`DilatedAttention`, then (with ``sub_layernorm``) MAGNETO's
    LayerNorm before the output projection. ``num_heads`` and the attention's
    configuration are stored in the ``state_dict``; loading one saved with others
    raises ``ValueError``.

    Positions: ``rotary`` (e.g. :class:`dilated_attention.nn.rotary.RotaryEmbedding`), a
    callable ``rotary(x, positions)`` applied to the projected ``q`` and ``k``
    ``(B, N, H, D)`` at their absolute ``positions`` (``(N,)`` or ``(B, N)`` ints).
    Decoding: :meth:`new_cache`, then ``forward(x, is_causal=True, cache=cache)`` with
    the next positions of every sequence.

    Initialisation (MAGNETO, Wang et al. 2022): ``q_proj`` and ``k_proj`` weights
    are Xavier-normal with gain 1; ``v_proj`` and ``out_proj`` weights Xavier-normal
    with gain ``gamma_init`` (MAGNETO's ``gamma``, which the enclosing model derives
    from its depth, e.g. ``sqrt(log(2 * num_layers))`` for an encoder); biases 0.
    """

    # As nn.MultiheadAttention has them with separate q, k, v projections: no packed
    # input projection. PyTorch's transformer layers read them to choose their fast path
    # (which only nn.MultiheadAttention itself can take).
    _qkv_same_embed_dim = False
    in_proj_weight = None
    in_proj_bias = None

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        segment_lengths: Sequence[int],
        dilation_rates: Sequence[int],
        *,
        mode: str = "mixture",
        head_offsets: str = "interleaved",
        dropout: float = 0.0,
        bias: bool = True,
        sub_layernorm: bool = True,
        layer_norm_eps: float = 1e-5,
        gamma_init: float = 1.0,
        batch_first: bool = True,
        rotary=None,
        device=None,
        dtype=None,
    ):
        super().__init__()
        self.batch_first = validation.check_flag(batch_first, "batch_first")
        for name, value in (("embed_dim", embed_dim), ("num_heads", num_heads)):
            validation.check_positive_int(value, name)
        if embed_dim % num_heads:
            raise ValueError(
                f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads}): "
                "each head gets embed_dim // num_heads channels"
            )
        self.attention = DilatedAttention(
            segment_lengths, dilation_rates, mode=mode, head_offsets=head_offsets, dropout=dropout
        )
        if mode == "head_groups":
            validation.check_head_groups(num_heads, len(self.attention.segment_lengths))
        self.embed_dim, self.num_heads = int(embed_dim), int(num_heads)
        self.gamma_init = validation.check_number(
            gamma_init, "gamma_init", 0.0, meaning=" (the gain of the value and output projections)"
        )
        bias, sub_layernorm = validation.check_flag(bias, "bias"), validation.check_flag(sub_layernorm, "sub_layernorm")
        layer_norm_eps = validation.check_number(layer_norm_eps, "layer_norm_eps", 0.0, low_open=True)
        if dtype is not None and dtype not in validation.FLOAT_DTYPES.values():
            raise ValueError(f"dtype must be float64, float32, bfloat16 or float16 (or None), got {dtype}")
        if rotary is not None and not callable(rotary):
            raise TypeError(f"rotary must be a callable rotary(x, positions), got {validation.type_name(rotary)}")
        self.rotary = rotary
        factory = {"device": device, "dtype": dtype}
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        self.k_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        self.v_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        self.norm = nn.LayerNorm(embed_dim, eps=layer_norm_eps, **factory) if sub_layernorm else None
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        self.reset_parameters()
        self._register_load_state_dict_pre_hook(check_saved_configs, with_module=True)

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

    def get_extra_state(self) -> dict:
        return {"num_heads": self.num_heads}

    def set_extra_state(self, state) -> None:
        validation.check_saved_config(self, dict(state), self.get_extra_state())

    # 2: a RotaryEmbedding keeps its head dim and base in the state (from 0.1.0's
    # development on); states of version 1 load as if saved with this module's.
    _version = 2

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, *args, **kwargs):
        rotary_state = prefix + "rotary._extra_state"
        old = local_metadata.get("version", 1) < 2
        if old and isinstance(self.rotary, RotaryEmbedding) and rotary_state not in state_dict:
            state_dict[rotary_state] = self.rotary.get_extra_state()
        super()._load_from_state_dict(state_dict, prefix, local_metadata, *args, **kwargs)

    def new_cache(self, batch: int, *, start=0, dtype=None, device=None, static: bool = False, max_chunk: int = 1):
        """An empty :class:`dilated_attention.DilatedKVCache` for ``batch`` sequences that
        matches this module's heads and attention (with ``static``, a
        :class:`dilated_attention.StaticKVCache` taking up to ``max_chunk`` positions a
        call, for ``torch.compile`` and CUDA graphs); see its ``start`` for left
        padding. ``dtype`` defaults to that of the projections' output (the autocast
        dtype inside ``torch.autocast``, but for float64 parameters; else the
        parameters'; float32 for dynamically quantized projections), ``device`` to the
        parameters'."""
        projections = self._projections()
        attention = self.attention
        kind: Any = StaticKVCache if validation.check_flag(static, "static") else DilatedKVCache
        validation.check_positive_int(max_chunk, "max_chunk")  # checked whether or not a static cache takes it
        extra = {"max_chunk": max_chunk} if kind is StaticKVCache else {}
        return kind(
            batch,
            self.num_heads,
            self.embed_dim // self.num_heads,
            attention.segment_lengths,
            attention.dilation_rates,
            mode=attention.mode,
            head_offsets=attention.head_offsets,
            softmax_scale=attention.softmax_scale,
            start=start,
            dtype=projections.gives if dtype is None else dtype,
            device=projections.device if device is None else device,
            **extra,
        )

    def _check_cache(self, cache, batch: int, is_causal, key_padding_mask, process_group, gives) -> None:
        """A ``ValueError`` unless ``cache`` is this module's and takes this call
        (``gives``: the projections' output dtype, :meth:`_projections`)."""
        if not isinstance(cache, (DilatedKVCache, StaticKVCache)):
            raise TypeError(
                f"cache must be a DilatedKVCache or StaticKVCache (see new_cache), got {validation.type_name(cache)}"
            )
        check_batch(cache.shape[0], batch, "query")
        if not is_causal or key_padding_mask is not None or process_group is not None:
            raise ValueError(
                "a cache attends causally to the sequences' earlier positions: pass is_causal=True, "
                "key_padding_mask=None (left-pad with the cache's start instead) and no process_group"
            )
        if self.training and self.attention.dropout > 0:
            raise ValueError("a cache computes without dropout: call .eval() first (or build with dropout=0)")
        attention, head_dim = self.attention, self.embed_dim // self.num_heads
        mine = (
            self.num_heads,
            head_dim,
            attention.segment_lengths,
            attention.dilation_rates,
            attention.mode,
            attention.head_offsets,
            validation.check_scale(attention.softmax_scale, head_dim),
        )
        theirs = (
            cache.shape[1],
            cache.shape[2],
            cache.segment_lengths,
            cache.dilation_rates,
            cache.mode,
            cache.head_offsets,
            cache.softmax_scale,
        )
        if mine != theirs:
            raise ValueError(
                f"the cache was built for (heads, head_dim, segment_lengths, dilation_rates, mode, head_offsets, "
                f"softmax_scale) = {theirs}, this module has {mine}: make it with this module's new_cache"
            )
        if cache.dtype != gives:
            whose = " (torch.autocast's dtype)" if gives != self._projections().takes else ""
            raise ValueError(
                f"the cache holds {cache.dtype} keys and values, but this call's projections give {gives}{whose}: "
                f"make the cache with new_cache where it is used (inside the same torch.autocast, or outside any), "
                f"or pass dtype={gives} to new_cache"
            )

    def _projections(self) -> _Projections:
        """Where the projections run and in which dtypes, this call (see :class:`_Projections`)."""
        weight = self.q_proj.weight
        if callable(weight):  # quantize_dynamic's projection: weight() gives int8 values
            device = weight().device
            return _Projections(
                device, torch.float32, torch.float32, validation.autocast_dtype(device.type) is not None
            )
        autocast = validation.autocast_dtype(weight.device.type)
        gives = weight.dtype if autocast is None or weight.dtype == torch.float64 else autocast
        return _Projections(weight.device, weight.dtype, gives, autocast is not None)

    def _check_like_parameters(self, projections: _Projections, *inputs: torch.Tensor) -> None:
        """A ``ValueError`` unless ``query, key, value`` are on the parameters' device and,
        outside ``torch.autocast``, of their dtype (the projections' own error names neither)."""
        device, dtype = projections.device, projections.takes
        for name, t in zip(("query", "key", "value"), inputs, strict=True):
            if t.device != device or (not projections.autocast and t.dtype != dtype):
                raise ValueError(
                    f"{name} must be {dtype} on {device} like the module's parameters, got {t.dtype} "
                    f"on {t.device}: move the input (or the module, with .to()), or run under torch.autocast"
                )

    def _checked_inputs(
        self,
        query,
        key,
        value,
        key_padding_mask,
        need_weights,
        attn_mask,
        average_attn_weights,
        is_causal,
        process_group,
        positions,
        cache,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, bool]:
        """``query, key, value`` as :meth:`forward` takes them, checked, in the batch-first
        layout (``key`` and ``value`` default to ``query``), the bool padding mask and
        whether the call is causal; a ``TypeError`` or ``ValueError`` naming what is
        wrong, raised on every rank of ``process_group``."""
        # checks of this rank's input, before any collective call: with a process_group a
        # failure is raised on every rank (the others would wait for this one)
        with validation.shared_errors(process_group):
            validation.check_flag(average_attn_weights, "average_attn_weights")  # read only with the weights
            if validation.check_flag(need_weights, "need_weights"):
                raise ValueError(
                    "need_weights=True is not supported: dilated attention never forms the "
                    "(N, N) weight matrix; pass need_weights=False (use "
                    "dilated_attention.reference.attention_weights_uniform to inspect the pattern)"
                )
            key = query if key is None else key
            value = query if value is None else value
            dims = "(batch, seq_len, " if self.batch_first else "(seq_len, batch, "
            for name, t in (("query", query), ("key", key), ("value", value)):
                validation.check_tensor(t, name)
                if t.dim() != 3 or t.shape[-1] != self.embed_dim or 0 in t.shape:
                    raise ValueError(
                        f"{name} must have shape {dims}embed_dim={self.embed_dim}) with "
                        f"batch_first={self.batch_first} and every dim >= 1, got {tuple(t.shape)}"
                    )
            for name, t in (("key", key), ("value", value)):
                if t.shape != query.shape:
                    raise ValueError(
                        f"{name} must have the shape of query {tuple(query.shape)}, got {tuple(t.shape)}: "
                        "MultiheadDilatedAttention is self-attention over one sequence"
                    )
            projections = self._projections()
            self._check_like_parameters(projections, query, key, value)
            if not self.batch_first:
                query, key, value = (t.transpose(0, 1) for t in (query, key, value))
            if attn_mask is not None and process_group is not None:
                raise ValueError(
                    "attn_mask cannot be given with process_group (it would be this shard's rows only): pass "
                    "is_causal=True for causal attention"
                )
            is_causal = validation.causal_from_attn_mask(
                attn_mask,
                is_causal,
                query.shape[1],
                query.device,
                f" (the query was read as {dims}embed_dim) with batch_first={self.batch_first}: is that its layout?)",
            )
            mask = key_padding_mask = validation.bool_padding_mask(key_padding_mask, query.device)
            if isinstance(mask, torch.Tensor) and tuple(mask.shape) != tuple(query.shape[:2]):
                raise ValueError(
                    f"key_padding_mask must have shape (batch, seq_len) = {tuple(query.shape[:2])}, got "
                    f"{tuple(mask.shape)}; the query was read as {dims}embed_dim) (batch_first="
                    f"{self.batch_first}): is that its layout?"
                )
            if cache is not None:
                self._check_cache(cache, query.shape[0], is_causal, key_padding_mask, process_group, projections.gives)
            if positions is not None and process_group is not None:  # else rotary checks them
                check_rotary_positions(positions, query.shape[0], query.shape[1])
        return query, key, value, key_padding_mask, is_causal

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = False,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
        *,
        process_group=None,
        positions: torch.Tensor | None = None,
        cache: DilatedKVCache | StaticKVCache | None = None,
    ) -> tuple[torch.Tensor, None]:
        """``query`` (and ``key``, ``value``, which default to it) ``(B, N, embed_dim)``
        (``(N, B, embed_dim)`` with ``batch_first=False``) -> ``(output, None)`` in the
        same layout, like ``nn.MultiheadAttention``, whose arguments it takes in its
        order. ``key_padding_mask``: ``(B, N)`` in either layout, bool (``True`` =
        padding) or float (``-inf`` = padding, ``0`` = kept). ``attn_mask``: ``None`` or
        the causal mask (``(N, N)``, ``True`` or ``-inf`` above the diagonal, as
        ``nn.Transformer.generate_square_subsequent_mask`` makes it), which makes the
        call causal as ``is_causal=True`` does; any other mask is refused (the keys each
        query sees are set by the branches). With ``is_causal=True`` the mask is
        PyTorch's hint, not read (as ``nn.MultiheadAttention`` takes it); without, its
        ``N x N`` values are checked. ``need_weights=True`` is refused (the
        weights are never formed); ``average_attn_weights`` has no effect without them.
        So the module can be the ``self_attn`` of ``nn.TransformerEncoderLayer`` and
        ``nn.TransformerDecoderLayer``.

        With ``process_group`` the inputs are this rank's shard of the sequence; the
        projections and the LayerNorm act per token, so the output is this rank's
        shard of the single-process output. Parameter gradients are this shard's
        part: sum them over ranks (``torch.distributed.all_reduce``) for the
        single-process gradients (``DistributedDataParallel`` averages them: scale
        the loss by the world size under it).

        ``positions``: the absolute positions of the rows, ``(N,)`` or ``(B, N)`` ints,
        for ``rotary``; by default ``0 .. N-1``, this shard's with ``process_group``,
        the cache's next ones with ``cache``. Without ``rotary`` they are not read:
        the segments are placed by the rows' places in the sequence (the shard's or the
        cache's).

        ``cache``: a :class:`dilated_attention.DilatedKVCache` (or
        :class:`dilated_attention.StaticKVCache`) from :meth:`new_cache` (needs
        ``is_causal=True``, no mask, no dropout): the rows are the next ``N`` positions
        of its sequences; their keys and values are appended to it.
        """
        query, key, value, key_padding_mask, is_causal = self._checked_inputs(
            query,
            key,
            value,
            key_padding_mask,
            need_weights,
            attn_mask,
            average_attn_weights,
            is_causal,
            process_group,
            positions,
            cache,
        )
        heads = (self.num_heads, self.embed_dim // self.num_heads)
        q = self.q_proj(query).unflatten(-1, heads)
        k = self.k_proj(key).unflatten(-1, heads)
        v = self.v_proj(value).unflatten(-1, heads)
        if self.rotary is not None:
            if positions is None:
                positions = sequence_positions(query.shape[1], query.device, cache, process_group)
            q, k = self.rotary(q, positions), self.rotary(k, positions)
        if cache is not None:
            x = cache.attend(q, k, v)
        else:
            x = self.attention(
                q, k, v, is_causal=is_causal, key_padding_mask=key_padding_mask, process_group=process_group
            )
        x = x.flatten(-2)
        if self.norm is not None:
            x = self.norm(x)
        if x.dtype != torch.float32 and callable(self.out_proj.weight):  # dynamically quantized: float32 only
            x = x.float()
        out = self.out_proj(x)
        return (out if self.batch_first else out.transpose(0, 1)), None


class GridAttention(nn.Module):
    """Attention over the patches of an image laid into the sequence in another order.

    ``GridAttention(attention, order="hilbert", extra_tokens=0)`` wraps a self-attention
    module called as ``attention(x, key_padding_mask=..., **kwargs) -> (out, ...)``
    (a :class:`MultiheadDilatedAttention`): ``forward(x, grid=(height, width))`` takes
    ``x`` ``(B, extra_tokens + height * width, embed_dim)`` with the patches in
    row-major order (after ``extra_tokens`` leading tokens: 1 for a CLS token), runs
    ``attention`` on the sequence in ``order`` (see :mod:`dilated_attention.nn.ordering`)
    and returns its output in the caller's order: a ViT block changes the order its
    segments follow without touching its data pipeline. ``batch_first=False``
    modules take and return ``(N, B, embed_dim)``. A ``key_padding_mask`` and rotary
    ``positions`` (``(N,)`` or ``(B, N)`` in both layouts, one per token of ``x``) are
    laid out with ``x``; without ``positions``, rotary attention takes each token's place
    in the ordered sequence.

    With ``process_group``, ``x`` is this rank's contiguous piece of the *ordered*
    sequence (:func:`dilated_attention.nn.ordering.shard` cuts it, as LongViT gives each
    rank a row-major strip); it goes to ``attention`` as it is and the output is that
    piece of the ordered output.
    """

    def __init__(self, attention: nn.Module, order: str = "hilbert", extra_tokens: int = 0):
        super().__init__()
        if not isinstance(attention, nn.Module):
            raise TypeError(f"attention must be an nn.Module, got {validation.type_name(attention)}")
        self.attention, self.order = attention, validation.check_choice(order, "order", ORDERS)
        self.extra_tokens = validation.check_non_negative_int(extra_tokens, "extra_tokens")

    def forward(
        self,
        x: torch.Tensor,
        grid: Sequence[int],
        key_padding_mask: torch.Tensor | None = None,
        process_group=None,
        **kwargs,
    ):
        """``(output, ...)`` as ``attention`` returns it, the output in ``x``'s order."""
        if kwargs.get("attn_mask") is not None:
            raise ValueError(
                "GridAttention takes no attn_mask: the attention runs in the grid's order, where a mask made for "
                "x's order means something else; pass key_padding_mask, which moves with its tokens (is_causal=True "
                "is causal in the grid's order)"
            )
        with validation.shared_errors(process_group):  # before any collective call: raised on every rank
            if not isinstance(grid, (tuple, list)) or len(grid) != 2:
                raise ValueError(f"grid must be (height, width) in patches, got {grid!r}")
            order, inverse = grid_permutations(self.order, *grid)
        if process_group is not None:  # x is a piece of the ordered sequence: it goes as it is
            return self.attention(x, key_padding_mask=key_padding_mask, process_group=process_group, **kwargs)
        batch_first = getattr(self.attention, "batch_first", True)
        dim = 1 if batch_first else 0
        if isinstance(x, torch.Tensor) and x.dim() != 3:
            raise ValueError(
                f"x must have shape {'(batch, tokens, embed_dim)' if batch_first else '(tokens, batch, embed_dim)'} "
                f"(batch_first={batch_first}), got {tuple(x.shape)}"
            )
        x = permute(x, order, self.extra_tokens, dim)
        positions = kwargs.get("positions")
        for name, laid_out in (("key_padding_mask", key_padding_mask), ("positions", positions)):
            if isinstance(laid_out, torch.Tensor) and laid_out.dim() in (1, 2) and laid_out.shape[-1] != x.shape[dim]:
                raise ValueError(
                    f"{name} must have one entry per token of x ({x.shape[dim]} along its last dim, the "
                    f"extra_tokens={self.extra_tokens} included), got shape {tuple(laid_out.shape)}"
                )
        mask = None
        if key_padding_mask is not None:  # (B, N) in either layout
            mask = permute(key_padding_mask, order, self.extra_tokens, name="key_padding_mask")
        if isinstance(positions, torch.Tensor) and positions.dim() in (1, 2):  # the attention checks the rest
            kwargs["positions"] = permute(positions, order, self.extra_tokens, positions.dim() - 1, name="positions")
        out, *rest = self.attention(x, key_padding_mask=mask, **kwargs)
        return (permute(out, inverse, self.extra_tokens, dim), *rest)
