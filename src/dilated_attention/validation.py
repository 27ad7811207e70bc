"""Checks of user input. Each failure names the argument and says how to fix it."""

from __future__ import annotations

import math
import numbers
from typing import Optional, Sequence

import torch

from .plan import MODES

_FLOAT_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


def check_branches(segment_lengths, dilation_rates) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Validate the ``(w_i, r_i)`` lists and return them as tuples of ints."""
    lists = {}
    for name, values in (("segment_lengths", segment_lengths), ("dilation_rates", dilation_rates)):
        if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
            raise TypeError(f"{name} must be a list or tuple of positive ints, got {type(values).__name__}")
        if len(values) == 0:
            raise ValueError(f"{name} must not be empty: give at least one branch")
        for value in values:
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise TypeError(f"{name} must contain ints, got {value!r} ({type(value).__name__})")
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
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    return mode


def check_dropout(dropout_p, name: str = "dropout_p") -> float:
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"{name} must be a float in [0, 1), got {type(dropout_p).__name__}")
    if not 0.0 <= float(dropout_p) < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {dropout_p}")
    return float(dropout_p)


def check_scale(softmax_scale, head_dim: int) -> float:
    if softmax_scale is None:
        return head_dim**-0.5
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        raise TypeError(f"softmax_scale must be a float or None, got {type(softmax_scale).__name__}")
    if not math.isfinite(float(softmax_scale)):
        raise ValueError(f"softmax_scale must be finite, got {softmax_scale}")
    return float(softmax_scale)


def check_qkv(q, k, v) -> None:
    """``q, k, v``: tensors of one shape ``(B, N, H, D)``, dtype and device."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(
                f"{name} must have 4 dims (batch, seq_len, heads, head_dim), got shape {tuple(t.shape)}"
            )
        if t.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"{name} must be float64, float32, bfloat16 or float16, got {t.dtype}")
        if min(t.shape) < 1:
            raise ValueError(f"{name} must have every dim >= 1, got shape {tuple(t.shape)}")
    for name, t in (("k", k), ("v", v)):
        if t.shape != q.shape:
            raise ValueError(
                f"{name} must have the shape of q {tuple(q.shape)}, got {tuple(t.shape)}: "
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
        raise TypeError(f"key_padding_mask must be a torch.Tensor or None, got {type(mask).__name__}")
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


def check_flag(value, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value
