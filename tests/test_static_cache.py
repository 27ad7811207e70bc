"""StaticKVCache: the same rows as the reference, with fixed shapes, and a decode
loop that compiles once under torch.compile(fullgraph=True)."""

import os

import pytest
import torch
import torch._dynamo
from hypothesis import given, settings
from hypothesis import strategies as st

from dilated_attention import DilatedKVCache, StaticKVCache, reference_dilated_attention
from dilated_attention.models import LongNetConfig, LongNetLM
from dilated_attention.tools.check import TOLERANCES, max_relative_error
from helpers import (
    INTERPRETED,
    chunks,
    configs,
    feed,
    kernel_against_reference,
    needs_interpreter,
    poison,
    random_inputs,
    split_config,
    static_cache,
)


@given(configs(max_len=36), st.integers(1, 4), st.data())
def test_static_rows_are_the_whole_sequence_rows(cfg, max_chunk, data):
    """Every chunking up to max_chunk, left padding per sequence, NaN and infinities:
    row for row the reference on each sequence."""
    cfg = dict(cfg, is_causal=True, masked=False)
    inputs, attn = split_config(cfg)
    tensors = [t.detach().clone() for t in random_inputs(**inputs)[0]]
    if data.draw(st.booleans()):
        poison(data, tensors, most=2)
    pads = [data.draw(st.integers(0, cfg["seq_len"] - 1)) for _ in range(cfg["batch"])]
    cache = static_cache(cfg, attn, pads, max_chunk)
    out = feed(cache, tensors, data.draw(chunks(cfg["seq_len"], max_chunk)))
    for row, pad in enumerate(pads):
        ref, _ = reference_dilated_attention(*(t[row : row + 1, pad:] for t in tensors), **attn)
        assert max_relative_error(out[row : row + 1, pad:], ref) <= 1e-10
        assert torch.all(out[row, :pad] == 0)
    assert cache.position.tolist() == [cfg["seq_len"] - p for p in pads]


@given(configs(max_len=30), st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
def test_static_low_precision(cfg, dtype):
    cfg = dict(cfg, is_causal=True, masked=False, softmax_scale=None)
    inputs, attn = split_config(cfg)
    tensors = [t.detach() for t in random_inputs(dtype=dtype, **inputs)[0]]
    out = feed(static_cache(cfg, attn, [0] * cfg["batch"], 1, dtype), tensors, [1] * cfg["seq_len"])
    ref, _ = reference_dilated_attention(*(t.double() for t in tensors), **attn)
    assert out.dtype == dtype and max_relative_error(out, ref) <= TOLERANCES[dtype]


@needs_interpreter
@pytest.mark.parametrize("kind", [StaticKVCache, DilatedKVCache])
@settings(max_examples=int(os.environ.get("TRITON_MAX_EXAMPLES", "6")))
@given(configs(max_len=14, max_heads=3), st.sampled_from([torch.float32, torch.float16, torch.bfloat16]), st.data())
def test_fused_steps_are_the_whole_sequence_rows(kind, cfg, dtype, data):
    """The fused launches (in Triton's interpreter) of every mode, head mapping, scale,
    chunking and padding, with NaN and infinities, against the reference: over the
    static cache's ring, and over a DilatedKVCache's window, every row in one launch
    whatever its position (once a NaN or an infinity is cached, its steps take the
    engine)."""
    kernel_against_reference(data, cfg, dtype, "cpu", kind=kind)


def test_a_compiled_decode_loop_compiles_once():
    """More steps than dynamo's recompile limit (8): positions live in a tensor, so
    the graph never specialises on them; every output equals the eager cache's."""
    gen = torch.Generator().manual_seed(2)
    batch, steps, heads, dim = 2, 24, 4, 8
    q, k, v = (torch.randn(batch, steps, heads, dim, generator=gen) for _ in range(3))

    def make():
        return StaticKVCache(batch, heads, dim, [4, 8, 16], [1, 2, 4], start=torch.tensor([0, -3]))

    eager, compiled = make(), make()
    step = torch.compile(compiled.attend, fullgraph=True, backend="aot_eager")
    torch._dynamo.utils.counters.clear()
    for i in range(steps):
        rows = (q[:, i : i + 1], k[:, i : i + 1], v[:, i : i + 1])
        assert torch.equal(step(*rows), eager.attend(*rows))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert compiled.position.tolist() == [steps, steps - 3]


def test_a_compiled_model_decodes_with_a_static_cache_as_the_eager_one():
    model = LongNetLM(
        LongNetConfig(
            vocab_size=50, dim=32, depth=2, heads=4, ffn_dim=48, segment_lengths=(4, 8), dilation_rates=(1, 2)
        )
    ).eval()
    tokens = torch.randint(0, 50, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(tokens)
        cache = model.new_cache(2, static=True)
        step = torch.compile(lambda t: model(t, cache=cache), fullgraph=True, backend="aot_eager")
        torch._dynamo.utils.counters.clear()
        logits = torch.cat([step(tokens[:, i : i + 1]) for i in range(20)], 1)
    assert max_relative_error(logits, expected) <= 1e-5
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_reach_the_queries_of_every_step(dtype):
    """One backward over several steps: each step's q gets the reference's gradient
    (later steps write into the ring the earlier steps attended)."""
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 9, 3, 8, generator=gen).to(dtype) for _ in range(3))
    grad = torch.randn(2, 9, 3, 8, generator=gen).to(dtype)
    q.requires_grad_()
    cache = StaticKVCache(2, 3, 8, [4, 8], [1, 2], dtype=dtype, max_chunk=2)
    out = feed(cache, (q, k, v), [1, 2, 1, 2, 2, 1])
    (dq,) = torch.autograd.grad(out, q, grad)
    ref_q = q.detach().double().requires_grad_()
    ref, _ = reference_dilated_attention(ref_q, k.double(), v.double(), [4, 8], [1, 2], is_causal=True)
    (ref_dq,) = torch.autograd.grad(ref, ref_q, grad.double())
    assert max_relative_error(out, ref) <= TOLERANCES[dtype] and max_relative_error(dq, ref_dq) <= TOLERANCES[dtype]


@pytest.mark.parametrize("kind", [StaticKVCache, DilatedKVCache])
def test_rows_with_no_key_or_a_nonfinite_query_pass_no_gradient(kind):
    """A left-padded row's padding, a head no branch selects at a position (r = 2 and 4)
    and a query holding NaN: their outputs follow the definition (0, 0, NaN) and their
    queries get gradient 0; every other query the reference's gradient."""
    gen = torch.Generator().manual_seed(5)
    q, k, v, grad = (torch.randn(2, 7, 4, 8, generator=gen, dtype=torch.float64) for _ in range(4))
    q[0, 5, 1, 2] = float("nan")
    q.requires_grad_()
    attn = dict(segment_lengths=[4, 8], dilation_rates=[2, 4])
    chunk = {"max_chunk": 2} if kind is StaticKVCache else {}
    cache = kind(2, 4, 8, **attn, start=torch.tensor([0, -3]), dtype=torch.float64, **chunk)
    out = feed(cache, (q, k, v), [2, 1, 2, 2])
    (dq,) = torch.autograd.grad(out, q, grad)
    assert torch.isfinite(dq).all()
    assert torch.isnan(out[0, 5, 1]).all() and torch.isfinite(out[0, :, [0, 2, 3]]).all()
    assert torch.all(out[1, :3] == 0) and torch.all(dq[1, :3] == 0) and torch.all(dq[0, 5, 1] == 0)
    clean = q.detach().clone()
    clean[0, 5, 1] = 0.0  # the other rows do not depend on it
    for row, first in ((0, 0), (1, 3)):  # row 1's text starts at its slot 3
        ref_q = clean[row : row + 1, first:].requires_grad_()
        kv = (k[row : row + 1, first:], v[row : row + 1, first:])
        ref, _ = reference_dilated_attention(ref_q, *kv, **attn, is_causal=True)
        (ref_dq,) = torch.autograd.grad(ref, ref_q, grad[row : row + 1, first:])
        if row == 0:
            ref_dq[0, 5, 1] = 0.0
            ref[0, 5, 1] = float("nan")
        assert torch.equal(torch.isnan(out[row : row + 1, first:]), torch.isnan(ref))
        assert max_relative_error(out[row : row + 1, first:].nan_to_num(), ref.nan_to_num()) <= 1e-12
        assert max_relative_error(dq[row : row + 1, first:], ref_dq) <= 1e-12
    assert (out[:, :, :, 0] == 0).any()  # some head attended to no key


def test_a_cache_made_under_inference_mode_serves_outside_it():
    """Its tensors are never inference tensors (which cannot be written in place outside
    that mode): after a reset, a reorder, and in a compiled step too."""
    gen = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(2, 6, 2, 4, generator=gen) for _ in range(3))
    with torch.inference_mode():
        static, dynamic = StaticKVCache(2, 2, 4, [4], [1], max_chunk=3), DilatedKVCache(2, 2, 4, [4], [1])
        feed(static, (q, k, v), [3])
    static.reset()
    with torch.no_grad():
        outs = [feed(cache, (q, k, v), [3, 1, 2]) for cache in (static, dynamic)]
    assert max_relative_error(outs[0], outs[1]) <= 1e-6 and static.position.tolist() == [6, 6]
    with torch.inference_mode():
        static.reorder(torch.tensor([1, 0]))
        static.reset()
    step = torch.compile(static.attend, fullgraph=True, backend="eager")
    compiled = feed(type("Compiled", (), {"attend": staticmethod(step)}), (q, k, v), [3, 3])
    assert max_relative_error(compiled, outs[1]) <= 1e-6


def test_a_key_the_query_does_not_attend_to_is_never_read():
    """A finite key of another segment whose score would overflow float32 leaves the
    row as the reference has it (it once made the softmax NaN)."""
    q, k = torch.ones(1, 3, 1, 4), torch.ones(1, 3, 1, 4)
    v = torch.randn(1, 3, 1, 4, generator=torch.Generator().manual_seed(7))
    k[0, 0], q[0, 2] = 1e30, 1e10  # q2 . k0 overflows; position 0 is in another segment of w = 2
    expected, _ = reference_dilated_attention(q.double(), k.double(), v.double(), [2], [1], is_causal=True)
    out = feed(StaticKVCache(1, 1, 4, [2], [1], max_chunk=3, kernel="torch"), (q, k, v), [1, 1, 1])
    assert max_relative_error(out, expected) <= 1e-6


def test_static_cache_matches_the_dynamic_one_and_reorders():
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(3, 30, 2, 4, generator=gen) for _ in range(3))
    static, dynamic = StaticKVCache(3, 2, 4, [8, 16], [1, 2]), DilatedKVCache(3, 2, 4, [8, 16], [1, 2])
    for cache in (static, dynamic):
        for i in range(20):
            cache.attend(q[:, i : i + 1], k[:, i : i + 1], v[:, i : i + 1])
        cache.reorder(torch.tensor([2, 0]))
    rows = (q[[2, 0], 20:21], k[[2, 0], 20:21], v[[2, 0], 20:21])
    assert max_relative_error(static.attend(*rows), dynamic.attend(*rows)) <= 1e-5
    assert static.position.tolist() == [21, 21] and static.nbytes == static.max_nbytes()
    for cache in (static, dynamic):
        for chunk, error in ((0, ValueError), (-5, ValueError), (2.5, TypeError), (True, TypeError)):
            with pytest.raises(error, match="chunk must be"):
                cache.max_nbytes(chunk)


@pytest.mark.parametrize("kind", [StaticKVCache, DilatedKVCache])
def test_kernel_choices_are_refused_when_a_cache_is_made(kind):
    """An unknown kernel, and kernel="triton" where the dtype or head dim rules the
    launches out: a ValueError from the constructor, before any step."""
    with pytest.raises(ValueError, match="kernel must be one of"):
        kind(1, 2, 4, [8], [1], kernel="cuda")
    with pytest.raises(ValueError, match=r"kernel='triton' cannot run this cache's steps: torch\.float64 is not fused"):
        kind(1, 2, 4, [8], [1], dtype=torch.float64, kernel="triton")
    with pytest.raises(ValueError, match=r"cannot run this cache's steps: head_dim 512 is above 256"):
        kind(1, 2, 512, [8], [1], kernel="triton")


def test_static_cache_refuses_what_it_cannot_take():
    cache = StaticKVCache(1, 2, 4, [8], [1], max_chunk=2)
    x = torch.randn(1, 3, 2, 4)
    with pytest.raises(ValueError, match="1 to max_chunk=2 positions"):
        cache.attend(x, x, x)
    with pytest.raises(ValueError, match="shape \\(batch=1, L >= 1, heads=2, head_dim=4\\)"):
        cache.attend(x[..., :3], x[..., :3], x[..., :3])
    with pytest.raises(ValueError, match="max_chunk must be >= 1"):
        StaticKVCache(1, 2, 4, [8], [1], max_chunk=0)
    with pytest.raises(ValueError, match="use DilatedKVCache"):
        StaticKVCache(1, 2, 4, [2**40], [1])
    x = torch.randn(1, 1, 2, 4, dtype=torch.float64)
    if INTERPRETED:
        fused = StaticKVCache(1, 2, 4, [8], [1], kernel="triton")
        with pytest.raises(ValueError, match=r"no backward \(q requires grad\)"):
            fused.attend(x.float().requires_grad_(), x.float(), x.float())
