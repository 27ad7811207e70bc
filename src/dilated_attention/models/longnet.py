"""``LongNetLM``: a decoder-only Transformer whose self-attention is dilated attention.

The LongNet paper's model (Ding et al. 2023) on the MAGNETO backbone (Wang et al.
2022): pre-norm blocks, each ``x + attention(LN(x))`` then ``x + ffn(LN(x))``, with an
extra LayerNorm inside both branches (sub-LN: before the attention's output projection
and before the feed-forward's second linear layer), and a final LayerNorm before the
LM head.

Initialisation (MAGNETO for a decoder of ``depth`` layers, ``gamma = sqrt(log(2 *
depth))``): ``q_proj``, ``k_proj`` Xavier-normal with gain 1; ``v_proj``, ``out_proj``
and both feed-forward layers Xavier-normal with gain ``gamma``; biases 0; token
embeddings normal with std ``dim ** -0.5``, multiplied by ``sqrt(dim)`` on input (so
a tied LM head starts with logits of unit scale).
"""

from __future__ import annotations

import math
from typing import cast

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from ..nn.cache import DilatedKVCache, check_batch
from ..nn.modules import MultiheadDilatedAttention, check_saved_configs, sequence_positions
from ..nn.rotary import RotaryEmbedding, check_rotary_positions
from ..nn.static_cache import StaticKVCache
from ..ops import validation
from .config import LongNetConfig


class FeedForward(nn.Module):
    """``fc2(LN(gelu(fc1(x))))``: ``(..., dim) -> (..., dim)`` through ``ffn_dim``."""

    def __init__(self, config: LongNetConfig):
        super().__init__()
        self.fc1 = nn.Linear(config.dim, config.ffn_dim)
        self.norm = nn.LayerNorm(config.ffn_dim, eps=config.layer_norm_eps)
        self.fc2 = nn.Linear(config.ffn_dim, config.dim)
        for layer in (self.fc1, self.fc2):
            nn.init.xavier_normal_(layer.weight, gain=config.gamma)
            nn.init.zeros_(layer.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.norm(F.gelu(self.fc1(x))))


class LongNetBlock(nn.Module):
    """One pre-norm layer: causal multi-head dilated attention, then the feed-forward."""

    def __init__(self, config: LongNetConfig):
        super().__init__()
        rotary = RotaryEmbedding(config.head_dim, config.rotary_base) if config.positions == "rotary" else None
        self.attention_norm = nn.LayerNorm(config.dim, eps=config.layer_norm_eps)
        self.attention = MultiheadDilatedAttention(
            config.dim,
            config.heads,
            config.segment_lengths,
            config.dilation_rates,
            mode=config.mode,
            head_offsets=config.head_offsets,
            dropout=config.dropout,
            layer_norm_eps=config.layer_norm_eps,
            gamma_init=config.gamma,
            rotary=rotary,
        )
        self.ffn_norm = nn.LayerNorm(config.dim, eps=config.layer_norm_eps)
        self.ffn = FeedForward(config)
        self.dropout = nn.Dropout(config.dropout)

    def forward(
        self, x, positions, cache: DilatedKVCache | StaticKVCache | None = None, process_group=None
    ) -> torch.Tensor:
        y, _ = self.attention(
            self.attention_norm(x), is_causal=True, positions=positions, cache=cache, process_group=process_group
        )
        x = x + self.dropout(y)
        return x + self.dropout(self.ffn(self.ffn_norm(x)))


class LongNetCache:
    """One :class:`dilated_attention.DilatedKVCache` (or
    :class:`dilated_attention.StaticKVCache`) per layer of a :class:`LongNetLM`, for
    feeding it a few tokens at a time. Its memory stays below ``2 * depth * B * 4 *
    (max(segment_lengths) + L) * dim`` elements for ``B`` sequences fed chunks of ``L``
    tokens, however many tokens pass through."""

    def __init__(self, layers: list[DilatedKVCache] | list[StaticKVCache]):
        self.layers = layers

    @property
    def position(self) -> torch.Tensor:
        """``(B,)`` int64: the position of each sequence's next token."""
        return self.layers[0].position

    @property
    def max_chunk(self) -> int | None:
        """The most tokens one call takes (a static cache's ``max_chunk``; ``None``: any)."""
        return getattr(self.layers[0], "max_chunk", None)

    @property
    def nbytes(self) -> int:
        """Bytes of every layer's key and value buffers."""
        return sum(layer.nbytes for layer in self.layers)

    def max_nbytes(self, chunk: int = 1) -> int:
        """The most bytes :attr:`nbytes` can be right after a call with ``chunk`` tokens."""
        return sum(layer.max_nbytes(chunk) for layer in self.layers)

    def reorder(self, indices: torch.Tensor) -> None:
        """Keep the sequences ``indices`` (``(B',)`` ints), in that order (beam search)."""
        for layer in self.layers:
            layer.reorder(indices)

    def reset(self, start=0) -> None:
        """Forget every token; the sequences start anew at ``start``."""
        for layer in self.layers:
            layer.reset(start)


def _check_state_dict(model: LongNetLM, state_dict, prefix: str, *_) -> None:
    """Before any tensor of ``state_dict`` loads into ``model``: its layers'
    configurations, and, for a model that ties its embedding and LM head (one matrix:
    the last loaded would silently win), a ``ValueError`` where the two differ."""
    check_saved_configs(model, state_dict, prefix)
    if not model.config.tie_embeddings:
        return
    embedding, head = state_dict.get(prefix + "embedding.weight"), state_dict.get(prefix + "head.weight")
    model._head_loads_alone = embedding is None and head is not None  # see _tie_after_loading
    if embedding is None or head is None or embedding is head or embedding.is_meta or head.is_meta:
        return  # (a meta tensor holds no values to compare)
    if embedding.shape != head.shape or not torch.equal(embedding, head.to(embedding.device, embedding.dtype)):
        raise ValueError(
            "cannot load a state_dict whose embedding.weight and head.weight differ (saved from a LongNetLM "
            "with tie_embeddings=False) into one with tie_embeddings=True: build the model with the "
            "checkpoint's configuration"
        )


def _tie_after_loading(model: LongNetLM, _incompatible_keys) -> None:
    """Tie again what ``load_state_dict(..., assign=True)`` untied, keeping the matrix
    loaded: the head's where the state_dict held it alone (as a load into the one
    shared matrix does), else the embedding's. (A module-level function: a pickled
    model keeps its hooks.)"""
    if model.config.tie_embeddings and model.head.weight is not model.embedding.weight:
        if model._head_loads_alone:
            model.embedding.weight = model.head.weight
        model.tie_weights()
    model._head_loads_alone = False


class LongNetLM(nn.Module):
    """A LongNet language model: ``tokens`` ``(B, N)`` -> next-token logits ``(B, N, vocab_size)``.

    ``model(tokens)`` runs whole sequences (positions ``0 .. N-1``);
    ``model(tokens, cache=cache)`` with ``cache = model.new_cache(B)`` feeds the next
    tokens of ``B`` sequences (one or many per call) and gives, position for position,
    the logits of the whole-sequence call; ``model(shard, process_group=group)`` runs
    this rank's contiguous shard of each sequence (sequence parallelism) and gives
    that shard of the logits.

    ``gradient_checkpointing = True``: in training, each block's activations are
    recomputed in backward instead of kept (less memory, about a third more compute).
    """

    _head_loads_alone: bool = False  # set by a load's pre-hook for its post-hook

    def __init__(self, config: LongNetConfig):
        super().__init__()
        if not isinstance(config, LongNetConfig):
            raise TypeError(f"config must be a LongNetConfig, got {validation.type_name(config)}")
        self.config = config
        self.embedding = nn.Embedding(config.vocab_size, config.dim)
        nn.init.normal_(self.embedding.weight, std=config.dim**-0.5)
        self.dropout = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(LongNetBlock(config) for _ in range(config.depth))
        self.norm = nn.LayerNorm(config.dim, eps=config.layer_norm_eps)
        self.head = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.gradient_checkpointing = False
        if config.tie_embeddings:
            self.tie_weights()
        else:
            nn.init.normal_(self.head.weight, std=config.dim**-0.5)
        self._register_load_state_dict_pre_hook(_check_state_dict, with_module=True)
        self.register_load_state_dict_post_hook(_tie_after_loading)

    def tie_weights(self) -> None:
        """With ``config.tie_embeddings``, make the LM head use the embedding's matrix
        (again): ``to_empty`` (after building on the meta device) and
        ``load_state_dict(..., assign=True)`` give each its own; ``load_state_dict``
        ties them again itself. Without it, nothing."""
        if self.config.tie_embeddings and self.head.weight is not self.embedding.weight:
            self.head.weight = self.embedding.weight

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def new_cache(
        self, batch_size: int, *, start=0, dtype=None, device=None, static: bool = False, max_chunk: int = 1
    ) -> LongNetCache:
        """An empty cache for ``batch_size`` sequences (dtype: by default that of the
        projections, the autocast dtype inside ``torch.autocast``; device: the
        parameters'; ``start``: see :class:`dilated_attention.DilatedKVCache`;
        ``static``: :class:`dilated_attention.StaticKVCache` layers taking up to
        ``max_chunk`` tokens a call, for ``torch.compile`` and CUDA graphs)."""
        validation.check_positive_int(batch_size, "batch_size")
        return LongNetCache(
            [
                cast(LongNetBlock, block).attention.new_cache(
                    batch_size, start=start, dtype=dtype, device=device, static=static, max_chunk=max_chunk
                )
                for block in self.blocks
            ]
        )

    def forward(
        self,
        tokens: torch.Tensor,
        *,
        cache: LongNetCache | None = None,
        process_group=None,
        positions: torch.Tensor | None = None,
        logits_to_keep: int = 0,
    ) -> torch.Tensor:
        """``tokens`` ``(B, N)`` ints in ``[0, vocab_size)`` -> logits ``(B, N, vocab_size)``
        (float32, or the parameters' dtype).

        ``cache``: a :meth:`new_cache` cache; ``tokens`` are the next ``N`` of its
        sequences. ``process_group``: ``tokens`` are this rank's contiguous shard of
        each sequence. ``positions``: the tokens' absolute positions (``(N,)`` or
        ``(B, N)``), which the cache or the shard otherwise supply.
        ``logits_to_keep``: where positive, the logits of the last ``logits_to_keep``
        tokens of ``tokens`` only (of this rank's shard with ``process_group``),
        ``(B, min(N, logits_to_keep), vocab_size)``: what scoring or sampling the end of
        a long sequence needs, without the others' memory.
        """
        with validation.shared_errors(process_group):  # before any collective call: raised on every rank
            logits_to_keep = validation.check_non_negative_int(logits_to_keep, "logits_to_keep")
            self._check_tokens(tokens)
            if cache is not None and not isinstance(cache, LongNetCache):
                raise TypeError(f"cache must come from model.new_cache, got {validation.type_name(cache)}")
            if cache is not None and len(cache.layers) != len(self.blocks):
                raise ValueError(f"the cache has {len(cache.layers)} layers, the model {len(self.blocks)}")
            if cache is not None:
                check_batch(cache.layers[0].shape[0], tokens.shape[0], "tokens")
            if positions is not None and process_group is not None:  # else rotary checks them
                check_rotary_positions(positions, *tokens.shape)
        recompute = self.gradient_checkpointing and self.training and torch.is_grad_enabled() and cache is None
        if process_group is not None:  # one collective: the shard's start, and the ranks' models compared
            from ..ops.distributed import shard_start

            shared = {**self.config.to_dict(), "positions= (given or None)": positions is not None}
            shared["gradient checkpointing (in training, with gradients)"] = recompute
            start = shard_start(process_group, tokens.shape[1], shared)
            if positions is None:
                positions = torch.arange(start, start + tokens.shape[1], device=tokens.device)
        elif positions is None:
            positions = sequence_positions(tokens.shape[1], tokens.device, cache)
        x = self.dropout(self.embedding(tokens) * math.sqrt(self.config.dim))
        for i, block in enumerate(self.blocks):
            if recompute:
                x = checkpoint(block, x, positions, None, process_group, use_reentrant=False)
            else:
                x = block(x, positions, None if cache is None else cache.layers[i], process_group)
        return self.head(self.norm(x[:, -logits_to_keep:] if logits_to_keep else x))

    def _check_tokens(self, tokens) -> None:
        if not isinstance(tokens, torch.Tensor):
            raise TypeError(f"tokens must be a torch.Tensor of token ids, got {validation.type_name(tokens)}")
        if tokens.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"tokens must be int64 (or int32) token ids, got {tokens.dtype}: convert ids with .long()")
        if tokens.dim() != 2 or tokens.shape[1] < 1:
            raise ValueError(
                f"tokens must have shape (batch, seq_len >= 1), got {tuple(tokens.shape)} (with process_group: "
                "this rank's shard, which must hold at least one position)"
            )
        if torch.compiler.is_compiling():  # values are not read while tracing
            return
        if tokens.numel() and not bool(((tokens >= 0) & (tokens < self.config.vocab_size)).all()):
            raise ValueError(
                f"token ids must lie in [0, vocab_size={self.config.vocab_size}), got values from "
                f"{int(tokens.min())} to {int(tokens.max())}"
            )

    def generate(self, prompt: torch.Tensor, max_new_tokens: int, **sampling) -> torch.Tensor:
        """``prompt`` ``(P,)`` or ``(B, P)`` followed by ``max_new_tokens`` sampled tokens;
        see :func:`dilated_attention.models.generate`."""
        from .generate import generate

        return generate(self, prompt, max_new_tokens, **sampling)
