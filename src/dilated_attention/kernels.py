"""Attention kernels with an external log-sum-exp: the building block of the engine.

Every kernel computes, for tensors in kernel layout ``(batch, heads, L, D)``,

    forward(q, k, v)  -> out (batch, heads, L, D), lse (batch, heads, L)
    backward(dout, q, k, v, out, lse) -> dq, dk, dv

where ``lse`` is the natural-log softmax denominator (scale applied) and the
backward uses the ``out``/``lse`` it is given, not its own. Given the *merged*
output and LSE of all branches, each branch's backward is the exact gradient of
the merged softmax, which is how the engine differentiates the mixture.

Masks: ``bias`` is ``None`` or an additive ``(batch, 1, 1, L)`` tensor (``0`` or
``-inf``, the key padding mask) in the inputs' dtype; ``is_causal`` is the square,
top-left-aligned causal mask. Rows whose keys are all masked are the caller's to
mark: the fused kernels report ``lse = 0`` for them, and the backward expects
``lse = +inf`` there (which makes every probability of the row 0).

Three kernels share this interface:

- ``cpu_flash``: PyTorch's fused CPU flash-attention ops (any float dtype).
- ``cuda_efficient``: PyTorch's fused CUDA memory-efficient ops (fp32, fp16, bf16).
- ``math``: explicit matmul + softmax in fp32/fp64, any device. It is used where
  the fused ops cannot do the job: ``dropout_p > 0`` (the CPU flash op has no
  dropout, and a dropout mask must be regenerated exactly in backward: here it is
  drawn from a generator seeded per call), and float64 on CUDA. It materialises the
  ``(L, L)`` score matrix of each segment, so it is slower and uses more memory.
"""

from __future__ import annotations

import math

import torch

_aten = torch.ops.aten


def _dropout_scale(shape, dropout_p: float, seed: int, device, dtype) -> torch.Tensor:
    """Keep-mask divided by ``1 - p``, drawn from a generator seeded with ``seed``."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    keep = torch.rand(shape, generator=gen, device=device, dtype=dtype) >= dropout_p
    return keep.to(dtype) / (1.0 - dropout_p)


class MathKernel:
    """Explicit softmax attention; supports dropout and every device and dtype."""

    name = "math"

    @staticmethod
    def _scores(q, k, bias, is_causal, scale):
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        s = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) * scale
        if bias is not None:
            s = s + bias.to(acc)
        if is_causal:
            n = s.shape[-1]
            upper = torch.ones(n, n, dtype=torch.bool, device=s.device).triu_(1)
            s = s.masked_fill(upper, -math.inf)
        return s

    @staticmethod
    def forward(q, k, v, bias, is_causal, scale, dropout_p=0.0, seed=0):
        s = MathKernel._scores(q, k, bias, is_causal, scale)
        lse = torch.logsumexp(s, dim=-1)
        finite_lse = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
        p = torch.exp(s - finite_lse.unsqueeze(-1))
        if dropout_p > 0:
            p = p * _dropout_scale(p.shape, dropout_p, seed, p.device, p.dtype)
        out = torch.matmul(p, v.to(p.dtype))
        return out.to(q.dtype), lse

    @staticmethod
    def backward(dout, q, k, v, out, lse, bias, is_causal, scale, dropout_p=0.0, seed=0):
        s = MathKernel._scores(q, k, bias, is_causal, scale)
        acc = s.dtype
        p = torch.exp(s - lse.to(acc).unsqueeze(-1))
        dout = dout.to(acc)
        dp = torch.matmul(dout, v.to(acc).transpose(-1, -2))
        p_used = p
        if dropout_p > 0:
            z = _dropout_scale(p.shape, dropout_p, seed, p.device, acc)
            p_used = p * z
            dp = dp * z
        dv = torch.matmul(p_used.transpose(-1, -2), dout)
        delta = (dout * out.to(acc)).sum(-1, keepdim=True)
        ds = p * (dp - delta)
        dq = torch.matmul(ds, k.to(acc)) * scale
        dk = torch.matmul(ds.transpose(-1, -2), q.to(acc)) * scale
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class CpuFlashKernel:
    """PyTorch's fused CPU flash attention (no dropout)."""

    name = "cpu_flash"

    @staticmethod
    def forward(q, k, v, bias, is_causal, scale, dropout_p=0.0, seed=0):
        return _aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, is_causal, attn_mask=bias, scale=scale
        )

    @staticmethod
    def backward(dout, q, k, v, out, lse, bias, is_causal, scale, dropout_p=0.0, seed=0):
        return _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, is_causal, attn_mask=bias, scale=scale
        )


def _cuda_bias(bias, heads, q_len, k_len):
    """Expand a ``(batch, 1, 1, Lk)`` bias to ``(batch, heads, Lq, Lk)`` with the row
    start aligned to 16 elements, as the memory-efficient kernel requires."""
    if bias is None:
        return None
    padded = -(-k_len // 16) * 16
    storage = bias.new_zeros(bias.shape[0], 1, 1, padded)
    storage[..., :k_len] = bias
    return storage[..., :k_len].expand(bias.shape[0], heads, q_len, k_len)


def _pad_head_dim(*tensors):
    """Zero-pad the last dim to a multiple of 8, the alignment of the fused CUDA
    kernels; zeros change neither ``q @ k^T`` nor the kept columns of the output."""
    dim = tensors[0].shape[-1]
    pad = -dim % 8
    return [torch.nn.functional.pad(t, (0, pad)) if pad else t for t in tensors]


def _cuda_lse_width(length: int) -> int:
    """Width of the LSE the CUDA memory-efficient kernel works with."""
    return length if torch.version.hip else -(-length // 32) * 32


class CudaEfficientKernel:
    """PyTorch's fused CUDA memory-efficient attention (no dropout). The scale is
    always passed explicitly, so padding the head dim does not change it."""

    name = "cuda_efficient"

    @staticmethod
    def forward(q, k, v, bias, is_causal, scale, dropout_p=0.0, seed=0):
        dim, length = q.shape[-1], q.shape[2]
        qp, kp, vp = _pad_head_dim(q, k, v)
        out, lse, _, _ = _aten._scaled_dot_product_efficient_attention(
            qp, kp, vp, _cuda_bias(bias, q.shape[1], length, k.shape[2]), True, 0.0, is_causal, scale=scale
        )
        return out[..., :dim], lse[..., :length]

    @staticmethod
    def backward(dout, q, k, v, out, lse, bias, is_causal, scale, dropout_p=0.0, seed=0):
        dim, length = q.shape[-1], q.shape[2]
        lse_padded = lse.new_full((*lse.shape[:-1], _cuda_lse_width(length)), math.inf, dtype=torch.float32)
        lse_padded[..., :length] = lse
        no_rng = torch.empty((), dtype=torch.int64)
        dq, dk, dv, _ = _aten._scaled_dot_product_efficient_attention_backward(
            *_pad_head_dim(dout, q, k, v), _cuda_bias(bias, q.shape[1], length, k.shape[2]), *_pad_head_dim(out),
            lse_padded, no_rng, no_rng, 0.0, [True, True, True, False], is_causal, scale=scale,
        )
        return dq[..., :dim], dk[..., :dim], dv[..., :dim]


def select_kernel(device: torch.device, dtype: torch.dtype, dropout_p: float):
    """The fused kernel for this device and dtype, or ``MathKernel`` where none applies
    (dropout, float64 on CUDA, other devices)."""
    if dropout_p > 0:
        return MathKernel
    if device.type == "cpu":
        return CpuFlashKernel
    if device.type == "cuda" and dtype in (torch.float16, torch.bfloat16, torch.float32):
        return CudaEfficientKernel
    return MathKernel
