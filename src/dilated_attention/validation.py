"""Checks of user input. Each failure names the argument and says how to fix it."""

from __future__ import annotations

import math
import numbers
import operator
import struct
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from .plan import MODES

# The dtypes the library computes in, by name (as the command line spells them).
FLOAT_DTYPES = {
    "float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16
}

# Tensor layouts the functional API accepts: ours, and PyTorch SDPA's.
LAYOUTS = {"bnhd": "(batch, seq_len, heads, head_dim)", "bhnd": "(batch, heads, seq_len, head_dim)"}


def type_name(value) -> str:
    """``int``, ``numpy.bool_``, ``torch.Tensor``: a type name a user recognises."""
    cls = type(value)
    module = cls.__module__.split(".")[0]
    return cls.__qualname__ if module == "builtins" else f"{module}.{cls.__qualname__}"


def check_branches(segment_lengths, dilation_rates) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Validate the ``(w_i, r_i)`` lists and return them as tuples of ints."""
    lists = {}
    for name, values in (("segment_lengths", segment_lengths), ("dilation_rates", dilation_rates)):
        if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
            raise TypeError(f"{name} must be a list or tuple of positive ints, got {type_name(values)}")
        if len(values) == 0:
            raise ValueError(f"{name} must not be empty: give at least one branch")
        for value in values:
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise TypeError(f"{name} must contain ints, got {value!r} ({type_name(value)})")
            if value < 1:
                raise ValueError(f"{name} must contain values >= 1, got {value}")
        lists[name] = tuple(int(value) for value in values)
    if len(lists["segment_lengths"]) != len(lists["dilation_rates"]):
        raise ValueError(
            f"segment_lengths ({len(segment_lengths)} values) and dilation_rates "
            f"({len(dilation_rates)} values) must have the same length: one (w, r) pair per branch"
        )
    return lists["segment_lengths"], lists["dilation_rates"]


def check_mode(mode) -> str:
    if not isinstance(mode, str) or mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    return mode


def check_layout(layout) -> str:
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(
            f"layout must be 'bnhd' for {LAYOUTS['bnhd']} or 'bhnd' for {LAYOUTS['bhnd']} "
            f"(the layout of torch.nn.functional.scaled_dot_product_attention), got {layout!r}"
        )
    return layout


def check_dropout(dropout_p, name: str = "dropout_p") -> float:
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"{name} must be a float in [0, 1), got {type_name(dropout_p)}")
    if not 0.0 <= float(dropout_p) < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {dropout_p}")
    return float(dropout_p)


def check_scale(softmax_scale, head_dim: int) -> float:
    if softmax_scale is None:
        return head_dim**-0.5
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        raise TypeError(f"softmax_scale must be a float or None, got {type_name(softmax_scale)}")
    try:
        scale = float(softmax_scale)
    except OverflowError:
        scale = math.inf
    if not math.isfinite(scale):
        raise ValueError(f"softmax_scale must be finite, got {softmax_scale}")
    return scale


def kernel_scale(scale: float, dtype: torch.dtype) -> float:
    """``scale`` as the kernels use it for inputs of ``dtype``: they compute scores of
    float32, float16 and bfloat16 inputs in float32, so it is rounded to float32
    (a tiny scale becomes 0, which the kernels must know); one too large for float32
    is refused."""
    if dtype == torch.float64:
        return scale
    try:
        rounded = struct.unpack("f", struct.pack("f", scale))[0]
    except OverflowError:
        rounded = math.inf
    if math.isinf(rounded):
        raise ValueError(
            f"softmax_scale={scale} does not fit float32, in which the scores of {dtype} inputs "
            "are computed: use a smaller scale (fold the rest into q) or float64 inputs"
        )
    return rounded


def check_flag(value, name: str) -> bool:
    """A Python or NumPy bool."""
    if isinstance(value, bool):
        return value
    if type_name(value) == "numpy.bool_" or type_name(value) == "numpy.bool":
        return bool(value)
    raise TypeError(f"{name} must be a bool, got {value!r} ({type_name(value)})")


def check_qkv(q, k, v, layout: str = "bnhd") -> None:
    """``q, k, v``: tensors of one shape, dtype and device, 4-D in ``layout``."""
    dims = LAYOUTS[layout]
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type_name(t)}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have 4 dims {dims} (layout={layout!r}), got shape {tuple(t.shape)}")
        if t.layout != torch.strided:
            raise ValueError(f"{name} must be a dense tensor, got layout {t.layout}: use {name}.to_dense()")
        if t.dtype not in FLOAT_DTYPES.values():
            raise ValueError(f"{name} must be float64, float32, bfloat16 or float16, got {t.dtype}")
        if min(int(size) for size in t.shape) < 1:
            raise ValueError(f"{name} must have every dim >= 1, got shape {tuple(t.shape)} {dims}")
    for name, t in (("k", k), ("v", v)):
        if t.shape != q.shape:
            raise ValueError(
                f"{name} must have the shape of q {tuple(q.shape)}, got {tuple(t.shape)} {dims}: "
                "dilated attention is self-attention over one sequence"
            )
        if t.dtype != q.dtype:
            raise ValueError(f"{name} must have the dtype of q ({q.dtype}), got {t.dtype}: cast it")
        if t.device != q.device:
            raise ValueError(f"{name} must be on the device of q ({q.device}), got {t.device}: move it")


def check_padding_mask(mask, batch: int, seq_len: int, device) -> Optional[torch.Tensor]:
    """``key_padding_mask``: ``None`` or a bool ``(B, N)`` tensor, ``True`` = padding."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"key_padding_mask must be a torch.Tensor or None, got {type_name(mask)}")
    if mask.dtype != torch.bool:
        raise ValueError(
            f"key_padding_mask must be a bool tensor (True = padding), got {mask.dtype}: "
            "use mask.bool() or mask == 0 as appropriate"
        )
    if tuple(mask.shape) != (batch, seq_len):
        raise ValueError(
            f"key_padding_mask must have shape (batch, seq_len) = {(batch, seq_len)}, got {tuple(mask.shape)}"
        )
    if mask.device != device:
        raise ValueError(f"key_padding_mask must be on the device of q ({device}), got {mask.device}")
    return mask


def check_head_groups(num_heads: int, num_branches: int) -> None:
    if num_heads < num_branches:
        raise ValueError(
            f"mode='head_groups' needs at least one head per branch: {num_heads} heads < "
            f"{num_branches} branches; use more heads, fewer branches, or mode='mixture'"
        )


@dataclass(frozen=True)
class Attention:
    """A validated call. ``q, k, v`` ``(B, N, H, D)``, ``padding`` ``(B, N)`` bool or ``None``."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    padding: Optional[torch.Tensor]
    segment_lengths: tuple[int, ...]
    dilation_rates: tuple[int, ...]
    mode: str
    is_causal: bool
    scale: float

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """``(B, N, H, D)`` as Python ints. (``operator.index`` also makes
        ``torch.compile`` specialise on them: the plan depends on every size.)"""
        return tuple(operator.index(size) for size in self.q.shape)


def check_attention(
    q, k, v, segment_lengths, dilation_rates, mode, is_causal, softmax_scale, key_padding_mask, layout="bnhd"
) -> Attention:
    """Validate what the library and the reference share; ``q, k, v`` come back as
    ``(B, N, H, D)`` views whatever ``layout`` they arrived in."""
    layout = check_layout(layout)
    check_qkv(q, k, v, layout)
    if layout == "bhnd":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    segment_lengths, dilation_rates = check_branches(segment_lengths, dilation_rates)
    mode = check_mode(mode)
    batch, seq_len, num_heads, head_dim = (operator.index(size) for size in q.shape)
    if mode == "head_groups":
        check_head_groups(num_heads, len(segment_lengths))
    return Attention(
        q,
        k,
        v,
        check_padding_mask(key_padding_mask, batch, seq_len, q.device),
        segment_lengths,
        dilation_rates,
        mode,
        check_flag(is_causal, "is_causal"),
        check_scale(softmax_scale, head_dim),
    )
