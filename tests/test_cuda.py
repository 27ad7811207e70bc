"""The CUDA path against the float64 reference (on the CPU): every dtype, both modes,
causal, masks, odd lengths, grouped-query heads, key windows, dropout, decoding.
Skipped without a CUDA device; ``benchmarks/gpu.sh`` runs them on a lent GPU."""

import importlib.util

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dilated_attention import DilatedKVCache, dilated_attention, reference_dilated_attention
from dilated_attention.tools.check import TOLERANCES, lse_error, max_relative_error
from helpers import configs, kernel_against_reference, random_inputs, split_config

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]


@settings(max_examples=40, deadline=None)
@given(configs(max_len=70, max_heads=6, grouped_query=True), st.sampled_from(DTYPES))
def test_cuda_matches_the_reference(cfg, dtype):
    """Output, LSE and gradients of every dtype (through the fused memory-efficient
    kernel; float64 through the unfused one), including odd head dims (padded)."""
    cfg = dict(cfg, softmax_scale=None if cfg["softmax_scale"] == -1.3 else cfg["softmax_scale"])
    inputs, attn = split_config(cfg)
    (q, k, v), (grad, grad_lse), mask = random_inputs(**inputs)
    cuda = [t.detach().to("cuda", dtype).requires_grad_() for t in (q, k, v)]
    out, lse = dilated_attention(*cuda, key_padding_mask=None if mask is None else mask.cuda(), return_lse=True, **attn)
    grads = torch.autograd.grad((out, lse), cuda, (grad.to("cuda", dtype), grad_lse.to("cuda", lse.dtype)))
    ref_out, ref_lse = reference_dilated_attention(q, k, v, key_padding_mask=mask, **attn)
    ref_grads = torch.autograd.grad((ref_out, ref_lse), (q, k, v), (grad, grad_lse))
    tolerance = TOLERANCES[dtype] if dtype != torch.float64 else 1e-10
    assert out.device.type == "cuda" and out.dtype == dtype
    assert max_relative_error(out.cpu(), ref_out) <= tolerance
    assert lse_error(lse.cpu(), ref_lse) <= tolerance
    assert max_relative_error([g.cpu() for g in grads], ref_grads) <= tolerance


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_key_window_rows_equal_the_whole_sequence(dtype):
    (q, k, v), _, mask = random_inputs(5, 2, 61, 4, 16, masked=True, kv_heads=2)
    whole, _ = reference_dilated_attention(q, k, v, [8, 16, 32], [1, 2, 4], is_causal=True, key_padding_mask=mask)
    window = [t.detach()[:, 32:].to("cuda", dtype) for t in (k, v)]
    out = dilated_attention(
        q.detach()[:, 50:].to("cuda", dtype),
        *window,
        [8, 16, 32],
        [1, 2, 4],
        is_causal=True,
        key_padding_mask=mask[:, 32:].cuda(),
        key_offset=32,
    )
    assert max_relative_error(out.cpu(), whole[:, 50:]) <= TOLERANCES[dtype]


def test_cuda_dropout_gradient_is_exact():
    """float64 on CUDA (the unfused kernel with its position-keyed masks): the
    backward regenerates the forward's mask, so finite differences agree."""
    (q, k, v), _, mask = random_inputs(21, 1, 11, 3, 2, masked=True)
    q, k, v = (t.detach().cuda().requires_grad_() for t in (q, k, v))

    def fn(q, k, v):
        torch.manual_seed(1234)
        out, lse = dilated_attention(
            q, k, v, [4, 6, 16], [1, 2, 3], is_causal=True, dropout_p=0.3, key_padding_mask=mask.cuda(), return_lse=True
        )
        return out, lse.masked_fill(torch.isneginf(lse), 0.0)

    assert torch.autograd.gradcheck(fn, (q, k, v))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_dropout_is_unbiased(dtype):
    """The mean over many dropout draws approaches the output without dropout."""
    (q, k, v), _, _ = random_inputs(3, 1, 40, 2, 8)
    q, k, v = (t.detach().to("cuda", dtype) for t in (q, k, v))
    plain = dilated_attention(q, k, v, [8, 16], [1, 2]).float()
    mean = sum(dilated_attention(q, k, v, [8, 16], [1, 2], dropout_p=0.2).float() for _ in range(400)) / 400
    assert max_relative_error(mean, plain) <= 0.1


def decode_against_the_whole_sequence(shape, segment_lengths, chunks, dtype):
    """Feed random ``(B, N, H, D)`` inputs through a CUDA cache in ``chunks`` (sizes
    summing to ``N``): the reference's causal rows of the whole sequence."""
    (q, k, v), _, _ = random_inputs(9, *shape)
    whole, _ = reference_dilated_attention(q, k, v, segment_lengths, [1, 2, 4], is_causal=True)
    cache = DilatedKVCache(shape[0], *shape[2:], segment_lengths, [1, 2, 4], dtype=dtype, device="cuda")
    pieces, start = [], 0
    for size in chunks:
        rows = slice(start, start + size)
        pieces.append(cache.attend(*(t.detach()[:, rows].to("cuda", dtype) for t in (q, k, v))))
        start += size
    assert max_relative_error(torch.cat(pieces, 1).cpu(), whole) <= TOLERANCES[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_cache_decoding_equals_the_whole_sequence(dtype):
    decode_against_the_whole_sequence((2, 53, 4, 16), [4, 8, 16], (13, 1, 1, 7, 1, 30), dtype)


# The fused Triton kernels on the GPU (their interpreter tests run everywhere: test_triton.py).
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")

LOW = [torch.bfloat16, torch.float16]


def _cuda_against_reference(q, k, v, grad, grad_lse, mask, dtype, attn, kernel="triton", key_offset=0):
    cuda = [t.detach().to("cuda", dtype).requires_grad_() for t in (q, k, v)]
    out, lse = dilated_attention(
        *cuda,
        key_padding_mask=None if mask is None else mask.cuda(),
        return_lse=True,
        kernel=kernel,
        key_offset=key_offset,
        **attn,
    )
    grads = torch.autograd.grad((out, lse), cuda, (grad.to("cuda", dtype), grad_lse.to("cuda", lse.dtype)))
    ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = reference_dilated_attention(*ref, key_padding_mask=mask, key_offset=key_offset, **attn)
    ref_grads = torch.autograd.grad((ref_out, ref_lse), ref, (grad.double(), grad_lse.double()))
    tolerance = TOLERANCES[dtype]
    assert out.dtype == dtype and torch.equal(out.isnan().cpu(), ref_out.isnan())
    assert max_relative_error(out.cpu(), ref_out) <= tolerance
    assert lse_error(lse.cpu(), ref_lse) <= tolerance
    assert max_relative_error([g.cpu() for g in grads], ref_grads) <= tolerance


@needs_triton
@settings(max_examples=30, deadline=None)
@given(configs(max_len=200, max_heads=6, grouped_query=True), st.sampled_from([*LOW, torch.float32]))
def test_triton_cuda_matches_the_reference(cfg, dtype):
    cfg = dict(cfg, softmax_scale=None if cfg["softmax_scale"] == -1.3 else cfg["softmax_scale"])
    inputs, attn = split_config(cfg)
    (q, k, v), (grad, grad_lse), mask = random_inputs(**inputs)
    _cuda_against_reference(q, k, v, grad, grad_lse, mask, dtype, attn)


@needs_triton
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_triton_cuda_at_real_tile_sizes(head_dim, is_causal, masked):
    """Segments longer than a tile's span, so that whole tiles run unmasked; grouped
    query heads; every query head's offsets."""
    (q, k, v), (grad, grad_lse), mask = random_inputs(7, 2, 1100, 8, head_dim, masked=masked, kv_heads=4)
    attn = dict(segment_lengths=[256, 512, 1024], dilation_rates=[1, 2, 4], is_causal=is_causal)
    _cuda_against_reference(q, k, v, grad, grad_lse, mask, torch.bfloat16, attn)


@needs_triton
def test_triton_cuda_windows_and_non_finite_values():
    (q, k, v), (grad, grad_lse), mask = random_inputs(12, 2, 300, 4, 64, masked=True, kv_heads=2)
    k, q = k.detach().clone(), q.detach().clone()
    k[0, 290, 1, 5], q[1, 299, 3, 0] = float("nan"), float("inf")
    attn = dict(segment_lengths=[64, 128], dilation_rates=[1, 2], is_causal=True)
    _cuda_against_reference(
        q[:, 200:],
        k[:, 128:],
        v[:, 128:],
        grad[:, 200:],
        grad_lse[:, 200:],
        mask[:, 128:],
        torch.float16,
        attn,
        key_offset=torch.tensor([128, 384]),
    )


@needs_triton
@pytest.mark.parametrize("dtype", LOW)
def test_triton_cuda_decoding_equals_the_whole_sequence(dtype, monkeypatch):
    monkeypatch.setenv("DILATED_ATTENTION_KERNEL", "triton")
    decode_against_the_whole_sequence((3, 150, 8, 64), [16, 32, 64], (37, 1, 1, 16, 1, 94), dtype)


def test_auto_runs_the_fused_kernels_on_cuda_for_half_precision():
    from dilated_attention.ops import fused

    half = torch.empty(1, 8, 2, 64, device="cuda", dtype=torch.bfloat16)
    assert fused.use_triton(half, 0.0, False, None) == (importlib.util.find_spec("triton") is not None)
    assert not fused.use_triton(half.float(), 0.0, False, None)  # float32: PyTorch's kernels unless asked
    assert not fused.use_triton(half, 0.1, False, None)  # dropout: the unfused kernel


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
@settings(max_examples=30, deadline=None)
@given(configs(max_len=70, max_heads=6), st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), st.data())
def test_static_cache_kernel_on_cuda_matches_the_reference(cfg, dtype, data):
    """The static cache's fused launches, compiled: every mode, head mapping, scale,
    chunking and padding, with NaN and infinities, the ring wrapping around."""
    kernel_against_reference(data, cfg, dtype, "cuda")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
@settings(max_examples=30, deadline=None)
@given(configs(max_len=70, max_heads=6), st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), st.data())
def test_dilated_cache_kernel_on_cuda_matches_the_reference(cfg, dtype, data):
    """DilatedKVCache's steps on the fused launches over its window, compiled: every
    mode, head mapping, scale, chunking and left padding (rows at different
    positions in one launch), with NaN and infinities."""
    kernel_against_reference(data, cfg, dtype, "cuda", kind=DilatedKVCache)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
def test_dilated_cache_steps_never_wait_for_the_device():
    """Once a cache has taken its first step, its fused steps (a NaN among the keys
    included) make no call that waits for the GPU: CUDA's sync check raises at any."""
    cache = DilatedKVCache(2, 4, 64, [8, 16], [1, 2], start=torch.tensor([0, -3]), dtype=torch.bfloat16, device="cuda")
    tensors = [torch.randn(2, 30, 4, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    tensors[1][0, 6, 2, 5] = float("nan")
    cache.attend(*(t[:, :2] for t in tensors))
    torch.cuda.set_sync_debug_mode("error")
    try:
        outs = [cache.attend(*(t[:, i : i + 1] for t in tensors)) for i in range(2, 30)]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    out = torch.cat(outs, 1).cpu()
    ref, _ = reference_dilated_attention(*(t[:1].cpu().double() for t in tensors), [8, 16], [1, 2], is_causal=True)
    assert torch.equal(out[:1].isnan(), ref[:, 2:].isnan()) and out[:1].isnan().any()
    assert max_relative_error(out[:1], ref[:, 2:]) <= TOLERANCES[torch.bfloat16]


def test_a_static_cache_step_replays_from_a_cuda_graph():
    """The static cache's step captured once in a CUDA graph, replayed per token with
    new inputs copied in: the eager cache's outputs."""
    from dilated_attention import StaticKVCache

    def make():
        return StaticKVCache(
            2, 4, 64, [16, 32, 64], [1, 2, 4], start=torch.tensor([0, -5]), dtype=torch.bfloat16, device="cuda"
        )

    gen = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(2, 40, 4, 64, generator=gen).to("cuda", torch.bfloat16) for _ in range(3))
    eager, cache = make(), make()
    inputs = [torch.zeros(2, 1, 4, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up before capture, as CUDA graphs need
        for _ in range(2):
            cache.attend(*inputs)
    torch.cuda.current_stream().wait_stream(side)
    cache.reset(torch.tensor([0, -5]))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cache.attend(*inputs)
    for i in range(40):
        for buffer, source in zip(inputs, (q, k, v), strict=True):
            buffer.copy_(source[:, i : i + 1])
        graph.replay()
        assert torch.equal(out, eager.attend(q[:, i : i + 1], k[:, i : i + 1], v[:, i : i + 1]))
    assert cache.position.tolist() == [40, 35]


def test_a_static_cache_loop_compiles_once_with_reduce_overhead():
    from dilated_attention import StaticKVCache

    gen = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(1, 30, 4, 64, generator=gen).to("cuda", torch.bfloat16) for _ in range(3))
    eager = StaticKVCache(1, 4, 64, [8, 16], [1, 2], dtype=torch.bfloat16, device="cuda")
    cache = StaticKVCache(1, 4, 64, [8, 16], [1, 2], dtype=torch.bfloat16, device="cuda")
    step = torch.compile(cache.attend, mode="reduce-overhead", fullgraph=True)
    for i in range(30):
        rows = (q[:, i : i + 1], k[:, i : i + 1], v[:, i : i + 1])
        assert max_relative_error(step(*rows).clone().cpu(), eager.attend(*rows).cpu()) <= 1e-2
