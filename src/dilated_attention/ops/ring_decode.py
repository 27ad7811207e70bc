"""Fused Triton kernels of the caches' decode steps: a ring of keys attended by a few
query rows, every branch in one pass. :class:`dilated_attention.StaticKVCache`'s step
is three launches whose arguments never change from step to step (positions are read
on the device), so that a step replays from a CUDA graph;
:class:`dilated_attention.DilatedKVCache`'s is the last two over its window of
consecutive positions. Neither waits for the device.

- ``_append_kernel``: writes the step's keys and values into their ring slots (a row
  holding NaN or infinity as zeros, flagged), with their positions.
- ``_ring_kernel``: a program owns one query row of one (batch row, head) and one
  split of the ring (split-K, as flash-decoding does, so that a step of one sequence
  fills the GPU). For each key it counts the branches that select it for that query
  and head, and runs an online softmax in which a key counts that many times (the
  definition's ``log(count)`` bias, exactly): partial maxima, sums and outputs in
  float32, and two flags (some key attended; a non-finite query or attended key, as
  flagged or as read: a key row holding NaN or infinity need not be flagged, and
  never reaches a row that does not attend to it).
- ``_combine_kernel``: merges the splits of a row, applies the definition's rules (a
  row with no key outputs 0, one reached by a non-finite value NaN) and the output
  scale, and writes the output in the cache's dtype.

Imported only when the kernels run (Triton is optional). On the CPU they run in
Triton's interpreter (``TRITON_INTERPRET=1`` before Triton is imported, for tests).
Scores are float32 sums of elementwise products (no ``tl.dot``: one query row is a
matrix-vector product, bound by reading the ring, and the interpreter's bfloat16 dot
is wrong).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .intmath import ceil_div

# Keys a program reads per iteration at most, and the (key, head-dim) elements of one
# such tile: 64 x 64 keeps the ring kernel's tiles in registers (sm_90, 4 warps: no
# spills; benchmarks/triton_compile.py reports them), so wider heads read fewer keys.
BLOCK_N = 64
TILE_ELEMENTS = 64 * 64
# Programs a step aims for on a GPU, per multiprocessor (splits of the ring add up to it).
PROGRAMS_PER_SM = 4
# The most splits of one row: the merge holds them all in one tile (splits x head dim floats).
MAX_SPLITS = 64


@triton.jit
def _append_kernel(
    K, V, NEW_K, NEW_V, NEXT, KEY_POS, BAD,
    rows, heads, capacity, dim,
    s_nb, s_nl, s_nh,  # new keys and values (B, L, H, D), last dim contiguous
    DIM_BLOCK: tl.constexpr,
):  # fmt: skip
    """Program ``(b * rows + l) * heads + h`` writes key and value row ``l`` of head ``h``
    of sequence ``b`` into ring slot ``(next[b] + l) mod capacity``."""
    pid = tl.program_id(0)
    h = pid % heads
    bl = pid // heads
    b = bl // rows
    position = tl.load(NEXT + b) + bl % rows
    slot = ((position % capacity) + capacity) % capacity  # the remainder's sign is the dividend's
    d = tl.arange(0, DIM_BLOCK)
    inside = d < dim
    source = b.to(tl.int64) * s_nb + (bl % rows) * s_nl + h * s_nh + d
    k = tl.load(NEW_K + source, mask=inside, other=0.0)
    v = tl.load(NEW_V + source, mask=inside, other=0.0)
    # checked in float32: the interpreter's bfloat16 NaN compared equal to itself
    kf, vf = k.to(tl.float32), v.to(tl.float32)
    bad = tl.max(
        ((kf != kf) | (vf != vf) | (tl.abs(kf) == float("inf")) | (tl.abs(vf) == float("inf"))).to(tl.int32), 0
    )
    ring_row = (b.to(tl.int64) * heads + h) * capacity + slot
    tl.store(K + ring_row * dim + d, tl.where(bad > 0, 0.0, k).to(K.dtype.element_ty), mask=inside)
    tl.store(V + ring_row * dim + d, tl.where(bad > 0, 0.0, v).to(V.dtype.element_ty), mask=inside)
    tl.store(BAD + ring_row, bad.to(tl.uint8))
    if h == 0:
        tl.store(KEY_POS + b.to(tl.int64) * capacity + slot, position)


@triton.jit
def _ring_kernel(
    Q, K, V, NEXT, KEY_POS, BAD, SEG, RATE, OFFSET,
    PART_M, PART_L, PART_O, PART_FLAGS,
    scale, rows, heads, capacity, dim, branches, keys_per_split, splits, key_shift,
    s_qb, s_ql, s_qh,  # queries (B, L, H, D), last dim contiguous
    s_kb, s_kh,  # keys and values (B, H, C, D), a slot's D elements contiguous
    s_pb,  # key positions (B, C), slots contiguous
    s_fb, s_fh, s_fc,  # non-finite flags (B, H, C)
    BLOCK: tl.constexpr, DIM_BLOCK: tl.constexpr, CONSECUTIVE: tl.constexpr,
):  # fmt: skip
    """Program ``(row, split)``, ``row = (b * heads + h) * rows + l``: the online softmax of
    query row ``l`` of head ``h`` of sequence ``b`` over ring slots ``[split *
    keys_per_split, (split + 1) * keys_per_split)``, each key weighted by the number of
    branches that select it, into the row's partials of that split. ``CONSECUTIVE``:
    slot ``n`` of sequence ``b`` holds position ``next[b] + key_shift + n`` (a window;
    ``KEY_POS`` unread)."""
    row = tl.program_id(0)
    split = tl.program_id(1)
    l = row % rows  # noqa: E741
    h = (row // rows) % heads
    b = row // (rows * heads)
    query = tl.load(NEXT + b) + l
    d = tl.arange(0, DIM_BLOCK)
    q = tl.load(Q + b.to(tl.int64) * s_qb + l * s_ql + h * s_qh + d, mask=d < dim, other=0.0).to(tl.float32)
    q_bad = tl.max(((q != q) | (tl.abs(q) == float("inf"))).to(tl.int32), 0)
    # Typed scalars that the loop carries: the running maximum, sum and flags.
    m = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), 0)
    total = tl.sum(tl.zeros([BLOCK], dtype=tl.float32), 0)
    some = tl.max(tl.zeros([BLOCK], dtype=tl.int32), 0)
    reached = some
    acc = tl.zeros([DIM_BLOCK], dtype=tl.float32)
    ring = b.to(tl.int64) * s_kb + h.to(tl.int64) * s_kh
    flags = b.to(tl.int64) * s_fb + h.to(tl.int64) * s_fh
    first = split * keys_per_split
    last = tl.minimum(first + keys_per_split, capacity)
    for start in range(first, last, BLOCK):
        n = start + tl.arange(0, BLOCK)
        inside = n < last
        if CONSECUTIVE:
            key = tl.where(inside, query - l + key_shift + n, -1)
        else:
            key = tl.load(KEY_POS + b.to(tl.int64) * s_pb + n, mask=inside, other=-1)
        count = tl.zeros([BLOCK], dtype=tl.float32)
        for g in range(branches):
            w = tl.load(SEG + g)
            r = tl.load(RATE + g)
            o = tl.load(OFFSET + g * heads + h)
            seg = (query // w) * w  # the query's segment (query >= 0 where it counts)
            selected = (query >= 0) & ((query - seg) % r == o) & (key >= seg) & (key <= query)
            count += (selected & ((key - seg) % r == o)).to(tl.float32)
        counted = count > 0
        # int64: a slot's offset (n * dim) passes 2**31 in rings of 2**23 slots of 256
        cells = ring + n.to(tl.int64)[:, None] * dim + d[None, :]
        cell_ok = inside[:, None] & (d[None, :] < dim)
        k = tl.load(K + cells, mask=cell_ok, other=0.0)
        scores = tl.where(counted, tl.sum(k.to(tl.float32) * q[None, :], 1) * scale, float("-inf"))
        # An attended key row holding NaN or an infinity gives a NaN or infinite score (q
        # is finite, or its row is flagged): -inf is found here, NaN and +inf make p NaN
        # (found below). So does a score that overflows (outside the definition).
        bad = (tl.load(BAD + flags + n * s_fc, mask=inside, other=0) != 0) | (scores == float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.where(counted, count * tl.exp(scores - m_safe), 0.0)
        alpha = tl.exp(m - m_safe)
        # the value rows of keys not attended to are never read (0 * NaN is NaN); x * 0 is
        # NaN exactly where x is NaN or infinite, whatever the size of a finite x
        v = tl.load(V + cells, mask=cell_ok & counted[:, None], other=0.0).to(tl.float32)
        bad = bad | (p != p) | (tl.sum(v * 0.0, 1) != 0.0)
        some = tl.maximum(some, tl.max(counted.to(tl.int32), 0))
        reached = tl.maximum(reached, tl.max((counted & bad).to(tl.int32), 0))
        acc = acc * alpha + tl.sum(p[:, None] * v, 0)
        total = total * alpha + tl.sum(p, 0)
        m = m_new
    part = row.to(tl.int64) * splits + split
    tl.store(PART_M + part, m)
    tl.store(PART_L + part, total)
    tl.store(PART_O + part * dim + d, acc, mask=d < dim)
    # The flags' bits: 1, some key attended; 2, a non-finite query or attended key.
    tl.store(PART_FLAGS + part, some * 1 + tl.maximum(reached, q_bad) * 2)


@triton.jit
def _combine_kernel(
    OUT, PART_M, PART_L, PART_O, PART_FLAGS,
    out_scale, rows, heads, dim, splits,
    s_ob, s_ol, s_oh,  # the output (B, L, H, D), last dim contiguous
    SPLIT_BLOCK: tl.constexpr, DIM_BLOCK: tl.constexpr,
):  # fmt: skip
    """Program ``row`` merges the row's ``splits`` partials into its output row."""
    row = tl.program_id(0)
    l = row % rows  # noqa: E741
    h = (row // rows) % heads
    b = row // (rows * heads)
    s = tl.arange(0, SPLIT_BLOCK)
    d = tl.arange(0, DIM_BLOCK)
    part = row.to(tl.int64) * splits + s
    m = tl.load(PART_M + part, mask=s < splits, other=float("-inf"))
    flags = tl.load(PART_FLAGS + part, mask=s < splits, other=0)
    top = tl.max(m, 0)
    weight = tl.exp(m - tl.where(top == float("-inf"), 0.0, top))
    total = tl.sum(tl.load(PART_L + part, mask=s < splits, other=0.0) * weight, 0)
    o = tl.load(PART_O + part[:, None] * dim + d[None, :], mask=(s[:, None] < splits) & (d[None, :] < dim), other=0.0)
    out = tl.sum(o * weight[:, None], 0) / total
    some = tl.max(flags & 1, 0)
    non_finite = tl.max(flags & 2, 0)
    out = tl.where(some == 0, 0.0, tl.where(non_finite != 0, float("nan"), out * out_scale))
    target = b.to(tl.int64) * s_ob + l * s_ol + h * s_oh + d
    tl.store(OUT + target, out.to(OUT.dtype.element_ty), mask=d < dim)


def splits_for(device: torch.device, rows: int, capacity: int) -> int:
    """How many splits of the ring a step's ``rows`` (query rows times heads times
    sequences) take: enough programs to fill the GPU (on the CPU, a few), each at
    least :data:`BLOCK_N` keys, at most :data:`MAX_SPLITS`."""
    return max(1, min(ceil_div(capacity, BLOCK_N), ceil_div(_programs(device), rows), MAX_SPLITS))


@functools.cache
def _programs(device: torch.device) -> int:
    """Programs a step aims for on ``device``."""
    if device.type == "cuda":
        return PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def _block(size: int) -> int:
    """A tile's width for ``size`` elements: a power of two, at least 16."""
    return max(16, triton.next_power_of_2(size))


def key_block(dim_block: int) -> int:
    """Keys the ring kernel reads per iteration for heads padded to ``dim_block``."""
    return max(16, min(BLOCK_N, TILE_ELEMENTS // dim_block))


def append(k_ring, v_ring, key_positions, bad, next_positions, k, v) -> None:
    """Write ``k, v`` ``(B, L, H, D)`` into the rings ``(B, H, C, D)`` at the slots of
    positions ``next_positions[b] + l`` (non-finite rows as zeros, flagged in ``bad``
    ``(B, H, C)`` bool), their positions into ``key_positions`` ``(B, C)``."""
    batch, rows, heads, dim = k.shape
    k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (k, v))
    if k.stride() != v.stride():
        k, v = k.contiguous(), v.contiguous()
    _append_kernel[(batch * rows * heads,)](
        k_ring, v_ring, k, v, next_positions, key_positions, bad.view(torch.uint8),
        rows, heads, k_ring.shape[2], dim, *k.stride()[:3],
        DIM_BLOCK=_block(dim),
    )  # fmt: skip


def attend(q, k_ring, v_ring, key_positions, bad, next_positions, branches, scale, out_scale, splits):
    """The output ``(B, L, H, D)`` of ``q`` ``(B, L, H, D)`` at positions ``next_positions[b]
    + l`` over the rings ``(B, H, C, D)`` (any strides but a slot's ``D`` contiguous
    elements; ``k_ring`` and ``v_ring`` alike), whose slots hold the keys at
    ``key_positions`` ``(B, C)`` (slots contiguous; a negative position never counts),
    or, where ``key_positions`` is an int ``s``, slot ``j`` of row ``b`` the key at
    ``next_positions[b] + s + j`` (a window of consecutive positions). ``bad`` ``(B, H,
    C)`` bool (any strides) flags key rows as non-finite; rows holding NaN or infinity
    count as flagged whether or not they are. ``branches`` = ``(segment lengths (G,),
    rates (G,), offsets (G, H))`` int64 on the device (offset -1: the head does not run
    the branch). Launches only: nothing waits for the device."""
    batch, rows, heads, dim = q.shape
    capacity = k_ring.shape[2]
    consecutive = isinstance(key_positions, int)
    if q.stride(-1) != 1:
        q = q.contiguous()
    positions_ok = consecutive or key_positions.stride(1) == 1
    if k_ring.stride()[2:] != (dim, 1) or v_ring.stride() != k_ring.stride() or not positions_ok:
        raise ValueError(
            "the rings' slots must each hold D contiguous elements, alike in k and v, positions contiguous"
        )
    programs = batch * heads * rows
    # the splits' partials in one block: maxima, sums, flags (as int32), outputs
    parts = torch.empty(programs * splits * (dim + 3), dtype=torch.float32, device=q.device)
    part_m, part_l, part_flags, part_o = parts.split([programs * splits] * 3 + [programs * splits * dim])
    part_flags = part_flags.view(torch.int32)
    seg, rate, offsets = branches
    dim_block = _block(dim)
    block = key_block(dim_block)
    _ring_kernel[(programs, splits)](
        q, k_ring, v_ring, next_positions, next_positions if consecutive else key_positions, bad.view(torch.uint8),
        seg, rate, offsets,
        part_m, part_l, part_o, part_flags,
        scale, rows, heads, capacity, dim, len(seg), ceil_div(ceil_div(capacity, splits), block) * block, splits,
        key_positions if consecutive else 0,
        *q.stride()[:3], *k_ring.stride()[:2], 0 if consecutive else key_positions.stride(0), *bad.stride(),
        BLOCK=block, DIM_BLOCK=dim_block, CONSECUTIVE=consecutive,
    )  # fmt: skip
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    _combine_kernel[(programs,)](
        out, part_m, part_l, part_o, part_flags,
        out_scale, rows, heads, dim, splits, *out.stride()[:3],
        SPLIT_BLOCK=_block(splits), DIM_BLOCK=dim_block,
    )  # fmt: skip
    return out
