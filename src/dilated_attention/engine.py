"""The engine: run every planned block through a fused kernel and merge the results.

Forward, block by block: gather the block's rows of ``q, k, v`` as strided views,
fold its segments into the kernel's batch dimension, call the kernel, and merge
its ``(out, lse)`` into the running output and LSE in place with the stable
log-sum-exp update. Nothing full-size is kept per branch.

Backward: the merged output is one softmax over the union of the keys each query
sees, so each block's kernel backward, given the *merged* output and LSE, yields
the exact gradient of the whole function; the block gradients are added into
``dq, dk, dv`` in place. Only the inputs, the mask, the output and the LSE are
saved (and, across processes, the rows received from other ranks: see
:class:`RemoteKeys`, merged after the local blocks).

``head_groups`` uses the same path: its blocks never overlap, so each result is
written once, with the final ``1 / G`` applied as it is written.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
from torch.autograd.function import once_differentiable

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
    :mod:`dilated_attention.kernels`.
    """

    blocks: tuple[Block, ...]
    unwritten_heads: tuple[slice, ...]
    max_call_elements: int
    is_causal: bool
    scale: float
    dropout_p: float
    out_scale: float
    kernel: type


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


def _block_mask(block: Block, padding: Optional[torch.Tensor], dtype, is_causal: bool):
    """:func:`_key_mask` of a block's keys."""
    return _key_mask(None if padding is None else block.select(padding).flatten(0, 1), dtype, is_causal)


@dataclass
class RemoteKeys:
    """Keys and values that another rank sent for one local query block.

    ``query``: the local query rows (one segment); ``k``, ``v``: ``(B, h, L, D)``
    kernel layout; ``padding``: ``(B, L)`` bool or ``None``. The queries see all of
    them (the sender's rows all precede the queries when causal)."""

    query: Block
    k: torch.Tensor
    v: torch.Tensor
    padding: Optional[torch.Tensor]


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


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _sanitize(o, l, empty):
    """Rows with no key: LSE ``-inf`` and output 0 (the fused kernels report LSE 0)."""
    if empty is None:
        return o, l
    return o.masked_fill(empty.unsqueeze(-1), 0.0), l.masked_fill(empty, -math.inf)


def engine_forward(q, k, v, padding, cfg: EngineConfig, seed: int, remote: Callable[[], Sequence[RemoteKeys]] = None):
    """Output ``(B, N, H, D)`` in ``q.dtype`` and LSE ``(B, N, H)``; see module docstring.

    ``remote``, when given, is called after the local blocks have run (so that data in
    flight from other ranks overlaps them) and returns the remote keys to merge in."""
    batch, seq_len, heads, _ = q.shape
    out = _buffer(q.shape, _accumulation_dtype(q.dtype, cfg, remote is not None), q.device, cfg, 0.0)
    lse = _buffer((batch, seq_len, heads), _lse_dtype(q.dtype), q.device, cfg, -math.inf)
    calls = _calls(cfg, batch, q.shape[-1])
    for index, block in enumerate(calls):
        qb, kb, vb = (_to_kernel(block.select(t)) for t in (q, k, v))
        bias, empty = _block_mask(block, padding, q.dtype, cfg.is_causal)
        o, l = cfg.kernel.forward(qb, kb, vb, bias, cfg.is_causal, cfg.scale, cfg.dropout_p, seed + index)
        o, l = _sanitize(o, l, empty)
        o, l = _from_kernel(o, batch), _from_kernel(l, batch)
        out_view, lse_view = block.select(out), block.select(lse)
        if block.fresh:
            _write(out_view, o, True, cfg.out_scale)
            lse_view.copy_(l)
        else:
            _merge_into(out_view, lse_view, o, l, cfg.out_scale)
    for index, piece in enumerate(remote() if remote is not None else (), start=len(calls)):
        qb = _to_kernel(piece.query.select(q))
        bias, empty = _key_mask(piece.padding, q.dtype, False)
        o, l = cfg.kernel.forward(qb, piece.k, piece.v, bias, False, cfg.scale, cfg.dropout_p, seed + index)
        o, l = _sanitize(o, l, empty)
        o, l = _from_kernel(o, batch), _from_kernel(l, batch)
        _merge_into(piece.query.select(out), piece.query.select(lse), o, l, cfg.out_scale)
    return out.to(q.dtype), lse


def engine_backward(grad_out, q, k, v, padding, out, lse, cfg: EngineConfig, seed: int, remote=(), send_remote=None):
    """``dq, dk, dv`` given ``grad_out``; ``out``/``lse`` as returned by :func:`engine_forward`.

    With ``out_scale = s`` (``head_groups``) the kernel must differentiate the
    unscaled output ``O = out / s`` for the gradient ``s * grad_out``; being linear
    in the gradient and in ``rowsum(grad * O)``, that equals ``s`` times its result
    for ``grad_out`` and ``O``, so only ``O`` is formed and ``s`` joins the copy.

    ``remote``: the :class:`RemoteKeys` of the forward; their gradients ``(dk, dv)``
    (kernel layout) are computed first and handed to ``send_remote`` before the local
    blocks run, so that sending them overlaps the local work."""
    batch = q.shape[0]
    acc = _accumulation_dtype(q.dtype, cfg, bool(remote))
    grads = [_buffer(t.shape, acc, t.device, cfg, 0.0) for t in (q, k, v)]
    # A row with no key at all has lse = -inf; +inf makes all its probabilities 0.
    lse = lse.masked_fill(torch.isneginf(lse), math.inf)

    def unscaled(t):
        return t / cfg.out_scale if cfg.out_scale != 1.0 else t

    calls = _calls(cfg, batch, q.shape[-1])
    remote_dq, remote_grads = [], []
    for index, piece in enumerate(remote, start=len(calls)):
        qb, ob, gb, lb = (_to_kernel(piece.query.select(t)) for t in (q, out, grad_out, lse))
        bias, _ = _key_mask(piece.padding, q.dtype, False)
        dq, dk, dv = cfg.kernel.backward(
            gb, qb, piece.k, piece.v, unscaled(ob), lb, bias, False, cfg.scale, cfg.dropout_p, seed + index
        )
        remote_dq.append(dq)  # added after the local blocks, whose fresh writes come first
        remote_grads.append((dk * cfg.out_scale, dv * cfg.out_scale) if cfg.out_scale != 1.0 else (dk, dv))
    if send_remote is not None:
        send_remote(remote_grads)
    for index, block in enumerate(calls):
        qb, kb, vb, ob, gb = (_to_kernel(block.select(t)) for t in (q, k, v, out, grad_out))
        lb = _to_kernel(block.select(lse))
        bias, _ = _block_mask(block, padding, q.dtype, cfg.is_causal)
        block_grads = cfg.kernel.backward(
            gb, qb, kb, vb, unscaled(ob), lb, bias, cfg.is_causal, cfg.scale, cfg.dropout_p, seed + index
        )
        for grad, block_grad in zip(grads, block_grads):
            _write(block.select(grad), _from_kernel(block_grad, batch), block.fresh, cfg.out_scale)
    for piece, dq in zip(remote, remote_dq):
        _write(piece.query.select(grads[0]), _from_kernel(dq, batch), False, cfg.out_scale)
    return grads


class DilatedAttentionFunction(torch.autograd.Function):
    """Autograd wrapper of the engine: inputs ``q, k, v`` ``(B, N, H, D)`` and an
    optional bool ``padding`` ``(B, N)``; outputs ``out`` and a non-differentiable ``lse``.

    ``sharding`` (a :class:`dilated_attention.distributed.Sharding`, or ``None``) makes
    the inputs one rank's shard: other ranks' key/value rows are received while the
    local blocks run, and their gradients are sent back while the local backward runs.
    """

    @staticmethod
    def forward(ctx, q, k, v, padding, cfg: EngineConfig, sharding=None):
        seed = 0
        if cfg.dropout_p > 0:
            seed = int(torch.randint(0, 2**62, (1,)).item())
        remote = sharding.send_keys(k, v, padding) if sharding is not None else None
        out, lse = engine_forward(q, k, v, padding, cfg, seed, remote)
        ctx.save_for_backward(q, k, v, padding, out, lse)
        ctx.cfg, ctx.seed, ctx.sharding = cfg, seed, sharding
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out, _grad_lse):
        q, k, v, padding, out, lse = ctx.saved_tensors
        sharding, pending = ctx.sharding, []
        grads = engine_backward(
            grad_out, q, k, v, padding, out, lse, ctx.cfg, ctx.seed,
            remote=sharding.pieces if sharding is not None else (),
            send_remote=(lambda g: pending.append(sharding.send_key_grads(g))) if sharding is not None else None,
        )
        for finish in pending:
            finish(grads[1], grads[2])
        dq, dk, dv = (g.to(t.dtype) for g, t in zip(grads, (q, k, v)))
        return dq, dk, dv, None, None, None
