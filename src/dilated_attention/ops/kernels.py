"""Attention kernels with an external log-sum-exp: the building block of the engine.

Every kernel computes, for tensors in kernel layout ``(batch, heads, L, D)``,

    forward(q, k, v, bias, is_causal, scale, dropout)  -> out (batch, heads, Lq, D), lse (batch, heads, Lq)
    backward(dout, q, k, v, out, lse, bias, is_causal, scale, dropout) -> dq, dk, dv
    supports(device, dtype, dropout) -> bool


where ``lse`` is the natural-log softmax denominator (scale applied) and the
backward uses the ``out``/``lse`` it is given, not its own. Given the *merged*
output and LSE of all branches, each branch's backward is the exact gradient of
the merged softmax, which is how the engine differentiates the mixture. The
backward reads ``out`` only through ``rowsum(dout * out)``.

Masks: ``bias`` is ``None`` or an additive ``(batch, 1, 1, Lk)`` tensor (``0`` or
``-inf``, the key padding mask) in the inputs' dtype; ``is_causal`` is the square,
top-left-aligned causal mask (``Lq == Lk``). Rows whose keys are all masked are
the caller's to mark: the fused kernels report ``lse = 0`` for them, and the
backward expects ``lse = +inf`` there (which makes every probability of the row 0).
``dropout`` is ``None`` or a :class:`dilated_attention.ops.dropout.DropoutMask`.

Grouped-query attention: ``k, v`` may have fewer heads ``h_k`` than ``q`` (``h_k``
divides ``h``); query head ``i`` then attends with key head ``i // (h / h_k)``, and
``dk, dv`` come back with ``h_k`` heads. The CPU flash ops do this themselves; for
the others each key head is repeated for its query heads within the call (a copy
of the call's keys only) and the key gradients are summed back.

Four kernels share this interface:

- ``CpuFlashKernel``: PyTorch's fused CPU flash-attention ops (any float dtype).
- ``CudaFlashKernel``: PyTorch's fused CUDA FlashAttention ops (fp16, bf16), for
  blocks without a bias; the others go to
- ``CudaEfficientKernel``: PyTorch's fused CUDA memory-efficient ops (fp32, fp16, bf16).
- ``MathKernel``: explicit matmul + softmax in fp32/fp64, any device. It serves
  what the fused ops cannot: dropout (neither fused op takes an external mask that
  backward can regenerate) and float64 on CUDA. It forms the score matrix in
  chunks of query rows of at most :data:`MATH_CHUNK_ELEMENTS` scores, so its
  temporaries stay bounded however long a segment is.
"""

from __future__ import annotations

import math
from typing import Protocol, TypeVar

import torch

from .dropout import DropoutMask
from .intmath import round_up

_aten = torch.ops.aten

# Scores the unfused kernel forms at once (query rows x keys x batch x heads).
MATH_CHUNK_ELEMENTS = 2**22


def accumulator(dtype: torch.dtype) -> torch.dtype:
    """float64 for float64, else float32: the dtype results are accumulated and LSEs
    reported in, for inputs of ``dtype``."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class Kernel(Protocol):
    """What the engine calls on a kernel: the static methods of its class."""

    @staticmethod
    def supports(device: torch.device, dtype: torch.dtype, dropout: bool) -> bool: ...

    @staticmethod
    def forward(q, k, v, bias, is_causal, scale, dropout=None) -> tuple[torch.Tensor, torch.Tensor]: ...

    @staticmethod
    def backward(
        dout, q, k, v, out, lse, bias, is_causal, scale, dropout=None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


_K = TypeVar("_K", bound=type[Kernel])


def _repeating_key_heads(kernel: _K) -> _K:
    """``kernel``, made (in place) to take ``k, v`` with fewer heads than ``q``: each key
    head is repeated for the query heads that share it, and its gradients are summed back."""
    forward, backward = kernel.forward, kernel.backward

    def forward_shared(q, k, v, *args, **kwargs):
        share = q.shape[1] // k.shape[1]
        if share > 1:
            k, v = (t.repeat_interleave(share, dim=1) for t in (k, v))
        return forward(q, k, v, *args, **kwargs)

    def backward_shared(dout, q, k, v, *args, **kwargs):
        share = q.shape[1] // k.shape[1]
        if share == 1:
            return backward(dout, q, k, v, *args, **kwargs)
        dq, dk, dv = backward(dout, q, *(t.repeat_interleave(share, dim=1) for t in (k, v)), *args, **kwargs)
        return (dq, *(g.unflatten(1, (-1, share)).sum(2, dtype=accumulator(g.dtype)).to(g.dtype) for g in (dk, dv)))

    # The decorator's purpose: the class's static methods are replaced by the wrappers.
    kernel.forward, kernel.backward = staticmethod(forward_shared), staticmethod(backward_shared)  # type: ignore[method-assign]
    return kernel


def _query_chunks(q: torch.Tensor, k: torch.Tensor) -> list[slice]:
    """Consecutive query rows whose scores against all keys fit :data:`MATH_CHUNK_ELEMENTS`."""
    length = q.shape[2]
    step = max(1, MATH_CHUNK_ELEMENTS // max(1, q.shape[0] * q.shape[1] * k.shape[2]))
    return [slice(start, min(start + step, length)) for start in range(0, length, step)]


@_repeating_key_heads
class MathKernel:
    """Explicit softmax attention; supports dropout and every device and dtype."""

    @staticmethod
    def supports(device: torch.device, dtype: torch.dtype, dropout: bool) -> bool:
        return True

    @staticmethod
    def _scores(q, k, bias, is_causal, scale, rows: slice):
        """Scores of query ``rows`` against the keys they may see, and those keys' slice.
        With ``is_causal`` the keys after the chunk's last row are left out."""
        keys = slice(0, min(rows.stop, k.shape[2]) if is_causal else k.shape[2])
        acc = accumulator(q.dtype)
        s = torch.matmul(q[:, :, rows].to(acc), k[:, :, keys].to(acc).transpose(-1, -2)) * scale
        if bias is not None:
            s = s + bias[..., keys].to(acc)
        if is_causal:
            query = torch.arange(rows.start, rows.stop, device=s.device)[:, None]
            key = torch.arange(keys.stop, device=s.device)[None, :]
            s = s.masked_fill(key > query, -math.inf)
        return s, keys

    @staticmethod
    def forward(q, k, v, bias, is_causal, scale, dropout: DropoutMask | None = None):
        acc = accumulator(q.dtype)
        out = q.new_empty((*q.shape[:-1], v.shape[-1]), dtype=acc)
        lse = q.new_empty(q.shape[:-1], dtype=acc)
        for rows in _query_chunks(q, k):
            s, keys = MathKernel._scores(q, k, bias, is_causal, scale, rows)
            lse[:, :, rows] = torch.logsumexp(s, dim=-1)
            finite = lse[:, :, rows].masked_fill(torch.isneginf(lse[:, :, rows]), 0.0)
            p = torch.exp(s - finite.unsqueeze(-1))
            if dropout is not None:
                p = p * dropout.multiplier(rows, keys, acc)
            out[:, :, rows] = torch.matmul(p, v[:, :, keys].to(acc))
        return out.to(q.dtype), lse

    @staticmethod
    def backward(dout, q, k, v, out, lse, bias, is_causal, scale, dropout: DropoutMask | None = None):
        acc = accumulator(q.dtype)
        dq = torch.empty(q.shape, dtype=acc, device=q.device)
        dk = torch.zeros(k.shape, dtype=acc, device=k.device)
        dv = torch.zeros(v.shape, dtype=acc, device=v.device)
        for rows in _query_chunks(q, k):
            s, keys = MathKernel._scores(q, k, bias, is_causal, scale, rows)
            p = torch.exp(s - lse[:, :, rows].to(acc).unsqueeze(-1))
            grad = dout[:, :, rows].to(acc)
            dp = torch.matmul(grad, v[:, :, keys].to(acc).transpose(-1, -2))
            kept = p
            if dropout is not None:
                z = dropout.multiplier(rows, keys, acc)
                kept, dp = p * z, dp * z
            dv[:, :, keys] += torch.matmul(kept.transpose(-1, -2), grad)
            delta = (grad * out[:, :, rows].to(acc)).sum(-1, keepdim=True)
            ds = p * (dp - delta) * scale
            dq[:, :, rows] = torch.matmul(ds, k[:, :, keys].to(acc))
            dk[:, :, keys] += torch.matmul(ds.transpose(-1, -2), q[:, :, rows].to(acc))
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _positive_scale(q: torch.Tensor, scale: float, is_causal: bool):
    """``(q', scale', sign)`` with ``scale' > 0`` and ``q' * scale' = q * scale``.

    The fused kernels scale scores after applying their causal mask, so a scale
    ``<= 0`` would turn masked scores into NaN: a negative scale moves its sign into
    ``q``, and a zero scale becomes ``q' = 0`` with scale 1. ``dq = sign * dq'``."""
    if not is_causal or scale > 0:
        return q, scale, 1.0
    if scale < 0:
        return -q, -scale, -1.0
    return torch.zeros_like(q), 1.0, 0.0


def _refuse_dropout(kernel: type, dropout) -> None:
    if dropout is not None:
        raise ValueError(f"{kernel.__name__} has no dropout: use MathKernel (select_kernel picks it)")


# Query rows of the CPU flash kernel's blocks for long queries (PyTorch's
# ``q_split_size`` from 768 rows up): every block reads all of ``k, v`` again.
CPU_QUERY_BLOCK = 256


def _packed_inputs(q, k, v):
    """``q, k, v`` as contiguous copies (a copy only where one is a strided view:
    dilated rows, or the ``(B, L, H, D)`` layout's rows ``H * D`` elements apart) when
    the queries span more than one of the CPU flash kernel's query blocks, which read
    every key and value again: the op ran 3 to 17% slower on such views than on
    contiguous copies on an Intel Xeon VM, 1 to 4% on an AMD EPYC VM (2 threads,
    float32, 2048-row segments; ``benchmarks/cpu_costs.py``). Short queries (decode
    steps) read the keys once: all three stay views."""
    if q.shape[2] <= CPU_QUERY_BLOCK:
        return q, k, v
    return q.contiguous(), k.contiguous(), v.contiguous()


class CpuFlashKernel:
    """PyTorch's fused CPU flash attention (no dropout). The strided inputs of long
    queries, whose keys and values it reads block after block, are packed first
    (:func:`_packed_inputs`)."""

    @staticmethod
    def supports(device: torch.device, dtype: torch.dtype, dropout: bool) -> bool:
        return device.type == "cpu" and not dropout

    @staticmethod
    def forward(q, k, v, bias, is_causal, scale, dropout=None):
        _refuse_dropout(CpuFlashKernel, dropout)
        q, scale, _ = _positive_scale(q, scale, is_causal)
        q, k, v = _packed_inputs(q, k, v)
        return _aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, attn_mask=bias, scale=scale)

    @staticmethod
    def backward(dout, q, k, v, out, lse, bias, is_causal, scale, dropout=None):
        _refuse_dropout(CpuFlashKernel, dropout)
        q, scale, sign = _positive_scale(q, scale, is_causal)
        q, k, v = _packed_inputs(q, k, v)
        dq, dk, dv = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, is_causal, attn_mask=bias, scale=scale
        )
        return (dq if sign == 1.0 else dq * sign), dk, dv


# Alignments of PyTorch's fused CUDA memory-efficient kernels, in elements.
CUDA_HEAD_DIM_ALIGNMENT = 8  # of the head dim
CUDA_BIAS_ALIGNMENT = 16  # of a bias row's start
CUDA_LSE_ALIGNMENT = 32  # of the LSE width its backward expects (CUDA, not ROCm)
CUDA_ADDRESS_ALIGNMENT = 16  # bytes: of an operand's start and of each of its strides


def _cuda_bias(bias, heads, q_len, k_len):
    """Expand a ``(batch, 1, 1, Lk)`` bias to ``(batch, heads, Lq, Lk)`` with the row
    start aligned as the memory-efficient kernel requires."""
    if bias is None:
        return None
    storage = bias.new_zeros(bias.shape[0], 1, 1, round_up(k_len, CUDA_BIAS_ALIGNMENT))
    storage[..., :k_len] = bias
    return storage[..., :k_len].expand(bias.shape[0], heads, q_len, k_len)


def _pad_head_dim(*tensors, output_layout: bool = False):
    """Zero-pad the last dim to the fused CUDA kernels' alignment (zeros change
    neither ``q @ k^T`` nor the kept columns of the output); padded tensors come back
    contiguous, others as they are. ``output_layout``: every tensor in the memory
    layout of the op's own outputs, ``(batch, L, heads, D)`` contiguous viewed as
    ``(batch, heads, L, D)``, which the backward needs (measured on an H100, torch
    2.11: its float16/bfloat16 ``dq, dk`` were wrong, up to inf, for padded
    ``(batch, heads, L, D)``-contiguous operands and for strided rows)."""
    dim = tensors[0].shape[-1]
    pad = round_up(dim, CUDA_HEAD_DIM_ALIGNMENT) - dim
    if output_layout:
        padded = [torch.nn.functional.pad(t, (0, pad)).transpose(1, 2).contiguous().transpose(1, 2) for t in tensors]
    else:
        padded = [torch.nn.functional.pad(t, (0, pad)).contiguous() if pad else t for t in tensors]
    return [_aligned(t) for t in padded]


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its start and every stride a multiple of 16 bytes, as PyTorch's fused
    CUDA kernels need on compute capability 8.0 and up (they have no unaligned
    variant there: "no kernel found to launch"). A dim of size 1 may carry any stride
    (one head of a ``(batch, L, heads, D)`` tensor seen as ``(batch, heads, L, D)``
    carries 1): restated, no copy; a misaligned start or stride takes a copy."""
    unit = CUDA_ADDRESS_ALIGNMENT // t.element_size()
    t = _restride_unit_dims(t, unit)
    if t.data_ptr() % CUDA_ADDRESS_ALIGNMENT or t.stride(-1) != 1 or any(s % unit for s in t.stride()[:-1]):
        t = _restride_unit_dims(t.clone(memory_format=torch.contiguous_format), unit)
    return t


def _restride_unit_dims(t: torch.Tensor, unit: int) -> torch.Tensor:
    """``t`` with each dim of size 1 given a stride that is a multiple of ``unit`` (1 for
    the last dim): the same elements, no copy."""
    extent = max((size * stride for size, stride in zip(t.shape, t.stride(), strict=True) if size > 1), default=1)
    strides = [stride if size > 1 else round_up(extent, unit) for size, stride in zip(t.shape, t.stride(), strict=True)]
    if t.shape[-1] == 1:
        strides[-1] = 1
    return t if strides == list(t.stride()) else t.as_strided(t.shape, strides, t.storage_offset())


def _cuda_lse_width(length: int) -> int:
    """Width of the LSE the CUDA memory-efficient kernel works with."""
    return length if torch.version.hip else round_up(length, CUDA_LSE_ALIGNMENT)


@_repeating_key_heads
class CudaEfficientKernel:
    """PyTorch's fused CUDA memory-efficient attention (no dropout). The scale is
    always passed explicitly, so padding the head dim does not change it."""

    @staticmethod
    def supports(device: torch.device, dtype: torch.dtype, dropout: bool) -> bool:
        return device.type == "cuda" and dtype in (torch.float16, torch.bfloat16, torch.float32) and not dropout

    @staticmethod
    def forward(q, k, v, bias, is_causal, scale, dropout=None):
        _refuse_dropout(CudaEfficientKernel, dropout)
        dim, length = q.shape[-1], q.shape[2]
        q, scale, _ = _positive_scale(q, scale, is_causal)
        qp, kp, vp = _pad_head_dim(q, k, v)
        out, lse, _, _ = _aten._scaled_dot_product_efficient_attention(
            qp, kp, vp, _cuda_bias(bias, q.shape[1], length, k.shape[2]), True, 0.0, is_causal, scale=scale
        )
        return out[..., :dim], lse[..., :length]

    @staticmethod
    def backward(dout, q, k, v, out, lse, bias, is_causal, scale, dropout=None):
        _refuse_dropout(CudaEfficientKernel, dropout)
        dim, length = q.shape[-1], q.shape[2]
        q, scale, sign = _positive_scale(q, scale, is_causal)
        lse_padded = lse.new_full((*lse.shape[:-1], _cuda_lse_width(length)), math.inf, dtype=torch.float32)
        lse_padded[..., :length] = lse
        no_rng = torch.empty((), dtype=torch.int64)
        dq, dk, dv, _ = _aten._scaled_dot_product_efficient_attention_backward(
            *_pad_head_dim(dout, q, k, v, output_layout=True),
            _cuda_bias(bias, q.shape[1], length, k.shape[2]),
            *_pad_head_dim(out, output_layout=True),
            lse_padded,
            no_rng,
            no_rng,
            0.0,
            [True, True, True, False],
            is_causal,
            scale=scale,
        )
        dq = dq[..., :dim]
        return (dq if sign == 1.0 else dq * sign), dk[..., :dim], dv[..., :dim]


# The largest head dim PyTorch's CUDA FlashAttention op takes.
CUDA_FLASH_MAX_HEAD_DIM = 256


@_repeating_key_heads
class CudaFlashKernel:
    """PyTorch's fused CUDA FlashAttention (float16, bfloat16; compute capability 8.0
    and up), the fastest of PyTorch's kernels, for blocks without a key padding bias
    and head dims up to 256; other blocks go to :class:`CudaEfficientKernel`. Its
    backward takes the merged ``out`` and ``lse`` like the others (no dropout: the
    forward's random state is not kept)."""

    @staticmethod
    def supports(device: torch.device, dtype: torch.dtype, dropout: bool) -> bool:
        return (
            device.type == "cuda"
            and dtype in (torch.float16, torch.bfloat16)
            and not dropout
            and torch.cuda.is_available()
            and torch.cuda.get_device_capability(device) >= (8, 0)
        )

    @staticmethod
    def _takes(q, bias) -> bool:
        return bias is None and q.shape[-1] <= CUDA_FLASH_MAX_HEAD_DIM

    @staticmethod
    def forward(q, k, v, bias, is_causal, scale, dropout=None):
        _refuse_dropout(CudaFlashKernel, dropout)
        if not CudaFlashKernel._takes(q, bias):
            return CudaEfficientKernel.forward(q, k, v, bias, is_causal, scale)
        dim = q.shape[-1]
        q, scale, _ = _positive_scale(q, scale, is_causal)
        out, lse, *_ = _aten._scaled_dot_product_flash_attention(
            *_pad_head_dim(q, k, v), 0.0, is_causal, False, scale=scale
        )
        return out[..., :dim], lse

    @staticmethod
    def backward(dout, q, k, v, out, lse, bias, is_causal, scale, dropout=None):
        _refuse_dropout(CudaFlashKernel, dropout)
        if not CudaFlashKernel._takes(q, bias):
            return CudaEfficientKernel.backward(dout, q, k, v, out, lse, bias, is_causal, scale)
        dim = q.shape[-1]
        q, scale, sign = _positive_scale(q, scale, is_causal)
        unused = torch.empty(0, dtype=torch.int64, device=q.device)  # the random state: no dropout
        dq, dk, dv = _aten._scaled_dot_product_flash_attention_backward(
            *_pad_head_dim(dout, q, k, v, out),
            lse.float().contiguous(),
            None,
            None,
            q.shape[2],
            k.shape[2],
            0.0,
            is_causal,
            unused,
            unused,
            scale=scale,
        )
        dq = dq[..., :dim]
        return (dq if sign == 1.0 else dq * sign), dk[..., :dim], dv[..., :dim]


if torch.__version__ < "2.5":  # the CPU flash ops broadcast key heads from PyTorch 2.5 on
    _repeating_key_heads(CpuFlashKernel)  # in place

KERNELS: tuple[type[Kernel], ...] = (CpuFlashKernel, CudaFlashKernel, CudaEfficientKernel, MathKernel)


def select_kernel(device: torch.device, dtype: torch.dtype, dropout_p: float) -> type[Kernel]:
    """The first of :data:`KERNELS` that supports this device, dtype and dropout: the
    fused kernel where one applies, else ``MathKernel`` (dropout, float64 on CUDA,
    other devices)."""
    return next(kernel for kernel in KERNELS if kernel.supports(device, dtype, dropout_p > 0))
