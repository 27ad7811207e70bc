"""Fused Triton kernels of dilated attention: every branch of a call in one launch.

Imported only when a fused path runs (``triton`` is an optional dependency). On a
machine without a GPU the same kernels run in Triton's interpreter, which is chosen
when this module is imported: ``TRITON_INTERPRET=1`` must be set before.

The layout of the work (see :class:`dilated_attention.ops.plan.BranchTable`):

- **Forward** (and the **dq** pass): a program owns query rows of one (batch row,
  head), ``p = c, c + R, ..., c + (BLOCK_M - 1) R`` inside an aligned span of ``R *
  BLOCK_M`` positions. For every branch that selects some of them, it loads the
  branch's selected keys of their segment by stride (rows ``seg + o, seg + o + r,
  ...``, no gather) and runs one online softmax over all branches' keys: in
  ``mixture`` mode that is exactly the branches' merge (one softmax over every key a
  query sees, a key seen twice counting twice), so the output and the float32 LSE
  are written once, with no merge pass and no temporary. A decode step (few query
  rows) uses ``R = 1``: its rows are consecutive.
- **dk, dv**: a program owns key rows of one (batch row, key head) the same way, and
  loops over the branches and over the query heads that share the key head, so that
  no two programs write one key row (no atomics) and grouped-query attention needs no
  repeated keys.
- ``delta = rowsum(dO * O) - dLSE`` is one small pass before them.

Positions are absolute (``key_start[b]`` is the position of key row 0 of batch row
``b``; the queries are the last ``Lq`` key rows), so segments stay anchored at
position 0 and per-row key offsets cost nothing. The rules of
``docs/definition.md`` hold in the kernel: padded keys and keys that are not
selected have no effect whatever they hold; with ``CHECK_FINITE`` a non-finite query
or key row is zeroed and marks the rows it reaches, which output NaN; a row with no
key outputs 0 and LSE ``-inf``.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from .plan import BranchTable

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
LOG2E = math.log2(math.e)
# Query rows of a decode call: up to this many run as one tile of consecutive rows.
DECODE_ROWS = 16


@triton.jit
def _nonfinite_rows(x):
    """Rows of a tile holding a NaN or an infinity (int1, one per row), checked in
    float32 (Triton's interpreter compared a bfloat16 NaN equal to itself)."""
    x = x.to(tl.float32)
    bad = (x != x) | (x == float("inf")) | (x == float("-inf"))
    return tl.max(bad.to(tl.int32), axis=1) > 0


@triton.jit
def _dot(a, b, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr):
    """``a @ b`` accumulated in float32 (operands cast to float32 first where the
    interpreter's bfloat16 dot is wrong)."""
    if DOT_FP32:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _tile_rows(pid, key_start, first_query, row_step, BLOCK: tl.constexpr):
    """The key-row coordinates (int32 ``(BLOCK,)``) of the rows tile ``pid`` owns:
    positions ``c, c + row_step, ...`` of the ``pid // row_step``-th aligned span of
    ``row_step * BLOCK`` positions from the one holding key row ``first_query``,
    ``c = pid % row_step`` (the tile's class)."""
    span = row_step * BLOCK
    base = ((key_start + first_query) // span + pid // row_step) * span + pid % row_step
    return (base - key_start).to(tl.int32) + row_step * tl.arange(0, BLOCK)


@triton.jit
def _segment(s, seg_len, key_start, num_keys):
    """Key-row coordinates ``[start, stop)`` (int32) of segment ``s`` (an int64 index)
    of a branch, cut to the keys present; ``start < 0`` for a segment that begins before
    the key window, which holds no query (the window reaches back to every query's
    segment start)."""
    start = s * seg_len - key_start
    stop = tl.minimum(start + seg_len, num_keys)
    return tl.maximum(start, -1).to(tl.int32), stop.to(tl.int32)


@triton.jit
def _branch(SEG, RATE, OFFSET, g, h, key_start, lo, hi, branches):
    """Branch ``g`` as head ``h`` runs it over the key rows ``lo .. hi``: its segment
    length, rate and the head's offset, and the first and number of its segments
    those rows touch (none where the head does not run the branch, or no row)."""
    seg_len = tl.load(SEG + g)
    rate = tl.load(RATE + g)
    offset = tl.load(OFFSET + h * branches + g)
    seg_first = (key_start + tl.maximum(lo, 0)) // seg_len
    seg_count = ((key_start + tl.maximum(hi, 0)) // seg_len - seg_first + 1).to(tl.int32)
    return seg_len, rate, offset, seg_first, tl.where((offset >= 0) & (hi >= lo), seg_count, 0)


@triton.jit
def _selection(rows, row_ok, s, seg_len, rate, offset, key_start, num_keys):
    """Segment ``s`` of a branch: its key-row bounds ``[start, stop)``, the step between
    its selected rows, which of ``rows`` it selects and how many."""
    start, stop = _segment(s, seg_len, key_start, num_keys)
    step = tl.minimum(rate, stop - start + 1).to(tl.int32)  # a larger rate selects one row
    selected = row_ok & (rows >= start) & (rows < stop) & (start >= 0) & ((rows - start) % step == offset)
    return start, stop, step, selected, tl.sum(selected.to(tl.int32))


@triton.jit
def _load_rows(ptr, rows, row_stride, ok, dims, head_dim, ROW_MASK: tl.constexpr, DIM_MASK: tl.constexpr):
    """A ``(len(rows), DIM_BLOCK)`` tile of rows ``rows`` (int32) of a ``(rows, head_dim)``
    view at ``ptr``: 0 where ``ok`` is false (``ROW_MASK``) or past the head dim
    (``DIM_MASK``); unmasked loads where neither can happen."""
    offsets = rows.to(tl.int64)[:, None] * row_stride + dims[None, :]
    if ROW_MASK and DIM_MASK:
        return tl.load(ptr + offsets, mask=ok[:, None] & (dims < head_dim)[None, :], other=0.0)
    elif ROW_MASK:
        return tl.load(ptr + offsets, mask=ok[:, None], other=0.0)
    elif DIM_MASK:
        return tl.load(ptr + offsets, mask=(dims < head_dim)[None, :], other=0.0)
    else:
        return tl.load(ptr + offsets)


@triton.jit
def _query_step(
    q,
    do,
    acc,
    m_i,
    l_i,
    reached,
    rows,
    selected,
    lse_log2,
    delta,
    k_base,
    v_base,
    pad_base,
    key_rows,
    key_ok,
    sk_n,
    sv_n,
    sp_n,
    dims,
    head_dim,
    scale_log2,
    out_scale,
    MASKED: tl.constexpr,
    DIM_MASK: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_PADDING: tl.constexpr,
    CHECK_FINITE: tl.constexpr,
    BACKWARD: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One tile of keys for a program's query rows: the online softmax update of
    ``acc, m_i, l_i`` (forward) or ``acc += dS K`` (``BACKWARD``, the dq pass). With
    ``MASKED`` the row selection, the key range, padding and causality apply and
    non-finite keys are found; without, every (row, key) pair of the tile attends."""
    k = _load_rows(k_base, key_rows, sk_n, key_ok, dims, head_dim, MASKED, DIM_MASK)
    v = _load_rows(v_base, key_rows, sv_n, key_ok, dims, head_dim, MASKED, DIM_MASK)
    allowed = selected[:, None]
    if MASKED:
        if HAS_PADDING:
            padded = tl.load(pad_base + key_rows.to(tl.int64) * sp_n, mask=key_ok, other=1)
            key_ok = key_ok & (padded == 0)
        allowed = selected[:, None] & key_ok[None, :]
        if CAUSAL:
            allowed = allowed & (key_rows[None, :] <= rows[:, None])
    if CHECK_FINITE:  # zero every row that must have no effect (p = 0 times NaN is NaN)
        key_bad = _nonfinite_rows(k) | _nonfinite_rows(v)
        if MASKED:
            key_bad = key_bad & key_ok
            reached = reached | (tl.max((allowed & key_bad[None, :]).to(tl.int32), axis=1) > 0)
            key_bad = key_bad | ~key_ok  # padded rows may hold anything
        else:
            reached = reached | (tl.max(key_bad.to(tl.int32)) > 0)
        k = tl.where(key_bad[:, None], 0.0, k)
        v = tl.where(key_bad[:, None], 0.0, v)
    s = _dot(q, tl.trans(k), DOT_FP32, PRECISION) * scale_log2
    if BACKWARD:
        p = tl.exp2(s - lse_log2[:, None])
        if MASKED:
            p = tl.where(allowed, p, 0.0)
        dp = _dot(do, tl.trans(v), DOT_FP32, PRECISION) * out_scale
        acc += _dot((p * (dp - delta[:, None])).to(k.dtype), k, DOT_FP32, PRECISION)
    else:
        if MASKED:
            s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_FP32, PRECISION)
        m_i = m_new
    return acc, m_i, l_i, reached


@triton.jit
def _forward_kernel(
    Q,
    K,
    V,
    PAD,
    OUT,
    LSE,
    DQ,
    DO,
    DELTA,
    KEY_START,
    SEG,
    RATE,
    OFFSET,
    sq_b,
    sq_n,
    sq_h,
    sk_b,
    sk_n,
    sk_h,
    sv_b,
    sv_n,
    sv_h,
    sp_b,
    sp_n,
    so_b,
    so_n,
    so_h,
    sl_b,
    sl_n,
    sl_h,
    num_queries,
    num_keys,
    group_size,
    scale_log2,
    scale,
    out_scale,
    head_dim,
    branches,
    row_step,
    DIM_BLOCK: tl.constexpr,
    DIM_MASK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_PADDING: tl.constexpr,
    CHECK_FINITE: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
    BACKWARD: tl.constexpr,
):
    """Forward: ``OUT``, ``LSE`` of the rows this program owns. With ``BACKWARD``, the
    dq pass instead: ``DQ`` of those rows, given ``DO``, the merged ``LSE`` and
    ``DELTA``. ``OUT``, ``LSE``, ``DQ``, ``DO``, ``DELTA`` share the query strides
    ``so_*`` (outputs and ``DO``, ``(B, Lq, H, D)``) and ``sl_*`` (``(B, Lq, H)``).

    Per branch and segment, the keys' tiles split in two loops: first those every
    row of the tile attends in full (no mask, no bounds: the fast path of a segment
    interior), then the rest, masked."""
    pid = tl.program_id(0)
    # int64: a head's offset (h * sq_h) passes 2**31 elements in long (B, H, N, D) views
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    kv_h = h // group_size
    key_start = tl.load(KEY_START + b)
    first_query = num_keys - num_queries  # the key row of query row 0
    rows = _tile_rows(pid, key_start, first_query, row_step, BLOCK_M)
    row_ok = (rows >= first_query) & (rows < num_keys)
    query_rows = rows - first_query
    dims = tl.arange(0, DIM_BLOCK)

    q = _load_rows(Q + b * sq_b + h * sq_h, query_rows, sq_n, row_ok, dims, head_dim, True, DIM_MASK)
    q_bad = tl.zeros([BLOCK_M], dtype=tl.int1)
    if CHECK_FINITE:
        q_bad = _nonfinite_rows(q) & row_ok
        q = tl.where(q_bad[:, None], 0.0, q)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_BLOCK], dtype=tl.float32)
    reached = tl.zeros([BLOCK_M], dtype=tl.int1)
    lse_log2 = l_i
    delta = l_i
    do = q
    if BACKWARD:
        row_offsets = b * sl_b + h * sl_h + query_rows.to(tl.int64) * sl_n
        lse = tl.load(LSE + row_offsets, mask=row_ok, other=0.0)
        # Rows with no key (-inf) or reached by a non-finite value (NaN) pass no gradient.
        lse_log2 = tl.where((lse != lse) | (lse == float("-inf")), float("inf"), lse * 1.4426950408889634)
        delta = tl.load(DELTA + row_offsets, mask=row_ok, other=0.0)
        do = _load_rows(DO + b * so_b + h * so_h, query_rows, so_n, row_ok, dims, head_dim, True, DIM_MASK)
        if CHECK_FINITE:
            do = tl.where((lse != lse)[:, None], 0.0, do)

    lo = tl.min(tl.where(row_ok, rows, num_keys))
    hi = tl.max(tl.where(row_ok, rows, -1))
    k_base = K + b * sk_b + kv_h * sk_h
    v_base = V + b * sv_b + kv_h * sv_h
    pad_base = PAD + b * sp_b
    for g in range(branches):
        seg_len, rate, offset, seg_first, seg_count = _branch(SEG, RATE, OFFSET, g, h, key_start, lo, hi, branches)
        for si in range(seg_count):
            start, stop, step, selected, chosen = _selection(
                rows, row_ok, seg_first + si, seg_len, rate, offset, key_start, num_keys
            )
            if chosen > 0:
                key_stop = stop
                if CAUSAL:
                    key_stop = tl.minimum(stop, tl.max(tl.where(selected, rows, -1)) + 1)
                count = tl.maximum(key_stop - start - offset + step - 1, 0) // step
                free = 0  # whole tiles that every row attends in full
                if (chosen == BLOCK_M) & (not HAS_PADDING) & (not (CHECK_FINITE and not BACKWARD)):
                    free = count
                    if CAUSAL:
                        free = tl.minimum(count, (tl.min(rows) - start - offset) // step + 1)
                    free = free // BLOCK_N * BLOCK_N
                for j0 in range(0, free, BLOCK_N):
                    key_rows = start + offset + step * (j0 + tl.arange(0, BLOCK_N))
                    acc, m_i, l_i, reached = _query_step(
                        q,
                        do,
                        acc,
                        m_i,
                        l_i,
                        reached,
                        rows,
                        selected,
                        lse_log2,
                        delta,
                        k_base,
                        v_base,
                        pad_base,
                        key_rows,
                        selected,
                        sk_n,
                        sv_n,
                        sp_n,
                        dims,
                        head_dim,
                        scale_log2,
                        out_scale,
                        False,
                        DIM_MASK,
                        CAUSAL,
                        HAS_PADDING,
                        CHECK_FINITE,
                        BACKWARD,
                        DOT_FP32,
                        PRECISION,
                    )
                for j0 in range(free, count, BLOCK_N):
                    j = j0 + tl.arange(0, BLOCK_N)
                    key_rows = start + offset + step * tl.minimum(j, count - 1)
                    acc, m_i, l_i, reached = _query_step(
                        q,
                        do,
                        acc,
                        m_i,
                        l_i,
                        reached,
                        rows,
                        selected,
                        lse_log2,
                        delta,
                        k_base,
                        v_base,
                        pad_base,
                        key_rows,
                        j < count,
                        sk_n,
                        sv_n,
                        sp_n,
                        dims,
                        head_dim,
                        scale_log2,
                        out_scale,
                        True,
                        DIM_MASK,
                        CAUSAL,
                        HAS_PADDING,
                        CHECK_FINITE,
                        BACKWARD,
                        DOT_FP32,
                        PRECISION,
                    )

    out_offsets = query_rows.to(tl.int64)[:, None] * so_n + dims[None, :]
    out_mask = row_ok[:, None] & (dims < head_dim)[None, :]
    if BACKWARD:
        tl.store(DQ + b * so_b + h * so_h + out_offsets, (acc * scale).to(DQ.dtype.element_ty), mask=out_mask)
    else:
        attended = l_i > 0
        out = acc / tl.where(attended, l_i, 1.0)[:, None] * out_scale
        # the LSE in natural log: log2 times ln 2
        lse = tl.where(attended, (m_i + tl.log2(tl.where(attended, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
        if CHECK_FINITE:
            dead = (q_bad | reached) & attended
            out = tl.where(dead[:, None], float("nan"), out)
            lse = tl.where(dead, float("nan"), lse)
        tl.store(OUT + b * so_b + h * so_h + out_offsets, out.to(OUT.dtype.element_ty), mask=out_mask)
        tl.store(LSE + b * sl_b + h * sl_h + query_rows.to(tl.int64) * sl_n, lse, mask=row_ok)


@triton.jit
def _key_step(
    k,
    v,
    dk,
    dv,
    rows,
    selected,
    q_base,
    do_base,
    lse_base,
    delta_base,
    query_rows,
    q_ok,
    first_query,
    sq_n,
    so_n,
    sl_n,
    dims,
    head_dim,
    scale_log2,
    out_scale,
    MASKED: tl.constexpr,
    DIM_MASK: tl.constexpr,
    CAUSAL: tl.constexpr,
    CHECK_FINITE: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One tile of queries for a program's key rows: ``dv += P^T dO``, ``dk += dS^T Q``
    (unscaled). With ``MASKED`` the key selection, the query range and causality
    apply; without, every (key, query) pair of the tile attends (padded and non-finite
    keys need no mask here: their rows' gradients are set to 0 when stored)."""
    q = _load_rows(q_base, query_rows, sq_n, q_ok, dims, head_dim, MASKED, DIM_MASK)
    do = _load_rows(do_base, query_rows, so_n, q_ok, dims, head_dim, MASKED, DIM_MASK)
    row_offsets = query_rows.to(tl.int64) * sl_n
    if MASKED:
        lse = tl.load(lse_base + row_offsets, mask=q_ok, other=0.0)
        delta = tl.load(delta_base + row_offsets, mask=q_ok, other=0.0)
    else:
        lse = tl.load(lse_base + row_offsets)
        delta = tl.load(delta_base + row_offsets)
    lse_log2 = tl.where((lse != lse) | (lse == float("-inf")), float("inf"), lse * 1.4426950408889634)
    if CHECK_FINITE:
        q = tl.where(_nonfinite_rows(q)[:, None], 0.0, q)
        do = tl.where((lse != lse)[:, None], 0.0, do)
    p = tl.exp2(_dot(k, tl.trans(q), DOT_FP32, PRECISION) * scale_log2 - lse_log2[None, :])
    if MASKED:
        allowed = selected[:, None] & q_ok[None, :]
        if CAUSAL:
            allowed = allowed & (rows[:, None] <= query_rows[None, :] + first_query)
        p = tl.where(allowed, p, 0.0)
    dv += _dot(p.to(do.dtype), do, DOT_FP32, PRECISION)
    dp = _dot(v, tl.trans(do), DOT_FP32, PRECISION) * out_scale
    dk += _dot((p * (dp - delta[None, :])).to(q.dtype), q, DOT_FP32, PRECISION)
    return dk, dv


@triton.jit
def _key_grads_kernel(
    Q,
    K,
    V,
    PAD,
    LSE,
    DO,
    DELTA,
    DK,
    DV,
    KEY_START,
    SEG,
    RATE,
    OFFSET,
    sq_b,
    sq_n,
    sq_h,
    sk_b,
    sk_n,
    sk_h,
    sv_b,
    sv_n,
    sv_h,
    sp_b,
    sp_n,
    so_b,
    so_n,
    so_h,
    sl_b,
    sl_n,
    sl_h,
    sdk_b,
    sdk_n,
    sdk_h,
    sdv_b,
    sdv_n,
    sdv_h,
    num_queries,
    num_keys,
    group_size,
    scale_log2,
    scale,
    out_scale,
    head_dim,
    branches,
    row_step,
    DIM_BLOCK: tl.constexpr,
    DIM_MASK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_PADDING: tl.constexpr,
    CHECK_FINITE: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """``DK``, ``DV`` of the key rows this program owns (one batch row and key head),
    summed over every branch and every query head sharing the key head. Per branch
    and segment the query tiles split in three loops: masked ones up to where every
    query follows every owned key, unmasked whole tiles, a masked last one."""
    pid = tl.program_id(0)
    kv_h = tl.program_id(1).to(tl.int64)  # int64: see _forward_kernel
    b = tl.program_id(2).to(tl.int64)
    key_start = tl.load(KEY_START + b)
    first_query = num_keys - num_queries
    rows = _tile_rows(pid, key_start, 0, row_step, BLOCK_N)
    row_ok = (rows >= 0) & (rows < num_keys)
    dims = tl.arange(0, DIM_BLOCK)
    k = _load_rows(K + b * sk_b + kv_h * sk_h, rows, sk_n, row_ok, dims, head_dim, True, DIM_MASK)
    v = _load_rows(V + b * sv_b + kv_h * sv_h, rows, sv_n, row_ok, dims, head_dim, True, DIM_MASK)
    key_ok = row_ok  # the keys whose gradients are kept: not padded, finite
    if HAS_PADDING:
        padded = tl.load(PAD + b * sp_b + rows.to(tl.int64) * sp_n, mask=row_ok, other=1)
        key_ok = key_ok & (padded == 0)
    if CHECK_FINITE:  # the rows a non-finite key reaches are dead: it gets no gradient
        key_ok = key_ok & ~(_nonfinite_rows(k) | _nonfinite_rows(v))
        k = tl.where(key_ok[:, None], k, 0.0)
        v = tl.where(key_ok[:, None], v, 0.0)
    dk = tl.zeros([BLOCK_N, DIM_BLOCK], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, DIM_BLOCK], dtype=tl.float32)
    lo = tl.min(tl.where(key_ok, rows, num_keys))
    hi = tl.max(tl.where(key_ok, rows, -1))
    for member in range(group_size):
        h = kv_h * group_size + member
        q_base = Q + b * sq_b + h * sq_h
        do_base = DO + b * so_b + h * so_h
        lse_base = LSE + b * sl_b + h * sl_h
        delta_base = DELTA + b * sl_b + h * sl_h
        for g in range(branches):
            seg_len, rate, offset, seg_first, seg_count = _branch(SEG, RATE, OFFSET, g, h, key_start, lo, hi, branches)
            for si in range(seg_count):
                start, stop, step, selected, chosen = _selection(
                    rows, row_ok, seg_first + si, seg_len, rate, offset, key_start, num_keys
                )
                if chosen > 0:
                    first = tl.maximum(first_query, start + offset)  # the first query that may see them
                    if CAUSAL:
                        first = tl.maximum(first, tl.min(tl.where(selected, rows, num_keys)))
                    j_first = (first - start - offset + step - 1) // step
                    j_stop = tl.maximum(stop - start - offset + step - 1, 0) // step
                    free_first = j_stop  # the tiles every owned key attends in full: [free_first, free_stop)
                    free_stop = j_stop
                    if chosen == BLOCK_N:
                        free_first = j_first
                        if CAUSAL:  # queries at or after the last owned key
                            last = tl.max(tl.where(selected, rows, -1))
                            free_first = tl.maximum(j_first, (last - start - offset + step - 1) // step)
                        free_first = j_first + (free_first - j_first + BLOCK_M - 1) // BLOCK_M * BLOCK_M
                        free_first = tl.minimum(free_first, j_stop)
                        free_stop = free_first + (j_stop - free_first) // BLOCK_M * BLOCK_M
                    for j0 in range(free_first, free_stop, BLOCK_M):
                        query_rows = start + offset + step * (j0 + tl.arange(0, BLOCK_M)) - first_query
                        dk, dv = _key_step(
                            k,
                            v,
                            dk,
                            dv,
                            rows,
                            selected,
                            q_base,
                            do_base,
                            lse_base,
                            delta_base,
                            query_rows,
                            selected,
                            first_query,
                            sq_n,
                            so_n,
                            sl_n,
                            dims,
                            head_dim,
                            scale_log2,
                            out_scale,
                            False,
                            DIM_MASK,
                            CAUSAL,
                            CHECK_FINITE,
                            DOT_FP32,
                            PRECISION,
                        )
                    # The masked tiles: those before the free ones (the diagonal), then the last one.
                    before = (free_first - j_first + BLOCK_M - 1) // BLOCK_M
                    after = (j_stop - free_stop + BLOCK_M - 1) // BLOCK_M
                    for t in range(before + after):
                        j0 = tl.where(t < before, j_first + t * BLOCK_M, free_stop + (t - before) * BLOCK_M)
                        j = j0 + tl.arange(0, BLOCK_M)
                        query_rows = start + offset + step * tl.minimum(j, j_stop - 1) - first_query
                        dk, dv = _key_step(
                            k,
                            v,
                            dk,
                            dv,
                            rows,
                            selected,
                            q_base,
                            do_base,
                            lse_base,
                            delta_base,
                            query_rows,
                            j < j_stop,
                            first_query,
                            sq_n,
                            so_n,
                            sl_n,
                            dims,
                            head_dim,
                            scale_log2,
                            out_scale,
                            True,
                            DIM_MASK,
                            CAUSAL,
                            CHECK_FINITE,
                            DOT_FP32,
                            PRECISION,
                        )
    mask = row_ok[:, None] & (dims < head_dim)[None, :]
    kept = key_ok[:, None]
    rows64 = rows.to(tl.int64)[:, None]
    tl.store(
        DK + b * sdk_b + kv_h * sdk_h + rows64 * sdk_n + dims[None, :],
        tl.where(kept, dk * scale, 0.0).to(DK.dtype.element_ty),
        mask=mask,
    )
    tl.store(
        DV + b * sdv_b + kv_h * sdv_h + rows64 * sdv_n + dims[None, :],
        tl.where(kept, dv * out_scale, 0.0).to(DV.dtype.element_ty),
        mask=mask,
    )


@triton.jit
def _delta_kernel(
    DO,
    OUT,
    DLSE,
    LSE,
    DELTA,
    so_b,
    so_n,
    so_h,
    sl_b,
    sl_n,
    sl_h,
    num_queries,
    num_heads,
    rows_total,
    head_dim,
    DIM_BLOCK: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_DLSE: tl.constexpr,
):
    """``DELTA = rowsum(DO * OUT) - DLSE`` per (batch row, query, head), 0 on rows that
    attend to nothing or that a non-finite value reached (they pass no gradient)."""
    index = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = index < rows_total
    b = index // (num_queries * num_heads)
    i = (index // num_heads) % num_queries
    h = index % num_heads
    dims = tl.arange(0, DIM_BLOCK)
    mask = ok[:, None] & (dims < head_dim)[None, :]
    offsets = (b * so_b + i * so_n + h * so_h)[:, None] + dims[None, :]
    do = tl.load(DO + offsets, mask=mask, other=0.0).to(tl.float32)
    out = tl.load(OUT + offsets, mask=mask, other=0.0).to(tl.float32)
    row = b * sl_b + i * sl_n + h * sl_h
    delta = tl.sum(do * out, axis=1)
    if HAS_DLSE:
        delta -= tl.load(DLSE + row, mask=ok, other=0.0)
    lse = tl.load(LSE + row, mask=ok, other=0.0)
    delta = tl.where((lse != lse) | (lse == float("-inf")), 0.0, delta)
    tl.store(DELTA + row, delta, mask=ok)


# Tile configurations per pass and head dim, ``(BLOCK_M, BLOCK_N, num_warps,
# num_stages)``, first the one used without tuning. Chosen from the compiler's resource
# report for sm_90 (Triton 3.6, ``benchmarks/triton_compile.py``): the fewest register
# spills first; a tile's accumulators are ``BLOCK x head_dim`` float32 (two of them in
# the dk/dv pass, whose ``BLOCK_N`` is its own key rows), so wide heads take small tiles.
GPU_CONFIGS = {
    64: {
        "forward": [(128, 64, 8, 3), (64, 64, 8, 3), (128, 32, 8, 3), (64, 32, 4, 3)],
        "dq": [(64, 64, 8, 3), (128, 32, 8, 3), (64, 32, 4, 3)],
        "keys": [(32, 32, 4, 3), (16, 64, 4, 3), (32, 64, 4, 3), (32, 128, 8, 3)],
        "decode": [(DECODE_ROWS, 32, 4, 3), (DECODE_ROWS, 128, 8, 3)],
    },
    128: {
        "forward": [(128, 32, 8, 3), (64, 64, 8, 3), (64, 32, 4, 3), (128, 64, 8, 3)],
        "dq": [(32, 64, 4, 3), (128, 32, 8, 3), (64, 64, 8, 3)],
        "keys": [(32, 32, 4, 3), (64, 64, 8, 3), (32, 128, 8, 3)],
        "decode": [(DECODE_ROWS, 32, 4, 3), (DECODE_ROWS, 64, 4, 3)],
    },
    256: {
        "forward": [(64, 32, 8, 2), (32, 32, 4, 2)],
        "dq": [(32, 32, 4, 2), (64, 32, 8, 2)],
        "keys": [(16, 32, 4, 2), (32, 32, 8, 2)],
        "decode": [(DECODE_ROWS, 32, 4, 2)],
    },
}
# Set to 0 to run each pass with its first configuration instead of autotuning (a
# process that compiles many variants once, such as a test run, saves most of its time).
TUNE_ENV = "DILATED_ATTENTION_TRITON_TUNE"


def gpu_configs(kind: str, head_dim: int) -> list[tuple[int, int, int, int]]:
    """The configurations of pass ``kind`` (``forward``, ``dq``, ``keys``: dk/dv,
    ``decode``: a few query rows) at ``head_dim``, the first the default."""
    return GPU_CONFIGS[min(width for width in GPU_CONFIGS if width >= head_dim)][kind]


def _tuned(kernel, kind: str, key: list[str]):
    """``kernel`` autotuned over :func:`gpu_configs` (its ``DIM_BLOCK`` picks the list);
    ``None`` under the interpreter."""
    if INTERPRETED:
        return None
    configs = {config for lists in GPU_CONFIGS.values() for config in lists[kind]}

    def prune(configs, named_args, **kwargs):
        wanted = set(gpu_configs(kind, {**named_args, **kwargs}["DIM_BLOCK"]))
        return [c for c in configs if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) in wanted]

    return triton.autotune(
        [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=st) for m, n, w, st in sorted(configs)],
        key=key,
        prune_configs_by={"early_config_prune": prune},
    )(kernel)


_TUNING_KEY = ["DIM_BLOCK", "DIM_MASK", "CAUSAL", "HAS_PADDING", "CHECK_FINITE", "BACKWARD"]
_TUNED = {
    "forward": _tuned(_forward_kernel, "forward", _TUNING_KEY),
    "dq": _tuned(_forward_kernel, "dq", _TUNING_KEY),
    "decode": _tuned(_forward_kernel, "decode", _TUNING_KEY),
    "keys": _tuned(_key_grads_kernel, "keys", _TUNING_KEY[:-1]),
}


class Launch:
    """What the kernels of one call share: the branch table on the device, each batch
    row's first key position, the flags, and how to size the grid."""

    def __init__(
        self,
        q,
        k,
        table: BranchTable,
        key_starts: tuple[int, ...],
        is_causal: bool,
        padding: torch.Tensor | None,
        check_finite: bool,
    ):
        batch, num_queries, num_heads, dim = q.shape
        self.batch, self.num_queries, self.num_keys, self.num_heads = batch, num_queries, k.shape[1], num_heads
        self.num_kv_heads, self.group_size = k.shape[2], num_heads // k.shape[2]
        self.key_starts = key_starts
        self.key_start = torch.tensor(key_starts, dtype=torch.int64, device=q.device)
        self.seg, self.rate, self.offset = _device_table(table, q.device)
        self.decode = num_queries <= DECODE_ROWS
        self.row_step = 1 if self.decode else table.row_step
        pad = None if padding is None else padding.view(torch.uint8)
        # Without padding the pointer is never read: any tensor serves.
        self.pad = (self.key_start, 0, 0) if pad is None else (pad, *pad.stride())
        # Run-time sizes (one compiled kernel serves them all), then the compile-time flags.
        self.sizes = (dim, len(table.segment_lengths), self.row_step)
        dim_block = max(16, triton.next_power_of_2(dim))
        self.flags = dict(
            DIM_BLOCK=dim_block,
            DIM_MASK=dim != dim_block,
            CAUSAL=is_causal,
            HAS_PADDING=padding is not None,
            CHECK_FINITE=check_finite,
            DOT_FP32=INTERPRETED and q.dtype == torch.bfloat16,
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        )

    def tiles(self, first_row: int, rows: int, block: int) -> int:
        """Programs along the rows: enough for the batch row whose rows ``[first_row,
        first_row + rows)`` (key-row coordinates) touch the most aligned spans of
        ``row_step * block`` positions."""
        span = self.row_step * block
        return self.row_step * max(
            (start + first_row + rows - 1) // span - (start + first_row) // span + 1 for start in self.key_starts
        )

    def query_grid(self, meta) -> tuple[int, int, int]:
        """The forward's and the dq pass's grid: query tiles x heads x batch rows (each
        of the last two at most :data:`~dilated_attention.ops.fused.MAX_GRID_YZ`)."""
        first_query = self.num_keys - self.num_queries
        return self.tiles(first_query, self.num_queries, meta["BLOCK_M"]), self.num_heads, self.batch

    def key_grid(self, meta) -> tuple[int, int, int]:
        """The dk/dv pass's grid: key tiles x key heads x batch rows."""
        return self.tiles(0, self.num_keys, meta["BLOCK_N"]), self.num_kv_heads, self.batch

    def run(self, kernel, kind: str, grid, *args, **constexprs) -> None:
        """Launch ``kernel`` for pass ``kind``: with the interpreter's small fixed tiles;
        on a GPU autotuned over :func:`gpu_configs` (its autotuner picks ``BLOCK_M``,
        ``BLOCK_N``, warps and stages), or with the first of them where ``$TUNE_ENV``
        is 0."""
        args = (*args, *self.sizes)
        if INTERPRETED:
            meta = {"BLOCK_M": 16, "BLOCK_N": 16}
            kernel[grid(meta)](*args, **meta, **self.flags, **constexprs)
        elif os.environ.get(TUNE_ENV, "1") == "0":
            block_m, block_n, warps, stages = gpu_configs(kind, self.flags["DIM_BLOCK"])[0]
            meta = {"BLOCK_M": block_m, "BLOCK_N": block_n}
            kernel[grid(meta)](*args, **meta, **self.flags, **constexprs, num_warps=warps, num_stages=stages)
        else:
            _TUNED[kind][grid](*args, **self.flags, **constexprs)


@torch.no_grad()
def forward(
    q,
    k,
    v,
    padding,
    key_starts,
    table: BranchTable,
    is_causal: bool,
    scale: float,
    out_scale: float,
    check_finite: bool,
):
    """``out`` ``(B, Lq, H, D)`` in ``q.dtype`` and ``lse`` ``(B, Lq, H)`` float32 of a
    dilated attention (``q`` the last ``Lq`` of the key rows, key row 0 of batch row
    ``b`` at position ``key_starts[b]``)."""
    launch = Launch(q, k, table, key_starts, is_causal, padding, check_finite)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    launch.run(
        _forward_kernel,
        "decode" if launch.decode else "forward",
        launch.query_grid,
        q,
        k,
        v,
        launch.pad[0],
        out,
        lse,
        out,
        out,
        lse,
        launch.key_start,
        launch.seg,
        launch.rate,
        launch.offset,
        *q.stride()[:3],
        *k.stride()[:3],
        *v.stride()[:3],
        *launch.pad[1:],
        *out.stride()[:3],
        *lse.stride(),
        launch.num_queries,
        launch.num_keys,
        launch.group_size,
        scale * LOG2E,
        scale,
        out_scale,
        BACKWARD=False,
    )
    return out, lse


@torch.no_grad()
def backward(
    dout,
    q,
    k,
    v,
    out,
    lse,
    dlse,
    padding,
    key_starts,
    table: BranchTable,
    is_causal: bool,
    scale: float,
    out_scale: float,
    check_finite: bool,
):
    """``dq, dk, dv`` (the dtypes and shapes of ``q, k, v``) given the gradient ``dout``
    of the output ``out`` and ``dlse`` (or ``None``) of ``lse``, as :func:`forward`
    returned them."""
    launch = Launch(q, k, table, key_starts, is_causal, padding, check_finite)
    if dout.stride() != out.stride():  # the passes read both with one set of strides
        dout, out = dout.contiguous(), out.contiguous()
    if dlse is not None and dlse.stride() != lse.stride():
        dlse = dlse.contiguous()
    delta = torch.empty(lse.shape, dtype=torch.float32, device=q.device)
    rows, block = lse.numel(), 16
    _delta_kernel[(triton.cdiv(rows, block),)](
        dout,
        out,
        lse if dlse is None else dlse,
        lse,
        delta,
        *out.stride()[:3],
        *lse.stride(),
        launch.num_queries,
        launch.num_heads,
        rows,
        q.shape[-1],
        DIM_BLOCK=launch.flags["DIM_BLOCK"],
        BLOCK=block,
        HAS_DLSE=dlse is not None,
    )
    dq = torch.empty_strided(q.shape, out.stride(), dtype=q.dtype, device=q.device)  # written with out's strides
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    common = (q, k, v, launch.pad[0])
    strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *launch.pad[1:], *out.stride()[:3], *lse.stride())
    scales = (scale * LOG2E, scale, out_scale)
    launch.run(
        _forward_kernel,
        "decode" if launch.decode else "dq",
        launch.query_grid,
        *common,
        out,
        lse,
        dq,
        dout,
        delta,
        launch.key_start,
        launch.seg,
        launch.rate,
        launch.offset,
        *strides,
        launch.num_queries,
        launch.num_keys,
        launch.group_size,
        *scales,
        BACKWARD=True,
    )
    launch.run(
        _key_grads_kernel,
        "keys",
        launch.key_grid,
        *common,
        lse,
        dout,
        delta,
        dk,
        dv,
        launch.key_start,
        launch.seg,
        launch.rate,
        launch.offset,
        *strides,
        *dk.stride()[:3],
        *dv.stride()[:3],
        launch.num_queries,
        launch.num_keys,
        launch.group_size,
        *scales,
    )
    return dq, dk, dv


_TABLES: dict = {}


def _device_table(table: BranchTable, device: torch.device):
    """``(SEG, RATE, OFFSET)`` of ``table`` on ``device``: int64 ``(G,)``, int64 ``(G,)``,
    int32 ``(H, G)``; made once per table and device."""
    key = (table, device)
    if key not in _TABLES:
        _TABLES[key] = (
            torch.tensor(table.segment_lengths, dtype=torch.int64, device=device),
            torch.tensor(table.rates, dtype=torch.int64, device=device),
            torch.tensor(table.offsets, dtype=torch.int32, device=device),
        )
    return _TABLES[key]
