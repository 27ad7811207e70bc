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

from dataclasses import dataclass, replace
from typing import Sequence

import torch

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
        return -(-(self.seglen - self.offset) // self.rate)

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


def make_plan(
    seq_len: int,
    num_heads: int,
    segment_lengths: Sequence[int],
    dilation_rates: Sequence[int],
    mode: str,
) -> list[Block]:
    """All blocks of one dilated attention, branch by branch.

    ``mixture``: every branch on every head, head ``j`` with offset ``j % r``, so the
    heads of one offset form the slice ``offset::r``; the first branch with ``r = 1``
    (if any) goes first, so that its blocks, which cover every cell, are written
    and the others merged into them. ``head_groups``: branch ``i`` on head group
    ``i`` only, offset ``i % r_i``; no two blocks share a cell. Blocks with no rows
    are dropped.
    """
    if mode == "mixture":
        head_sets = [
            [(o, slice(o, num_heads, r)) for o in range(min(r, num_heads))] for r in dilation_rates
        ]
    else:
        bounds = head_group_bounds(num_heads, len(segment_lengths))
        head_sets = [[(i % r, slice(*bounds[i]))] for i, r in enumerate(dilation_rates)]
    order = list(range(len(segment_lengths)))
    if mode == "mixture" and 1 in dilation_rates:
        first = dilation_rates.index(1)
        order = [first] + [i for i in order if i != first]
    blocks = []
    for i in order:
        w, r = segment_lengths[i], dilation_rates[i]
        fresh = mode == "head_groups" or i == order[0]
        for start, nseg, seglen in _segment_groups(seq_len, w):
            for offset, heads in head_sets[i]:
                if offset < seglen:
                    blocks.append(Block(i, start, nseg, seglen, r, offset, heads, fresh))
    return blocks


def partly_covered_heads(num_heads: int, dilation_rates: Sequence[int], mode: str) -> list[slice]:
    """Head slices in which the fresh blocks leave cells unwritten, which must be
    initialised (output 0, LSE ``-inf``). A fresh branch with ``r = 1`` writes every
    position of its heads (its segments tile the sequence); one with ``r > 1`` does not."""
    if mode == "mixture":
        return [] if 1 in dilation_rates else [slice(0, num_heads)]
    bounds = head_group_bounds(num_heads, len(dilation_rates))
    return [slice(*bounds[i]) for i, r in enumerate(dilation_rates) if r > 1]
