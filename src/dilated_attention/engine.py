"""The engine: run every planned block through a fused kernel and merge the results.

Forward, block by block: gather the block's rows of ``q, k, v`` as strided views,
fold its segments into the kernel's batch dimension, call the kernel, and merge
its ``(out, lse)`` into the running output and LSE in place with the stable
log-sum-exp update. Nothing full-size is kept per branch.

Backward: the merged output is one softmax over the union of the keys each query
sees, so each block's kernel backward, given the *merged* output and LSE, yields
the exact gradient of the whole function; the block gradients are added into
``dq, dk, dv`` in place. Only the inputs, the mask, the output and the LSE are
saved.

``head_groups`` uses the same path: its blocks never overlap, so each result is
written once, with the final ``1 / G`` applied in the same pass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

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


def _block_mask(block: Block, padding: Optional[torch.Tensor], dtype, is_causal: bool):
    """Additive key bias ``(B * nseg, 1, 1, rows)`` and the rows left with no key
    ``(B * nseg, 1, rows)`` (bool), or ``(None, None)`` without a padding mask."""
    if padding is None:
        return None, None
    pad = block.select(padding).flatten(0, 1)
    bias = torch.zeros(pad.shape, dtype=dtype, device=pad.device).masked_fill_(pad, -math.inf)
    valid = ~pad
    if is_causal:
        empty = valid.cumsum(-1) == 0
    else:
        empty = ~valid.any(-1, keepdim=True).expand_as(valid)
    return bias[:, None, None, :], empty[:, None, :]


def _buffer(shape, dtype, device, cfg: EngineConfig, fill: float) -> torch.Tensor:
    """Uninitialised buffer, with ``fill`` in the heads the fresh blocks may not cover."""
    buf = torch.empty(shape, dtype=dtype, device=device)
    for heads in cfg.unwritten_heads:
        buf[:, :, heads].fill_(fill)
    return buf


def _write(dst: torch.Tensor, src: torch.Tensor, fresh: bool, scale: float = 1.0) -> None:
    """``dst <- scale * src`` for a fresh block, else ``dst += src``, in place. (The
    scaling is a second pass over the block: ``torch.mul(..., out=dst)`` would fuse it,
    but ``torch.compile`` cannot trace a non-contiguous ``out=``.)"""
    if not fresh:
        dst.add_(src)
    else:
        dst.copy_(src)
        if scale != 1.0:
            dst.mul_(scale)


def _merge_into(out: torch.Tensor, lse: torch.Tensor, o: torch.Tensor, l: torch.Tensor) -> None:
    """In place: ``lse <- logaddexp(lse, l)``, ``out <- out * e^(lse_old - lse) + o * e^(l - lse)``.

    ``out`` ``(..., D)`` and ``lse`` ``(...)`` are views into the running buffers."""
    new = torch.logaddexp(lse, l)
    base = torch.where(torch.isneginf(new), torch.zeros_like(new), new)
    out.mul_((lse - base).exp_().unsqueeze(-1)).addcmul_(o, (l - base).exp_().unsqueeze(-1))
    lse.copy_(new)


def _accumulation_dtype(dtype: torch.dtype, cfg: EngineConfig) -> torch.dtype:
    """float32 for float16/bfloat16 results that are merged across branches; the
    input dtype where every cell is written once (``head_groups``) or it is >= 32 bits."""
    merges = any(not block.fresh for block in cfg.blocks)
    return torch.float32 if merges and dtype in (torch.float16, torch.bfloat16) else dtype


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def engine_forward(q, k, v, padding, cfg: EngineConfig, seed: int):
    """Output ``(B, N, H, D)`` in ``q.dtype`` and LSE ``(B, N, H)``; see module docstring."""
    batch, seq_len, heads, _ = q.shape
    out = _buffer(q.shape, _accumulation_dtype(q.dtype, cfg), q.device, cfg, 0.0)
    lse = _buffer((batch, seq_len, heads), _lse_dtype(q.dtype), q.device, cfg, -math.inf)
    for index, block in enumerate(_calls(cfg, batch, q.shape[-1])):
        qb, kb, vb = (_to_kernel(block.select(t)) for t in (q, k, v))
        bias, empty = _block_mask(block, padding, q.dtype, cfg.is_causal)
        o, l = cfg.kernel.forward(qb, kb, vb, bias, cfg.is_causal, cfg.scale, cfg.dropout_p, seed + index)
        if empty is not None:
            l = l.masked_fill(empty, -math.inf)
            o = o.masked_fill(empty.unsqueeze(-1), 0.0)
        o, l = _from_kernel(o, batch), _from_kernel(l, batch)
        out_view, lse_view = block.select(out), block.select(lse)
        if block.fresh:
            _write(out_view, o, True, cfg.out_scale)
            lse_view.copy_(l)
        else:
            _merge_into(out_view, lse_view, o, l)
    return out.to(q.dtype), lse


def engine_backward(grad_out, q, k, v, padding, out, lse, cfg: EngineConfig, seed: int):
    """``dq, dk, dv`` given ``grad_out``; ``out``/``lse`` as returned by :func:`engine_forward`.

    With ``out_scale = s`` (``head_groups``) the kernel must differentiate the
    unscaled output ``O = out / s`` for the gradient ``s * grad_out``; being linear
    in the gradient and in ``rowsum(grad * O)``, that equals ``s`` times its result
    for ``grad_out`` and ``O``, so only ``O`` is formed and ``s`` joins the copy."""
    batch = q.shape[0]
    acc = _accumulation_dtype(q.dtype, cfg)
    grads = [_buffer(t.shape, acc, t.device, cfg, 0.0) for t in (q, k, v)]
    # A row with no key at all has lse = -inf; +inf makes all its probabilities 0.
    lse = lse.masked_fill(torch.isneginf(lse), math.inf)
    for index, block in enumerate(_calls(cfg, batch, q.shape[-1])):
        qb, kb, vb, ob, gb = (_to_kernel(block.select(t)) for t in (q, k, v, out, grad_out))
        if cfg.out_scale != 1.0:
            ob = ob / cfg.out_scale
        lb = _to_kernel(block.select(lse))
        bias, _ = _block_mask(block, padding, q.dtype, cfg.is_causal)
        block_grads = cfg.kernel.backward(
            gb, qb, kb, vb, ob, lb, bias, cfg.is_causal, cfg.scale, cfg.dropout_p, seed + index
        )
        for grad, block_grad in zip(grads, block_grads):
            _write(block.select(grad), _from_kernel(block_grad, batch), block.fresh, cfg.out_scale)
    return tuple(g.to(t.dtype) for g, t in zip(grads, (q, k, v)))


class DilatedAttentionFunction(torch.autograd.Function):
    """Autograd wrapper of the engine: inputs ``q, k, v`` ``(B, N, H, D)`` and an
    optional bool ``padding`` ``(B, N)``; outputs ``out`` and a non-differentiable ``lse``."""

    @staticmethod
    def forward(ctx, q, k, v, padding, cfg: EngineConfig):
        seed = 0
        if cfg.dropout_p > 0:
            seed = int(torch.randint(0, 2**62, (1,)).item())
        out, lse = engine_forward(q, k, v, padding, cfg, seed)
        ctx.save_for_backward(q, k, v, padding, out, lse)
        ctx.cfg, ctx.seed = cfg, seed
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out, _grad_lse):
        q, k, v, padding, out, lse = ctx.saved_tensors
        dq, dk, dv = engine_backward(grad_out, q, k, v, padding, out, lse, ctx.cfg, ctx.seed)
        return dq, dk, dv, None, None
