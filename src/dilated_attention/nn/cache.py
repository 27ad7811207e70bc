"""``DilatedKVCache``: causal dilated attention fed a few positions at a time.

A causal query never sees a key before the start of its own segment, so a cache
needs only the positions since the earliest segment start a future query can fall
in: fewer than ``max(segment_lengths)`` per sequence, however long the sequence
grows. Each call computes :func:`dilated_attention.dilated_attention` on that window
(``key_offset`` = the window's first position), through the same paths (on CUDA, a
step of a few rows through the fused decode launches), so it is exactly the
whole-sequence result, row for row.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from .. import functional
from ..ops import decode, fused, validation
from ..ops.finite import all_finite, nonfinite_rows
from ..ops.plan import branch_table, window_start_needed


def check_batch(sequences: int, batch: int, name: str) -> None:
    """A ``ValueError`` unless ``batch``, the batch size of ``name``, is ``sequences``,
    the number of sequences a cache holds."""
    if batch == 0:
        raise ValueError(
            f"{name} has a batch of 0: each call feeds the next positions of every sequence the cache holds "
            f"({sequences})"
        )
    if batch != sequences:
        if batch < sequences:
            example = f"cache.reorder(torch.arange({batch})) keeps the first {batch}"
        else:
            example = f"cache.reorder(torch.arange({batch}) % {sequences}) repeats them, as beam search does"
        raise ValueError(
            f"the cache holds {validation.counted(sequences, 'sequence')}, but {name} has a batch of {batch}: "
            "feed the next positions of every sequence in each call; to continue with other sequences of these, "
            f"first cache.reorder(indices) with indices in [0, {sequences}) (e.g. {example}); for new sequences, "
            f"make a new cache of {batch} (a cache's batch is set when it is made; reset() keeps it)"
        )


class CacheSettings:
    """What both caches share: ``shape`` ``(B, H, D)``, the branches, mode, head
    offsets, ``softmax_scale`` (and the kernels' rounding of it), ``dtype``,
    ``device`` and ``kernel``, checked and set by :meth:`_configure`; and whether a
    step runs the fused Triton launches of :mod:`dilated_attention.ops.ring_decode`."""

    shape: tuple[int, int, int]
    segment_lengths: tuple[int, ...]
    dilation_rates: tuple[int, ...]
    mode: str
    head_offsets: str
    softmax_scale: float
    _kernel_scale: float
    dtype: torch.dtype
    device: torch.device
    kernel: str  # "auto", "triton" or "torch": as given, else as $DILATED_ATTENTION_KERNEL says when made
    _kernel_given: bool  # whether the caller gave kernel (else the environment chose it)

    def _configure(
        self,
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
    ) -> None:
        for name, value in (("batch", batch), ("num_heads", num_heads), ("head_dim", head_dim)):
            validation.check_positive_int(value, name)
        if dtype not in validation.FLOAT_DTYPES.values():
            raise ValueError(f"dtype must be float64, float32, bfloat16 or float16, got {dtype}")
        self.segment_lengths, self.dilation_rates = validation.check_branches(segment_lengths, dilation_rates)
        self.mode = validation.check_mode(mode)
        if self.mode == "head_groups":
            validation.check_head_groups(num_heads, len(self.segment_lengths))
        self.head_offsets = validation.check_head_offsets(head_offsets)
        self.softmax_scale = validation.check_scale(softmax_scale, head_dim)
        # refused here, not at the first attend, if too large
        self._kernel_scale = validation.kernel_scale(self.softmax_scale, dtype)
        self.shape = (int(batch), int(num_heads), int(head_dim))
        self.dtype = dtype
        self.device = torch.empty(0, device=device).device  # as tensors report it: "cuda:0", not "cuda"
        given = kernel
        kernel = fused.requested(kernel)  # a ValueError for an unknown choice; the environment read once
        if kernel == "triton":
            # what the configuration alone rules out, refused before anything is made
            step = torch.empty((1, 1, num_heads, head_dim), dtype=dtype, device=self.device)
            reason = fused.why_not_triton(step, 0.0, False, capturable=True)
            if reason is not None:
                raise fused.refusal(given, "this cache's steps", reason)
        self.kernel, self._kernel_given = kernel, given is not None

    def _takes_kernel(self, q: torch.Tensor) -> bool:
        """Whether a step runs the fused Triton launches: with ``kernel="auto"`` on CUDA
        where they can run it, with ``"triton"`` wherever they can (else a ``ValueError``
        saying why), never with ``"torch"``."""
        choice = self.kernel
        if choice == "torch" or (choice == "auto" and q.device.type != "cuda"):
            return False
        reason = fused.why_not_triton(q, 0.0, False, capturable=True)
        if reason is None and torch.is_grad_enabled() and q.requires_grad:
            reason = "the fused launches have no backward (q requires grad)"
        if choice == "triton" and reason is not None:
            raise fused.refusal("triton" if self._kernel_given else None, "this step", reason)
        return reason is None

    def _well_formed(self, q, k, v) -> bool:
        """Whether ``q, k, v`` are what ``attend`` takes, but for a limit on ``L`` (the
        common case, checked quickly; :meth:`_check_inputs` says what is wrong otherwise)."""
        if type(q) is not torch.Tensor or type(k) is not torch.Tensor or type(v) is not torch.Tensor:
            return False
        shape = q.shape
        return (
            len(shape) == 4
            and k.shape == shape
            and v.shape == shape
            and shape[1] >= 1
            and (shape[0], shape[2], shape[3]) == self.shape
            and q.dtype == k.dtype == v.dtype == self.dtype
            and q.device == k.device == v.device == self.device
        )

    def _check_inputs(self, q, k, v, max_chunk: int | None = None) -> None:
        """A ``TypeError`` or ``ValueError`` saying what is wrong with ``q, k, v``
        ``(B, L, H, D)``: one shape, ``1 <= L`` (``<= max_chunk`` where given), the
        cache's batch, heads, head dim, dtype and device."""
        batch, heads, dim = self.shape
        for name, t in (("q", q), ("k", k), ("v", v)):
            validation.check_tensor(t, name)
            if t.dim() == 4:
                check_batch(batch, t.shape[0], name)
            if t.dim() != 4 or (t.shape[0], t.shape[2], t.shape[3]) != (batch, heads, dim) or t.shape[1] < 1:
                hint = (
                    " (the cache keeps as many key/value heads as query heads: for grouped-query attention, repeat "
                    "k and v per query head)"
                    if name != "q" and t.dim() == 4 and t.shape[2] < heads
                    else ""
                )
                raise ValueError(
                    f"{name} must have shape (batch={batch}, L >= 1, heads={heads}, head_dim={dim}), the (B, L, H, "
                    f"D) layout, got {tuple(t.shape)}{hint}"
                )
            if t.dtype != self.dtype or t.device != self.device:
                raise ValueError(
                    f"{name} must be {self.dtype} on {self.device} like the cache, got {t.dtype} on {t.device}"
                )
        if k.shape != q.shape or v.shape != q.shape:
            raise ValueError(f"q, k, v must have one shape, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
        if max_chunk is not None and q.shape[1] > max_chunk:
            raise ValueError(
                f"q, k, v must hold 1 to max_chunk={max_chunk} positions, got {q.shape[1]}: feed longer "
                "chunks in parts, or make the cache with a larger max_chunk"
            )

    def _kept_sequences(self, indices) -> list[int]:
        """The sequences ``reorder(indices)`` keeps, as a list; a ``TypeError`` unless
        ``indices`` is a tensor, a ``ValueError`` unless it is a 1-D integer one of at
        least one sequence index."""
        if not isinstance(indices, torch.Tensor):
            raise TypeError(
                "indices must be a 1-D int64 (or int32) tensor of sequence indices (torch.tensor(indices) "
                f"for a list), got {validation.type_name(indices)}"
            )
        if indices.dtype not in (torch.int32, torch.int64) or indices.dim() != 1:
            raise ValueError(f"indices must be a 1-D int64 (or int32) tensor of sequence indices, got {indices!r}")
        rows = indices.tolist()
        if not rows or not 0 <= min(rows) <= max(rows) < self.shape[0]:
            raise ValueError(f"indices must be at least one sequence index in [0, {self.shape[0]}), got {rows}")
        return rows

    @functools.cached_property
    def _ring_branches(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The branches as the fused launches take them: segment lengths ``(G,)``, rates
        ``(G,)`` and each head's offset ``(G, H)`` (``-1``: the head does not run the
        branch), int64 on the device."""
        table = branch_table(self.shape[1], self.segment_lengths, self.dilation_rates, self.mode, self.head_offsets)
        return (
            torch.tensor(table.segment_lengths, dtype=torch.int64, device=self.device),
            torch.tensor(table.rates, dtype=torch.int64, device=self.device),
            torch.tensor(table.offsets, dtype=torch.int64, device=self.device).T.contiguous(),
        )


def check_starts(start, batch: int, segment_lengths) -> list[int]:
    """A cache's ``start``: one int per sequence, ``>= -2**62``; a positive one a
    multiple of every segment length."""
    starts = list(validation.check_positions(start, "start", batch, -validation.MAX_POSITION, "positions are int64"))
    for s in starts:
        if s > 0 and window_start_needed(s, segment_lengths) != s:
            raise ValueError(
                f"start={s}: a sequence starting after position 0 must start at a multiple of every "
                f"segment length {list(segment_lengths)}, or its first queries would need keys "
                "the cache never saw; start at 0, or at a negative position to left-pad"
            )
    return starts


# The fewest slots a cache's buffers have (or twice the longest segment, where that is
# fewer): a new cache would otherwise move its keys to new buffers at positions 1, 2,
# 4, 8, ..., each move a fresh allocation.
MIN_SLOTS = 64


def _moved(t: torch.Tensor, capacity: int, kept: slice, dim: int) -> torch.Tensor:
    """A new zeroed buffer like ``t`` with ``capacity`` slots along ``dim``, holding
    ``t``'s slots ``kept`` at its start."""
    shape = list(t.shape)
    shape[dim] = capacity
    fresh = t.new_zeros(shape)
    fresh.narrow(dim, 0, kept.stop - kept.start).copy_(t.narrow(dim, kept.start, kept.stop - kept.start))
    return fresh


def _phase_order(positions: Sequence[int], dilation_rates: Sequence[int]) -> list[int]:
    """The order a cache keeps sequences at ``positions`` in: by their positions modulo
    each rate, the smallest rate first (a stable sort). All sequences advance together,
    so the sequences whose queries share a phase of a branch (with ``w`` a multiple of
    ``r``, the same position modulo ``r``) stay neighbours, and a decode step of a
    left-padded batch reads each phase's rows as one slice (:func:`dilated_attention.ops.decode.branch_calls`)."""
    moduli = sorted(set(dilation_rates))
    return sorted(range(len(positions)), key=lambda s: [positions[s] % r for r in moduli])


def _needed_from(position: int, segment_lengths: Sequence[int]) -> int:
    """The earliest position a query at ``position`` or later may attend to (a query at
    a negative position, i.e. left padding, attends to nothing)."""
    return min(position, window_start_needed(max(position, 0), segment_lengths))


class DilatedKVCache(CacheSettings):
    """Keys and values of ``batch`` sequences, for attending to them step by step.

    ``attend(q, k, v)`` takes the next ``L >= 1`` positions of every sequence (a
    prompt, a chunk, or one token) as ``(B, L, H, D)`` tensors, appends their keys and
    values, and returns their causal dilated attention output ``(B, L, H, D)``: row for
    row the output of one causal call on the whole sequence.

    Memory is bounded whatever the length: per sequence it keeps fewer than
    ``max(segment_lengths)`` past positions (only those a later query may attend to),
    in buffers of at most ``4 * (kept + L)`` positions for a chunk of ``L``, or of
    :data:`MIN_SLOTS` = 64 where that is more (twice the longest segment where that is
    fewer). Between ``kept + L`` and that, they are reused; when full, or after a long
    chunk, the kept positions move to new buffers of twice their size with the chunk,
    so copying costs ``O(1)`` per position. ``nbytes`` is their size.

    ``start``: the position of each sequence's first token (an int or a ``(B,)``
    integer tensor). A negative start left-pads: a batch of prompts of different
    lengths, right-aligned, with ``start = -(number of padding tokens)`` puts every
    prompt's first real token at position 0. Padding positions (< 0) attend to
    nothing and output 0; no position ``>= 0`` attends to them. A positive start must
    be a multiple of every segment length (no earlier key can be needed). Starts lie
    in ``[-2**62, 2**62]`` (positions are int64).

    ``kernel``: ``"auto"`` (the default, or ``$DILATED_ATTENTION_KERNEL`` when the
    cache is made) runs a step of a few rows (at most 16 per sequence, nothing to
    differentiate) on CUDA as two fused Triton launches over the window of keys
    (:mod:`dilated_attention.ops.ring_decode`: one for every row, whatever its
    position, and one to merge its splits; they find NaN and infinity themselves, and
    nothing in such a step waits for the device), and on the CPU, where no value is
    NaN or infinite, as the lean path's few PyTorch operations
    (:mod:`dilated_attention.ops.decode`); longer chunks, and steps with gradients or
    (on the CPU) non-finite values, run the engine.
    ``"triton"`` asks for the launches (on the CPU in Triton's interpreter) and the
    engine's Triton kernels, ``"torch"`` for PyTorch's operations and kernels. All
    compute the same rows.

    A call that raises leaves the cache as it was: every check runs before the keys
    are appended, and should the attention itself fail, the append is undone.

    The cache stores keys and values detached: gradients reach ``q`` and the ``k, v``
    of the call, not earlier chunks (to train through chunks, call
    :func:`dilated_attention.dilated_attention` with ``key_offset``).
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
        self._min_slots = min(MIN_SLOTS, 2 * max(self.segment_lengths))
        self.reset(start)

    def reset(self, start: int | torch.Tensor = 0) -> None:
        """Forget every position (and free the buffers); the sequences start anew at ``start``."""
        starts = self._starts(start)
        # Inside, sequences are kept in phase order (see _phase_order): row i holds sequence order[i].
        order = self._set_order(starts)
        self._position = [starts[s] for s in order]
        self._stored_from = list(self._position)  # earliest position kept, per row
        self._kept = 0  # the most positions a row keeps: max(position - stored_from)
        self._until_window_moves = 0  # positions to come before some row's window start may move
        # Key-head-major, (B, H, slots, D): a decode step's window is contiguous per head.
        batch, heads, dim = len(starts), *self.shape[1:]
        self._k = self._v = torch.empty(batch, heads, 0, dim, dtype=self.dtype, device=self.device)
        self._bad: torch.Tensor | None = (
            None  # (B, slots, H) bool: key rows holding NaN or infinity, once one was appended
        )
        self._end = 0  # buffer slots [end - kept, end) hold a sequence's kept positions
        # The last slots the fused launches appended unchecked (they read NaN and infinity
        # themselves); checked before another path reads them.
        self._unchecked = 0
        self._queries: torch.Tensor | None = None  # (B,) int64 on the device: the rows' positions

    def _starts(self, start) -> list[int]:
        return check_starts(start, self.shape[0], self.segment_lengths)

    def _set_order(self, positions: list[int]) -> list[int]:
        """Keep sequences at ``positions`` (in the caller's order) in phase order from
        now on; return it (row ``i`` holds sequence ``order[i]``)."""
        order = _phase_order(positions, self.dilation_rates)
        self._row_of = [0] * len(order)  # each sequence's row
        for row, sequence in enumerate(order):
            self._row_of[sequence] = row
        identity = order == list(range(len(order)))
        self._rows = None if identity else torch.tensor(order, device=self.device)
        self._sequences = None if identity else torch.tensor(self._row_of, device=self.device)
        return order

    @property
    def position(self) -> torch.Tensor:
        """``(B,)`` int64: the position of each sequence's next token (its start plus
        the tokens fed so far)."""
        return torch.tensor([self._position[row] for row in self._row_of], dtype=torch.int64)

    @property
    def cached_positions(self) -> int:
        """The most past positions any sequence keeps (below ``max(segment_lengths)``)."""
        return self._kept

    def _count_kept(self) -> None:
        self._kept = max(p - s for p, s in zip(self._position, self._stored_from, strict=True))

    @property
    def nbytes(self) -> int:
        """Bytes of the key and value buffers."""
        return 2 * self._k.numel() * self._k.element_size()

    def max_nbytes(self, chunk: int = 1) -> int:
        """The most bytes :attr:`nbytes` can be right after a call with ``chunk``
        positions, however long the sequences: ``4 * (max(segment_lengths) - 1 + chunk)``
        positions of keys and values per sequence."""
        chunk = validation.check_positive_int(chunk, "chunk")
        batch, heads, dim = self.shape
        positions = 4 * (max(self.segment_lengths) - 1 + chunk)
        return 2 * batch * positions * heads * dim * torch.empty((), dtype=self.dtype).element_size()

    def reorder(self, indices: torch.Tensor) -> None:
        """Keep the sequences ``indices`` (``(B',)`` ints, repeats allowed), in that order,
        as beam search does after picking its beams."""
        rows = self._kept_sequences(indices)
        sources = [self._row_of[sequence] for sequence in rows]  # the row each kept sequence comes from
        order = self._set_order([self._position[source] for source in sources])
        sources = [sources[kept] for kept in order]
        index = torch.tensor(sources, device=self.device)
        self._k, self._v = self._k.index_select(0, index), self._v.index_select(0, index)
        self._bad = None if self._bad is None else self._bad.index_select(0, index)
        self._queries = None
        self._position = [self._position[source] for source in sources]
        self._stored_from = [self._stored_from[source] for source in sources]
        self._count_kept()
        self.shape = (len(rows), *self.shape[1:])

    def _append(self, k: torch.Tensor, v: torch.Tensor, flags: torch.Tensor | None, checked: bool = True) -> int:
        """Write ``k, v`` ``(B, L, H, D)`` after the kept positions (``flags``: their
        non-finite rows, ``(B, L, H)``, or ``None``: none; ``checked=False``: not known,
        see :meth:`_check_appended`); return the slot of their first row."""
        length = k.shape[1]
        kept = self._kept
        if flags is not None and self._bad is None:
            self._bad = self._no_flags_yet()
        capacity = self._k.shape[2]
        # New buffers when full, far too large, or made in (or out of) inference mode
        # and now written out of (or in) it.
        stale = self._k.is_inference() != torch.is_inference_mode_enabled()
        if self._end + length > capacity or capacity > max(4 * (kept + length), self._min_slots) or stale:
            capacity = max(2 * (kept + length), self._min_slots)
            kept_slots = slice(self._end - kept, self._end)
            self._k, self._v = (_moved(t, capacity, kept_slots, dim=2) for t in (self._k, self._v))
            self._bad = None if self._bad is None else _moved(self._bad, capacity, kept_slots, dim=1)
            self._end = kept
            self._unchecked = min(self._unchecked, kept)
        first = self._end
        k, v = (k.detach() if k.requires_grad else k), (v.detach() if v.requires_grad else v)
        if length == 1:  # a decode step: its one row's slot
            self._k.select(2, first).copy_(k.select(1, 0))
            self._v.select(2, first).copy_(v.select(1, 0))
        else:
            self._k.narrow(2, first, length).copy_(k.transpose(1, 2))
            self._v.narrow(2, first, length).copy_(v.transpose(1, 2))
        if self._bad is not None:
            self._bad[:, first : first + length] = False if flags is None else flags
        self._end = first + length
        self._unchecked = 0 if checked else self._unchecked + length
        return first

    def _no_flags_yet(self) -> torch.Tensor:
        """Flags ``(B, slots, H)`` of the buffers' slots, none set (made when a first
        row is to be flagged)."""
        return torch.zeros(self._k.shape[0], self._k.shape[2], self._k.shape[1], dtype=torch.bool, device=self.device)

    def _check_appended(self) -> None:
        """Flag the non-finite rows among the slots the fused launches appended
        unchecked, before a path that trusts the flags reads them (one scan, once)."""
        if self._unchecked:
            slots = slice(self._end - self._unchecked, self._end)
            flags = nonfinite_rows(*(t[:, :, slots].transpose(1, 2) for t in (self._k, self._v)))
            if flags is not None:
                if self._bad is None:
                    self._bad = self._no_flags_yet()
                elif self._bad.is_inference() and not torch.is_inference_mode_enabled():
                    self._bad = self._bad.clone()  # made in inference mode: not writable outside it
                self._bad[:, slots] = flags
            self._unchecked = 0

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The causal dilated attention output ``(B, L, H, D)`` of the next ``L``
        positions of every sequence, given their ``q, k, v`` ``(B, L, H, D)``."""
        validation.refuse_torch_func(q, k, v)
        if not self._well_formed(q, k, v):
            self._check_inputs(q, k, v)  # raises, saying what is wrong
        if self._rows is not None:  # into the rows' order
            q, k, v = (t.index_select(0, self._rows) for t in (q, k, v))
        buffers = (self._k, self._v, self._bad, self._end, self._unchecked)
        try:
            path = self._step_path(q, k, v)
            if path == "triton":  # non-finite values are the launches' to find: nothing waits for the device
                out = self._attend_window_fused(q, self._append(k, v, None, checked=False))
            else:
                self._check_appended()
                if path == "torch":
                    out = self._attend_window(q, self._append(k, v, None))
                else:
                    out = self._attend_appended(q, k, v, self._append(k, v, nonfinite_rows(k, v)))
        except BaseException:  # an error or an interrupt: undo the append, so that a retry is exact
            self._k, self._v, self._bad, self._end, self._unchecked = buffers
            raise
        if self._sequences is not None:  # back into the sequences' order
            out = out.index_select(0, self._sequences)
        length = q.shape[1]
        self._position = [position + length for position in self._position]
        if path == "triton" and self._queries is not None:
            self._queries += length  # on the device, as the launches read it
        else:
            self._queries = None
        self._kept += length
        self._until_window_moves -= length
        if self._until_window_moves <= 0:
            self._move_window_starts()
        return out

    def _move_window_starts(self) -> None:
        """Drop from the kept positions what no query to come attends to, and count the
        positions until that can change again: a window start moves only where a
        position reaches a multiple of a segment length (every step at negative
        positions, which attend to nothing). Steps in between skip this."""
        self._stored_from = [
            max(kept, _needed_from(position, self.segment_lengths))
            for kept, position in zip(self._stored_from, self._position, strict=True)
        ]
        self._count_kept()
        self._until_window_moves = min(
            min(w - position % w for w in self.segment_lengths) if position >= 0 else 1 for position in self._position
        )

    def _step_path(self, q, k, v) -> str | None:
        """How this call runs when it takes a few rows and nothing to differentiate:
        ``"triton"``, the fused launches over the window of keys (:meth:`_takes_kernel`:
        on CUDA by default; they find NaN and infinity themselves, so that nothing
        waits for the device), or, with no NaN or infinity anywhere, ``"torch"``, the
        lean path's PyTorch operations (:mod:`dilated_attention.ops.decode`, on the
        CPU); else ``None``: the engine's blocks, group by group."""
        if not decode.is_step(q.shape[1], q, k, v):
            return None
        if self._takes_kernel(q):  # (which raises where "triton" is asked for and cannot run)
            return "triton"
        clean = self._bad is None and not self._unchecked
        return "torch" if self.device.type == "cpu" and clean and all_finite(q, k, v) else None

    @functools.cached_property
    def _decode_tables(self) -> decode.DecodeTables:
        """The lean path's tables of these heads and branches (shared by caches alike)."""
        return decode.decode_tables(
            self.shape[1], self.segment_lengths, self.dilation_rates, self.mode, self.head_offsets, self.device
        )

    def _window_width(self, rows: int, stop: int) -> int:
        """How many slots before ``stop`` the next ``rows`` queries of every row reach
        back over (the positions are not yet advanced)."""
        return decode.window_width(self._decode_tables, self._position, rows, stop)

    def _attend_window(self, q, first_slot: int) -> torch.Tensor:
        """The output ``(B, L, H, D)`` of ``q`` over the window of keys its rows reach, once
        its keys are in the buffers from slot ``first_slot`` on (the positions are not
        yet advanced), by the lean path."""
        rows = q.shape[1]
        stop = first_slot + rows
        tables = self._decode_tables
        width = self._window_width(rows, stop)  # the keys every query reaches back to, and no further
        out, _ = decode.attend_step(
            q,
            self._k.narrow(2, stop - width, width),
            self._v.narrow(2, stop - width, width),
            [position + rows - width for position in self._position],
            tables,
            self._kernel_scale,
            width=width,
        )
        return out

    def _attend_window_fused(self, q, first_slot: int) -> torch.Tensor:
        """:meth:`_attend_window` by the fused launches of
        :mod:`dilated_attention.ops.ring_decode`: one for every row whatever its
        position, and one to merge the splits. The rows' positions stay on the device
        from step to step, so that nothing is copied to or from it."""
        from ..ops import ring_decode

        rows = q.shape[1]
        stop = first_slot + rows
        width = self._window_width(rows, stop)
        window = slice(stop - width, stop)
        if self._queries is None:
            with torch.inference_mode(False):  # advanced in place, in and out of inference mode
                self._queries = torch.tensor(self._position, dtype=torch.int64, device=self.device)
        if self._bad is None:
            flags = self._no_flags.expand(self.shape[0], self.shape[1], width)
        else:
            flags = self._bad[:, window].transpose(1, 2)
        return ring_decode.attend(
            q,
            self._k[:, :, window],
            self._v[:, :, window],
            rows - width,  # slot j of row b: position queries[b] + rows - width + j
            flags,
            self._queries,
            self._ring_branches,
            self._kernel_scale,
            self._decode_tables.out_scale,
            ring_decode.splits_for(self.device, q.shape[0] * rows * self.shape[1], width),
        )

    @functools.cached_property
    def _no_flags(self) -> torch.Tensor:
        """A 0-dim ``False`` on the device, expanded as the flags of keys none of which is flagged."""
        with torch.inference_mode(False):
            return torch.zeros((), dtype=torch.bool, device=self.device)

    def _attend_appended(self, q, k, v, first_slot: int) -> torch.Tensor:
        """The output ``(B, L, H, D)`` of ``q`` once ``k, v`` are in the buffers from slot
        ``first_slot`` on (the positions are not yet advanced)."""
        length = q.shape[1]
        differentiable = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        if differentiable and max(self._position) + length <= 0:
            # Every query is padding: zeros, with a graph whose gradients are zeros (as
            # dilated_attention gives rows that attend to nothing), whatever q, k, v hold.
            return torch.where(torch.zeros((), dtype=torch.bool, device=self.device), q + k + v, 0.0)
        groups = functional.rows_by_value(self._position)
        keys = self._k[:, :, : first_slot + length].transpose(1, 2)
        values = self._v[:, :, : first_slot + length].transpose(1, 2)
        flags = None if self._bad is None else self._bad[:, : first_slot + length]
        if differentiable:
            # Autograd keeps the keys and their flags for the backward: copies, as the
            # buffers change in place, the keys with the new rows' graph.
            keys, values = torch.cat([keys[:, :first_slot], k], 1), torch.cat([values[:, :first_slot], v], 1)
            flags = None if flags is None else flags.clone()
        parts = [self._attend_group(q, keys, values, flags, position, rows, first_slot) for position, rows in groups]
        if len(parts) == 1:
            return parts[0]
        return torch.cat(parts).index_select(0, functional.row_order(groups, self.device))

    def _attend_group(self, q, k, v, flags, position: int, rows: tuple[int, ...], first_slot: int) -> torch.Tensor:
        """The output of the sequences ``rows``, all at ``position``, given keys and
        values ``(B, slots, H, D)`` whose new rows start at slot ``first_slot`` and their
        non-finite flags ``(B, slots, H)`` (``None``: none)."""
        length = q.shape[1]
        first_query = max(position, 0)  # negative positions are padding: they output 0
        window = _needed_from(first_query, self.segment_lengths)
        slots = slice(first_slot + window - position, first_slot + length)
        k, v = k[:, slots], v[:, slots]
        flags = None if flags is None else flags[:, slots]
        if len(rows) < self.shape[0]:
            index = torch.tensor(rows, device=self.device)
            q, k, v = (t.index_select(0, index) for t in (q, k, v))
            flags = None if flags is None else flags.index_select(0, index)
        padding = q.new_zeros(q.shape[0], min(first_query - position, length), *q.shape[2:])
        if first_query >= position + length:
            return padding
        call = validation.Attention(  # q, k, v were checked in attend, the rest at construction
            q=q[:, first_query - position :],
            k=k,
            v=v,
            padding=None,
            segment_lengths=self.segment_lengths,
            dilation_rates=self.dilation_rates,
            mode=self.mode,
            head_offsets=self.head_offsets,
            is_causal=True,
            scale=self.softmax_scale,
            key_offsets=(window,) * q.shape[0],
        )
        # The keys were checked for NaN and infinity as they were appended: no new scan.
        attended, _ = functional.run(call, key_flags=flags, keys_checked=True, kernel=self.kernel)
        return torch.cat([padding, attended], 1) if padding.shape[1] else attended
