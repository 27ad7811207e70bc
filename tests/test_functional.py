"""The fast path against the float64 reference: forward, LSE and gradients."""

import math
import re

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from dilated_attention import DilatedKVCache, dilated_attention, reference_dilated_attention
from dilated_attention.ops import kernels
from dilated_attention.ops.kernels import MathKernel
from dilated_attention.tools.check import TOLERANCES, lse_error, max_relative_error
from helpers import LargestTensor, call_budget, configs, forced_kernel, poison, random_inputs, split_config


def compare_with_reference(cfg, dtype=torch.float64, tolerance=1e-10):
    """Output, LSE and the gradients of a loss through both (random cotangents)."""
    inputs, attn = split_config(cfg)
    (q, k, v), (grad, grad_lse), mask = random_inputs(dtype=dtype, **inputs)
    out, lse = dilated_attention(q, k, v, key_padding_mask=mask, return_lse=True, **attn)
    grads = torch.autograd.grad((out, lse), (q, k, v), (grad, grad_lse.to(lse.dtype)))
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = reference_dilated_attention(*ref_in, key_padding_mask=mask, **attn)
    ref_grads = torch.autograd.grad((ref_out, ref_lse), ref_in, (grad.double(), grad_lse))

    assert out.dtype == dtype and out.shape == q.shape
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert lse.shape == q.shape[:3]
    assert max_relative_error(out, ref_out) <= tolerance
    assert lse_error(lse, ref_lse) <= tolerance
    assert all(g.dtype == dtype for g in grads)
    assert max_relative_error(grads, ref_grads) <= tolerance


@given(configs(grouped_query=True))
def test_float64_matches_reference(cfg):
    compare_with_reference(cfg)


@given(
    configs(max_len=40, max_heads=4, grouped_query=True),
    st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
)
def test_low_precision_within_tolerance(cfg, dtype):
    # |scale| > 1 amplifies input rounding beyond the tolerances, which are for scales <= 1.
    cfg = dict(cfg, softmax_scale=None if cfg["softmax_scale"] == -1.3 else cfg["softmax_scale"])
    compare_with_reference(cfg, dtype=dtype, tolerance=TOLERANCES[dtype])


@given(configs(max_len=40, max_heads=4, grouped_query=True), st.sampled_from([torch.bfloat16, torch.float16]))
def test_under_autocast_the_inputs_are_cast_to_its_dtype_as_sdpa_casts_them(cfg, dtype):
    """Models under autocast pass float32 queries and keys (after a float32 rotary step)
    with lower-precision values: computed as the same call on the cast inputs, its
    output in autocast's dtype and its gradients in the inputs' own dtypes; float64
    inputs are not cast."""
    cfg = dict(cfg, softmax_scale=None if cfg["softmax_scale"] == -1.3 else cfg["softmax_scale"])
    inputs, attn = split_config(cfg)
    (q, k, v), (grad, _), mask = random_inputs(dtype=torch.float32, **inputs)
    v = v.detach().to(dtype).requires_grad_()
    with torch.autocast("cpu", dtype=dtype):
        out = dilated_attention(q, k, v, key_padding_mask=mask, **attn)
    cast = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    expected = dilated_attention(*cast, key_padding_mask=mask, **attn)
    assert out.dtype == dtype and torch.equal(out, expected)
    grads = torch.autograd.grad(out, (q, k, v), grad.to(dtype))
    expected_grads = torch.autograd.grad(expected, cast, grad.to(dtype))
    assert [g.dtype for g in grads] == [torch.float32, torch.float32, dtype]
    assert all(torch.equal(g.to(dtype), e) for g, e in zip(grads, expected_grads, strict=True))
    ref_out, _ = reference_dilated_attention(*(t.detach().double() for t in cast), key_padding_mask=mask, **attn)
    assert max_relative_error(out, ref_out) <= TOLERANCES[dtype]
    doubles = [t.detach().double() for t in (q, k, v)]
    with torch.autocast("cpu", dtype=dtype):
        kept = dilated_attention(*doubles, key_padding_mask=mask, **attn)
    assert kept.dtype == torch.float64 and torch.equal(kept, dilated_attention(*doubles, key_padding_mask=mask, **attn))
    with torch.autocast("cpu", dtype=dtype), pytest.raises(ValueError, match="the float64 ones stay float64"):
        dilated_attention(doubles[0], k, v, key_padding_mask=mask, **attn)


@given(configs(grouped_query=True), st.integers(1, 300))
def test_blocks_cut_into_many_calls_match_reference(cfg, elements):
    with call_budget(elements):
        compare_with_reference(cfg)


@given(configs(grouped_query=True))
def test_packed_inputs_match_reference(cfg):
    """The CPU kernel packs strided queries, keys and values for long queries: here for all but
    the shortest, so that the hypothesis configurations reach it."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kernels, "CPU_QUERY_BLOCK", 2)
        compare_with_reference(cfg)


@pytest.mark.parametrize("is_causal", [False, True])
def test_cpu_kernel_packs_strided_inputs_of_long_queries(monkeypatch, is_causal):
    """Dilated ``(B, L, H, D)`` views of 300 query rows (more than one of the CPU kernel's
    query blocks): the op receives packed queries, keys and values, and the results are the
    unfused kernel's, forward and backward, with a key padding bias."""
    gen = torch.Generator().manual_seed(7)
    q, k, v, out_grad = (torch.randn(2, 600, 3, 16, dtype=torch.float64, generator=gen) for _ in range(4))
    q, k, v, out_grad = (t[:, 1::2].transpose(1, 2) for t in (q, k, v, out_grad))  # (2, 3, 300, 16), strided
    bias = torch.zeros(2, 1, 1, 300, dtype=torch.float64).masked_fill_(
        torch.rand(2, 1, 1, 300, generator=gen) < 0.2, -math.inf
    )
    bias[..., 0] = 0.0  # every causal row keeps a key
    received = []
    forward_op = kernels._aten._scaled_dot_product_flash_attention_for_cpu
    backward_op = kernels._aten._scaled_dot_product_flash_attention_for_cpu_backward

    def forward_spy(q, k, v, *args, **kwargs):
        received.append((q.is_contiguous(), k.is_contiguous(), v.is_contiguous()))
        return forward_op(q, k, v, *args, **kwargs)

    def backward_spy(grad, q, k, v, *args, **kwargs):
        received.append((q.is_contiguous(), k.is_contiguous(), v.is_contiguous()))
        return backward_op(grad, q, k, v, *args, **kwargs)

    monkeypatch.setattr(kernels._aten, "_scaled_dot_product_flash_attention_for_cpu", forward_spy)
    monkeypatch.setattr(kernels._aten, "_scaled_dot_product_flash_attention_for_cpu_backward", backward_spy)
    out, lse = kernels.CpuFlashKernel.forward(q, k, v, bias, is_causal, 0.3)
    grads = kernels.CpuFlashKernel.backward(out_grad, q, k, v, out, lse, bias, is_causal, 0.3)
    ref_out, ref_lse = MathKernel.forward(q, k, v, bias, is_causal, 0.3)
    ref_grads = MathKernel.backward(out_grad, q, k, v, ref_out, ref_lse, bias, is_causal, 0.3)
    assert received == [(True, True, True)] * 2 and not (q.is_contiguous() or k.is_contiguous())
    assert max_relative_error(out, ref_out) <= 1e-12 and max_relative_error(lse, ref_lse) <= 1e-12
    assert max_relative_error(grads, ref_grads) <= 1e-12


@given(configs(max_len=32, max_heads=4, grouped_query=True))
def test_math_kernel_matches_reference(cfg):
    """The unfused kernel (used for dropout and float64 on CUDA) on the whole pipeline."""
    with forced_kernel(MathKernel):
        compare_with_reference(cfg)


@pytest.mark.parametrize("mode", ["mixture", "head_groups"])
@pytest.mark.parametrize("is_causal", [False, True])
def test_gradcheck_finite_differences(mode, is_causal):
    """Gradients of the output and of the LSE (its ``-inf`` entries, constant, set to
    0) against finite differences, independently of the reference (``fast_mode``:
    random projections of the Jacobian, a hundredth of the full one's time)."""
    (q, k, v), _, mask = random_inputs(11, 1, 13, 3, 2, masked=True)

    def fn(q, k, v):
        out, lse = dilated_attention(
            q, k, v, [4, 6, 20], [1, 2, 3], mode=mode, is_causal=is_causal, key_padding_mask=mask, return_lse=True
        )
        return out, lse.masked_fill(torch.isneginf(lse), 0.0)

    assert torch.autograd.gradcheck(fn, (q, k, v), fast_mode=True)


def test_mixture_is_one_softmax_over_the_union_of_keys():
    """The definition: the mixture equals one softmax over all keys seen, a key seen by two
    branches counted twice. Built here from the branch patterns alone."""
    from dilated_attention.reference import branch_offsets, branch_pattern

    segs, rates = [6, 8, 30], [1, 2, 4]
    (q, k, v), _, _ = random_inputs(3, 2, 23, 4, 5)
    count = sum(
        branch_pattern(23, w, r, offs, is_causal=True).double()
        for w, r, offs in zip(segs, rates, branch_offsets(4, segs, rates, "mixture"), strict=True)
    )
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(5) + count.log()
    expected = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)
    out = dilated_attention(q, k, v, segs, rates, is_causal=True)
    assert max_relative_error(out, expected) <= 1e-12


def lineage_dilated_attention(q, k, v, segment_lengths, dilation_rates, is_causal=False):
    """The ``DilatedAttention`` of the dilated-attention-pytorch lineage, rewritten
    plainly: per branch, split the sequence into segments (N divisible by every w),
    take rows ``offset::r`` with offset ``i % r`` for head group ``i`` (sizes H // G,
    the first H % G one larger, as its forks do), attend, add into the output, and
    divide by the number of branches."""
    b, n, h, d = q.shape
    groups = len(segment_lengths)
    sizes = [h // groups + (1 if i < h % groups else 0) for i in range(groups)]
    out = torch.zeros_like(q)
    hmin = 0
    for i, (s, r) in enumerate(zip(segment_lengths, dilation_rates, strict=True)):
        hmax, offset = hmin + sizes[i], i % r
        sel = [t.reshape(b, n // s, s, h, d)[:, :, offset::r, hmin:hmax] for t in (q, k, v)]
        folded = [t.reshape(-1, *t.shape[2:]).transpose(1, 2) for t in sel]
        x = F.scaled_dot_product_attention(*folded, is_causal=is_causal)
        x = x.transpose(1, 2).reshape(b, n // s, -1, hmax - hmin, d)
        out.view(b, n // s, s, h, d)[:, :, offset::r, hmin:hmax] += x
        hmin = hmax
    return out / groups


@pytest.mark.parametrize("heads", [6, 7])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float64, 1e-12), (torch.float32, 2e-6)])
def test_head_groups_reproduces_the_lineage(heads, is_causal, dtype, tol):
    (q, k, v), _, _ = random_inputs(5, 2, 48, heads, 8, dtype=dtype)
    segs, rates = [8, 16, 48], [1, 2, 4]
    out = dilated_attention(q, k, v, segs, rates, mode="head_groups", is_causal=is_causal)
    expected = lineage_dilated_attention(q, k, v, segs, rates, is_causal)
    assert max_relative_error(out, expected) <= tol


def test_non_contiguous_inputs():
    gen = torch.Generator().manual_seed(2)
    base = [torch.randn(2, 5, 40, 6, generator=gen, dtype=torch.float64) for _ in range(3)]
    q, k, v = (t.transpose(1, 2)[:, ::2, :, :] for t in base)  # (2, 20, 5, 6), strided
    assert not q.is_contiguous()
    for mode in ("mixture", "head_groups"):
        out = dilated_attention(q, k, v, [6, 9], [2, 3], mode=mode, is_causal=True)
        ref, _ = reference_dilated_attention(q, k, v, [6, 9], [2, 3], mode=mode, is_causal=True)
        assert max_relative_error(out, ref) <= 1e-12


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_head_dim_that_is_not_unit_stride(dtype):
    """The layout einops' ``b n (d h)`` and ``qkv.unbind(-1)`` give, and a stride-0
    (expanded) head dim; the output gradient strided the same way."""
    gen = torch.Generator().manual_seed(4)
    qkv = torch.randn(2, 21, 8, 3, 3, generator=gen, dtype=torch.float64).to(dtype)
    q, k, v = (t.transpose(2, 3).requires_grad_() for t in qkv.unbind(-1))  # (2, 21, 3, 8), stride(-1) = 3
    assert q.stride(-1) != 1
    q_flat = torch.randn(2, 21, 3, 1, generator=gen, dtype=torch.float64).to(dtype).expand(2, 21, 3, 8)
    grad = torch.randn(2, 21, 8, 3, generator=gen, dtype=torch.float64).to(dtype).transpose(2, 3)
    for query in (q, q_flat):
        out = dilated_attention(query, k, v, [6, 8], [1, 2], is_causal=True)
        grads = torch.autograd.grad(out, (k, v), grad)
        ref_in = [t.detach().double().requires_grad_() for t in (k, v)]
        ref, _ = reference_dilated_attention(query.double(), *ref_in, [6, 8], [1, 2], is_causal=True)
        ref_grads = torch.autograd.grad(ref, ref_in, grad.double())
        assert max_relative_error(out, ref) <= TOLERANCES[dtype]
        assert max_relative_error(grads, ref_grads) <= TOLERANCES[dtype]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_inputs_whose_elements_share_memory(dtype):
    """Heads ``D`` elements long but one element apart (``unfold``'s sliding windows),
    and rows one element apart: PyTorch's CPU flash op reads outside the first; the
    library copies what overlaps. Output, decode-step rows and gradients."""
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(2, 23, 3 + 8 - 1, generator=gen, dtype=torch.float64).to(dtype)
    heads_overlap = x.unfold(-1, 8, 1)  # (2, 23, 3, 8), strides (230, 10, 1, 1)
    flat = torch.randn(2 * 23 + 3 * 8, generator=gen, dtype=torch.float64).to(dtype)
    rows_overlap = flat.as_strided((2, 23, 3, 8), (23, 1, 8, 1))  # a row starts one element after the last
    k, v = (torch.randn(2, 23, 3, 8, generator=gen, dtype=torch.float64).to(dtype) for _ in range(2))
    for q in (heads_overlap, rows_overlap):
        keys = [t.clone().requires_grad_() for t in (k, v)]
        out = dilated_attention(q, *keys, [6, 8], [1, 2], is_causal=True)
        ref_keys = [t.detach().double().requires_grad_() for t in (k, v)]
        ref, _ = reference_dilated_attention(q.double(), *ref_keys, [6, 8], [1, 2], is_causal=True)
        grad = torch.randn(out.shape, generator=gen, dtype=torch.float64)
        grads = torch.autograd.grad(out, keys, grad.to(dtype))
        assert max_relative_error(out, ref) <= TOLERANCES[dtype]
        assert max_relative_error(grads, torch.autograd.grad(ref, ref_keys, grad)) <= TOLERANCES[dtype]
        step = dilated_attention(q[:, -2:], k, v, [6, 8], [1, 2], is_causal=True)  # the last two rows, as a step
        assert max_relative_error(step, ref[:, -2:]) <= TOLERANCES[dtype]
        cache = DilatedKVCache(2, 3, 8, [6, 8], [1, 2], dtype=dtype)
        steps = [cache.attend(q[:, i : i + 1], k[:, i : i + 1], v[:, i : i + 1]) for i in range(q.shape[1])]
        assert max_relative_error(torch.cat(steps, 1), ref) <= TOLERANCES[dtype]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_query_expanded_over_the_sequence_beside_a_head_of_stride_one(dtype):
    """``(B, N, 1, D)`` expanded over ``N`` (stride 0) from the ``b n (d h)`` layout, its
    one head of stride 1: PyTorch's CPU flash op misreads it; the library restrides the
    size-1 dim (no copy). Output, decode rows and gradients of ``k, v``."""
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(2, 1, 8, 1, generator=gen, dtype=torch.float64).to(dtype).transpose(2, 3).expand(2, 23, 1, 8)
    assert q.stride() == (8, 0, 1, 1)
    k, v = (torch.randn(2, 23, 1, 8, generator=gen, dtype=torch.float64).to(dtype).requires_grad_() for _ in range(2))
    out = dilated_attention(q, k, v, [6, 8], [1, 2], is_causal=True)
    ref_keys = [t.detach().double().requires_grad_() for t in (k, v)]
    ref, _ = reference_dilated_attention(q.double(), *ref_keys, [6, 8], [1, 2], is_causal=True)
    grad = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    assert max_relative_error(out, ref) <= TOLERANCES[dtype]
    grads = torch.autograd.grad(out, (k, v), grad.to(dtype))
    assert max_relative_error(grads, torch.autograd.grad(ref, ref_keys, grad)) <= TOLERANCES[dtype]
    step = dilated_attention(q[:, -2:], k.detach(), v.detach(), [6, 8], [1, 2], is_causal=True)
    assert max_relative_error(step, ref[:, -2:]) <= TOLERANCES[dtype]


@pytest.mark.parametrize(("dtype", "scale"), [(torch.float32, 1e8), (torch.float64, 1e18)])
def test_branches_merge_by_their_shares_whatever_the_scores_size(dtype, scale):
    """Scores so large that ``log 2`` is below half an ulp of the LSE: two branches that
    both see a query's best key must average, not add (the output was twice that key's
    value), in the whole call and in decode steps alike."""
    gen = torch.Generator().manual_seed(10)
    q, k, v = (torch.randn(1, 8, 1, 4, generator=gen, dtype=torch.float64).to(dtype) for _ in range(3))
    for is_causal in (False, True):
        ref, _ = reference_dilated_attention(q, k, v, [8, 4], [1, 1], softmax_scale=scale, is_causal=is_causal)
        out = dilated_attention(q, k, v, [8, 4], [1, 1], softmax_scale=scale, is_causal=is_causal)
        assert max_relative_error(out, ref) <= TOLERANCES[dtype]
    step = dilated_attention(q[:, -1:], k, v, [8, 4], [1, 1], softmax_scale=scale, is_causal=True)
    assert max_relative_error(step, ref[:, -1:]) <= TOLERANCES[dtype]


@pytest.mark.parametrize("strided", ["qk", "v"])
def test_lse_gradient_with_a_head_dim_of_one_laid_out_sequence_fastest(strided):
    """``(B, N, H, 1)`` whose sequence dim is the fastest: the LSE's gradient column must
    not inherit that layout (PyTorch's CPU flash backward gets it wrong)."""
    gen = torch.Generator().manual_seed(8)
    inputs = [torch.randn(1, 17, 5, 1, generator=gen, dtype=torch.float64) for _ in range(3)]
    for index in [0, 1] if strided == "qk" else [2]:
        inputs[index] = inputs[index].permute(0, 3, 2, 1).contiguous().permute(0, 3, 2, 1)
    inputs = [t.requires_grad_() for t in inputs]
    grad, grad_lse = torch.randn(1, 17, 5, 1, generator=gen), torch.randn(1, 17, 5, generator=gen)
    out, lse = dilated_attention(*inputs, [4], [1], return_lse=True)
    grads = torch.autograd.grad((out, lse), inputs, (grad, grad_lse))
    ref_in = [t.detach().contiguous().requires_grad_() for t in inputs]
    ref, ref_lse = reference_dilated_attention(*ref_in, [4], [1])
    ref_grads = torch.autograd.grad((ref, ref_lse), ref_in, (grad, grad_lse))
    assert max_relative_error(grads, ref_grads) <= 1e-12


def test_sdpa_layout():
    """``layout="bhnd"`` takes, and returns, PyTorch SDPA's ``(B, H, N, D)``."""
    (q, k, v), (grad, grad_lse), _ = random_inputs(6, 2, 19, 3, 4)
    out, lse = dilated_attention(q, k, v, [4, 8], [1, 2], is_causal=True, return_lse=True)
    sdpa = [t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v)]
    out_h, lse_h = dilated_attention(*sdpa, [4, 8], [1, 2], is_causal=True, return_lse=True, layout="bhnd")
    assert out_h.shape == (2, 3, 19, 4) and lse_h.shape == (2, 3, 19)
    assert torch.equal(out_h.transpose(1, 2), out) and torch.equal(lse_h.transpose(1, 2), lse)
    grads = torch.autograd.grad((out, lse), (q, k, v), (grad, grad_lse))
    grads_h = torch.autograd.grad((out_h, lse_h), sdpa, (grad.transpose(1, 2), grad_lse.transpose(1, 2)))
    assert all(torch.equal(g, gh.transpose(1, 2)) for g, gh in zip(grads, grads_h, strict=True))


def test_unselected_rows_and_fully_padded_rows_output_zero():
    (q, k, v), _, _ = random_inputs(9, 1, 12, 4, 3)
    out, lse = dilated_attention(q, k, v, [12], [2], mode="head_groups", return_lse=True)
    # one group, offset 0: odd positions are never selected
    assert torch.all(out[:, 1::2] == 0) and torch.all(torch.isneginf(lse[:, 1::2]))
    assert torch.all(torch.isfinite(lse[:, 0::2]))
    mask = torch.ones(1, 12, dtype=torch.bool)
    out, lse = dilated_attention(q, k, v, [4, 6], [1, 2], key_padding_mask=mask, return_lse=True)
    assert torch.all(out == 0) and torch.all(torch.isneginf(lse))
    grads = torch.autograd.grad((out * torch.randn_like(out)).sum() + lse.clamp(min=0).sum(), (q, k, v))
    assert all(torch.all(g == 0) for g in grads)


@pytest.mark.parametrize("loss", ["linear", "square"])
def test_double_backward_is_refused(loss):
    """Even when the loss is linear in the output (the first backward's inputs then
    need no gradient, so autograd would otherwise return a detached, wrong result)."""
    (q, k, v), _, _ = random_inputs(1, 1, 8, 2, 4)
    out = dilated_attention(q, k, v, [4], [1])
    value = out.sum() if loss == "linear" else out.square().sum()
    with pytest.raises(RuntimeError, match="does not support double backward"):
        torch.autograd.grad(value, q, create_graph=True)


@pytest.mark.parametrize(("segment_lengths", "dilation_rates"), [([1, 2], [1, 2]), ([8], [1]), ([3, 5], [1, 3])])
def test_nan_in_a_query_reaches_its_output(segment_lengths, dilation_rates):
    """Also where a block has one or two keys (the fused kernel returns 0 there)."""
    (q, k, v), _, _ = random_inputs(4, 1, 8, 2, 4)
    q = q.detach().clone()
    q[0, 3, 0, 0] = float("nan")
    out, lse = dilated_attention(q, k, v, segment_lengths, dilation_rates, return_lse=True)
    ref, ref_lse = reference_dilated_attention(q, k, v, segment_lengths, dilation_rates)
    assert torch.isnan(out[0, 3, 0]).all() and torch.isnan(lse[0, 3, 0])
    assert torch.isfinite(out[0, :, 1]).all()
    assert max_relative_error(out, ref) <= 1e-12 and lse_error(lse, ref_lse) <= 1e-12


@given(configs(grouped_query=True), st.data())
def test_non_finite_inputs_follow_the_definition(cfg, data):
    """NaN or infinity anywhere in q, k, v, padded or not: padded keys have no effect,
    exactly the rows a non-finite value reaches are NaN (the reference says which),
    and those rows pass no gradient back, so every gradient stays finite."""
    inputs, attn = split_config(cfg)
    (q, k, v), (grad, grad_lse), mask = random_inputs(**inputs)
    q, k, v = (t.detach().clone() for t in (q, k, v))
    poison(data, [q, k, v])
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, lse = dilated_attention(q, k, v, key_padding_mask=mask, return_lse=True, **attn)
    ref, ref_lse = reference_dilated_attention(q, k, v, key_padding_mask=mask, **attn)
    assert max_relative_error(out, ref) <= 1e-10
    assert lse_error(lse, ref_lse) <= 1e-10
    grads = torch.autograd.grad((out, lse), (q, k, v), (grad, grad_lse))
    ref_grads = torch.autograd.grad((ref, ref_lse), (q, k, v), (grad, grad_lse))
    assert all(torch.isfinite(g).all() for g in grads)
    assert max_relative_error(grads, ref_grads) <= 1e-10


def test_padded_keys_holding_non_finite_values_change_nothing():
    (q, k, v), _, mask = random_inputs(5, 2, 24, 3, 4, masked=True)
    clean = dilated_attention(q, k, v, [4, 8], [1, 2], is_causal=True, key_padding_mask=mask)
    k2, v2 = k.detach().clone(), v.detach().clone()
    k2[mask], v2[mask] = float("nan"), float("inf")
    dirty = dilated_attention(q, k2, v2, [4, 8], [1, 2], is_causal=True, key_padding_mask=mask)
    assert torch.equal(clean, dirty)


@pytest.mark.parametrize("masked", [False, True])
def test_cuda_kernel_calls_fit_the_op_schemas(masked):
    """No GPU here: run the whole pipeline with the CUDA kernel on meta tensors, which
    checks the calls against PyTorch's schemas and shape functions (not the numbers;
    `dilated-attention check --device cuda` does that on a GPU)."""
    from dilated_attention.ops.kernels import CudaEfficientKernel

    with forced_kernel(CudaEfficientKernel):
        q, k, v = (torch.empty(2, 37, 5, 12, device="meta", requires_grad=True) for _ in range(3))
        mask = torch.empty(2, 37, dtype=torch.bool, device="meta") if masked else None
        out, lse = dilated_attention(q, k, v, [8, 16], [1, 3], key_padding_mask=mask, return_lse=True)
        grads = torch.autograd.grad(out, (q, k, v), torch.empty_like(out))
    assert out.shape == q.shape and lse.shape == (2, 37, 5) and lse.dtype == torch.float32
    assert all(g.shape == q.shape for g in grads)


def test_cuda_kernel_non_square_calls_fit_the_op_schemas():
    """Queries attending to another rank's keys: Lq != Lk, with a key padding bias."""
    from dilated_attention.ops.kernels import CudaEfficientKernel

    q = torch.empty(3, 2, 5, 12, device="meta")
    k = torch.empty(3, 2, 9, 12, device="meta")
    bias = torch.empty(3, 1, 1, 9, device="meta")
    out, lse = CudaEfficientKernel.forward(q, k, k, bias, False, 0.5)
    assert out.shape == q.shape and lse.shape == (3, 2, 5)
    dq, dk, dv = CudaEfficientKernel.backward(out, q, k, k, out, lse, bias, False, 0.5)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == k.shape


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_kernel_operands_are_aligned(dtype):
    """PyTorch's fused CUDA kernels have no variant for a start or stride off 16 bytes
    on recent GPUs (seen on an H100: one head of a ``(B, L, H, D)`` tensor carries a
    stride of 1): strides of dims of size 1 are restated, other misalignments copied,
    the values unchanged."""
    from dilated_attention.ops.kernels import CUDA_ADDRESS_ALIGNMENT, _pad_head_dim

    gen = torch.Generator().manual_seed(3)
    one_head = torch.randn(2, 7, 1, 8, generator=gen).to(dtype).as_strided((2, 1, 7, 8), (56, 1, 8, 1))
    shifted = torch.randn(1 + 2 * 3 * 5 * 8, generator=gen).to(dtype)[1:].view(2, 3, 5, 8)  # start off by 1 element
    odd_dim = torch.randn(2, 5, 3, 5, generator=gen).to(dtype).transpose(1, 2)
    unit = CUDA_ADDRESS_ALIGNMENT // one_head.element_size()
    for tensor in (one_head, shifted, odd_dim):
        for output_layout in (False, True):
            (aligned,) = _pad_head_dim(tensor, output_layout=output_layout)
            assert aligned.data_ptr() % CUDA_ADDRESS_ALIGNMENT == 0 and aligned.stride(-1) == 1
            assert all(stride % unit == 0 for stride in aligned.stride()[:-1])
            assert torch.equal(aligned[..., : tensor.shape[-1]], tensor)
            assert not aligned[..., tensor.shape[-1] :].any()
    assert _pad_head_dim(one_head)[0].data_ptr() == one_head.data_ptr()  # restated, not copied


@pytest.mark.parametrize("masked", [False, True])
def test_cuda_flash_kernel_calls_fit_the_op_schemas(masked):
    """The FlashAttention kernel on meta tensors, through the whole pipeline, with
    grouped-query heads and a head dim to pad; masked blocks go to the other kernel."""
    from dilated_attention.ops.kernels import CudaFlashKernel

    with forced_kernel(CudaFlashKernel):
        q = torch.empty(2, 37, 6, 12, device="meta", dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.empty(2, 37, 2, 12, device="meta", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
        mask = torch.empty(2, 37, dtype=torch.bool, device="meta") if masked else None
        out, lse = dilated_attention(q, k, v, [8, 16], [1, 3], key_padding_mask=mask, is_causal=True, return_lse=True)
        grads = torch.autograd.grad((out, lse), (q, k, v), (torch.empty_like(out), torch.empty_like(lse)))
    assert out.shape == q.shape and lse.shape == (2, 37, 6) and lse.dtype == torch.float32
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_large_lse_gradients_in_half_precision(dtype):
    """A loss scaled as AMP's GradScaler does (65536 and more) through the LSE: the
    gradient column must not overflow float16 where the true gradient fits."""
    (q, k, v), _, mask = random_inputs(13, 1, 24, 2, 8, dtype=dtype, masked=True)
    _, lse = dilated_attention(q, k, v, [8, 16], [1, 2], is_causal=True, key_padding_mask=mask, return_lse=True)
    weight = torch.randn(lse.shape, generator=torch.Generator().manual_seed(1)) * 3e4
    grads = torch.autograd.grad((lse.nan_to_num(neginf=0.0) * weight).sum(), (q, k))  # the LSE needs no v
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    _, ref_lse = reference_dilated_attention(*ref_in, [8, 16], [1, 2], is_causal=True, key_padding_mask=mask)
    ref_grads = torch.autograd.grad((ref_lse.nan_to_num(neginf=0.0) * weight.double()).sum(), ref_in[:2])
    assert max(g.abs().max().item() for g in ref_grads) < 6e4  # fits float16
    assert max_relative_error(grads, ref_grads) <= TOLERANCES[dtype]


def test_torch_func_transforms_are_refused_clearly_and_up_front():
    """The library's own refusal, before any work (not PyTorch's message about
    data-dependent control flow): even arguments it would refuse, or a cache, which
    stays as it was."""
    from dilated_attention import DilatedKVCache, StaticKVCache

    (q, k, v), _, _ = random_inputs(1, 1, 8, 2, 4)
    q, k, v = (t.detach() for t in (q, k, v))
    refusal = "dilated_attention does not support torch.func transforms (grad, vjp, vmap, ...)"

    def loss(q):
        return dilated_attention(q, k, v, [4], [1]).square().sum()

    cache = DilatedKVCache(1, 2, 4, [4], [1], dtype=torch.float64)
    static = StaticKVCache(1, 2, 4, [4], [1], dtype=torch.float64)
    for transformed in (
        lambda: torch.func.grad(loss)(q),
        lambda: torch.func.vmap(lambda q: dilated_attention(q, q, q, [4], [1]))(q[None]),
        lambda: torch.func.vmap(lambda q: dilated_attention(q, q, q, [4], [1, 2]))(q[None]),
        lambda: torch.func.jacrev(lambda k: dilated_attention(q, k, v, [4], [1], is_causal=True))(k),
        lambda: torch.func.vmap(lambda q: cache.attend(q, q, q))(q[None]),
        lambda: torch.func.vmap(lambda q: static.attend(q, q, q))(q[None]),
        lambda: torch.func.grad(lambda q: static.attend(q, k, v).sum())(q),
    ):
        with pytest.raises(RuntimeError, match=re.escape(refusal)):
            transformed()
    assert cache.position.tolist() == [0] and cache.nbytes == 0
    assert static.position.tolist() == [0]


@pytest.mark.parametrize("layout", ["bnhd", "bhnd"])
def test_grouped_query_keys_are_shared_not_repeated(layout):
    """8 query heads on 2 key/value heads, branches whose head sets map to key heads
    by strided views: no operation makes a tensor larger than the keys (repeating
    them would make one 4 times as large), and the result is the reference's."""
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(1, 3, 8, 16, generator=gen)
    k, v = (torch.randn(1, 96, 2, 16, generator=gen) for _ in range(2))
    if layout == "bhnd":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    branches = dict(segment_lengths=[16, 32, 64], dilation_rates=[1, 2, 4], is_causal=True, key_offset=64)
    with LargestTensor() as largest:
        out = dilated_attention(q, k, v, layout=layout, **branches)
    assert largest.numel <= k.numel()
    ref, _ = reference_dilated_attention(*(t.transpose(1, 2) if layout == "bhnd" else t for t in (q, k, v)), **branches)
    ref = ref.transpose(1, 2) if layout == "bhnd" else ref
    assert max_relative_error(out, ref) <= 1e-5


# PyTorch's vectorized jacobian scripts helpers of its own (a deprecation warning of PyTorch's)
@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
def test_forward_mode_and_batched_gradients_are_refused_by_name():
    """Forward-mode tangents are refused before any work (the CPU flash op has no
    forward derivative: PyTorch's error named an op the caller never called), and a
    batched backward when it reaches the library (PyTorch's batching error came from
    inside it); the plain jacobian still matches the reference."""
    import torch.autograd.forward_ad as fwAD

    (q, k, v), _, _ = random_inputs(1, 1, 12, 2, 4)
    q, k, v = (t.detach() for t in (q, k, v))
    branches = dict(segment_lengths=[4, 8], dilation_rates=[1, 2], is_causal=True)
    cache = DilatedKVCache(1, 2, 4, [4, 8], [1, 2], dtype=torch.float64)
    for dropout_p in (0.0, 0.3):
        with fwAD.dual_level(), pytest.raises(RuntimeError, match="has no forward-mode AD"):
            dilated_attention(fwAD.make_dual(q, torch.randn_like(q)), k, v, dropout_p=dropout_p, **branches)
    with fwAD.dual_level():
        with pytest.raises(RuntimeError, match="has no forward-mode AD"):
            cache.attend(q[:, :1], fwAD.make_dual(k[:, :1], torch.randn_like(k[:, :1])), v[:, :1])
        plain = dilated_attention(q, k, v, **branches)  # no tangents: a dual level alone is not refused
    assert cache.position.tolist() == [0]
    assert torch.equal(plain, dilated_attention(q, k, v, **branches))

    def attention(q):
        return dilated_attention(q, k, v, **branches)

    refusal = re.escape("nor batched gradients (torch.autograd.functional.jacobian(vectorize=True)")
    with pytest.raises(RuntimeError, match=refusal):
        torch.autograd.functional.jacobian(attention, q, vectorize=True)
    leaf = q.clone().requires_grad_()
    with pytest.raises(RuntimeError, match=refusal):
        torch.autograd.grad(attention(leaf), leaf, torch.randn(3, *q.shape, dtype=q.dtype), is_grads_batched=True)
    jacobian = torch.autograd.functional.jacobian(attention, q)
    expected = torch.autograd.functional.jacobian(lambda q: reference_dilated_attention(q, k, v, **branches)[0], q)
    assert max_relative_error([jacobian], [expected]) <= 1e-10
