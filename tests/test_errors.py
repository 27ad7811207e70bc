"""Every bad input SPEC.md lists raises ValueError/TypeError naming the argument."""

import re

import pytest
import torch

from dilated_attention import DilatedAttention, MultiheadDilatedAttention, dilated_attention


def qkv(shape=(2, 16, 4, 8), dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=gen).to(dtype) for _ in range(3)]


def call(**overrides):
    q, k, v = qkv()
    args = dict(q=q, k=k, v=v, segment_lengths=[4, 8], dilation_rates=[1, 2])
    args.update(overrides)
    return dilated_attention(
        args.pop("q"), args.pop("k"), args.pop("v"), args.pop("segment_lengths"), args.pop("dilation_rates"), **args
    )


q0, k0, v0 = qkv()


@pytest.mark.parametrize(
    "overrides,exc,fragment",
    [
        (dict(segment_lengths=[4, 8, 16]), ValueError, "same length"),
        (dict(segment_lengths=[]), ValueError, "segment_lengths must not be empty"),
        (dict(segment_lengths=[0, 8]), ValueError, "segment_lengths must contain values >= 1"),
        (dict(dilation_rates=[1, -2]), ValueError, "dilation_rates must contain values >= 1"),
        (dict(segment_lengths=[4.0, 8]), TypeError, "segment_lengths must contain ints"),
        (dict(dilation_rates=[1, True]), TypeError, "dilation_rates must contain ints"),
        (dict(segment_lengths=8), TypeError, "segment_lengths must be a list"),
        (dict(q=q0[0]), ValueError, "q must have 4 dims"),
        (dict(k=k0[:, :8]), ValueError, "k must have the shape of q"),
        (dict(v=v0.double()), ValueError, "v must have the dtype of q"),
        (dict(q=q0.int(), k=k0.int(), v=v0.int()), ValueError, "q must be float64, float32"),
        (dict(q=q0.numpy()), TypeError, "q must be a torch.Tensor"),
        (dict(v=v0[:, :, :, :0]), ValueError, "v must have every dim >= 1"),
        (dict(mode="dilated"), ValueError, "mode must be one of"),
        (dict(mode="head_groups", segment_lengths=[2, 4, 8, 16, 32], dilation_rates=[1] * 5), ValueError, "needs at least one head per branch"),
        (dict(key_padding_mask=torch.zeros(2, 16)), ValueError, "key_padding_mask must be a bool tensor"),
        (dict(key_padding_mask=torch.zeros(2, 15, dtype=torch.bool)), ValueError, "key_padding_mask must have shape"),
        (dict(key_padding_mask=[[False] * 16] * 2), TypeError, "key_padding_mask must be a torch.Tensor"),
        (dict(dropout_p=1.0), ValueError, "dropout_p must be in [0, 1)"),
        (dict(dropout_p="0.1"), TypeError, "dropout_p must be a float"),
        (dict(softmax_scale=float("nan")), ValueError, "softmax_scale must be finite"),
        (dict(softmax_scale="1"), TypeError, "softmax_scale must be a float"),
        (dict(is_causal=1), TypeError, "is_causal must be a bool"),
    ],
)
def test_bad_input(overrides, exc, fragment):
    with pytest.raises(exc, match=re.escape(fragment)):
        call(**overrides)


def test_device_mismatch_is_reported():
    meta = torch.empty(2, 16, 4, 8, device="meta")
    with pytest.raises(ValueError, match="k must be on the device of q"):
        dilated_attention(q0, meta, v0, [4], [1])


def test_module_errors():
    with pytest.raises(ValueError, match="same length"):
        DilatedAttention([4, 8], [1])
    with pytest.raises(ValueError, match="dropout must be in"):
        DilatedAttention([4], [1], dropout=1.5)
    with pytest.raises(ValueError, match="embed_dim \\(30\\) must be divisible by num_heads \\(4\\)"):
        MultiheadDilatedAttention(30, 4, [4], [1])
    with pytest.raises(ValueError, match="needs at least one head per branch"):
        MultiheadDilatedAttention(32, 2, [4, 8, 16], [1, 2, 4], mode="head_groups")
    mha = MultiheadDilatedAttention(32, 4, [4, 8], [1, 2])
    x = torch.randn(2, 8, 32)
    with pytest.raises(ValueError, match="need_weights=True is not supported"):
        mha(x, need_weights=True)
    with pytest.raises(ValueError, match="query must have shape \\(batch, seq_len, embed_dim=32\\)"):
        mha(torch.randn(2, 8, 16))
    with pytest.raises(ValueError, match="k must have the shape of q"):
        mha(x, torch.randn(2, 9, 32))


def test_process_group_without_torch_distributed_initialized():
    with pytest.raises(ValueError, match="torch.distributed is not initialized"):
        dilated_attention(q0, k0, v0, [4], [1], process_group=object())
