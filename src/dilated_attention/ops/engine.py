"""The engine: run every planned block through a kernel and merge the results.

A block (:class:`dilated_attention.ops.plan.Block`) is "these query rows against those
key rows". Whole sequences, queries at the end of a longer key window (prefill
chunks, decode steps) and the rows other ranks send are all blocks, and every block
goes through one pipeline: gather its rows as strided views, fold its segments into
the kernel's batch dimension, call the kernel, and merge its ``(out, lse)`` into the
running output and LSE in place with the stable log-sum-exp update. Nothing
full-size is kept per branch.

Backward: the merged output is one softmax over the union of the keys each query
sees, so each block's kernel backward, given the *merged* output and LSE, yields
the exact gradient of the whole function; the block gradients are added into
``dq, dk, dv`` in place. The LSE is differentiable too: its gradient enters each
block's backward as a shift of the softmax's row term (see :func:`_attend_backward`).
Only the inputs, the mask, the dropout seed, the rows flagged non-finite, the output
and the LSE are saved (and, across processes, the rows received from other ranks,
kept by the exchange).

``head_groups`` uses the same path: no two branches share a cell, so each result is
written once, with the final ``1 / G`` applied as it is written (a key window's block
of a segment's earlier keys and its diagonal block are merged as in ``mixture``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from . import fused
from .dropout import DropoutMask, column_keys, row_keys
from .finite import known_empty
from .kernels import Kernel, accumulator
from .plan import Block, FusedPlan, Rows, key_heads
from .strides import contiguous_last_dim
from .validation import TORCH_FUNC_REFUSAL, gradients_are_batched


@dataclass(frozen=True)
class EngineConfig:
    """Everything about one call except the tensors.

    ``blocks``: the plan (see :func:`dilated_attention.ops.plan.make_plan`);
    ``unwritten_cells``: whether the fresh blocks leave cells of the output unwritten
    (:func:`dilated_attention.ops.plan.leaves_cells_unwritten`); ``max_call_elements``:
    a block is run in chunks of whole segments whose output has at most this many
    elements (at least one segment per call), which bounds the temporary memory
    and, on CPU, keeps it small enough to be reused rather than freshly paged in
    each call; ``out_scale``: factor applied to the merged output (``1 / G`` in
    ``head_groups``, where no two branches share a cell); ``kernel``: one of the classes of
    :mod:`dilated_attention.ops.kernels`; ``query_position``, ``key_position``: the
    sequence positions of the first row of ``q`` and of ``k, v``; ``batch_rows``: the
    batch rows of the caller's tensors that these are (``None``: all, in order).
    The last three key the dropout masks. ``fused``: the call runs the fused Triton
    kernels, which take the whole plan in one launch (``blocks`` and ``kernel`` are
    then unused).
    """

    blocks: tuple[Block, ...]
    unwritten_cells: bool
    max_call_elements: int
    scale: float
    dropout_p: float
    out_scale: float
    kernel: type[Kernel] | None
    query_position: int = 0
    key_position: int = 0
    batch_rows: tuple[int, ...] | None = None
    fused: FusedPlan | None = None


@dataclass
class KeySource:
    """Rows that blocks take keys from: ``k``, ``v`` ``(B, L, H', D)``, ``padding``
    ``(B, L)`` bool or ``None``, ``bad`` (:func:`dilated_attention.ops.finite.nonfinite_rows` of ``k, v``); row
    ``i`` is sequence position ``first_position + step * i``."""

    k: torch.Tensor
    v: torch.Tensor
    padding: torch.Tensor | None
    first_position: int
    step: int = 1
    bad: torch.Tensor | None = None

    def positions(self, rows: Rows) -> torch.Tensor:
        """Sequence positions of ``rows`` of this source, ``(nseg, count)``."""
        return self.first_position + self.step * rows.positions(self.k.device)


def _calls(blocks, max_call_elements: int, batch: int, head_dim: int) -> list[Block]:
    """The kernel calls: every block, cut into chunks of at most ``max_call_elements``."""
    calls = []
    for block in blocks:
        per_segment = batch * block.queries.count * block.queries.head_count * head_dim
        calls.extend(block.chunks(max(1, max_call_elements // per_segment)))
    return calls


def _to_kernel(x: torch.Tensor) -> torch.Tensor:
    """``(B, nseg, rows, h, ...)`` -> ``(B * nseg, h, rows, ...)``."""
    return x.flatten(0, 1).transpose(1, 2)


def _from_kernel(y: torch.Tensor, batch: int) -> torch.Tensor:
    """``(B * nseg, h, rows, ...)`` -> ``(B, nseg, rows, h, ...)``."""
    return y.transpose(1, 2).unflatten(0, (batch, -1))


def _key_mask(pad: torch.Tensor | None, dtype, is_causal: bool):
    """From padded keys ``(B', L)`` (bool): the additive bias ``(B', 1, 1, L)`` and the
    query rows left with no key ``(B', 1, L or 1)``; ``(None, None)`` without a mask.
    Causal blocks are square (queries are the keys' rows)."""
    if pad is None:
        return None, None
    bias = torch.zeros(pad.shape, dtype=dtype, device=pad.device).masked_fill_(pad, -math.inf)
    valid = ~pad
    empty = valid.cumsum(-1) == 0 if is_causal else ~valid.any(-1, keepdim=True)
    return bias[:, None, None, :], empty[:, None, :]


def _clean(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bad):
    """``q, k, v`` (kernel layout) with their non-finite rows set to 0."""
    if bad is None:
        return q, k, v
    q_rows, kv_rows = bad[0].unsqueeze(-1), bad[1].unsqueeze(-1)
    return q.masked_fill(q_rows, 0.0), k.masked_fill(kv_rows, 0.0), v.masked_fill(kv_rows, 0.0)


def _reached_rows(bad, pad: torch.Tensor | None, is_causal: bool) -> torch.Tensor:
    """Query rows ``(B', h, Lq)`` that a non-finite value reaches: one in the query
    itself, or in an unpadded key it attends to (key flags ``(B', h_k, Lk)``)."""
    bad_q, bad_k = bad
    if pad is not None:
        bad_k = bad_k & ~pad[:, None, :]
    reached = bad_k.cumsum(-1) > 0 if is_causal else bad_k.any(-1, keepdim=True)
    return bad_q | reached.repeat_interleave(bad_q.shape[1] // bad_k.shape[1], dim=1)


def _append_column(t: torch.Tensor, column) -> torch.Tensor:
    """``t`` ``(..., D)`` with ``column`` ``(...)`` as its column ``D``: a new contiguous
    tensor (the CPU flash backward mishandles other layouts of the same shape)."""
    out = t.new_empty(*t.shape[:-1], t.shape[-1] + 1)
    out[..., :-1] = t
    out[..., -1] = column
    return out


@dataclass(frozen=True)
class KeyRows:
    """The key/value rows of a block: ``rows`` of ``k, v``, then, when ``index`` is
    set, their heads ``index`` (gathered: grouped-query heads no view can express).
    With fewer key/value heads than query heads, each selected key head serves
    ``h / h_k`` consecutive query heads of the block (the kernels broadcast it)."""

    rows: Rows
    index: torch.Tensor | None = None

    @classmethod
    def of(cls, rows: Rows, num_heads: int, groups: int) -> KeyRows:
        """The key rows for the query heads of ``rows`` (indices among ``num_heads``),
        each ``groups`` consecutive query heads sharing one key/value head."""
        if groups == 1:
            return cls(rows)
        kv, _, index = key_heads(rows.heads.indices(num_heads), groups)
        if kv is not None:
            return cls(replace(rows, heads=slice(*kv)))
        return cls(replace(rows, heads=slice(0, num_heads // groups)), torch.tensor(index))

    def select(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, nseg, count, h_k, ...)``: a view, or a copy of the gathered heads."""
        view = self.rows.select(x)
        return view if self.index is None else view.index_select(3, self.index.to(x.device))

    def add_into(self, dst: torch.Tensor, src: torch.Tensor, scale: float) -> None:
        """``dst[these rows] += scale * src`` (``src`` as :meth:`select` returns)."""
        view = self.rows.select(dst)
        if self.index is None:
            view.add_(src, alpha=scale)
        else:
            view.index_add_(3, self.index.to(dst.device), src.to(dst.dtype), alpha=scale)


@dataclass
class _Call:
    """One kernel call's inputs, in kernel layout: ``q`` ``(B', h, Lq, D)``, ``k, v``
    ``(B', h_k, Lk, D)`` (``h_k`` divides ``h``), ``pad`` ``(B', Lk)``, ``bad`` (query
    and key non-finite rows); ``keys``: where ``k, v`` came from."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    pad: torch.Tensor | None
    bad: tuple[torch.Tensor, torch.Tensor] | None
    is_causal: bool
    dropout: DropoutMask | None
    keys: KeyRows


def _call(cfg: EngineConfig, block: Block, q, bad_q, source: KeySource, seed, groups: int = 1) -> _Call:
    """Gather the rows of one block (strided views; nothing is copied but the key
    heads of grouped-query attention that no view can express). ``groups``: query
    heads per key/value head of the call's own ``k, v``."""
    batch = q.shape[0]
    keys = KeyRows.of(block.keys, q.shape[2], groups)
    pad = None if source.padding is None else block.keys.select(source.padding).flatten(0, 1)
    bad = None
    if bad_q is not None or source.bad is not None:
        query_flags = block.queries.select(bad_q) if bad_q is not None else None
        key_flags = keys.select(source.bad) if source.bad is not None else None
        if query_flags is None:
            assert key_flags is not None  # the keys' flags, when the queries have none
            query_flags = key_flags.new_zeros(*key_flags.shape[:2], block.queries.count, block.queries.head_count)
        if key_flags is None:
            kv_head_count = keys.rows.head_count if keys.index is None else len(keys.index)
            key_flags = query_flags.new_zeros(*query_flags.shape[:2], block.keys.count, kv_head_count)
        bad = (_to_kernel(query_flags), _to_kernel(key_flags))
    dropout = None
    if seed is not None:
        positions = cfg.query_position + block.queries.positions(q.device)
        heads = torch.arange(q.shape[2], device=q.device)[block.queries.heads]
        rows = torch.arange(batch) if cfg.batch_rows is None else torch.tensor(cfg.batch_rows)
        columns = column_keys(source.positions(block.keys)).expand(batch, -1, -1).flatten(0, 1).unsqueeze(1)
        keys_of_rows = row_keys(seed, rows.to(q.device), heads, positions)
        dropout = DropoutMask(cfg.dropout_p, _to_kernel(keys_of_rows), columns)
    return _Call(
        _to_kernel(block.queries.select(q)),
        _to_kernel(keys.select(source.k)),
        _to_kernel(keys.select(source.v)),
        pad,
        bad,
        block.is_causal,
        dropout,
        keys,
    )


def _attend(cfg: EngineConfig, call: _Call):
    """``(out, lse)`` of one kernel call in kernel layout, with the rules of the
    definition a fused kernel does not keep by itself: padded keys have no effect
    whatever they hold, a non-finite value makes exactly the rows it reaches NaN,
    and a row with no key is ``0``, ``-inf``."""
    q, k, v = _clean(call.q, call.k, call.v, call.bad)
    bias, empty = _key_mask(call.pad, q.dtype, call.is_causal)
    assert cfg.kernel is not None  # None only where the fused kernels run the whole call
    o, lse = cfg.kernel.forward(q, k, v, bias, call.is_causal, cfg.scale, call.dropout)
    if call.bad is not None:
        reached = _reached_rows(call.bad, call.pad, call.is_causal)
        o, lse = o.masked_fill(reached.unsqueeze(-1), math.nan), lse.masked_fill(reached, math.nan)
    if empty is not None:
        o, lse = o.masked_fill(empty.unsqueeze(-1), 0.0), lse.masked_fill(empty, -math.inf)
    return o, lse


def _attend_backward(cfg: EngineConfig, call: _Call, grad, out, lse, lse_grad):
    """``dq, dk, dv`` of one kernel call (kernel layout), given the merged ``out`` and
    ``lse`` (``+inf`` on rows with no key or reached by a non-finite value).

    ``lse_grad`` ``(B', h, Lq)`` or ``None``: a gradient reaching the LSE. It adds
    ``P_ij * g_i`` to the score gradient ``P * (dP - delta)``, i.e. lowers
    ``delta = rowsum(grad * out)`` by ``g``. The kernels get it through one more
    head-dim column: 0 in ``q, k, v`` (nothing else changes), ``c`` in ``out`` and
    ``-g / c`` in ``grad``, with ``c = sqrt(max(|g|, 1))`` so that both fit float16."""
    q, k, v = _clean(call.q, call.k, call.v, call.bad)
    bias, _ = _key_mask(call.pad, q.dtype, call.is_causal)
    dim = q.shape[-1]
    if lse_grad is not None:
        split = lse_grad.abs().clamp(min=1.0).sqrt()
        q, k, v = (_append_column(t, 0.0) for t in (q, k, v))
        out, grad = _append_column(out, split), _append_column(grad, -lse_grad / split)
    assert cfg.kernel is not None  # None only where the fused kernels run the whole call
    dq, dk, dv = cfg.kernel.backward(grad, q, k, v, out, lse, bias, call.is_causal, cfg.scale, call.dropout)
    return dq[..., :dim], dk[..., :dim], dv[..., :dim]


def _buffer(shape, dtype, device, cfg: EngineConfig, fill: float) -> torch.Tensor:
    """Uninitialised buffer, or ``fill`` throughout where the fresh blocks leave cells
    unwritten (``cfg.unwritten_cells``), in one contiguous pass: most of a fill's time
    is the page faults of fresh memory's first touch (``benchmarks/cpu_costs.py``),
    which a fill of only the unwritten cells, on every page, would pay as well."""
    if cfg.unwritten_cells:
        return torch.full(shape, fill, dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def _write(dst: torch.Tensor, src: torch.Tensor, fresh: bool, scale: float = 1.0) -> None:
    """``dst <- scale * src`` for a fresh block, else ``dst += scale * src``, in place.
    Eagerly a scaled write of the same dtype is one pass (``torch.mul(..., out=dst)``);
    ``torch.compile`` cannot trace a non-contiguous ``out=``, and a wider ``dst`` must
    not be scaled in ``src``'s precision, so those copy first and scale after."""
    if not fresh:
        dst.add_(src, alpha=scale)
    elif scale == 1.0:
        dst.copy_(src)
    elif src.dtype == dst.dtype and not torch.compiler.is_compiling():
        torch.mul(src, scale, out=dst)
    else:
        dst.copy_(src).mul_(scale)


def merge_into(out, lse, o, o_lse, scale: float = 1.0) -> None:
    """In place: ``out <- out + share * (scale * o - out)``, ``lse <- logaddexp(lse, o_lse)``,
    with ``share = sigmoid(o_lse - lse)``, the block's part of the joint denominator.

    ``out`` ``(..., D)`` and ``lse`` ``(...)`` are views into the running buffers; ``out``
    already carries the factor ``scale``. The two parts sum to 1 whatever the LSEs' size
    (weights ``e^(lse_i - lse_new)`` would carry the rounding of ``lse_new``: where
    ``log 2`` is below half an ulp of two equal LSEs, both became 1 and the output
    doubled). A cell neither side has a key for (both ``-inf``) keeps its 0; a NaN
    reaches a cell through ``out`` or ``o``, which hold it wherever an LSE does. ``o``
    may be overwritten."""
    share = (o_lse - lse).sigmoid_().nan_to_num_(nan=0.0).unsqueeze(-1)
    end = o.to(out.dtype)
    out.lerp_(end.mul_(scale) if scale != 1.0 else end, share)
    lse.copy_(torch.logaddexp(lse, o_lse))


def _accumulation_dtype(dtype: torch.dtype, cfg: EngineConfig, remote: bool = False) -> torch.dtype:
    """float32 for float16/bfloat16 results that are merged (across branches or with
    other ranks' keys); the input dtype where every cell is written once or it is >= 32 bits."""
    merges = remote or any(not block.fresh for block in cfg.blocks)
    return torch.float32 if merges and dtype in (torch.float16, torch.bfloat16) else dtype


def _keys_are_queries(cfg: EngineConfig) -> bool:
    """Whether every local block's key rows are its query rows (one sequence, no
    window): then key gradients are written as the query cells are, else added into
    zeros."""
    return all(block.keys == block.queries for block in cfg.blocks)


def engine_forward(q, k, v, padding, seed, query_flags, key_flags, cfg: EngineConfig, exchange=None):
    """Output ``(B, Lq, H, D)`` in ``q.dtype`` and LSE ``(B, Lq, H)``; see module docstring.

    ``seed``: 0-dim int64 tensor of the dropout masks, or ``None`` without dropout.
    ``query_flags`` ``(B, Lq, H)``, ``key_flags`` ``(B, Lk, H_kv)``: bool, the rows of ``q``
    and of ``k, v`` that hold a NaN or an infinity (:func:`dilated_attention.ops.finite.nonfinite_rows`; ``None``:
    none; the fused kernels then check every tile they load).
    ``exchange`` (a :class:`dilated_attention.ops.distributed.Exchange`, or ``None``) has
    posted the transfer of other ranks' rows; it is finished after the local blocks
    have run, so that the transfer overlaps them, and its blocks are merged in."""
    if cfg.fused is not None:
        plan = cfg.fused
        return fused.kernels().forward(
            q,
            k,
            v,
            padding,
            plan.key_starts,
            plan.table,
            plan.is_causal,
            cfg.scale,
            cfg.out_scale,
            query_flags is not None or key_flags is not None,
        )
    batch, length, heads, dim = q.shape
    out = _buffer(q.shape, _accumulation_dtype(q.dtype, cfg, exchange is not None), q.device, cfg, 0.0)
    lse = _buffer((batch, length, heads), accumulator(q.dtype), q.device, cfg, -math.inf)
    sources = [KeySource(k, v, padding, cfg.key_position, bad=key_flags)]
    groups = heads // k.shape[2]  # grouped-query attention (one process only)

    def run(blocks):
        for block in _calls(blocks, cfg.max_call_elements, batch, dim):
            o, o_lse = _attend(cfg, _call(cfg, block, q, query_flags, sources[block.source], seed, groups))
            o, o_lse = _from_kernel(o, batch), _from_kernel(o_lse, batch)
            out_view, lse_view = block.queries.select(out), block.queries.select(lse)
            if block.fresh:
                _write(out_view, o, True, cfg.out_scale)
                lse_view.copy_(o_lse)
            else:
                merge_into(out_view, lse_view, o, o_lse, cfg.out_scale)

    run(cfg.blocks)
    if exchange is not None:
        remote_sources, remote_blocks = exchange.finish_forward()
        sources.extend(remote_sources)
        run(remote_blocks)
    return out.to(q.dtype), lse


def _backward_rows(out, grad_out, lse, grad_lse, out_scale: float):
    """``out, grad_out, lse`` and the LSE's gradient (divided by ``out_scale``; ``None``
    where none reaches it) as the kernels' backward takes them. A row with no key at
    all has ``lse = -inf``: ``+inf`` makes all its probabilities 0. A row that a
    non-finite input reached (``lse`` NaN) is a constant NaN: it passes no gradient
    back, so it gets the same treatment and its output counts as 0."""
    grad_out = torch.zeros_like(out) if grad_out is None else grad_out
    no_key, dead = torch.isneginf(lse), torch.isnan(lse)
    if not known_empty(dead):
        out, grad_out = (t.masked_fill(dead.unsqueeze(-1), 0.0) for t in (out, grad_out))
        no_key = no_key | dead
    lse_grad = None if grad_lse is None else grad_lse.masked_fill(no_key, 0.0) / out_scale
    return out, grad_out, lse.masked_fill(no_key, math.inf), lse_grad


def engine_backward(
    grad_out, grad_lse, q, k, v, padding, seed, query_flags, key_flags, out, lse, cfg: EngineConfig, exchange=None
):
    """``dq, dk, dv`` given ``grad_out`` and ``grad_lse`` (either may be ``None``: no
    gradient reaches that output); the other arguments as :func:`engine_forward` took
    them, ``out``/``lse`` as it returned them.

    With ``out_scale = s`` (``head_groups``) the kernel must differentiate the
    unscaled output ``O = out / s`` for the gradient ``s * grad_out``; being linear
    in the gradient and in ``rowsum(grad * O)``, that equals ``s`` times its result
    for ``grad_out`` and ``O``, so only ``O`` is formed and ``s`` joins the copy (the
    LSE's gradient, not scaled by ``s``, enters divided by it).

    The blocks on other ranks' rows run first: the gradients of those rows are handed
    to ``exchange`` to send while the local blocks run."""
    if cfg.fused is not None:
        plan = cfg.fused
        return fused.kernels().backward(
            torch.zeros_like(out) if grad_out is None else grad_out,
            q,
            k,
            v,
            out,
            lse,
            grad_lse,
            padding,
            plan.key_starts,
            plan.table,
            plan.is_causal,
            cfg.scale,
            cfg.out_scale,
            query_flags is not None or key_flags is not None,
        )
    batch, _, _, dim = q.shape
    remote_sources, remote_blocks = exchange.received if exchange is not None else ([], [])
    acc = _accumulation_dtype(q.dtype, cfg, exchange is not None)
    grad_q = _buffer(q.shape, acc, q.device, cfg, 0.0)
    groups = q.shape[2] // k.shape[2]  # grouped-query attention (one process only)
    keys_fresh = _keys_are_queries(cfg) and groups == 1  # shared key heads add up
    if keys_fresh:
        grad_k, grad_v = (_buffer(t.shape, acc, t.device, cfg, 0.0) for t in (k, v))
    else:
        grad_k, grad_v = (torch.zeros(t.shape, dtype=acc, device=t.device) for t in (k, v))
    out, grad_out, lse, lse_grad = _backward_rows(out, grad_out, lse, grad_lse, cfg.out_scale)
    sources = [KeySource(k, v, padding, cfg.key_position, bad=key_flags), *remote_sources]

    def block_grads(block: Block):
        """``dq, dk, dv`` of one block, ``(B, nseg, rows, h or h_k, D)``, and its key rows."""
        ob, gb, lb = (_to_kernel(block.queries.select(t)) for t in (out, grad_out, lse))
        ob = ob / cfg.out_scale if cfg.out_scale != 1.0 else ob
        glb = None if lse_grad is None else _to_kernel(block.queries.select(lse_grad))
        call = _call(cfg, block, q, query_flags, sources[block.source], seed, groups)
        return [_from_kernel(g, batch) for g in _attend_backward(cfg, call, gb, ob, lb, glb)], call.keys

    remote_dq, remote_key_grads = [], []
    for block in remote_blocks:  # one block per received source, in order
        (dq, dk, dv), _ = block_grads(block)
        remote_dq.append((block, dq))  # added after the local blocks, whose fresh writes come first
        remote_key_grads.append(tuple(g.squeeze(1) * cfg.out_scale for g in (dk, dv)))
    if exchange is not None:
        exchange.start_backward(remote_key_grads)
    for block in _calls(cfg.blocks, cfg.max_call_elements, batch, dim):
        (dq, dk, dv), keys = block_grads(block)
        _write(block.queries.select(grad_q), dq, block.fresh, cfg.out_scale)
        for grad, block_grad in ((grad_k, dk), (grad_v, dv)):
            if block.fresh and keys_fresh:
                _write(block.keys.select(grad), block_grad, True, cfg.out_scale)
            else:
                keys.add_into(grad, block_grad, cfg.out_scale)
    for block, dq in remote_dq:
        _write(block.queries.select(grad_q), dq, False, cfg.out_scale)
    if exchange is not None:
        exchange.finish_backward(grad_k, grad_v)
    return grad_q, grad_k, grad_v


class DilatedAttentionFunction(torch.autograd.Function):
    """Autograd wrapper of the engine: inputs ``q`` ``(B, Lq, H, D)``, ``k, v``
    ``(B, Lk, H_kv, D)`` (``H_kv`` divides ``H``; last dims unit-stride), an optional bool ``padding`` ``(B, Lk)``,
    the dropout ``seed`` and the ``query_flags`` and ``key_flags`` (see
    :func:`engine_forward`: found once, for the backward too); outputs ``out`` and
    ``lse``, both differentiable.

    ``exchange`` (a :class:`dilated_attention.ops.distributed.Exchange`, or ``None``)
    makes the inputs one rank's shard: other ranks' key/value rows are received while
    the local blocks run, and their gradients are sent back while the local backward
    runs. Double backward is refused: the backward is not itself differentiable.
    """

    @staticmethod
    def forward(q, k, v, padding, seed, query_flags, key_flags, cfg: EngineConfig, exchange=None):
        if exchange is not None:
            exchange.start_forward(k, v, padding)
        return engine_forward(q, k, v, padding, seed, query_flags, key_flags, cfg, exchange)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, padding, seed, query_flags, key_flags, cfg, exchange = inputs
        ctx.save_for_backward(q, k, v, padding, seed, query_flags, key_flags, *output)
        ctx.cfg, ctx.exchange = cfg, exchange
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        if gradients_are_batched(grad_out, grad_lse):
            raise RuntimeError(TORCH_FUNC_REFUSAL)
        if torch.is_grad_enabled():
            raise RuntimeError(
                "dilated_attention does not support double backward (a backward with "
                "create_graph=True, e.g. for a gradient penalty): its gradient is not itself "
                "differentiable, so it is refused rather than silently cut from the graph"
            )
        q, k, v, padding, seed, query_flags, key_flags, out, lse = ctx.saved_tensors
        grads = engine_backward(
            None if grad_out is None else contiguous_last_dim(grad_out),
            grad_lse,
            q,
            k,
            v,
            padding,
            seed,
            query_flags,
            key_flags,
            out,
            lse,
            ctx.cfg,
            ctx.exchange,
        )
        dq, dk, dv = (g.to(t.dtype) for g, t in zip(grads, (q, k, v), strict=True))
        return dq, dk, dv, None, None, None, None, None, None
