"""The engine: run every planned block through a fused kernel and merge the results.

Forward, block by block: gather the block's rows of ``q, k, v`` as strided views,
fold its segments into the kernel's batch dimension, call the kernel, and merge
its ``(out, lse)`` into the running output and LSE in place with the stable
log-sum-exp update. Nothing full-size is kept per branch.

Backward: the merged output is one softmax over the union of the keys each query
sees, so each block's kernel backward, given the *merged* output and LSE, yields
the exact gradient of the whole function; the block gradients are added into
``dq, dk, dv`` in place. The LSE is differentiable too: its gradient enters each
block's backward as a shift of the softmax's row term (see :func:`_attend_backward`).
Only the inputs, the mask, the dropout seed, the output and the LSE are saved
(and, across processes, the rows received from other ranks: see
:class:`RemoteKeys`, merged after the local blocks).

``head_groups`` uses the same path: its blocks never overlap, so each result is
written once, with the final ``1 / G`` applied as it is written.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from .dropout import DropoutMask, column_keys, row_keys
from .kernels import accumulator
from .plan import Block


@dataclass(frozen=True)
class EngineConfig:
    """Everything about one call except the tensors.

    ``blocks``: the plan (see :func:`dilated_attention.plan.make_plan`);
    ``unwritten_heads``: head slices the fresh blocks do not fully write
    (:func:`dilated_attention.plan.partly_covered_heads`); ``max_call_elements``:
    a block is run in chunks of whole segments whose output has at most this many
    elements (at least one segment per call), which bounds the temporary memory
    and, on CPU, keeps it small enough to be reused rather than freshly paged in
    each call; ``out_scale``: factor applied to the merged output (``1 / G`` in
    ``head_groups``, where blocks never overlap); ``kernel``: one of the classes of
    :mod:`dilated_attention.kernels`; ``first_position``: the sequence position of
    the first row of ``q, k, v`` (a shard's start; it keys the dropout masks).
    """

    blocks: tuple[Block, ...]
    unwritten_heads: tuple[slice, ...]
    max_call_elements: int
    is_causal: bool
    scale: float
    dropout_p: float
    out_scale: float
    kernel: type
    first_position: int = 0


def _calls(cfg: EngineConfig, batch: int, head_dim: int) -> list[Block]:
    """The kernel calls: every block, cut into chunks of at most ``max_call_elements``."""
    calls = []
    for block in cfg.blocks:
        per_segment = batch * block.rows * block.head_count * head_dim
        calls.extend(block.chunks(max(1, cfg.max_call_elements // per_segment)))
    return calls


def _to_kernel(x: torch.Tensor) -> torch.Tensor:
    """``(B, nseg, rows, h, ...)`` -> ``(B * nseg, h, rows, ...)``."""
    return x.flatten(0, 1).transpose(1, 2)


def _from_kernel(y: torch.Tensor, batch: int) -> torch.Tensor:
    """``(B * nseg, h, rows, ...)`` -> ``(B, nseg, rows, h, ...)``."""
    return y.transpose(1, 2).unflatten(0, (batch, -1))


def contiguous_last_dim(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself if its last dim is unit-stride (the fused kernels assume it), else a
    contiguous copy. Other strides, 0 included, are passed through as they are."""
    return x if x.shape[-1] == 1 or x.stride(-1) == 1 else x.contiguous()


def _key_mask(pad: Optional[torch.Tensor], dtype, is_causal: bool):
    """From padded keys ``(B', L)`` (bool): the additive bias ``(B', 1, 1, L)`` and the
    query rows left with no key ``(B', 1, L or 1)``; ``(None, None)`` without a mask.
    Causal masks here are square (queries are the keys' rows)."""
    if pad is None:
        return None, None
    bias = torch.zeros(pad.shape, dtype=dtype, device=pad.device).masked_fill_(pad, -math.inf)
    valid = ~pad
    empty = valid.cumsum(-1) == 0 if is_causal else ~valid.any(-1, keepdim=True)
    return bias[:, None, None, :], empty[:, None, :]


def _nonfinite(t: torch.Tensor) -> torch.Tensor:
    """Rows ``t[..., :]`` holding a NaN or an infinity (two reductions, no full-size temporary)."""
    return ~(torch.isfinite(t.amax(-1)) & torch.isfinite(t.amin(-1)))


def _known_empty(flags: torch.Tensor) -> bool:
    """Whether ``flags`` (bool) is known to hold no ``True``: checked where that is free
    (eager on CPU); elsewhere (CUDA, ``torch.compile``) it is not known, and the
    caller takes the path that is right either way."""
    return flags.device.type == "cpu" and not torch.compiler.is_compiling() and not bool(flags.any())


def nonfinite_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """``(bad_q, bad_kv)`` ``(B, N, H)`` bool: rows of ``q``, and of ``k`` or ``v``, that
    hold a NaN or an infinity; ``None`` where there are known to be none. The fused
    kernels let such values leak into rows that do not attend to them (a causal
    future key's value times probability 0), so the engine zeroes them and marks the
    rows they reach instead."""
    bad_q, bad_kv = _nonfinite(q), _nonfinite(k) | _nonfinite(v)
    return None if _known_empty(bad_q | bad_kv) else (bad_q, bad_kv)


def _clean(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bad):
    """``q, k, v`` (kernel layout) with their non-finite rows set to 0."""
    if bad is None:
        return q, k, v
    q_rows, kv_rows = bad[0].unsqueeze(-1), bad[1].unsqueeze(-1)
    return q.masked_fill(q_rows, 0.0), k.masked_fill(kv_rows, 0.0), v.masked_fill(kv_rows, 0.0)


def _append_column(t: torch.Tensor, column: torch.Tensor) -> torch.Tensor:
    """``t`` ``(..., D)`` with ``column`` ``(...)`` as its column ``D``: a new contiguous
    tensor (the CPU flash backward mishandles other layouts of the same shape)."""
    out = t.new_empty(*t.shape[:-1], t.shape[-1] + 1)
    out[..., :-1] = t
    out[..., -1] = column
    return out


def _reached_rows(bad, pad: Optional[torch.Tensor], is_causal: bool) -> torch.Tensor:
    """Query rows ``(B', h, Lq)`` that a non-finite value reaches: one in the query
    itself, or in an unpadded key it attends to."""
    bad_q, bad_k = bad
    if pad is not None:
        bad_k = bad_k & ~pad[:, None, :]
    reached = bad_k.cumsum(-1) > 0 if is_causal else bad_k.any(-1, keepdim=True)
    return bad_q | reached


@dataclass
class RemoteKeys:
    """Keys and values that another rank sent for one local query block.

    ``query``: the local query rows (one segment); ``k``, ``v``: ``(B, h, L, D)``
    kernel layout; ``padding``: ``(B, L)`` bool or ``None``; ``positions``: ``(L,)``
    the keys' positions in the sequence. The queries see all of them (the sender's
    rows all precede the queries when causal)."""

    query: Block
    k: torch.Tensor
    v: torch.Tensor
    padding: Optional[torch.Tensor]
    positions: torch.Tensor


def _attend(cfg: EngineConfig, q, k, v, pad, bad, is_causal: bool, dropout: Optional[DropoutMask]):
    """``(out, lse)`` of one kernel call in kernel layout, with the rules of the
    definition a fused kernel does not keep by itself: padded keys have no effect
    whatever they hold, a non-finite value makes exactly the rows it reaches NaN,
    and a row with no key is ``0``, ``-inf``. ``bad``: ``None`` or the call's
    ``(bad_q (B', h, Lq), bad_k (B', h, Lk))`` from :func:`nonfinite_rows`."""
    q, k, v = _clean(q, k, v, bad)
    bias, empty = _key_mask(pad, q.dtype, is_causal)
    o, l = cfg.kernel.forward(q, k, v, bias, is_causal, cfg.scale, dropout)
    if bad is not None:
        reached = _reached_rows(bad, pad, is_causal)
        o, l = o.masked_fill(reached.unsqueeze(-1), math.nan), l.masked_fill(reached, math.nan)
    if empty is not None:
        o, l = o.masked_fill(empty.unsqueeze(-1), 0.0), l.masked_fill(empty, -math.inf)
    return o, l


def _attend_backward(cfg: EngineConfig, grad, q, k, v, out, lse, lse_grad, pad, bad, is_causal: bool, dropout):
    """``dq, dk, dv`` of one kernel call (kernel layout), given the merged ``out`` and
    ``lse`` (``+inf`` on rows with no key).

    ``lse_grad`` ``(B', h, Lq)`` or ``None``: a gradient reaching the LSE. It adds
    ``P_ij * g_i`` to the score gradient ``P * (dP - delta)``, i.e. lowers
    ``delta = rowsum(grad * out)`` by ``g``. The kernels get it through one more
    head-dim column: 0 in ``q, k, v`` (nothing else changes), ``c`` in ``out`` and
    ``-g / c`` in ``grad``, with ``c = sqrt(max(|g|, 1))`` so that both fit float16."""
    q, k, v = _clean(q, k, v, bad)
    bias, _ = _key_mask(pad, q.dtype, is_causal)
    dim = q.shape[-1]
    if lse_grad is not None:
        split = lse_grad.abs().clamp(min=1.0).sqrt()
        q, k, v = (_append_column(t, 0.0) for t in (q, k, v))
        out, grad = _append_column(out, split), _append_column(grad, -lse_grad / split)
    dq, dk, dv = cfg.kernel.backward(grad, q, k, v, out, lse, bias, is_causal, cfg.scale, dropout)
    return dq[..., :dim], dk[..., :dim], dv[..., :dim]


def _block_rows(block: Block, padding: Optional[torch.Tensor], bad):
    """The block's rows of the padding mask ``(B * nseg, rows)`` and of the
    non-finite flags (kernel layout), each ``None`` where absent."""
    pad = None if padding is None else block.select(padding).flatten(0, 1)
    return pad, None if bad is None else tuple(_to_kernel(block.select(t)) for t in bad)


def _remote_rows(piece: RemoteKeys, bad):
    """The non-finite flags of a call on received keys: the local queries' (none if
    ``bad`` is ``None``) and the received keys', which are always checked."""
    bad_k = _nonfinite(piece.k) | _nonfinite(piece.v)
    if bad is None:  # one segment of queries: (B, h, rows)
        return bad_k.new_zeros(*bad_k.shape[:2], piece.query.rows), bad_k
    return _to_kernel(piece.query.select(bad[0])), bad_k


def _dropout(cfg: EngineConfig, seed, query: Block, q: torch.Tensor, key_positions=None):
    """The :class:`DropoutMask` of a call whose queries are ``query``'s rows and whose
    keys are the same rows, or other rows at ``key_positions`` ``(L,)``; ``None``
    without dropout."""
    if seed is None:
        return None
    batch, _, num_heads, _ = q.shape
    positions = query.positions(cfg.first_position, q.device)
    heads = torch.arange(num_heads, device=q.device)[query.heads]
    rows = _to_kernel(row_keys(seed, batch, heads, positions))
    columns = column_keys(positions if key_positions is None else key_positions.expand(positions.shape[0], -1))
    return DropoutMask(cfg.dropout_p, rows, columns.expand(batch, -1, -1).flatten(0, 1).unsqueeze(1))


def _buffer(shape, dtype, device, cfg: EngineConfig, fill: float) -> torch.Tensor:
    """Uninitialised buffer, with ``fill`` in the heads the fresh blocks may not cover."""
    buf = torch.empty(shape, dtype=dtype, device=device)
    for heads in cfg.unwritten_heads:
        buf[:, :, heads].fill_(fill)
    return buf


def _write(dst: torch.Tensor, src: torch.Tensor, fresh: bool, scale: float = 1.0) -> None:
    """``dst <- scale * src`` for a fresh block, else ``dst += scale * src``, in place.
    (The fresh scaling is a second pass over the block: ``torch.mul(..., out=dst)``
    would fuse it, but ``torch.compile`` cannot trace a non-contiguous ``out=``.)"""
    if not fresh:
        dst.add_(src, alpha=scale)
    else:
        dst.copy_(src)
        if scale != 1.0:
            dst.mul_(scale)


def _merge_into(out, lse, o, l, scale: float = 1.0) -> None:
    """In place: ``lse <- logaddexp(lse, l)``,
    ``out <- out * e^(lse_old - lse) + scale * o * e^(l - lse)``.

    ``out`` ``(..., D)`` and ``lse`` ``(...)`` are views into the running buffers; ``out``
    already carries the factor ``scale``."""
    new = torch.logaddexp(lse, l)
    base = torch.where(torch.isneginf(new), torch.zeros_like(new), new)
    out.mul_((lse - base).exp_().unsqueeze(-1)).addcmul_(o, (l - base).exp_().unsqueeze(-1), value=scale)
    lse.copy_(new)


def _accumulation_dtype(dtype: torch.dtype, cfg: EngineConfig, remote: bool = False) -> torch.dtype:
    """float32 for float16/bfloat16 results that are merged (across branches or with
    other ranks' keys); the input dtype where every cell is written once or it is >= 32 bits."""
    merges = remote or any(not block.fresh for block in cfg.blocks)
    return torch.float32 if merges and dtype in (torch.float16, torch.bfloat16) else dtype


def engine_forward(
    q, k, v, padding, seed, cfg: EngineConfig, remote: Optional[Callable[[], Sequence[RemoteKeys]]] = None
):
    """Output ``(B, N, H, D)`` in ``q.dtype`` and LSE ``(B, N, H)``; see module docstring.

    ``seed``: 0-dim int64 tensor of the dropout masks, or ``None`` without dropout.
    ``remote``, when given, is called after the local blocks have run (so that data in
    flight from other ranks overlaps them) and returns the remote keys to merge in."""
    batch, seq_len, heads, _ = q.shape
    out = _buffer(q.shape, _accumulation_dtype(q.dtype, cfg, remote is not None), q.device, cfg, 0.0)
    lse = _buffer((batch, seq_len, heads), accumulator(q.dtype), q.device, cfg, -math.inf)
    bad = nonfinite_rows(q, k, v)
    for block in _calls(cfg, batch, q.shape[-1]):
        qb, kb, vb = (_to_kernel(block.select(t)) for t in (q, k, v))
        pad, block_bad = _block_rows(block, padding, bad)
        o, l = _attend(cfg, qb, kb, vb, pad, block_bad, cfg.is_causal, _dropout(cfg, seed, block, q))
        o, l = _from_kernel(o, batch), _from_kernel(l, batch)
        out_view, lse_view = block.select(out), block.select(lse)
        if block.fresh:
            _write(out_view, o, True, cfg.out_scale)
            lse_view.copy_(l)
        else:
            _merge_into(out_view, lse_view, o, l, cfg.out_scale)
    for piece in remote() if remote is not None else ():
        qb = _to_kernel(piece.query.select(q))
        dropout = _dropout(cfg, seed, piece.query, q, piece.positions)
        o, l = _attend(cfg, qb, piece.k, piece.v, piece.padding, _remote_rows(piece, bad), False, dropout)
        o, l = _from_kernel(o, batch), _from_kernel(l, batch)
        _merge_into(piece.query.select(out), piece.query.select(lse), o, l, cfg.out_scale)
    return out.to(q.dtype), lse


def engine_backward(
    grad_out, grad_lse, q, k, v, padding, seed, out, lse, cfg: EngineConfig, remote=(), send_remote=None
):
    """``dq, dk, dv`` given ``grad_out`` and ``grad_lse`` (either may be ``None``: no
    gradient reaches that output); ``out``/``lse`` as returned by :func:`engine_forward`.

    With ``out_scale = s`` (``head_groups``) the kernel must differentiate the
    unscaled output ``O = out / s`` for the gradient ``s * grad_out``; being linear
    in the gradient and in ``rowsum(grad * O)``, that equals ``s`` times its result
    for ``grad_out`` and ``O``, so only ``O`` is formed and ``s`` joins the copy (the
    LSE's gradient, not scaled by ``s``, enters divided by it).

    ``remote``: the :class:`RemoteKeys` of the forward; their gradients ``(dk, dv)``
    (kernel layout) are computed first and handed to ``send_remote`` before the local
    blocks run, so that sending them overlaps the local work."""
    batch = q.shape[0]
    acc = _accumulation_dtype(q.dtype, cfg, bool(remote))
    grads = [_buffer(t.shape, acc, t.device, cfg, 0.0) for t in (q, k, v)]
    grad_out = torch.zeros_like(out) if grad_out is None else grad_out
    # A row with no key at all has lse = -inf; +inf makes all its probabilities 0.
    # A row that a non-finite input reached (lse NaN) is a constant NaN: it passes
    # no gradient back, so it gets the same treatment and its output counts as 0.
    no_key, dead = torch.isneginf(lse), torch.isnan(lse)
    if not _known_empty(dead):
        out, grad_out = (t.masked_fill(dead.unsqueeze(-1), 0.0) for t in (out, grad_out))
        no_key = no_key | dead
    lse = lse.masked_fill(no_key, math.inf)
    lse_grad = None if grad_lse is None else grad_lse.masked_fill(no_key, 0.0) / cfg.out_scale

    def inputs(query: Block):
        """The query block's rows of the output, its gradients and the LSE, kernel layout."""
        ob, gb, lb = (_to_kernel(query.select(t)) for t in (out, grad_out, lse))
        ob = ob / cfg.out_scale if cfg.out_scale != 1.0 else ob
        return gb, ob, lb, None if lse_grad is None else _to_kernel(query.select(lse_grad))

    bad = nonfinite_rows(q, k, v)
    remote_dq, remote_grads = [], []
    for piece in remote:
        gb, ob, lb, glb = inputs(piece.query)
        dropout = _dropout(cfg, seed, piece.query, q, piece.positions)
        qb = _to_kernel(piece.query.select(q))
        dq, dk, dv = _attend_backward(
            cfg, gb, qb, piece.k, piece.v, ob, lb, glb, piece.padding, _remote_rows(piece, bad), False, dropout
        )
        remote_dq.append(dq)  # added after the local blocks, whose fresh writes come first
        remote_grads.append((dk * cfg.out_scale, dv * cfg.out_scale) if cfg.out_scale != 1.0 else (dk, dv))
    if send_remote is not None:
        send_remote(remote_grads)
    for block in _calls(cfg, batch, q.shape[-1]):
        qb, kb, vb = (_to_kernel(block.select(t)) for t in (q, k, v))
        gb, ob, lb, glb = inputs(block)
        pad, block_bad = _block_rows(block, padding, bad)
        block_grads = _attend_backward(
            cfg, gb, qb, kb, vb, ob, lb, glb, pad, block_bad, cfg.is_causal, _dropout(cfg, seed, block, q)
        )
        for grad, block_grad in zip(grads, block_grads):
            _write(block.select(grad), _from_kernel(block_grad, batch), block.fresh, cfg.out_scale)
    for piece, dq in zip(remote, remote_dq):
        _write(piece.query.select(grads[0]), _from_kernel(dq, batch), False, cfg.out_scale)
    return grads


class DilatedAttentionFunction(torch.autograd.Function):
    """Autograd wrapper of the engine: inputs ``q, k, v`` ``(B, N, H, D)`` (last dim
    unit-stride), an optional bool ``padding`` ``(B, N)`` and the dropout ``seed``;
    outputs ``out`` and ``lse``, both differentiable.

    ``sharding`` (a :class:`dilated_attention.distributed.Sharding`, or ``None``) makes
    the inputs one rank's shard: other ranks' key/value rows are received while the
    local blocks run, and their gradients are sent back while the local backward runs.
    Double backward is refused: the backward is not itself differentiable.
    """

    @staticmethod
    def forward(q, k, v, padding, seed, cfg: EngineConfig, sharding=None):
        remote = sharding.send_keys(k, v, padding) if sharding is not None else None
        return engine_forward(q, k, v, padding, seed, cfg, remote)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, padding, seed, cfg, sharding = inputs
        ctx.save_for_backward(q, k, v, padding, seed, *output)
        ctx.cfg, ctx.sharding = cfg, sharding
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        if torch.is_grad_enabled() and torch._C._are_functorch_transforms_active():
            raise RuntimeError(
                "dilated_attention does not support torch.func transforms (grad, vjp, vmap, ...): "
                "use torch.autograd.grad or .backward()"
            )
        if torch.is_grad_enabled():
            raise RuntimeError(
                "dilated_attention does not support double backward (a backward with "
                "create_graph=True, e.g. for a gradient penalty): its gradient is not itself "
                "differentiable, so it is refused rather than silently cut from the graph"
            )
        q, k, v, padding, seed, out, lse = ctx.saved_tensors
        sharding, pending = ctx.sharding, []
        grads = engine_backward(
            None if grad_out is None else contiguous_last_dim(grad_out), grad_lse,
            q, k, v, padding, seed, out, lse, ctx.cfg,
            remote=sharding.pieces if sharding is not None else (),
            send_remote=(lambda g: pending.append(sharding.send_key_grads(g))) if sharding is not None else None,
        )
        for finish in pending:
            finish(grads[1], grads[2])
        dq, dk, dv = (g.to(t.dtype) for g, t in zip(grads, (q, k, v)))
        return dq, dk, dv, None, None, None, None
