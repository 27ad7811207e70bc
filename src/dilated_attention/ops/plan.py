"""Plan the kernel calls of dilated attention as strided views.

A branch ``(w, r)`` cuts the sequence into segments of length ``w`` (the last one
may be shorter) and, inside each segment, keeps the rows whose relative position
``t`` has ``t % r == offset``. For a fixed offset and a fixed set of heads, all
segments of the same length select their rows with one strided view:

    x.narrow(1, start, nseg * seglen).unflatten(1, (nseg, seglen))[:, :, offset::r, heads]

(:class:`Rows`). A :class:`Block` is "these query rows against those key rows":
one call of a fused attention kernel with the segments folded into the batch
dimension. A whole sequence needs at most two blocks per branch and offset (the
full segments and the shorter last one); queries at the end of a longer key window
add, for the segment the first query falls in, one block of those queries against
the keys before them; the rows another rank sends are one more kind of key rows.
Nothing here copies data.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from .intmath import ceil_div

MODES = ("mixture", "head_groups")
HEAD_OFFSETS = ("interleaved", "contiguous")


@dataclass(frozen=True)
class Rows:
    """Rows of a ``(B, N, H, ...)`` tensor: ``nseg`` consecutive segments of ``seglen``
    rows from row ``start``, and in each the rows ``offset, offset + rate, ...``;
    for the heads ``heads``."""

    start: int
    nseg: int
    seglen: int
    rate: int
    offset: int
    heads: slice

    @classmethod
    def strided(cls, start: int, count: int, rate: int, heads: slice) -> Rows:
        """``count`` rows ``start, start + rate, ...`` (one segment)."""
        return cls(start, 1, (count - 1) * rate + 1, rate, 0, heads)

    @property
    def count(self) -> int:
        """Selected rows per segment: ``ceil((seglen - offset) / rate)``."""
        return ceil_div(self.seglen - self.offset, self.rate)

    @property
    def head_count(self) -> int:
        return len(range(*self.heads.indices(2**62)))

    def segments(self, first: int, count: int) -> Rows:
        """Segments ``first .. first + count - 1`` of these rows."""
        return replace(self, start=self.start + first * self.seglen, nseg=count)

    def select(self, x: torch.Tensor) -> torch.Tensor:
        """View of these rows of ``x``: ``(B, N, H, ...)`` -> ``(B, nseg, count, h, ...)``,
        or of a mask ``(B, N)`` -> ``(B, nseg, count)``: ``x.narrow(1, start, nseg *
        seglen).unflatten(1, (nseg, seglen))[:, :, offset::rate, heads]``. Eagerly it is
        made as one ``as_strided`` call, in a fraction of the time (which counts in a
        decode step); ``torch.compile`` traces the composed views."""
        if self.start + self.nseg * self.seglen > x.shape[1]:
            raise IndexError(f"rows up to {self.start + self.nseg * self.seglen} of a tensor of {x.shape[1]}")
        if torch.compiler.is_compiling():
            seg = x.narrow(1, self.start, self.nseg * self.seglen).unflatten(1, (self.nseg, self.seglen))
            rows = seg[:, :, self.offset :: self.rate]
            return rows if x.dim() == 2 else rows[:, :, :, self.heads]
        stride = x.stride()
        size = [x.shape[0], self.nseg, self.count]
        strides = [stride[0], self.seglen * stride[1], self.rate * stride[1]]
        first = x.storage_offset() + (self.start + self.offset) * stride[1]
        if x.dim() > 2:
            head, stop, step = self.heads.indices(x.shape[2])
            size += [len(range(head, stop, step)), *x.shape[3:]]
            strides += [step * stride[2], *stride[3:]]
            first += head * stride[2]
        return x.as_strided(size, strides, first)

    def positions(self, device=None) -> torch.Tensor:
        """Row indices of the selected rows, ``(nseg, count)`` int64."""
        segment = torch.arange(self.nseg, device=device) * self.seglen
        row = torch.arange(self.count, device=device) * self.rate
        return self.start + self.offset + segment[:, None] + row[None, :]

    @property
    def head_indices(self) -> list[int]:
        return list(range(*self.heads.indices(2**62)))


@dataclass(frozen=True)
class Block:
    """One kernel call: the query rows ``queries`` (of ``q``) against the key rows
    ``keys`` (of key source ``source``: 0 is the call's own ``k, v``, others hold rows
    received from other ranks), in branch ``branch``, segment by segment.

    ``is_causal``: the block is square (the query rows are the key rows) and each
    query sees the keys up to itself; otherwise every query sees every key. ``fresh``:
    no earlier block of the plan writes any of its query cells, so its result is
    written rather than merged.
    """

    branch: int
    queries: Rows
    keys: Rows
    is_causal: bool
    fresh: bool
    source: int = 0

    def chunks(self, max_segments: int) -> list[Block]:
        """The block cut into consecutive blocks of at most ``max_segments`` segments."""
        nseg = self.queries.nseg
        if nseg <= max_segments:
            return [self]
        return [
            replace(
                self,
                queries=self.queries.segments(first, min(max_segments, nseg - first)),
                keys=self.keys.segments(first, min(max_segments, nseg - first)),
            )
            for first in range(0, nseg, max_segments)
        ]


def head_group_bounds(num_heads: int, num_groups: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of each head group: sizes ``H // G``, the first ``H % G`` one larger."""
    base, extra = divmod(num_heads, num_groups)
    bounds, start = [], 0
    for g in range(num_groups):
        stop = start + base + (1 if g < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def _segment_groups(seq_len: int, w: int) -> list[tuple[int, int, int]]:
    """``(start, nseg, seglen)`` for the full segments and the shorter last one."""
    nfull, tail = divmod(seq_len, w)
    groups = []
    if nfull:
        groups.append((0, nfull, w))
    if tail:
        groups.append((nfull * w, 1, tail))
    return groups


def branch_head_sets(
    num_heads: int, dilation_rates: Sequence[int], mode: str, head_offsets: str = "interleaved"
) -> list[list[tuple[int, slice]]]:
    """Per branch, its ``(offset, heads)`` pairs. ``mixture``: with ``interleaved`` head
    offsets head ``j`` uses ``j % r`` (the heads of offset ``o`` are ``o::r``), with
    ``contiguous`` ones ``j // ceil(H / r)`` (runs of ``ceil(H / r)`` heads).
    ``head_groups``: branch ``i`` has its group at offset ``i % r_i``."""
    if mode == "head_groups":
        bounds = head_group_bounds(num_heads, len(dilation_rates))
        return [[(i % r, slice(*bounds[i]))] for i, r in enumerate(dilation_rates)]
    if head_offsets == "interleaved":
        return [[(o, slice(o, num_heads, min(r, num_heads))) for o in range(min(r, num_heads))] for r in dilation_rates]
    runs = [ceil_div(num_heads, min(r, num_heads)) for r in dilation_rates]
    return [
        [(o, slice(o * run, min((o + 1) * run, num_heads))) for o in range(ceil_div(num_heads, run))] for run in runs
    ]


def branch_order(dilation_rates: Sequence[int], mode: str) -> list[int]:
    """The order branches run in: in ``mixture`` the first with ``r = 1`` goes first."""
    order = list(range(len(dilation_rates)))
    if mode == "mixture" and 1 in dilation_rates:
        first = list(dilation_rates).index(1)
        order = [first] + [i for i in order if i != first]
    return order


def _selected_rows(first: int, stop: int, segment_start: int, offset: int, rate: int) -> tuple[int, int]:
    """For positions ``[first, stop)`` of a segment starting at ``segment_start``: the
    offset, relative to ``first``, of the first selected one and how many are selected."""
    local_offset = (offset - (first - segment_start)) % rate
    return local_offset, max(0, ceil_div(stop - first - local_offset, rate))


def _part(first: int, stop: int, segment_start: int, offset: int, rate: int, origin: int, heads: slice):
    """The selected rows among positions ``[first, stop)`` of a segment, as :class:`Rows`
    of a tensor whose row 0 is position ``origin``; ``None`` if there are none."""
    local_offset, count = _selected_rows(first, stop, segment_start, offset, rate)
    return Rows.strided(first - origin + local_offset, count, rate, heads) if count else None


def uncached_when_compiling(cached):
    """``cached`` (an ``lru_cache`` function), or the function under it while
    ``torch.compile`` traces: dynamo would trace through the cache anyway (once per
    compilation), with a warning at every call site."""
    return cached.__wrapped__ if torch.compiler.is_compiling() else cached


@functools.lru_cache(maxsize=4096)
def key_heads(
    heads: tuple[int, int, int], groups: int
) -> tuple[tuple[int, int, int] | None, int, tuple[int, ...] | None]:
    """Grouped-query attention: the key/value heads of the query heads ``range(*heads)``
    when each ``groups`` consecutive query heads share one key/value head.

    Returns ``(kv_heads, share, None)`` when query head ``i`` of ``heads`` uses key head
    ``i // share`` of ``range(*kv_heads)`` (a strided view; the kernels broadcast each
    key head over ``share`` query heads), else ``(None, 1, index)``: query head ``i``
    uses key head ``index[i]`` (the keys are gathered)."""
    kv = [head // groups for head in range(*heads)]
    share = next((i for i, h in enumerate(kv) if h != kv[0]), len(kv))  # the first run's length
    firsts = kv[::share]
    steps = {b - a for a, b in itertools.pairwise(firsts)} or {1}
    if len(kv) % share == 0 and all(h == firsts[i // share] for i, h in enumerate(kv)) and len(steps) == 1:
        step = steps.pop()
        if step > 0:
            return (firsts[0], firsts[-1] + 1, step), share, None
    return None, 1, tuple(kv)


def window_start_needed(query_position: int, segment_lengths: Sequence[int]) -> int:
    """The earliest key position that queries from ``query_position`` on may see: the
    start of the segment holding it, in the branch where that is earliest."""
    return min(query_position // w * w for w in segment_lengths)


def make_plan(
    num_queries: int,
    num_heads: int,
    segment_lengths: Sequence[int],
    dilation_rates: Sequence[int],
    mode: str,
    is_causal: bool,
    head_offsets: str = "interleaved",
    num_keys: int | None = None,
    key_offset: int = 0,
) -> tuple[Block, ...]:
    """All blocks of one dilated attention on one process, branch by branch (see
    :func:`_make_plan`). Plans are cached: a plan is local to its window, so shifting
    ``key_offset`` by a multiple of every segment length gives the same plan (a decode
    step finds its plan made after at most ``lcm(segment_lengths)`` steps)."""
    num_keys = num_queries if num_keys is None else num_keys
    key_offset %= math.lcm(*segment_lengths)  # (clamping w to the sequence changes no segment)
    return uncached_when_compiling(_make_plan)(
        num_queries,
        num_heads,
        tuple(segment_lengths),
        tuple(dilation_rates),
        mode,
        is_causal,
        head_offsets,
        num_keys,
        key_offset,
    )


@functools.lru_cache(maxsize=4096)
def _make_plan(
    num_queries: int,
    num_heads: int,
    segment_lengths: tuple[int, ...],
    dilation_rates: tuple[int, ...],
    mode: str,
    is_causal: bool,
    head_offsets: str,
    num_keys: int,
    key_offset: int,
) -> tuple[Block, ...]:
    """All blocks of one dilated attention on one process, branch by branch.

    The keys are ``num_keys`` (default ``num_queries``) rows at positions
    ``key_offset, key_offset + 1, ...``; the queries are the last ``num_queries`` of
    those positions (fewer than the keys only with ``is_causal``). Segments are
    anchored at position 0. A segment wholly among the queries is a square block; the
    segment holding the first query, if it starts before it, adds a block of those
    queries against its earlier keys, which must all be in the window (see
    :func:`window_start_needed`; the caller checks it).

    ``mixture``: every branch on every head (offsets by ``head_offsets``); the first
    branch with ``r = 1`` (if any) goes first, so that its blocks, which cover every
    cell, are written and the others merged into them. ``head_groups``: branch ``i``
    on head group ``i`` only, offset ``i % r_i``; no two branches share a cell (a
    window's earlier-keys block and diagonal block of one segment do, merged).
    """
    query_start = key_offset + num_keys - num_queries
    head_sets = branch_head_sets(num_heads, dilation_rates, mode, head_offsets)
    order = branch_order(dilation_rates, mode)
    blocks: list[Block] = []
    for i in order:
        # A segment longer than the sequence is the whole sequence, and a step longer
        # than a segment selects one row of it: clamping both changes nothing, and
        # keeps huge values away from tensor indexing.
        w = min(segment_lengths[i], key_offset + num_keys)
        r = min(dilation_rates[i], w)
        fresh = mode == "head_groups" or i == order[0]
        square_start = query_start
        first_segment = query_start // w * w
        if first_segment < query_start:  # the first query's segment started among the keys
            # (only with is_causal: without it the queries are all the keys, and keys must
            # start where a segment does)
            square_start = min(first_segment + w, key_offset + num_keys)
            for offset, heads in head_sets[i]:
                if offset >= w:
                    continue
                queries = _part(query_start, square_start, first_segment, offset, r, query_start, heads)
                if queries is None:
                    continue
                if queries.count == 1:  # one query: its keys, itself included, in one block
                    stop = query_start + queries.start + 1
                    keys = _part(first_segment, stop, first_segment, offset, r, key_offset, heads)
                    blocks.append(Block(i, queries, keys, False, fresh))
                    continue
                earlier = _part(first_segment, query_start, first_segment, offset, r, key_offset, heads)
                diagonal = replace(queries, start=queries.start + query_start - key_offset)
                if earlier is not None:
                    blocks.append(Block(i, queries, earlier, False, fresh))
                blocks.append(Block(i, queries, diagonal, is_causal, fresh and earlier is None))
        span = key_offset + num_keys - square_start
        origins = (square_start - query_start, square_start - key_offset)
        blocks += _segment_blocks(i, span, w, r, head_sets[i], origins, is_causal, fresh)
    return tuple(blocks)


def _segment_blocks(branch, span, w, r, head_set, origins, is_causal, fresh) -> list[Block]:
    """The square blocks of branch ``branch`` (``w``, ``r``, heads ``head_set``) over
    ``span`` positions from a segment start on (the last segment may be short): one
    per group of equal segments and head offset, its query and key rows from
    ``origins`` = (the first position's query row, its key row)."""
    query_origin, key_origin = origins
    blocks = []
    for start, nseg, seglen in _segment_groups(span, w):
        for offset, heads in head_set:
            if offset < seglen:
                queries = Rows(query_origin + start, nseg, seglen, r, offset, heads)
                blocks.append(Block(branch, queries, replace(queries, start=key_origin + start), is_causal, fresh))
    return blocks


@dataclass(frozen=True)
class ShardPlan:
    """One rank's part of a sequence-parallel dilated attention.

    ``blocks``: local blocks (local coordinates), as :func:`make_plan` gives for one
    process; ``sends``: per peer, the rows of this shard that peer's queries need;
    ``receives``: per peer, that peer's rows (its coordinates) and the local query
    rows that attend to them. A peer appears only if it shares a segment with this
    rank and needs (or has) keys for it; lists are in the same order on both sides of
    each pair. ``starts``: every shard's first sequence position; ``rank``: this rank."""

    blocks: tuple[Block, ...]
    sends: tuple[tuple[int, tuple[Rows, ...]], ...]
    receives: tuple[tuple[int, tuple[tuple[Rows, Block], ...]], ...]
    starts: tuple[int, ...]
    rank: int

    @property
    def first_position(self) -> int:
        """The sequence position of this rank's first row."""
        return self.starts[self.rank]


def make_shard_plan(
    shard_lengths: Sequence[int],
    rank: int,
    num_heads: int,
    segment_lengths: Sequence[int],
    dilation_rates: Sequence[int],
    mode: str,
    is_causal: bool,
    head_offsets: str = "interleaved",
) -> ShardPlan:
    """The plan of rank ``rank`` when rank ``k`` holds the ``k``-th contiguous shard of
    lengths ``shard_lengths`` (each at least 1). Segments inside the shard become local
    blocks as on one process; a segment that crosses shard boundaries contributes its
    local part as a local block (square, causal if asked) plus one exchange with each
    peer holding another part: a query attends to a peer's selected rows in full, and
    with ``is_causal`` only to those of earlier ranks (later ranks' rows all follow
    it). The received rows are key source ``1 + j`` for the ``j``-th received part."""
    starts = [0, *itertools.accumulate(shard_lengths)][:-1]
    seq_len = sum(shard_lengths)
    lo, hi = starts[rank], starts[rank] + shard_lengths[rank]
    head_sets = branch_head_sets(num_heads, dilation_rates, mode, head_offsets)
    order = branch_order(dilation_rates, mode)
    blocks: list[Block] = []
    sends: dict[int, list[Rows]] = {}
    receives: dict[int, list[tuple[Rows, Block]]] = {}
    for i in order:
        w = min(segment_lengths[i], seq_len)  # clamped as in make_plan
        r = min(dilation_rates[i], w)
        fresh = mode == "head_groups" or i == order[0]
        first_seg, last_seg = lo // w, (hi - 1) // w
        # Segments wholly inside the shard: [inner_first, inner_last]; at most the
        # first and the last segment touching the shard cross its boundaries.
        inner_first = ceil_div(lo, w)
        inner_last = last_seg if hi == seq_len else hi // w - 1
        if inner_first <= inner_last:
            inner_start, inner_stop = inner_first * w, min((inner_last + 1) * w, seq_len)
            origins = (inner_start - lo, inner_start - lo)
            blocks += _segment_blocks(i, inner_stop - inner_start, w, r, head_sets[i], origins, is_causal, fresh)
        for seg in sorted({first_seg, last_seg}):
            if inner_first <= seg <= inner_last:
                continue
            seg_lo, seg_hi = seg * w, min((seg + 1) * w, seq_len)
            mine = (max(seg_lo, lo), min(seg_hi, hi))
            peers = [
                k
                for k in range(len(shard_lengths))
                if k != rank and starts[k] < seg_hi and starts[k] + shard_lengths[k] > seg_lo
            ]
            for offset, heads in head_sets[i]:
                if offset >= w:  # no position of a segment has this offset (r was clamped to w)
                    continue
                rows = _part(*mine, seg_lo, offset, r, lo, heads)
                if rows is None:
                    continue
                block = Block(i, rows, rows, is_causal, fresh)
                blocks.append(block)
                for peer in peers:
                    theirs = (max(seg_lo, starts[peer]), min(seg_hi, starts[peer] + shard_lengths[peer]))
                    their_rows = _part(*theirs, seg_lo, offset, r, starts[peer], heads)
                    if their_rows is None:
                        continue
                    if not is_causal or rank < peer:
                        sends.setdefault(peer, []).append(rows)
                    if not is_causal or peer < rank:
                        receives.setdefault(peer, []).append((their_rows, block))
    return ShardPlan(
        tuple(blocks),
        tuple((peer, tuple(rows)) for peer, rows in sorted(sends.items())),
        tuple((peer, tuple(pairs)) for peer, pairs in sorted(receives.items())),
        tuple(starts),
        rank,
    )


def output_scale(mode: str, num_branches: int) -> float:
    """The factor of every output row: ``1 / G`` in ``head_groups`` (the definition
    divides each branch's ``O_i`` by the number of branches ``G``), 1 in ``mixture``."""
    return 1.0 if mode == "mixture" else 1.0 / num_branches


def leaves_cells_unwritten(dilation_rates: Sequence[int], mode: str) -> bool:
    """Whether the fresh blocks leave cells of the output unwritten, which must then be
    initialised (output 0, LSE ``-inf``). A fresh branch with ``r = 1`` writes every
    position of its heads (its segments tile the sequence); one with ``r > 1`` does not.
    In ``mixture`` every branch runs on every head, in ``head_groups`` on its own."""
    if mode == "mixture":
        return 1 not in dilation_rates
    return any(r > 1 for r in dilation_rates)


# Query rows a fused program owns per tile (see BranchTable.row_step): the cost model
# below assumes tiles of this many rows.
FUSED_TILE_ROWS = 64
# The largest row step considered: beyond it tiles span too many positions.
MAX_ROW_STEP = 64
# Longer segments hold every position a call can have (below 2**62 + 2**31) in their
# first segment, as this one does: clamping to it changes nothing and keeps a
# segment's end within int64.
FUSED_MAX_SEGMENT = 2**62 + 2**40


@dataclass(frozen=True)
class BranchTable:
    """The branches as a fused kernel reads them, for ``H`` heads: everything of a call's
    plan that does not depend on its lengths.

    ``segment_lengths``, ``rates``: per branch ``w`` (clamped to
    :data:`FUSED_MAX_SEGMENT`) and ``r`` (clamped to ``w``); neither clamp changes a
    selection (a rate of ``w`` or more selects one row per segment).
    ``offsets[h][i]``: the offset head ``h`` uses in branch ``i``, or ``-1`` where the
    head does not run the branch (``head_groups``) or its offset selects nothing
    (``o >= w``). ``row_step``: a fused program owns the query rows ``p = c, c + R, c +
    2R, ...`` (``R = row_step``) of a range of positions, so that each branch whose rate
    divides ``R`` selects all of its rows within a segment or none (no tile rows wasted);
    see :func:`fused_row_step`."""

    segment_lengths: tuple[int, ...]
    rates: tuple[int, ...]
    offsets: tuple[tuple[int, ...], ...]
    row_step: int


@functools.lru_cache(maxsize=256)
def branch_table(
    num_heads: int,
    segment_lengths: tuple[int, ...],
    dilation_rates: tuple[int, ...],
    mode: str,
    head_offsets: str = "interleaved",
) -> BranchTable:
    """The :class:`BranchTable` of these branches for ``num_heads`` heads (cached)."""
    segment_lengths = tuple(min(w, FUSED_MAX_SEGMENT) for w in segment_lengths)
    rates = tuple(min(r, w) for w, r in zip(segment_lengths, dilation_rates, strict=True))
    offsets = [[-1] * len(segment_lengths) for _ in range(num_heads)]
    for i, head_sets in enumerate(branch_head_sets(num_heads, dilation_rates, mode, head_offsets)):
        for offset, heads in head_sets:
            if offset < segment_lengths[i]:
                for h in range(*heads.indices(num_heads)):
                    offsets[h][i] = offset
    used = [i for i in range(len(rates)) if any(row[i] >= 0 for row in offsets)]
    row_step = fused_row_step(tuple(segment_lengths[i] for i in used), tuple(rates[i] for i in used))
    return BranchTable(tuple(segment_lengths), rates, tuple(map(tuple, offsets)), row_step)


@dataclass(frozen=True)
class FusedPlan:
    """A call as the fused kernels take it: the branches (:class:`BranchTable`), the
    position of each batch row's first key, and causality."""

    table: BranchTable
    key_starts: tuple[int, ...]
    is_causal: bool


def fused_row_step(segment_lengths: tuple[int, ...], rates: tuple[int, ...], tile_rows: int = FUSED_TILE_ROWS) -> int:
    """The row step ``R`` (a divisor of ``lcm(rates)``, at most :data:`MAX_ROW_STEP`) that
    minimises the work of a fused program's tiles: tiles of ``tile_rows`` rows ``R``
    positions apart. A branch whose rate ``r`` does not divide ``R`` selects only a
    fraction ``gcd(R, r) / r`` of a tile's rows, and one whose segments are shorter
    than a tile's span ``R * tile_rows`` fills a fraction of the tile per segment:
    the work of branch ``i``, ``w_i / r_i**2`` per position, is scaled by both."""
    limit = math.lcm(*rates) if rates else 1
    candidates = [d for d in range(1, min(limit, MAX_ROW_STEP) + 1) if limit % d == 0]

    def work(step: int) -> float:
        return sum(
            w / r**2 * (r / math.gcd(step, r)) * max(1.0, step * tile_rows / w)
            for w, r in zip(segment_lengths, rates, strict=True)
        )

    return min(candidates, key=lambda step: (work(step), step))
