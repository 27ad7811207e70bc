"""A few query rows against a window of keys in a handful of tensor operations: the
lean path of decode steps (one token per sequence, or a few).

A query attends, in each branch that selects it, to the selected keys of its
segment up to itself. ``mixture`` is one softmax over all of those keys, a key that
``m`` branches select counting ``m`` times: exactly the softmax over the window of
keys from the earliest one any branch reaches, with ``log(m)`` added to each key's
score (``-inf`` where ``m = 0``). ``head_groups`` is the same with each head's one
branch, the output divided by the number of branches. So a step is one fused
attention call over that window with an additive bias, and the bias is built from
its branches: the selected keys of a branch in the query's segment are every
``r``-th key from the segment's start, one strided column slice of the window, and
the heads it counts for are those whose offset is the query's phase in the segment
(a precomputed per-branch, per-phase head vector). The cost is one small tensor
operation per branch and query row, whatever the lengths, plus the attention over
the window (never longer than ``max(segment_lengths)`` keys).

Where windows are much longer than what the heads attend to, a step of one row per
sequence runs branch by branch instead (:func:`branch_attention`): a call per branch
and phase over the branch's strided keys, merged by their log-sum-exps, planned once
per arrangement of the rows in their segments (:func:`branch_calls`); a cost model
picks the cheaper way (:func:`attend_step`). Both are exact: the tests hold them to
the float64 reference.
"""

from __future__ import annotations

import array
import functools
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .finite import nonfinite
from .kernels import accumulator
from .plan import branch_head_sets, branch_table, key_heads, output_scale
from .strides import contiguous_last_dim

# PyTorch's fused CPU attention, ``(out, lse)``; its direct binding costs microseconds less per
# call than ``torch.ops.aten``'s.
_cpu_attention = torch._scaled_dot_product_flash_attention_for_cpu
# Query rows a step takes through this path at most (more are a prefill chunk).
MAX_ROWS = 16
# What the branch-by-branch path's extra calls and merges cost, in (key, head) pairs
# of the window path (measured on 2-core x86 CPUs: about 60 us, at about 10 ns a pair).
BRANCH_CALLS_COST = 8192
# What one more call of a single batch row costs in that path (about 20 us), and
# what a call of a gathered subset of the rows costs beyond its pairs: its gather.
ROW_CALL_COST = 2048
# Rows that one branch-by-branch call takes at most.
MAX_RUN = 32
# What a pair costs in a call whose rows attend to different numbers of keys (a mask
# for each row's keys before its own), against a pair of a call whose rows attend to
# all of theirs. The mask itself costs a call alone 1.0 to 1.1 times; set from the
# steps of left-padded batches of 8 instead (2-core AMD EPYC, keys out of the
# processor's caches, alternating runs from 4K to 64K): 2 made them 2 to 7% faster
# than 1.125, and 3 or 4 no faster than 2 beyond the runs' noise.
MASKED_FACTOR = 2.0
# Rows at different positions: the window's pairs cost this many times more (a bias
# per row to build and read, and the keys before a later row's segment start), and a
# row taken alone this much more (its whole step's overhead); measured alike.
DISTINCT_FACTOR = 1.25
ROW_STEP_COST = 3 * BRANCH_CALLS_COST
# What a kept call holds beyond its masks' and gathered rows' entries, in elements.
CALL_ELEMENTS = 8


def is_step(num_rows: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether a call of ``num_rows`` query rows on ``q, k, v`` is a decode step, which
    the caches' fused launches and this module's lean path take: at most
    :data:`MAX_ROWS` rows, nothing to differentiate, not traced by ``torch.compile``
    (which takes the engine's path, whose shapes it follows)."""
    if num_rows > MAX_ROWS or torch.compiler.is_compiling():
        return False
    return not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad))


class Memo(dict):
    """A memo whose values hold at most a given number of elements in all, each value's
    count given as it is kept: emptied when the next would pass the bound (what it
    keeps is remade cheaply). A value replaced under its key counts until then, and
    threads keeping values at once may miscount by a few."""

    held = 0

    def keep(self, key, value, elements: int, bound: int) -> None:
        if self.held + elements > bound:
            self.clear()
        if elements <= bound:
            self[key] = value
            self.held += elements

    def clear(self) -> None:
        super().clear()
        self.held = 0


@dataclass(frozen=True)
class DecodeTables:
    """Per branch ``(w, r, heads, chosen)`` (``r`` clamped to ``w``): per phase ``t <
    min(r, H)`` of a query in its segment (later phases select no head), ``heads[t]``
    the ``(H, 1)`` float 0/1 vector of the heads that count the branch's keys (those
    whose offset is ``t``) and ``chosen[t]`` the same as a bit mask (bit ``h`` for
    head ``h``); ``every_head``: all ``H`` bits."""

    branches: tuple[tuple[int, int, tuple[torch.Tensor, ...], tuple[int, ...]], ...]
    every_head: int
    out_scale: float
    # per branch (in the order above) and phase: the heads that count it, as a slice
    query_heads: tuple[tuple[slice | None, ...], ...]

    def window_cost(
        self, positions: Sequence[int], num_heads: int, window_factor: float = 1.0, width: int | None = None
    ) -> int:
        """What one query row per sequence at ``positions`` costs over one window (of
        ``width`` keys, default: what the queries reach), in (key, head) pairs read, each
        counting ``window_factor``; :func:`branch_calls` says what the branch-by-branch
        way costs in the same unit."""
        if width is None:
            width = max(self.reach(p, p) for p in positions)
        return int(window_factor * len(positions) * num_heads * width)

    def row_cost(self, position: int, num_heads: int) -> int:
        """The cheaper way's cost (:meth:`window_cost`, :func:`branch_calls`) for one
        sequence's query at ``position``: it depends on the position only modulo
        ``lcm(segment_lengths)`` (its place in every segment), so it is kept per place
        and cost model (a left-padded batch asks every step)."""
        if position < 0:  # padding: attends to nothing
            return 0
        key = (position % self.period, num_heads, cost_constants())
        found = self._row_costs.get(key)
        if found is None:
            window = self.window_cost([position], num_heads)
            found = min(window, branch_calls(self, [position], window)[0])
            self._row_costs.keep(key, found, 1, MAX_ROW_COSTS)
        return found

    def __deepcopy__(self, memo) -> DecodeTables:
        """Itself: tables follow from the configuration alone (what they keep are memos),
        so a deep copy of a cache shares them."""
        return self

    @functools.cached_property
    def period(self) -> int:
        """``lcm(segment_lengths)``: positions this far apart have one place in every segment."""
        return math.lcm(*self.segment_lengths)

    @functools.cached_property
    def _row_costs(self) -> Memo:
        return Memo()

    def reach(self, first: int, last: int) -> int:
        """How many keys queries at positions ``first .. last`` attend back over: from
        the first one's earliest segment start to the last (0 if all are padding,
        at negative positions)."""
        if last < 0:
            return 0
        first = max(first, 0)
        return last - min([first - first % w for w in self.segment_lengths]) + 1

    @functools.cached_property
    def segment_lengths(self) -> tuple[int, ...]:
        return tuple(w for w, _, _, _ in self.branches)

    @functools.cached_property
    def num_heads(self) -> int:
        return self.branches[0][2][0].shape[0]

    @functools.cached_property
    def first_length(self) -> int:
        """The shortest segment length: positions below it are in every branch's first segment."""
        return min(self.segment_lengths)

    def early_bias(self, first: int, rows: int, dtype: torch.dtype) -> tuple[torch.Tensor, bool] | None:
        """:func:`window_bias` of one sequence whose ``rows`` queries from ``first`` on all
        lie in the first segment of every branch (``0 <= first``, ``first + rows <=
        min(segment_lengths)``), as a view of a table made once: ``None`` elsewhere, or
        where the table would be too large. There a key ``d`` positions before a query at
        ``p`` is counted by each branch ``(w, r)`` whose ``r`` divides ``d``, for the heads
        of phase ``p % r``: the bias depends on ``p`` only through ``p mod lcm(r)``."""
        if first < 0 or first + rows > self.first_length:
            return None
        found = self._early_tables.get(dtype)
        if found is None:
            found = self._early_tables[dtype] = _early_table(self, dtype)
        table, empty = found
        if table is None:
            return None
        phases, heads, length = table.shape
        phase = first % (phases - MAX_ROWS)
        # row i, head h, key j: table[phase + i, h, m - 1 - (first + i) + j], m = min(w)
        view = table.as_strided(
            (1, heads, rows, first + rows),
            (0, length, heads * length - 1, 1),
            phase * heads * length + length - MAX_ROWS - 1 - first,
        )
        return view, any(empty[phase : phase + rows])

    def late_keys_mask(self, deficits: tuple[int, ...], longest: int, dtype: torch.dtype, device) -> torch.Tensor:
        """The additive mask ``(len(deficits), 1, 1, longest)`` of rows that share a call
        over their last ``longest`` keys, row ``i`` attending to its last ``longest -
        deficits[i]`` only (``-inf`` before them, ``0`` from there): a view of a mask kept
        per ``deficits`` (these stay the same from step to step until a row's segment
        starts anew), a power of two wide, made again once too narrow."""
        key = (deficits, dtype)
        mask = self._late_masks.get(key)
        if mask is None or mask.shape[-1] < longest:
            width = 1 << (longest - 1).bit_length()
            before = torch.arange(width, device=device) < torch.tensor(key[0], device=device).view(-1, 1, 1, 1)
            mask = torch.zeros(before.shape, dtype=dtype, device=device).masked_fill_(before, -math.inf)
            self._late_masks.keep(key, mask, mask.numel(), MAX_LATE_MASK_ELEMENTS)
        return mask[..., :longest]

    @functools.cached_property
    def _late_masks(self) -> Memo:
        return Memo()

    @functools.cached_property
    def plans(self) -> Memo:
        """:func:`branch_calls`' plans (:class:`StepPlan`), by their keys (of at most
        :data:`MAX_PLAN_ELEMENTS` elements in all)."""
        return Memo()

    @functools.cached_property
    def reused(self) -> dict[object, tuple]:
        """``"filled"``: the last bias :func:`window_bias` filled, with its arguments;
        ``("step", B)``: the last choice :func:`attend_step` made for ``B`` rows, with its
        arguments."""
        return {}

    @functools.cached_property
    def _early_tables(self) -> dict[torch.dtype, tuple[torch.Tensor | None, tuple[bool, ...]]]:
        return {}


def cost_constants() -> tuple:
    """The cost model's constants, part of the key of every choice kept (a changed
    constant makes its choices anew)."""
    return (BRANCH_CALLS_COST, ROW_CALL_COST, MAX_RUN, MASKED_FACTOR, DISTINCT_FACTOR, ROW_STEP_COST)


# Places in the cycle of segments whose one-row cost DecodeTables.row_cost keeps.
MAX_ROW_COSTS = 2**16
# Elements of the plans of branch-by-branch steps kept (:attr:`StepPlan.size`; about
# 20 MiB of Python objects and indices at most).
MAX_PLAN_ELEMENTS = 2**20
# Elements of the late-key masks kept (:meth:`DecodeTables.late_keys_mask`; 16 MiB in float32).
MAX_LATE_MASK_ELEMENTS = 2**22
# Elements of the largest bias kept for the next layer's step (4 MiB in float32).
MAX_REUSED_BIAS = 2**20
# Elements of the largest table :meth:`DecodeTables.early_bias` makes (16 MiB in float32).
MAX_EARLY_TABLE = 2**22


def _early_table(tables: DecodeTables, dtype: torch.dtype) -> tuple[torch.Tensor | None, tuple[bool, ...]]:
    """``(table, empty)`` for :meth:`DecodeTables.early_bias`: per phase ``t`` in ``[0,
    lcm(r) + MAX_ROWS)``, ``table[t]`` ``(H, m + MAX_ROWS)`` (``m = min(w)``) holds at
    ``m - 1 - d`` the log-multiplicity of the key ``d`` positions before a query whose
    position is ``t`` modulo ``lcm(r)``, and ``-inf`` after column ``m - 1`` (keys
    after the query); ``empty[t]``: whether some head attends to no key there."""
    period = math.lcm(*(r for _, r, _, _ in tables.branches))
    first_length = tables.first_length
    heads = tables.num_heads
    phases = period + MAX_ROWS
    if phases * heads * (first_length + MAX_ROWS) > MAX_EARLY_TABLE:
        return None, ()
    back = torch.arange(first_length - 1, -1, -1, device=tables.branches[0][2][0].device)  # d, by column
    table = torch.full((phases, heads, first_length + MAX_ROWS), -math.inf, dtype=dtype, device=back.device)
    empty = []
    for t in range(phases):
        count = torch.zeros(heads, first_length, dtype=dtype, device=back.device)
        counted = 0
        for _, r, by_phase, chosen in tables.branches:
            phase = t % r
            if phase < len(chosen) and chosen[phase]:
                count += by_phase[phase].to(dtype) * (back % r == 0)
                counted |= chosen[phase]
        table[t, :, :first_length] = count.log()
        empty.append(counted != tables.every_head)
    return table, tuple(empty)


@functools.lru_cache(maxsize=64)
def decode_tables(
    num_heads: int,
    segment_lengths: tuple[int, ...],
    dilation_rates: tuple[int, ...],
    mode: str,
    head_offsets: str,
    device: torch.device,
) -> DecodeTables:
    """The :class:`DecodeTables` of these branches on ``device`` (cached)."""
    table = branch_table(num_heads, segment_lengths, dilation_rates, mode, head_offsets)
    sets = branch_head_sets(num_heads, dilation_rates, mode, head_offsets)
    branches, query_heads = [], []
    # A branch that counts every head first (r = 1 in mixture): its call is the one the
    # others merge into in place (see StepPlan.merges_in_place).
    for i in sorted(range(len(sets)), key=lambda i: table.rates[i] != 1):
        w, r = table.segment_lengths[i], table.rates[i]
        # Offsets are below H: phases from H on select no head (and r may be huge).
        phases = [[table.offsets[h][i] == t for h in range(num_heads)] for t in range(min(r, num_heads))]
        heads = tuple(torch.tensor(p, dtype=torch.float32, device=device).view(-1, 1) for p in phases)
        chosen = tuple(sum(1 << h for h, yes in enumerate(p) if yes) for p in phases)
        branches.append((w, r, heads, chosen))
        by_offset = {offset: heads for offset, heads in sets[i] if offset < w}
        query_heads.append(tuple(by_offset.get(t) for t in range(len(phases))))
    out_scale = output_scale(mode, len(segment_lengths))
    return DecodeTables(tuple(branches), (1 << num_heads) - 1, out_scale, tuple(query_heads))


def window_bias(
    tables: DecodeTables, firsts: Sequence[int], rows: int, width: int, num_heads: int, device, dtype=torch.float32
) -> tuple[torch.Tensor, bool]:
    """The additive bias ``(len(firsts), H, rows, width)`` over a window of ``width``
    keys of ``rows`` consecutive queries per sequence, the first at ``firsts[b]`` and the
    last at the window's last key: ``log(multiplicity)``; and whether some (query,
    head) attends to no key (a query at a negative position, or selected by no
    branch). Early in a sequence a view of a table (:meth:`DecodeTables.early_bias`),
    else :func:`filled_bias`. Read-only: it may be a view of the table."""
    if len(firsts) == 1 and width == firsts[0] + rows:
        early = tables.early_bias(firsts[0], rows, dtype)
        if early is not None:
            return early
    # The layers of a model take their steps at the same positions, one after another.
    key = (tuple(firsts), rows, width, dtype, torch.is_inference_mode_enabled())
    last = tables.reused.get("filled")
    if last is not None and last[0] == key:
        return last[1]
    bias = _early_rows(tables, firsts, rows, width, num_heads, device, dtype)
    if bias is None:
        bias = filled_bias(tables, firsts, rows, width, num_heads, device, dtype)
    if bias[0].numel() <= MAX_REUSED_BIAS:
        tables.reused["filled"] = (key, bias)
    return bias


def _early_rows(
    tables: DecodeTables, firsts: Sequence[int], rows: int, width: int, num_heads: int, device, dtype
) -> tuple[torch.Tensor, bool] | None:
    """:func:`window_bias` of sequences all at early positions (a left-padded batch at
    the start of its text): each one's table view (:meth:`DecodeTables.early_bias`)
    copied into place, right-aligned (keys before its position 0: ``-inf``); ``None``
    unless every sequence's queries are early."""
    views = []
    for first in firsts:
        early = tables.early_bias(first, rows, dtype)
        if early is None:
            return None
        views.append(early)
    bias = torch.full((len(firsts), num_heads, rows, width), -math.inf, device=device, dtype=dtype)
    for sequence, (view, _) in enumerate(views):
        bias[sequence, :, :, width - view.shape[-1] :] = view[0]
    return bias, any(empty for _, empty in views)


def filled_bias(
    tables: DecodeTables, firsts: Sequence[int], rows: int, width: int, num_heads: int, device, dtype=torch.float32
) -> tuple[torch.Tensor, bool]:
    """:func:`window_bias`, filled in place: one tensor whatever the batch, a strided
    column view per (sequence, query, branch)."""
    # count - 1 from the start: log1p of it is log(count), fast where the count is 0 (log is not)
    count = torch.full((len(firsts), num_heads, rows, width), -1.0, device=device, dtype=dtype)
    empty = False
    head_stride = rows * width
    for sequence, first in enumerate(firsts):
        for row in range(rows):
            position = first + row
            counted = 0
            if position >= 0:
                # the window column of this query's own key, in count's storage
                own = (sequence * num_heads * rows + row) * width + width - rows + row
                for w, r, heads, chosen in tables.branches:
                    into = position % w  # the query's place in its segment
                    phase = into % r
                    if phase < len(chosen) and chosen[phase]:
                        # every r-th key from the segment's first one (into columns back) to the query's own
                        keys = (into - phase) // r + 1
                        count.as_strided((num_heads, keys), (head_stride, r), own - (keys - 1) * r).add_(heads[phase])
                        counted |= chosen[phase]
            empty = empty or counted != tables.every_head
    return count.log1p_(), empty  # log(count): -inf where 0


def window_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_positions: Sequence[int],
    tables: DecodeTables,
    scale: float,
    padding: torch.Tensor | None = None,
    width: int | None = None,
):
    """``out`` ``(B, Lq, H, D)`` and ``lse`` ``(B, Lq, H)`` of causal dilated attention
    of ``q`` ``(B, Lq, H, D)`` against ``k, v`` ``(B, H_kv, Lk, D)`` (key-head-major
    views), the queries being the last ``Lq`` key slots; slot 0 of row ``b`` is at
    position ``key_positions[b]`` (negative positions are padding). ``padding``:
    ``(B, Lk)`` bool, ``True`` for a padded key. The keys must reach back to every
    query's earliest segment start (as a window of :func:`dilated_attention` must).
    ``width``: how many of the last keys the queries reach (:func:`window_width`),
    where the caller has it."""
    rows, num_heads = q.shape[1], q.shape[2]
    num_keys = k.shape[2]
    firsts = [p + num_keys - rows for p in key_positions]  # the first query's position, per row
    if width is None:
        width = window_width(tables, firsts, rows, num_keys)
    shared = len(set(firsts)) == 1  # sequences at one position share one bias
    dtype = accumulator(q.dtype)  # the scores' dtype
    bias, empty = window_bias(tables, firsts[:1] if shared else firsts, rows, width, num_heads, q.device, dtype)
    if width < num_keys:
        k, v = k.narrow(2, num_keys - width, width), v.narrow(2, num_keys - width, width)
    k, v = contiguous_last_dim(k), contiguous_last_dim(v)
    if padding is not None:
        bias = bias.masked_fill(padding[:, None, None, num_keys - width :], -math.inf)
    out, lse = _cpu_attention(
        contiguous_last_dim(q).transpose(1, 2),
        k,
        v,
        0.0,
        False,
        attn_mask=bias,
        scale=scale,
    )
    if empty or padding is not None:  # rows with no key: 0 and -inf, not the kernel's 0/0
        none = torch.isneginf(bias).all(-1)
        out, lse = out.masked_fill(none.unsqueeze(-1), 0.0), lse.masked_fill(none, -math.inf)
    if tables.out_scale != 1.0:
        out = out * tables.out_scale
    return out.transpose(1, 2), lse.transpose(1, 2)


def window_width(tables: DecodeTables, firsts: Sequence[int], rows: int, num_keys: int) -> int:
    """How many of the last ``num_keys`` keys ``rows`` queries per sequence from
    ``firsts[b]`` on reach (at least 1)."""
    return max(1, min(num_keys, max(tables.reach(first, first + rows - 1) for first in firsts)))


@dataclass(frozen=True)
class BranchCall:
    """One attention call of the branch-by-branch way: the heads ``heads`` (a slice) of
    the batch rows ``rows`` (a slice, or the rows to gather) against every ``r``-th key
    back from their queries, as many as the row ``lead`` attends to, the ``i``-th row
    ``deficits[i]`` fewer (the keys before its segment's start, masked; ``None``: no
    row fewer); ``branch``: the index of its branch in :attr:`DecodeTables.branches`
    (the calls of one branch cover each (row, head) at most once); ``weight``: what it
    costs per key of its lead row, in (key, head) pairs read."""

    branch: int
    r: int
    heads: slice
    rows: slice | tuple[int, ...]
    lead: int
    deficits: tuple[int, ...] | None
    weight: float


@dataclass(frozen=True, eq=False)
class StepPlan:
    """The calls of :func:`branch_attention` for query rows whose places in their
    segments stand as the plan's key says (:func:`_places`); ``fixed``: what they cost
    beyond their keys and :data:`BRANCH_CALLS_COST` (:data:`ROW_CALL_COST` per call
    beyond one per branch and phase); ``sources``: where the merge reads each cell in
    their outputs (:func:`_sources`) where they do not merge in place; ``size``: the
    elements it holds with its key (the merge index, the key's places, the calls'
    fields and rows), a measure of its memory; ``batch``, ``num_heads``: the step's rows
    and query heads."""

    calls: tuple[BranchCall, ...]
    fixed: float
    sources: torch.Tensor
    size: int
    batch: int
    num_heads: int

    def kv_heads(self, groups_per_kv: int) -> tuple[slice, ...] | None:
        """Per call, the key/value heads of its query heads when each ``groups_per_kv``
        consecutive query heads share one (a slice, the kernel broadcasting each over its
        query heads); ``None`` where a call's map no view expresses. Kept per grouping."""
        if groups_per_kv not in self._kv_heads:
            found: tuple[slice, ...] | None = tuple(call.heads for call in self.calls)
            if groups_per_kv > 1:
                mapped = [key_heads(call.heads.indices(self.num_heads), groups_per_kv)[0] for call in self.calls]
                found = tuple(slice(*kv) for kv in mapped if kv is not None)
                found = found if len(found) == len(mapped) else None
            self._kv_heads[groups_per_kv] = found
        return self._kv_heads[groups_per_kv]

    @functools.cached_property
    def _kv_heads(self) -> dict[int, tuple[slice, ...] | None]:
        return {}

    @functools.cached_property
    def merges_in_place(self) -> bool:
        """Whether the first call covers every (row, head) of the step and every other
        call's rows are a slice: then :func:`_combine` merges each part into the first's
        output in place, a view at a time (:func:`_merge_into`)."""
        first = self.calls[0] if self.calls else None
        return (
            first is not None
            and _covers(first.rows, self.batch)
            and _covers(first.heads, self.num_heads)
            and all(isinstance(call.rows, slice) for call in self.calls)
        )


@dataclass(frozen=True)
class StepCalls:
    """A step's :class:`StepPlan`, and how many keys each call's lead row attends to."""

    plan: StepPlan
    longest: tuple[int, ...]


def _places(tables: DecodeTables, positions: Sequence[int]) -> tuple[list[list[int]], tuple]:
    """Per branch, each row's place in its segment (``-1`` for a row at a negative
    position, i.e. padding), and the key of the step's :class:`StepPlan`: per branch,
    the place of the first row that is not padding modulo ``r``, the places relative
    to it (``None`` for padding), and the largest place rounded down to three
    significant bits. The rows' phases, the differences between their numbers of keys,
    and so the calls' rows, heads and masks, follow from the key (their runs are chosen
    for numbers of keys of that size); the numbers of keys from the places. Rows
    advance together, so a key recurs every ``lcm(r)`` steps until a row's segment
    starts anew, a padded row reaches position 0, or the largest place's rounding
    changes (every eighth to quarter of its value)."""
    places, key = [], []
    started = next((row for row, p in enumerate(positions) if p >= 0), None)
    for w, r, _, _ in tables.branches:
        into = [p % w if p >= 0 else -1 for p in positions]
        first, most = (0 if started is None else into[started]), max(into)
        shift = max(most.bit_length() - 3, 0)
        key.append((first % r, most >> shift << shift, tuple(place - first if place >= 0 else None for place in into)))
        places.append(into)
    return places, tuple(key)


def _plan(tables: DecodeTables, places: Sequence[Sequence[int]]) -> StepPlan:
    """The :class:`StepPlan` of rows at ``places`` (:func:`_places`): per branch and per
    phase some row's query has in its segment, the rows of that phase in runs
    (:func:`_grouping`)."""
    fixed, calls = 0.0, []
    for branch, ((_, r, _, chosen), heads_by_phase) in enumerate(zip(tables.branches, tables.query_heads, strict=True)):
        groups: dict[int, dict[int, int]] = {}
        for row, into in enumerate(places[branch]):
            phase = into % r
            if into >= 0 and phase < len(chosen) and chosen[phase]:
                groups.setdefault(phase, {})[row] = into // r + 1
        for phase, members in groups.items():
            heads = heads_by_phase[phase]
            assert heads is not None  # a phase that counts some head: below w
            runs = _grouping(members, chosen[phase].bit_count())
            fixed += ROW_CALL_COST * (len(runs) - 1)
            for rows, counts, weight in runs:
                longest = max(counts)
                deficits = None if min(counts) == longest else tuple(longest - count for count in counts)
                lead = rows[counts.index(longest)]
                calls.append(BranchCall(branch, r, heads, _rows_index(rows), lead, deficits, weight))
    sources = _sources(calls, len(tables.branches), len(places[0]), tables.num_heads)
    size = sources.numel() + len(places) * len(places[0])
    for call in calls:
        size += CALL_ELEMENTS + len(call.deficits or ()) + (len(call.rows) if isinstance(call.rows, tuple) else 0)
    return StepPlan(tuple(calls), fixed, sources, size, len(places[0]), tables.num_heads)


def _grouping(members: dict[int, int], heads_counted: int) -> list[tuple[list[int], list[int], float]]:
    """The cheapest way to call the rows ``members`` (row -> its keys, in increasing row
    order) of one branch and phase for ``heads_counted`` heads, in (key, head) pairs
    read, as consecutive runs of them ``(rows, counts, weight)``, each one call reading
    its longest row's keys for every row, ``weight`` pairs per key: ``rows`` a slice
    where they are evenly spaced (a view), else the rows to gather (a gather counting
    as a second read); a mask of the keys before a row's own, where counts differ,
    makes each pair cost :data:`MASKED_FACTOR`; each call beyond the first costs
    :data:`ROW_CALL_COST`. Rows far apart in their segments are called apart, rows
    near each other together (a shortest path over the places between runs, runs of
    at most :data:`MAX_RUN` rows)."""
    rows, counts = list(members), list(members.values())
    if len(rows) == 1 or (min(counts) == counts[0] == max(counts) and _evenly_spaced(rows)):
        return [(rows, counts, len(rows) * heads_counted)]
    # best[end]: the cost of calling rows[:end]; start[end], factor[end]: its last run's
    best, start, factor = [0.0] + [math.inf] * len(rows), [0] * (len(rows) + 1), [1.0] * (len(rows) + 1)
    for end in range(1, len(rows) + 1):
        longest, lowest, even = 0, math.inf, True
        for first in range(end - 1, max(end - 1 - MAX_RUN, -1), -1):
            longest, lowest = max(longest, counts[first]), min(lowest, counts[first])
            if first + 2 < end:
                even = even and rows[first + 1] - rows[first] == rows[first + 2] - rows[first + 1]
            each = (1 if even else 2) * (1 if lowest >= longest else MASKED_FACTOR)
            cost = best[first] + each * (end - first) * heads_counted * longest + ROW_CALL_COST
            if cost < best[end]:
                best[end], start[end], factor[end] = cost, first, each
    runs, end = [], len(rows)
    while end:
        first = start[end]
        runs.append((rows[first:end], counts[first:end], factor[end] * (end - first) * heads_counted))
        end = first
    return runs[::-1]


def _evenly_spaced(rows: Sequence[int]) -> bool:
    return all(b - a == rows[1] - rows[0] for a, b in itertools.pairwise(rows))


def _rows_index(rows: Sequence[int]) -> slice | tuple[int, ...]:
    """Batch rows as one call takes them: a slice where they are evenly spaced, else
    the rows to gather."""
    if len(rows) == 1 or _evenly_spaced(rows):
        return slice(rows[0], rows[-1] + 1, rows[1] - rows[0] if len(rows) > 1 else 1)
    return tuple(rows)


def branch_calls(
    tables: DecodeTables, positions: Sequence[int], limit: float = math.inf
) -> tuple[int, StepCalls | None]:
    """The calls of :func:`branch_attention` for one query row per sequence at
    ``positions``, and their cost in (key, head) pairs read (:data:`BRANCH_CALLS_COST`
    for the calls and merges, and each call's pairs): per branch and per phase some
    row's query has in its segment, the rows of that phase in runs of rows near each
    other in their segments (:func:`_grouping`). The calls are ``None`` where the cost
    reaches ``limit`` (another way is cheaper). Their plan is kept per key
    (:func:`_places`), which a left-padded batch's steps meet again and again, and
    which the model's layers share."""
    if limit <= BRANCH_CALLS_COST:  # short windows: the common case, answered at once
        return BRANCH_CALLS_COST, None
    places, key = _places(tables, positions)
    key = (key, cost_constants())  # with the constants of the cost model that chose it
    plan = tables.plans.get(key)
    if plan is None:
        plan = _plan(tables, places)
        tables.plans.keep(key, plan, plan.size, MAX_PLAN_ELEMENTS)
    longest = tuple(places[call.branch][call.lead] // call.r + 1 for call in plan.calls)
    keys_read = sum(call.weight * keys for call, keys in zip(plan.calls, longest, strict=True))
    cost = int(BRANCH_CALLS_COST + plan.fixed + keys_read)
    return cost, (StepCalls(plan, longest) if cost < limit else None)


def branch_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: Sequence[int],
    tables: DecodeTables,
    scale: float,
    calls: StepCalls | None = None,
):
    """``(out, lse)`` as :func:`window_attention` gives them, for one query row per
    sequence at ``positions`` (no padding mask), computed branch by branch: for each
    branch and each phase the rows' queries have in their segments, one attention call
    of the heads that count it against the branch's selected keys, every ``r``-th key
    back from the query (a strided view; the rows of other phases left out, the rows of
    that phase gathered where there are others; a row's keys before its segment's start
    masked), the calls combined by their log-sum-exps. It reads only the keys each head
    attends to, where a window reads every head's whole window: fewer bytes once
    windows are long, more calls. ``calls``: :func:`branch_calls` of ``positions``,
    where the caller has them. ``None`` where grouped-query heads map to key heads no
    view expresses (the window then serves)."""
    batch, _, num_heads, dim = q.shape
    groups_per_kv = num_heads // k.shape[1]
    queries, end = contiguous_last_dim(q).transpose(1, 2), k.shape[2]  # each query's own key is slot end - 1
    k, v = contiguous_last_dim(k), contiguous_last_dim(v)
    acc = accumulator(q.dtype)
    if calls is None:
        calls = branch_calls(tables, positions)[1]
        assert calls is not None  # without a limit
    kv_heads = calls.plan.kv_heads(groups_per_kv)
    if kv_heads is None:
        return None
    # Every call's arguments first, then the calls back to back: each call streams its
    # keys through the processor's caches, and the small operations between two calls
    # would run cold (several times slower).
    arguments = []
    for call, longest, kv in zip(calls.plan.calls, calls.longest, kv_heads, strict=True):
        keys = (end - 1 - (longest - 1) * call.r, longest, call.r)
        # the rows to gather (at the call, one copy at a time), or None: a slice
        if isinstance(call.rows, slice):
            rows, gathered = call.rows, None
        else:
            rows, gathered = slice(0, batch, 1), torch.tensor(call.rows, device=q.device)
        qs = _sliced(queries, rows, call.heads, (0, 1, 1))
        ks, vs = _sliced(k, rows, kv, keys), _sliced(v, rows, kv, keys)
        # a row's keys before its segment's start, where its call reads further back for others
        mask = None if call.deficits is None else tables.late_keys_mask(call.deficits, longest, acc, q.device)
        arguments.append((qs, ks, vs, mask, gathered))
    parts = []
    for qs, ks, vs, mask, gathered in arguments:
        if gathered is not None:
            qs, ks, vs = qs.index_select(0, gathered), ks.index_select(0, gathered), vs.index_select(0, gathered)
        parts.append(_cpu_attention(qs, ks, vs, 0.0, False, attn_mask=mask, scale=scale))
    shape = (batch, num_heads, 1, dim)
    out, lse = _combine(parts, calls.plan, len(tables.branches), shape, tables.out_scale, acc, q.device)
    return (out if out.dtype == q.dtype else out.to(q.dtype)).transpose(1, 2), lse.transpose(1, 2)


def _sliced(t: torch.Tensor, rows: slice, heads: slice, keys: tuple[int, int, int]) -> torch.Tensor:
    """``t[rows, heads, first : first + count * step : step]`` of ``t`` ``(B, H, N, D)``, with
    ``keys = (first, count, step)`` (in bounds; ``t`` itself where that is all of it), in
    one operation: a decode step's tensors are small, and each operation costs microseconds."""
    first_row, stop_row, row_step = rows.indices(t.shape[0])
    first_head, stop_head, head_step = heads.indices(t.shape[1])
    first, count, step = keys
    size = (len(range(first_row, stop_row, row_step)), len(range(first_head, stop_head, head_step)), count, t.shape[3])
    if size == t.shape:
        return t
    batch_stride, head_stride, key_stride, dim_stride = t.stride()
    return t.as_strided(
        size,
        (batch_stride * row_step, head_stride * head_step, key_stride * step, dim_stride),
        t.storage_offset() + first_row * batch_stride + first_head * head_stride + first * key_stride,
    )


def _combine(
    parts, plan: StepPlan, branches: int, shape: tuple[int, int, int, int], out_scale: float, acc: torch.dtype, device
):
    """``(out, lse)`` ``(B, H, L, D)``, ``(B, H, L)`` of one softmax over the keys of every
    part ``(out, lse)``, the ``i``-th the attention of ``plan.calls[i]``, its heads
    (a slice) of its batch rows (a slice or a tuple of rows) over some of the keys of
    its branch, of ``branches`` (the parts of one branch cover each cell at most
    once), ``out`` times ``out_scale``; what no part covers: 0 and ``-inf``. Where
    ``plan.merges_in_place``, the other parts merge into the first's output in place
    (:func:`_merge_into`); else the parts are concatenated and gathered into a
    ``(branches, B, H)`` grid (``plan.sources``), then merged over the branches by their
    log-sum-exps (a decode step's tensors are small: operations, not bytes, cost)."""
    length, dim = shape[2:]
    if plan.merges_in_place:
        out, lse = parts[0][0].to(acc), parts[0][1]
        for call, (part, part_lse) in zip(plan.calls[1:], parts[1:], strict=True):
            assert isinstance(call.rows, slice)  # merges_in_place says so
            _merge_into(out, lse, call.rows, call.heads, part if part.dtype == acc else part.to(acc), part_lse)
        return (out.mul_(out_scale) if out_scale != 1.0 else out), lse
    none_out, none_lse = _no_part(length, dim, acc, device)
    # every part's cells, then the (0, -inf) of no part, gathered into (branch, row, head)
    # order (the no-part row is in the accumulator's dtype: the concatenation promotes to it)
    outs = torch.cat([o.reshape(-1, length, dim) for o, _ in parts] + [none_out]).index_select(0, plan.sources)
    lses = torch.cat([lse.reshape(-1, length) for _, lse in parts] + [none_lse]).index_select(0, plan.sources)
    outs, lses = outs.view(branches, *shape), lses.view(branches, *shape[:3])
    # Weights against the largest branch's LSE (kept finite where no part covers a cell),
    # divided by their sum: weights against the joint LSE itself would carry its rounding,
    # about an ulp of |lse|, into every output.
    top = lses.amax(0).clamp_min_(torch.finfo(acc).min)
    weights = (lses - top).exp_()
    total = weights.sum(0)
    out = (outs * weights.unsqueeze(-1)).sum(0).div_(total.clamp_min(torch.finfo(acc).tiny).unsqueeze(-1))
    return (out.mul_(out_scale) if out_scale != 1.0 else out), total.log_().add_(top)


@functools.lru_cache(maxsize=16)
def _no_part(length: int, dim: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """What :func:`_combine` reads for a cell no part covers: ``0`` ``(1, length, dim)``
    and ``-inf`` ``(1, length)`` (kept; never written)."""
    return torch.zeros((1, length, dim), dtype=dtype, device=device), torch.full(
        (1, length), -math.inf, dtype=dtype, device=device
    )


def _merge_into(out, lse, rows: slice, heads: slice, part: torch.Tensor, part_lse: torch.Tensor) -> None:
    """Merge one softmax's ``(part, part_lse)`` into another's ``(out, lse)`` ``(B, H, L,
    D)``, ``(B, H, L)`` at batch rows ``rows`` and heads ``heads``, in place: the rule of
    :func:`dilated_attention.ops.engine.merge_into` (each side weighted by its share of
    the joint denominator, ``sigmoid(part_lse - lse)`` for the part), in four small
    operations, as a decode step counts operations, not bytes (measured: a third of
    the time of the engine's). The engine's guard for cells neither side has a key for
    is not needed: a step merges in place only where the first call covers every cell
    (:attr:`StepPlan.merges_in_place`), and a cell that a branch's call covers attends
    at least to its own key (this path takes no padding mask)."""
    if _covers(rows, out.shape[0]):
        out_view, lse_view = out[:, heads], lse[:, heads]
    else:
        out_view, lse_view = out[rows, heads], lse[rows, heads]
    share = (part_lse - lse_view).sigmoid_()
    out_view.lerp_(part, share.unsqueeze(-1))
    torch.logaddexp(lse_view, part_lse, out=lse_view)


def _sources(calls: Sequence[BranchCall], branches: int, batch: int, num_heads: int) -> torch.Tensor:
    """Per cell of a ``(branches, B, H)`` grid, flat, where :func:`_combine` reads it in
    the calls' outputs concatenated ``(row, head)`` by ``(row, head)``: the place of the
    call of its branch that covers it, or one past the last (no call does). Built in an
    ``array``: a list's ``torch.tensor`` takes several times as long."""
    cells = array.array("q")
    for call in calls:
        first, stop, step = call.heads.indices(num_heads)
        rows = call.rows
        for row in range(*rows.indices(batch)) if isinstance(rows, slice) else rows:
            base = (call.branch * batch + row) * num_heads
            cells.extend(range(base + first, base + stop, step))
    sources = array.array("q", [len(cells)]) * (branches * batch * num_heads)
    for place, cell in enumerate(cells):
        sources[cell] = place
    return torch.frombuffer(sources, dtype=torch.int64)


def _covers(index: slice | tuple[int, ...], size: int) -> bool:
    """Whether ``index`` is the slice of all ``size`` places, in order."""
    return isinstance(index, slice) and index.indices(size) == (0, size, 1)


def attend_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_positions: Sequence[int],
    tables: DecodeTables,
    scale: float,
    padding: torch.Tensor | None = None,
    width: int | None = None,
):
    """:func:`window_attention`, or :func:`branch_attention` where it reads far fewer
    keys (one query row per sequence, windows much longer than what the heads attend
    to): the cheaper of two exact ways. Rows at different positions (a left-padded
    batch) take one call together, or one row at a time where their phases differ
    enough that shared calls would read far more than each row alone. ``width``: as
    :func:`window_attention` takes it."""
    batch, rows, num_heads, _ = q.shape
    if rows > 1 or padding is not None:
        return window_attention(q, k, v, key_positions, tables, scale, padding, width)
    positions = [p + k.shape[2] - 1 for p in key_positions]
    distinct = batch > 1 and len(set(positions)) > 1  # a bias per row
    # The layers of a model take their steps at the same positions, one after another
    # (kept per batch size: a batch's rows taken alone keep their own).
    key = (tuple(positions), k.shape[2], num_heads, width, cost_constants())
    last = tables.reused.get(("step", batch))
    if last is not None and last[0] == key:
        width, window, branches, calls = last[1]
    else:
        if width is None:
            width = window_width(tables, positions, 1, k.shape[2])
        window = tables.window_cost(positions, num_heads, DISTINCT_FACTOR if distinct else 1.0, width)
        branches, calls = branch_calls(tables, positions, window)
        tables.reused[("step", batch)] = (key, (width, window, branches, calls))
    if distinct and ROW_STEP_COST * batch < min(window, branches):  # rows alone may be cheaper
        alone = sum(tables.row_cost(p, num_heads) for p in positions) + ROW_STEP_COST * batch
        if alone < min(window, branches):
            parts = [
                attend_step(q[b : b + 1], k[b : b + 1], v[b : b + 1], key_positions[b : b + 1], tables, scale)
                for b in range(batch)
            ]
            return torch.cat([out for out, _ in parts]), torch.cat([lse for _, lse in parts])
    if calls is not None:  # branch by branch is cheaper than the window
        result = branch_attention(q, k, v, positions, tables, scale, calls)
        if result is not None:
            return result
    return window_attention(q, k, v, key_positions, tables, scale, width=width)


def ring_counts(
    segment_lengths: tuple[int, ...],
    rates: tuple[int, ...],
    offsets: torch.Tensor,
    key_positions: torch.Tensor,
    query_positions: torch.Tensor,
) -> torch.Tensor:
    """How many branches count each (row, head, query, key): ``(B, H, Lq, C)`` float32,
    for keys at ``key_positions`` ``(B, C)`` in any order (slots of a ring; a negative
    position never counts) and queries at ``query_positions`` ``(B, Lq)``; ``offsets``
    ``(G, H)`` int64 (``-1``: the head does not run the branch). The same arithmetic on
    tensors of the same shapes whatever the positions: what ``torch.compile`` and CUDA
    graphs need (:class:`dilated_attention.StaticKVCache`)."""
    keys = key_positions[:, None, None, :]
    queries = query_positions[:, None, :, None]
    count = torch.zeros((), device=keys.device)
    for w, r, offset in zip(segment_lengths, rates, offsets, strict=True):
        start = torch.div(queries, w, rounding_mode="floor") * w  # the query's segment
        heads = offset.view(1, -1, 1, 1)
        counted = (keys >= start) & (keys <= queries) & (queries >= 0)
        counted = counted & ((queries - start) % r == heads) & ((keys - start) % r == heads)
        count = count + counted.float()
    return count


def ring_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, key_bad: torch.Tensor, count: torch.Tensor, scale: float
) -> torch.Tensor:
    """The definition's output ``(B, H, L, D)`` of query rows ``q`` ``(B, H, L, D)``
    against a ring of ``keys, values`` ``(B, H, C, D)`` in which each key counts
    ``count`` ``(B, H, L, C)`` times (:func:`ring_counts`) and the rows flagged in
    ``key_bad`` ``(B, H, C)`` held a NaN or an infinity (stored as 0), all in the
    accumulator's dtype: one dense softmax, the same operations on tensors of the same
    shapes whatever the values (:class:`dilated_attention.StaticKVCache`'s step, which
    ``torch.compile`` and CUDA graphs take)."""
    attended = count > 0
    # Every row's softmax finite, its backward too: a non-finite query row as 0, the
    # keys a row does not attend to at -inf (their scores, which may overflow, never
    # read), a row with no key at 0 throughout; the definition's rules below then set
    # those rows, passing them no gradient.
    q_bad = nonfinite(q)  # (B, H, L)
    some = attended.any(-1)
    scores = torch.matmul(q.masked_fill(q_bad[..., None], 0.0), keys.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~attended, -math.inf).masked_fill(~some[..., None], 0.0)
    weights = torch.softmax(scores + count.to(q.dtype).clamp_min(1).log(), dim=-1)  # a key m branches count: m times
    out = torch.matmul(weights, values)
    # The definition's rules: a row with no key outputs 0, one a non-finite value
    # reaches (its query, or a key it attends) outputs NaN.
    reached = (attended & key_bad[:, :, None, :]).any(-1) | q_bad
    return out.masked_fill((reached & some)[..., None], math.nan).masked_fill(~some[..., None], 0.0)
