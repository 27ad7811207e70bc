"""Plan the kernel calls of dilated attention as strided views.

A branch ``(w, r)`` cuts the sequence into segments of length ``w`` (the last one
may be shorter) and, inside each segment, keeps the rows whose relative position
``t`` has ``t % r == offset``. For a fixed offset and a fixed set of heads, all
segments of the same length select their rows with one strided view:

    x.narrow(1, start, nseg * seglen).unflatten(1, (nseg, seglen))[:, :, offset::r, heads]

so a branch needs at most two such *blocks* per offset: the full segments and the
shorter last one. Each block becomes one call of a fused attention kernel with the
segments folded into the batch dimension. Nothing here copies data.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Sequence

import torch

from .intmath import ceil_div

MODES = ("mixture", "head_groups")


@dataclass(frozen=True)
class Block:
    """One fused-kernel call: rows ``offset::rate`` of ``nseg`` segments of ``seglen``
    positions starting at sequence position ``start``, for the heads in ``heads``.

    ``branch`` is the index of the ``(w, r)`` pair the block belongs to; ``fresh``
    means no earlier block of the plan writes any of its (position, head) cells, so
    its result is written rather than merged.
    """

    branch: int
    start: int
    nseg: int
    seglen: int
    rate: int
    offset: int
    heads: slice
    fresh: bool

    @property
    def rows(self) -> int:
        """Selected rows per segment: ``ceil((seglen - offset) / rate)``."""
        return ceil_div(self.seglen - self.offset, self.rate)

    @property
    def head_count(self) -> int:
        return len(range(self.heads.start, self.heads.stop, self.heads.step or 1))

    def chunks(self, max_segments: int) -> list["Block"]:
        """The block cut into consecutive blocks of at most ``max_segments`` segments."""
        if self.nseg <= max_segments:
            return [self]
        return [
            replace(self, start=self.start + first * self.seglen, nseg=min(max_segments, self.nseg - first))
            for first in range(0, self.nseg, max_segments)
        ]

    def select(self, x: torch.Tensor) -> torch.Tensor:
        """View of the block's rows of ``x``.

        ``x`` is ``(B, N, H, ...)`` -> ``(B, nseg, rows, h, ...)``, or a mask
        ``(B, N)`` -> ``(B, nseg, rows)``.
        """
        seg = x.narrow(1, self.start, self.nseg * self.seglen).unflatten(1, (self.nseg, self.seglen))
        rows = seg[:, :, self.offset :: self.rate]
        return rows if x.dim() == 2 else rows[:, :, :, self.heads]

    def positions(self, first_position: int, device=None) -> torch.Tensor:
        """Positions in the sequence of the block's rows, ``(nseg, rows)`` int64, when
        the tensors it selects from start at sequence position ``first_position``."""
        segment = torch.arange(self.nseg, device=device) * self.seglen
        row = torch.arange(self.rows, device=device) * self.rate
        return first_position + self.start + self.offset + segment[:, None] + row[None, :]


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


def branch_head_sets(num_heads: int, dilation_rates: Sequence[int], mode: str) -> list[list[tuple[int, slice]]]:
    """Per branch, its ``(offset, heads)`` pairs: in ``mixture`` the heads of offset
    ``o`` are ``o::r``; in ``head_groups`` branch ``i`` has its group at offset ``i % r_i``."""
    if mode == "mixture":
        return [
            [(o, slice(o, num_heads, min(r, num_heads))) for o in range(min(r, num_heads))] for r in dilation_rates
        ]
    bounds = head_group_bounds(num_heads, len(dilation_rates))
    return [[(i % r, slice(*bounds[i]))] for i, r in enumerate(dilation_rates)]


def branch_order(dilation_rates: Sequence[int], mode: str) -> list[int]:
    """The order branches run in: in ``mixture`` the first with ``r = 1`` goes first."""
    order = list(range(len(dilation_rates)))
    if mode == "mixture" and 1 in dilation_rates:
        first = list(dilation_rates).index(1)
        order = [first] + [i for i in order if i != first]
    return order


def make_plan(
    seq_len: int,
    num_heads: int,
    segment_lengths: Sequence[int],
    dilation_rates: Sequence[int],
    mode: str,
) -> list[Block]:
    """All blocks of one dilated attention on one process, branch by branch.

    ``mixture``: every branch on every head, head ``j`` with offset ``j % r``, so the
    heads of one offset form the slice ``offset::r``; the first branch with ``r = 1``
    (if any) goes first, so that its blocks, which cover every cell, are written
    and the others merged into them. ``head_groups``: branch ``i`` on head group
    ``i`` only, offset ``i % r_i``; no two blocks share a cell. Blocks with no rows
    are dropped.
    """
    return list(make_shard_plan([seq_len], 0, num_heads, segment_lengths, dilation_rates, mode, False).blocks)


@dataclass(frozen=True)
class Rows:
    """Rows ``start, start + rate, ...`` (``count`` of them) of a shard, for ``heads``:
    what one rank sends another for one branch, segment and head set."""

    start: int
    count: int
    rate: int
    heads: slice

    def positions(self, device=None) -> torch.Tensor:
        """The local row indices, ``(count,)`` int64."""
        return torch.arange(self.start, self.start + self.count * self.rate, self.rate, device=device)

    @property
    def head_indices(self) -> list[int]:
        return list(range(self.heads.start, self.heads.stop, self.heads.step or 1))


@dataclass(frozen=True)
class ShardPlan:
    """One rank's part of a sequence-parallel dilated attention.

    ``blocks``: local blocks (local coordinates), as :func:`make_plan` gives for one
    process; ``sends``: per peer, the rows of this shard that peer's queries need;
    ``receives``: per peer, that peer's rows and the local query block that attends to
    them. A peer appears only if it shares a segment with this rank and needs (or
    has) keys for it; lists are in the same order on both sides of each pair.
    ``starts``: every shard's first sequence position; ``rank``: this rank."""

    blocks: tuple[Block, ...]
    sends: tuple[tuple[int, tuple[Rows, ...]], ...]
    receives: tuple[tuple[int, tuple[tuple[Rows, Block], ...]], ...]
    starts: tuple[int, ...]
    rank: int

    @property
    def first_position(self) -> int:
        """The sequence position of this rank's first row."""
        return self.starts[self.rank]


def _selected_rows(first: int, stop: int, segment_start: int, offset: int, rate: int) -> tuple[int, int]:
    """For positions ``[first, stop)`` of a segment starting at ``segment_start``: the
    offset, relative to ``first``, of the first selected one and how many are selected."""
    local_offset = (offset - (first - segment_start)) % rate
    return local_offset, max(0, ceil_div(stop - first - local_offset, rate))


def make_shard_plan(
    shard_lengths: Sequence[int],
    rank: int,
    num_heads: int,
    segment_lengths: Sequence[int],
    dilation_rates: Sequence[int],
    mode: str,
    is_causal: bool,
) -> ShardPlan:
    """The plan of rank ``rank`` when rank ``k`` holds the ``k``-th contiguous shard of
    lengths ``shard_lengths`` (each at least 1). Segments inside the shard become local blocks as on one
    process; a segment that crosses shard boundaries contributes its local part as a
    local block (square, causal if asked) plus one exchange with each peer holding
    another part: a query attends to a peer's selected rows in full, and with
    ``is_causal`` only to those of earlier ranks (later ranks' rows all follow it)."""
    starts = [0, *itertools.accumulate(shard_lengths)][:-1]
    seq_len = sum(shard_lengths)
    lo, hi = starts[rank], starts[rank] + shard_lengths[rank]
    head_sets = branch_head_sets(num_heads, dilation_rates, mode)
    order = branch_order(dilation_rates, mode)
    blocks: list[Block] = []
    sends: dict[int, list[Rows]] = {}
    receives: dict[int, list[tuple[Rows, Block]]] = {}
    for i in order:
        # A segment longer than the sequence is the whole sequence, and a step longer
        # than a segment selects one row of it: clamping both changes nothing, and
        # keeps huge values away from tensor indexing.
        w = min(segment_lengths[i], seq_len)
        r = min(dilation_rates[i], w)
        fresh = mode == "head_groups" or i == order[0]
        first_seg, last_seg = lo // w, (hi - 1) // w
        # Segments wholly inside the shard: [inner_first, inner_last]; at most the
        # first and the last segment touching the shard cross its boundaries.
        inner_first = ceil_div(lo, w)
        inner_last = last_seg if hi == seq_len else hi // w - 1
        if inner_first <= inner_last:
            inner_start, inner_stop = inner_first * w, min((inner_last + 1) * w, seq_len)
            for start, nseg, seglen in _segment_groups(inner_stop - inner_start, w):
                for offset, heads in head_sets[i]:
                    if offset < seglen:
                        blocks.append(Block(i, inner_start - lo + start, nseg, seglen, r, offset, heads, fresh))
        for seg in sorted({first_seg, last_seg}):
            if inner_first <= seg <= inner_last:
                continue
            seg_lo, seg_hi = seg * w, min((seg + 1) * w, seq_len)
            mine = (max(seg_lo, lo), min(seg_hi, hi))
            peers = [
                k for k in range(len(shard_lengths))
                if k != rank and starts[k] < seg_hi and starts[k] + shard_lengths[k] > seg_lo
            ]
            for offset, heads in head_sets[i]:
                if offset >= w:  # no position of a segment has this offset (r was clamped to w)
                    continue
                my_offset, my_rows = _selected_rows(*mine, seg_lo, offset, r)
                if not my_rows:
                    continue
                block = Block(i, mine[0] - lo, 1, mine[1] - mine[0], r, my_offset, heads, fresh)
                blocks.append(block)
                for peer in peers:
                    theirs = (max(seg_lo, starts[peer]), min(seg_hi, starts[peer] + shard_lengths[peer]))
                    their_offset, their_rows = _selected_rows(*theirs, seg_lo, offset, r)
                    if not their_rows:
                        continue
                    if not is_causal or rank < peer:
                        sends.setdefault(peer, []).append(Rows(mine[0] - lo + my_offset, my_rows, r, heads))
                    if not is_causal or peer < rank:
                        rows = Rows(theirs[0] - starts[peer] + their_offset, their_rows, r, heads)
                        receives.setdefault(peer, []).append((rows, block))
    return ShardPlan(
        tuple(blocks),
        tuple((peer, tuple(rows)) for peer, rows in sorted(sends.items())),
        tuple((peer, tuple(pairs)) for peer, pairs in sorted(receives.items())),
        tuple(starts),
        rank,
    )


def partly_covered_heads(num_heads: int, dilation_rates: Sequence[int], mode: str) -> list[slice]:
    """Head slices in which the fresh blocks leave cells unwritten, which must be
    initialised (output 0, LSE ``-inf``). A fresh branch with ``r = 1`` writes every
    position of its heads (its segments tile the sequence); one with ``r > 1`` does not."""
    if mode == "mixture":
        return [] if 1 in dilation_rates else [slice(0, num_heads)]
    bounds = head_group_bounds(num_heads, len(dilation_rates))
    return [slice(*bounds[i]) for i, r in enumerate(dilation_rates) if r > 1]
