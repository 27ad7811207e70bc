"""Layouts the kernels take: inputs passed as they are where PyTorch's fused attention
reads them right, copied where it would not."""

from __future__ import annotations

import torch


def contiguous_last_dim(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself if its last dim is unit-stride (the fused kernels assume it) and no
    two of its elements share memory through dims of nonzero stride, else a contiguous
    copy. Other strides, 0 included (an expanded tensor), are passed through as they
    are. Overlapping dims are copied because PyTorch's CPU flash op reads outside such a
    tensor (heads ``D`` elements long but one element apart, as ``unfold`` makes them:
    wrong outputs, torch 2.13); beside an expanded dim, dims of size 1 are given new
    strides by views (no copy; ``as_strided`` would blur the gradient of an expanded
    input), as the op misreads a query expanded over the sequence whose single head has
    stride 1."""
    if x.is_contiguous():
        return x
    strides, shape = x.stride(), x.shape
    if 0 in strides:
        for dim in range(x.dim() - 2, -1, -1):
            if shape[dim] == 1:
                x = x.squeeze(dim).unsqueeze(dim)  # the stride of the dims after it, as a contiguous tensor's
        strides = x.stride()
    if (strides[-1] != 1 and shape[-1] != 1) or _overlaps(strides, shape):
        return x.contiguous()
    return x


def _overlaps(strides: tuple[int, ...], shape: torch.Size) -> bool:
    """Whether two elements of a tensor of these strides and shape may share memory
    through dims of nonzero stride: each dim must step past the extent of the dims of
    smaller stride (a conservative test, exact for views of one contiguous tensor).
    Dims in their own order first (a slice's, a decode window's: no sort), then sorted."""
    extent, dim = 0, len(strides)
    while dim:  # an index loop: the cheapest in Python, where a decode step counts microseconds
        dim -= 1
        size, stride = shape[dim], strides[dim]
        if size > 1 and stride:
            if stride <= extent:
                break
            extent += (size - 1) * stride
    else:
        return False
    extent = 0
    for stride, size in sorted(zip(strides, shape, strict=True)):  # strides are never negative
        if size > 1 and stride:
            if stride <= extent:
                return True
            extent += (size - 1) * stride
    return False
