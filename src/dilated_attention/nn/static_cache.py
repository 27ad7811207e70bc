"""``StaticKVCache``: a decode cache whose every step runs the same operations on
tensors of the same shapes, for ``torch.compile(fullgraph=True)`` and CUDA graphs."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..ops import validation
from ..ops.decode import ring_attention, ring_counts
from ..ops.finite import nonfinite
from ..ops.kernels import accumulator
from ..ops.plan import branch_table, output_scale
from .cache import CacheSettings, check_starts

# The position of a ring slot no key has filled yet: never attended.
EMPTY = -(2**62)
# The most positions a ring holds per sequence.
MAX_CAPACITY = 2**24


class StaticKVCache(CacheSettings):
    """Keys and values of ``batch`` sequences in a ring of fixed size, attended a few
    positions at a time: what :class:`dilated_attention.DilatedKVCache` computes, with
    every step the same tensor operations on the same shapes.

    The ring holds ``max(segment_lengths) - 1 + max_chunk`` positions per sequence
    (all a chunk of up to ``max_chunk`` rows may attend to); a new key overwrites the
    slot of the position ``capacity`` before it. Positions live in a tensor on the
    cache's device and advance in place, so that a loop of ``attend`` calls compiles
    once under ``torch.compile(fullgraph=True)`` (also ``mode="reduce-overhead"``) and
    a step can be captured in a CUDA graph (see the README's "Decoding"). Each step
    attends over the whole ring, with the branches' pattern as a bias computed on the
    device, so it costs the same at every position: :class:`DilatedKVCache` reads only
    the window a step needs and is the faster one without compilation.

    The arguments are :class:`DilatedKVCache`'s (``start`` left-pads the same way),
    plus ``max_chunk``: the most positions one call takes, and ``kernel``: ``"auto"``
    (the default, or ``$DILATED_ATTENTION_KERNEL`` when the cache is made) runs a step
    on CUDA as three fused Triton launches (:mod:`dilated_attention.ops.ring_decode`)
    whose arguments never change, so a CUDA graph captures them, and elsewhere, under
    ``torch.compile`` or where ``q`` requires grad as PyTorch operations (gradients
    reach ``q``; keys are stored detached); ``"triton"`` asks for the launches (on the
    CPU in Triton's interpreter), ``"torch"`` for the operations. Both compute the
    same rows.
    """

    def __init__(
        self,
        batch: int,
        num_heads: int,
        head_dim: int,
        segment_lengths: Sequence[int],
        dilation_rates: Sequence[int],
        *,
        mode: str = "mixture",
        head_offsets: str = "interleaved",
        softmax_scale: float | None = None,
        start: int | torch.Tensor = 0,
        max_chunk: int = 1,
        dtype: torch.dtype = torch.float32,
        device=None,
        kernel: str | None = None,
    ):
        self._configure(
            batch,
            num_heads,
            head_dim,
            segment_lengths,
            dilation_rates,
            mode,
            head_offsets,
            softmax_scale,
            dtype,
            device,
            kernel,
        )
        self.max_chunk = validation.check_positive_int(max_chunk, "max_chunk")
        table = branch_table(self.shape[1], self.segment_lengths, self.dilation_rates, self.mode, self.head_offsets)
        self._branches = (table.segment_lengths, table.rates)  # Python ints: what torch.compile specialises on
        self._offsets = self._ring_branches[2]  # made now: a compiled step only reads it
        self._out_scale = output_scale(self.mode, len(self.segment_lengths))
        self.capacity = max(self.segment_lengths) - 1 + self.max_chunk
        if self.capacity > MAX_CAPACITY:
            raise ValueError(
                f"a StaticKVCache keeps max(segment_lengths) - 1 + max_chunk = {self.capacity} positions "
                f"per sequence, more than {MAX_CAPACITY}: use DilatedKVCache, which keeps only the "
                "positions a sequence has reached"
            )
        self.reset(start)

    def reset(self, start: int | torch.Tensor = 0) -> None:
        """Forget every position; the sequences start anew at ``start``. The tensors are
        reset in place: a CUDA graph captured on this cache stays valid."""
        starts = check_starts(start, self.shape[0], self.segment_lengths)
        batch, heads, dim = self.shape
        if getattr(self, "_k", None) is None:
            # Never inference tensors (a cache made under inference_mode serves outside it
            # too, compiled steps included); inside it their in-place updates are allowed.
            with torch.inference_mode(False):
                ring = (batch, heads, self.capacity, dim)
                self._k = torch.zeros(ring, dtype=self.dtype, device=self.device)
                self._v = torch.zeros(ring, dtype=self.dtype, device=self.device)
                self._key_positions = torch.empty(batch, self.capacity, dtype=torch.int64, device=self.device)
                self._bad = torch.zeros(batch, heads, self.capacity, dtype=torch.bool, device=self.device)
                self._next = torch.empty(batch, dtype=torch.int64, device=self.device)
        for t in (self._k, self._v, self._bad):
            t.zero_()
        self._key_positions.fill_(EMPTY)
        self._next.copy_(torch.tensor(starts, dtype=torch.int64))

    @property
    def position(self) -> torch.Tensor:
        """``(B,)`` int64: the position of each sequence's next token (a copy)."""
        return self._next.clone()

    @property
    def nbytes(self) -> int:
        """Bytes of the key and value rings (fixed)."""
        return 2 * self._k.numel() * self._k.element_size()

    def max_nbytes(self, chunk: int = 1) -> int:
        """:attr:`nbytes`: the rings never grow (``chunk``: checked as
        :meth:`dilated_attention.DilatedKVCache.max_nbytes` takes it)."""
        validation.check_positive_int(chunk, "chunk")
        return self.nbytes

    def reorder(self, indices: torch.Tensor) -> None:
        """Keep the sequences ``indices`` (``(B',)`` ints, repeats allowed), in that order.
        The cache's tensors are replaced: capture a CUDA graph again after a reorder."""
        self._kept_sequences(indices)  # a ValueError unless they are sequence indices
        index = indices.to(self.device)
        with torch.inference_mode(False):  # never inference tensors (see reset)
            for name in ("_k", "_v", "_key_positions", "_bad", "_next"):
                setattr(self, name, getattr(self, name).index_select(0, index))
        self.shape = (len(indices), *self.shape[1:])

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The causal dilated attention output ``(B, L, H, D)`` of the next ``L <=
        max_chunk`` positions of every sequence, given their ``q, k, v`` ``(B, L, H, D)``."""
        validation.refuse_torch_func(q, k, v)  # its rings are written in place, which no transform follows
        if not self._well_formed(q, k, v) or q.shape[1] > self.max_chunk:
            self._check_inputs(q, k, v, self.max_chunk)  # raises, saying what is wrong
        batch, heads, dim = self.shape
        length = q.shape[1]
        if self._takes_kernel(q):
            return self._attend_fused(q, k, v)
        queries = self._next[:, None] + torch.arange(length, device=self.device)  # (B, L)
        slots = queries % self.capacity
        bad = (nonfinite(k) | nonfinite(v)).transpose(1, 2)  # (B, H, L)
        index = slots[:, None, :, None].expand(batch, heads, length, dim)
        for ring, new in ((self._k, k), (self._v, v)):
            ring.scatter_(2, index, new.detach().transpose(1, 2).masked_fill(bad[..., None], 0.0))
        self._key_positions.scatter_(1, slots, queries)
        self._bad.scatter_(2, slots[:, None, :].expand(batch, heads, length), bad)
        count = ring_counts(*self._branches, self._offsets, self._key_positions, queries)  # (B, H, L, C)
        # In float32 (float64) whatever the dtype: log(2) for a key two branches count stays exact.
        acc = accumulator(self.dtype)
        # Autograd saves the rings for q's gradient: a copy, which later steps' writes
        # leave alone (in float32 `.to` alone would hand it the ring itself).
        saved = torch.is_grad_enabled() and q.requires_grad
        keys, values = (ring.to(acc, copy=saved) for ring in (self._k, self._v))
        out = ring_attention(q.transpose(1, 2).to(acc), keys, values, self._bad, count, self._kernel_scale)
        self._next += length
        return (out * self._out_scale).to(self.dtype).transpose(1, 2)

    def _attend_fused(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """:meth:`attend` by the fused launches: append, attend, then advance."""
        from ..ops import ring_decode

        splits = ring_decode.splits_for(self.device, q.shape[0] * q.shape[1] * q.shape[2], self.capacity)
        ring_decode.append(self._k, self._v, self._key_positions, self._bad, self._next, k.detach(), v.detach())
        out = ring_decode.attend(
            q.detach(),
            self._k,
            self._v,
            self._key_positions,
            self._bad,
            self._next,
            self._ring_branches,
            self._kernel_scale,
            self._out_scale,
            splits,
        )
        self._next += q.shape[1]
        return out
