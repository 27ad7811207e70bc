"""``DilatedKVCache``: fed in chunks of any sizes, it gives the whole-sequence causal
output row for row, in memory bounded by the longest segment."""

import copy
import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dilated_attention import DilatedKVCache, StaticKVCache, reference_dilated_attention
from dilated_attention.nn.cache import MIN_SLOTS
from dilated_attention.tools.check import TOLERANCES, max_relative_error
from helpers import configs, feed, needs_interpreter, random_inputs, split_config


@st.composite
def chunkings(draw, total: int):
    """Chunk sizes summing to ``total``: single tokens, prompts, anything between."""
    sizes = []
    while sum(sizes) < total:
        sizes.append(draw(st.one_of(st.just(1), st.integers(1, total - sum(sizes)))))
    return sizes


def make_cache(cfg, tensors, **kwargs):
    batch, _, heads, dim = tensors[0].shape
    attn = dict(mode=cfg["mode"], head_offsets=cfg["head_offsets"], softmax_scale=cfg["softmax_scale"])
    return DilatedKVCache(
        batch, heads, dim, cfg["segment_lengths"], cfg["dilation_rates"], dtype=tensors[0].dtype, **attn, **kwargs
    )


@given(configs(max_len=40), st.data())
def test_chunked_feeding_equals_the_whole_sequence(cfg, data):
    """Every chunking (including one token at a time across many segment boundaries),
    both modes and head-offset mappings, sequences left-padded to different lengths:
    row for row the reference's causal output on each sequence."""
    cfg = dict(cfg, is_causal=True, masked=False)
    inputs, attn = split_config(cfg)
    tensors, _, _ = random_inputs(**inputs)
    tensors = [t.detach() for t in tensors]
    batch, total = cfg["batch"], cfg["seq_len"]
    pads = [data.draw(st.integers(0, total - 1)) for _ in range(batch)]
    cache = make_cache(cfg, tensors, start=torch.tensor([-p for p in pads]))
    out = feed(cache, tensors, data.draw(chunkings(total)))
    for row, pad in enumerate(pads):
        real = [t[row : row + 1, pad:] for t in tensors]
        ref, _ = reference_dilated_attention(*real, **attn)
        assert max_relative_error(out[row : row + 1, pad:], ref) <= 1e-10
        assert torch.all(out[row, :pad] == 0)
    assert cache.cached_positions < max(cfg["segment_lengths"])
    assert cache.position.tolist() == [total - p for p in pads]


@given(configs(max_len=32), st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), st.data())
def test_chunked_feeding_in_low_precision(cfg, dtype, data):
    cfg = dict(cfg, is_causal=True, masked=False, softmax_scale=None)
    inputs, attn = split_config(cfg)
    tensors, _, _ = random_inputs(dtype=dtype, **inputs)
    tensors = [t.detach() for t in tensors]
    out = feed(make_cache(cfg, tensors), tensors, data.draw(chunkings(cfg["seq_len"])))
    ref, _ = reference_dilated_attention(*tensors, **attn)
    assert out.dtype == dtype and max_relative_error(out, ref) <= TOLERANCES[dtype]


def test_memory_stays_bounded_over_a_million_tokens():
    """A million positions, fed in chunks and then token by token: the cache keeps
    fewer than max(w) past positions, and its buffers hold at most 4 * (max(w) +
    chunk) positions, whatever the position."""
    segs, rates = [64, 256, 1024], [1, 2, 4]
    cache = DilatedKVCache(1, 2, 2, segs, rates)
    per_position = 2 * 2 * 2 * 4  # keys and values, H = D = 2, float32
    chunk = torch.randn(1, 2**14, 2, 2)
    while int(cache.position) < 2**20:
        cache.attend(chunk, chunk, chunk)
        assert cache.cached_positions < max(segs)
        assert cache.nbytes <= 4 * (max(segs) + chunk.shape[1]) * per_position
    token = torch.randn(1, 1, 2, 2)
    for _ in range(2500):
        cache.attend(token, token, token)
        assert cache.cached_positions < max(segs)
        assert cache.nbytes <= 4 * (max(segs) + 1) * per_position
    assert int(cache.position) == 2**20 + 2500


@pytest.mark.parametrize("segs", [[2], [8, 32], [64, 256]])
def test_a_new_cache_writes_its_first_steps_in_place(segs):
    """A new cache's first buffers hold MIN_SLOTS positions (twice the longest segment
    where that is fewer): its first steps write into them without moving to larger
    ones; the buffers stay within max_nbytes at every step."""
    cache = DilatedKVCache(1, 2, 4, segs, [1] * len(segs))
    slots = min(MIN_SLOTS, 2 * max(segs))
    tokens = torch.randn(2 * slots, 1, 1, 2, 4)
    sizes = []
    for token in tokens:
        cache.attend(token, token, token)
        sizes.append(cache.nbytes)
        assert cache.nbytes <= cache.max_nbytes()
    assert sizes[: slots - 1] == [slots * 2 * 2 * 4 * 4] * (slots - 1)  # keys and values, H=2, D=4, float32


@given(
    st.lists(st.tuples(st.integers(1, 40), st.integers(1, 3)), min_size=1, max_size=3),
    st.lists(st.integers(0, 30), min_size=1, max_size=4),
    st.lists(st.integers(1, 9), min_size=1, max_size=30),
    st.data(),
)
def test_kept_positions_are_exactly_what_queries_to_come_need(branches, pads, chunks, data):
    """Left-padded rows fed in chunks of any sizes, reordered now and then: after every
    call the cache keeps, of each sequence, exactly the positions from where a query at
    its next position may look back to (the window start, checked lazily between
    segment boundaries)."""
    segs, rates = [w for w, _ in branches], [r for _, r in branches]
    cache = DilatedKVCache(len(pads), 1, 2, segs, rates, start=torch.tensor([-p for p in pads]))
    for size in chunks:
        if data.draw(st.booleans()):  # beam search keeps some sequences, repeats allowed
            kept = data.draw(st.lists(st.integers(0, len(pads) - 1), min_size=len(pads), max_size=len(pads)))
            cache.reorder(torch.tensor(kept))
            pads = [pads[i] for i in kept]
        chunk = torch.randn(len(pads), size, 1, 2)
        cache.attend(chunk, chunk, chunk)
        needed = [
            p - max(-pad, min(p, min(max(p, 0) // w * w for w in segs)))
            for p, pad in zip(cache.position.tolist(), pads, strict=True)
        ]
        assert cache.cached_positions == max(needed)


def test_positive_starts_at_segment_boundaries():
    segs, rates = [4, 8], [1, 2]
    (q, k, v), _, _ = random_inputs(1, 1, 24, 2, 3)
    q, k, v = (t.detach() for t in (q, k, v))
    cache = DilatedKVCache(1, 2, 3, segs, rates, dtype=torch.float64, start=8)
    out = feed(cache, (q[:, 8:], k[:, 8:], v[:, 8:]), [3, 1, 1, 11])
    ref, _ = reference_dilated_attention(q, k, v, segs, rates, is_causal=True)
    assert max_relative_error(out, ref[:, 8:]) <= 1e-12
    with pytest.raises(ValueError, match="must start at a multiple of every segment length"):
        DilatedKVCache(1, 2, 3, segs, rates, start=4)


def test_reorder_follows_the_chosen_beams_and_reset_starts_over():
    segs, rates = [4, 8], [1, 2]
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 20, 2, 3, generator=gen, dtype=torch.float64) for _ in range(3))
    cache = DilatedKVCache(3, 2, 3, segs, rates, dtype=torch.float64)
    cache.attend(q[:, :9], k[:, :9], v[:, :9])
    beams = torch.tensor([2, 2, 0])
    cache.reorder(beams)
    out = cache.attend(q[:, 9:], k[:, 9:], v[:, 9:])  # each beam continues with new tokens
    history = [torch.cat([t[beams, :9], t[:, 9:]], 1) for t in (q, k, v)]
    ref, _ = reference_dilated_attention(*history, segs, rates, is_causal=True)
    assert max_relative_error(out, ref[:, 9:]) <= 1e-12
    cache.reset()
    assert cache.position.tolist() == [0, 0, 0] and cache.cached_positions == 0
    ref, _ = reference_dilated_attention(q, k, v, segs, rates, is_causal=True)
    assert max_relative_error(feed(cache, (q, k, v), [20]), ref) <= 1e-12


def test_a_deep_copy_continues_on_its_own():
    """``copy.deepcopy`` of a cache mid-sequence (one token at a time, the lean path):
    the copy and the original each continue by the reference, the copy on other
    tokens, steps alternating, neither touching the other's keys."""
    segs, rates = [4, 8], [1, 2]
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 20, 4, 3, generator=gen, dtype=torch.float64) for _ in range(3))
    other = [torch.randn(2, 9, 4, 3, generator=gen, dtype=torch.float64) for _ in range(3)]
    cache = DilatedKVCache(2, 4, 3, segs, rates, dtype=torch.float64, start=torch.tensor([0, -3]))
    feed(cache, [t[:, :11] for t in (q, k, v)], [1] * 11)
    copied = copy.deepcopy(cache)
    outs, outs_copy = [], []
    for at in range(9):  # steps alternating: shared buffers would mix the two
        outs_copy.append(copied.attend(*(t[:, at : at + 1] for t in other)))
        outs.append(cache.attend(*(t[:, 11 + at : 12 + at] for t in (q, k, v))))
    out, out_copy = torch.cat(outs, 1), torch.cat(outs_copy, 1)
    for row, pad in enumerate([0, 3]):
        ref, _ = reference_dilated_attention(*(t[row : row + 1, pad:] for t in (q, k, v)), segs, rates, is_causal=True)
        assert max_relative_error(out[row : row + 1], ref[:, 11 - pad :]) <= 1e-12
        mixed = (
            torch.cat([t[row : row + 1, pad:11], o[row : row + 1]], 1) for t, o in zip((q, k, v), other, strict=True)
        )
        ref, _ = reference_dilated_attention(*mixed, segs, rates, is_causal=True)
        assert max_relative_error(out_copy[row : row + 1], ref[:, 11 - pad :]) <= 1e-12


@given(configs(max_len=24), st.data())
def test_a_left_padded_batch_follows_its_beams(cfg, data):
    """Sequences at different positions (kept inside in phase order) decode, are
    reordered with repeats and keep decoding: each row is its beam's history, by the
    reference, and positions are reported in the caller's order."""
    cfg = dict(cfg, is_causal=True, masked=False, batch=data.draw(st.integers(2, 5)), seq_len=max(cfg["seq_len"], 6))
    inputs, attn = split_config(cfg)
    q, k, v = (t.detach() for t in random_inputs(**inputs)[0])
    batch, total = cfg["batch"], cfg["seq_len"]
    pads = [data.draw(st.integers(0, total // 2 - 1)) for _ in range(batch)]
    cut = data.draw(st.integers(max(pads) + 1, total - 1))
    cache = make_cache(cfg, (q, k, v), start=torch.tensor([-p for p in pads]))
    first = feed(cache, (q[:, :cut], k[:, :cut], v[:, :cut]), [1] * cut)
    beams = torch.tensor([data.draw(st.integers(0, batch - 1)) for _ in range(batch)])
    cache.reorder(beams)
    assert cache.position.tolist() == [cut - pads[b] for b in beams.tolist()]
    rest = feed(cache, (q[:, cut:], k[:, cut:], v[:, cut:]), [1] * (total - cut))
    for row, beam in enumerate(beams.tolist()):
        history = [torch.cat([t[beam : beam + 1, pads[beam] : cut], t[row : row + 1, cut:]], 1) for t in (q, k, v)]
        ref, _ = reference_dilated_attention(*history, **attn)
        assert max_relative_error(rest[row : row + 1], ref[:, cut - pads[beam] :]) <= 1e-10
        solo, _ = reference_dilated_attention(*(t[row : row + 1, pads[row] : cut] for t in (q, k, v)), **attn)
        assert max_relative_error(first[row : row + 1, pads[row] :], solo) <= 1e-10


def test_gradients_reach_the_queries_and_the_new_keys():
    segs, rates = [4, 8], [1, 2]
    (q, k, v), _, _ = random_inputs(2, 1, 12, 2, 3)
    cache = DilatedKVCache(1, 2, 3, segs, rates, dtype=torch.float64)
    cache.attend(q[:, :7].detach(), k[:, :7].detach(), v[:, :7].detach())
    out = cache.attend(q[:, 7:], k[:, 7:], v[:, 7:])
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    window = [t.detach().requires_grad_() for t in (q, k, v)]
    ref, _ = reference_dilated_attention(*window, segs, rates, is_causal=True)
    ref_grads = torch.autograd.grad(ref[:, 7:].square().sum(), window)
    for grad, ref_grad in zip(grads, ref_grads, strict=True):
        assert max_relative_error(grad[:, 7:], ref_grad[:, 7:]) <= 1e-12  # earlier rows: detached in the cache
        assert torch.all(grad[:, :7] == 0)


@pytest.mark.parametrize(
    ("call", "fragment"),
    [
        (lambda c: c.attend(*[torch.randn(2, 1, 2, 3)] * 3), "the cache holds 1 sequence, but q has a batch of 2"),
        (lambda c: c.attend(*[torch.randn(0, 1, 2, 3)] * 3), "q has a batch of 0: each call feeds the next positions"),
        (lambda c: c.attend(*[torch.randn(1, 1, 3, 3)] * 3), "q must have shape (batch=1, L >= 1, heads=2"),
        (lambda c: c.attend(*[torch.randn(1, 2, 1, 3)] * 3), "head_dim=3), the (B, L, H, D) layout, got (1, 2, 1, 3)"),
        (
            lambda c: c.attend(torch.randn(1, 1, 2, 3), *[torch.randn(1, 1, 1, 3)] * 2),
            (
                "k must have shape (batch=1, L >= 1, heads=2, head_dim=3), the (B, L, H, D) layout, got (1, 1, 1, 3) "
                "(the cache keeps as many key/value heads as query heads"
            ),
        ),
        (lambda c: c.attend(*[torch.randn(1, 1, 2, 3, dtype=torch.float64)] * 3), "like the cache"),
        (lambda c: c.attend(torch.randn(1, 2, 2, 3), *[torch.randn(1, 1, 2, 3)] * 2), "q, k, v must have one shape"),
        (lambda c: c.attend(torch.randn(1, 1, 2, 3), *[torch.randn(1, 2, 2, 3)] * 2), "q, k, v must have one shape"),
        (lambda c: c.attend(*[torch.randn(1, 1, 2, 3)] * 2, torch.randn(1, 2, 2, 3)), "q, k, v must have one shape"),
        (lambda c: c.attend(*[torch.randn(1, 1, 2, 3)] * 2, [0.0]), "v must be a torch.Tensor, got list"),
        (lambda c: c.reorder(torch.tensor([1])), "indices must be at least one sequence index in [0, 1)"),
        (lambda c: c.reorder(torch.tensor([], dtype=torch.long)), "indices must be at least one sequence index"),
        (lambda c: c.reorder(torch.tensor([True])), "indices must be a 1-D int64 (or int32) tensor"),
        (lambda c: c.reset(start=1.5), "start must be an int"),
    ],
)
@pytest.mark.parametrize("kind", [DilatedKVCache, StaticKVCache])
def test_bad_input(kind, call, fragment):
    """Both caches refuse the same bad input with the same message, before any change:
    the next good call gives what it gives on a fresh cache."""
    cache, fresh = kind(1, 2, 3, [4, 8], [1, 2]), kind(1, 2, 3, [4, 8], [1, 2])
    with pytest.raises((ValueError, TypeError), match=re.escape(fragment)):
        call(cache)
    q, k, v = (torch.randn(1, 1, 2, 3) for _ in range(3))
    assert torch.equal(cache.attend(q, k, v), fresh.attend(q, k, v))


@pytest.mark.parametrize("kind", [DilatedKVCache, StaticKVCache])
def test_reorder_refuses_a_list_with_a_type_error(kind):
    """A wrong type is a ``TypeError``, as everywhere in the library, saying how to make the tensor."""
    with pytest.raises(TypeError, match=re.escape("(torch.tensor(indices) for a list), got list")):
        kind(2, 2, 3, [4], [1]).reorder([1, 0])


@given(configs(max_len=32), st.data())
def test_non_finite_values_reach_the_rows_the_definition_says(cfg, data):
    """The cache checks keys for NaN and infinity once, as they arrive, and still
    gives the reference's rows (NaN exactly where a non-finite value reaches)."""
    cfg = dict(cfg, is_causal=True, masked=False)
    inputs, attn = split_config(cfg)
    tensors, _, _ = random_inputs(**inputs)
    tensors = [t.detach().clone() for t in tensors]
    for _ in range(data.draw(st.integers(1, 2))):
        tensor = data.draw(st.sampled_from(tensors))
        index = tuple(data.draw(st.integers(0, size - 1)) for size in tensor.shape)
        tensor[index] = data.draw(st.sampled_from([float("nan"), float("inf")]))
    out = feed(make_cache(cfg, tensors), tensors, data.draw(chunkings(cfg["seq_len"])))
    ref, _ = reference_dilated_attention(*tensors, **attn)
    assert max_relative_error(out, ref) <= 1e-10


def test_training_through_the_cache_with_only_queries_requiring_grad():
    segs, rates = [4, 8], [1, 2]
    (q, k, v), _, _ = random_inputs(3, 1, 9, 2, 3)
    k, v = k.detach(), v.detach()
    cache = DilatedKVCache(1, 2, 3, segs, rates, dtype=torch.float64)
    first, second = cache.attend(q[:, :5], k[:, :5], v[:, :5]), cache.attend(q[:, 5:], k[:, 5:], v[:, 5:])
    (grad,) = torch.autograd.grad(first.square().sum() + second.square().sum(), q)
    ref_q = q.detach().requires_grad_()
    ref, _ = reference_dilated_attention(ref_q, k, v, segs, rates, is_causal=True)
    (ref_grad,) = torch.autograd.grad(ref.square().sum(), ref_q)
    assert max_relative_error(grad, ref_grad) <= 1e-12


def test_a_chunk_of_padding_only_is_differentiable_with_zero_gradients():
    """Chunks trained through where every sequence is still in its left padding: the
    output is 0 (a NaN in the padding included) and part of the graph, as
    dilated_attention gives rows that attend to nothing, so a loss over the chunks
    backpropagates; the padding's gradients are 0, the later chunk's the reference's."""
    segs, rates = [4, 8], [1, 2]
    (q, k, v), _, _ = random_inputs(5, 2, 9, 2, 3)
    pads = [4, 3]
    with torch.no_grad():
        q[0, 1, 0, 0] = float("nan")  # in the padding: no effect
    cache = DilatedKVCache(2, 2, 3, segs, rates, dtype=torch.float64, start=torch.tensor([-p for p in pads]))
    padding = cache.attend(q[:, :3], k[:, :3], v[:, :3])
    assert padding.requires_grad and torch.equal(padding, torch.zeros_like(padding))
    later = cache.attend(q[:, 3:], k[:, 3:], v[:, 3:])
    grads = torch.autograd.grad(padding.sum() + later.square().sum(), (q, k, v))
    for grad in grads:
        assert torch.equal(grad[:, :3], torch.zeros_like(grad[:, :3]))
    for row, pad in enumerate(pads):
        window = [t.detach()[row : row + 1, pad:].requires_grad_() for t in (q, k, v)]
        ref, _ = reference_dilated_attention(*window, segs, rates, is_causal=True)
        assert max_relative_error(later[row : row + 1, pad - 3 :], ref) <= 1e-10
        ref_grads = torch.autograd.grad(ref.square().sum(), window)
        for grad, ref_grad in zip(grads, ref_grads, strict=True):
            assert max_relative_error(grad[row : row + 1, pad:], ref_grad) <= 1e-10


def test_gradients_of_a_chunk_with_a_non_finite_key_survive_later_chunks():
    """A chunk's backward keeps the non-finite flags of its keys as they were: later
    chunks append in place, and the gradient is still the reference's (finite, the
    rows the NaN reaches passing none back)."""
    segs, rates = [4, 8], [1, 2]
    (q, k, v), _, _ = random_inputs(4, 1, 10, 2, 3)
    with torch.no_grad():
        k[0, 2, 1, 0] = float("nan")
    cache = DilatedKVCache(1, 2, 3, segs, rates, dtype=torch.float64)
    first = cache.attend(q[:, :6], k[:, :6], v[:, :6])
    cache.attend(q[:, 6:], k[:, 6:], v[:, 6:])
    grads = torch.autograd.grad(first.nan_to_num().square().sum(), (q, k, v))
    window = [t.detach()[:, :6].requires_grad_() for t in (q, k, v)]
    ref, _ = reference_dilated_attention(*window, segs, rates, is_causal=True)
    ref_grads = torch.autograd.grad(ref.nan_to_num().square().sum(), window)
    assert torch.isnan(first).any() and not torch.isnan(first).all()
    for grad, ref_grad in zip(grads, ref_grads, strict=True):
        assert torch.isfinite(grad).all() and max_relative_error(grad[:, :6], ref_grad) <= 1e-12


def test_inference_mode_then_normal_use_and_canonical_devices():
    cache = DilatedKVCache(1, 2, 3, [4, 8], [1, 2], device="cpu:0")
    x = torch.randn(1, 5, 2, 3)
    with torch.inference_mode():
        cache.attend(x, x, x)
    cache.attend(x[:, :1], x[:, :1], x[:, :1])  # buffers made in inference mode are replaced
    cache.reset()
    assert cache.attend(x, x, x).shape == x.shape


@pytest.mark.parametrize(
    ("start", "fragment"),
    [
        (2**64, "start must be at most 2**62 (positions are int64), got 18446744073709551616"),
        (2**62 + 8, "start must be at most 2**62"),
        (-(2**62) - 1, "start must be >= -2**62 (positions are int64)"),
        (torch.tensor([0, -(2**63)]), "start must be >= -2**62 (positions are int64), got -9223372036854775808"),
    ],
)
def test_starts_are_bounded_like_key_offsets(start, fragment):
    with pytest.raises(ValueError, match=re.escape(fragment)):
        DilatedKVCache(2, 2, 3, [4, 8], [1, 2], start=start)
    cache = DilatedKVCache(2, 2, 3, [4, 8], [1, 2])
    with pytest.raises(ValueError, match=re.escape(fragment)):
        cache.reset(start)
    cache = DilatedKVCache(2, 2, 3, [4, 8], [1, 2], start=torch.tensor([-(2**62), 2**62]))  # the bounds themselves
    x = torch.randn(2, 3, 2, 3, generator=torch.Generator().manual_seed(0))
    out = cache.attend(x, x, x)
    assert cache.position.tolist() == [-(2**62) + 3, 2**62 + 3]
    assert torch.all(out[0] == 0) and torch.isfinite(out[1]).all()


def test_a_scale_too_large_for_the_dtype_is_refused_at_construction():
    with pytest.raises(ValueError, match=re.escape("softmax_scale=1e+39 does not fit float32")):
        DilatedKVCache(1, 2, 3, [4, 8], [1, 2], softmax_scale=1e39)
    cache = DilatedKVCache(1, 2, 3, [4, 8], [1, 2], softmax_scale=1e39, dtype=torch.float64)
    x = torch.randn(1, 5, 2, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    assert torch.isfinite(cache.attend(x, x, x)).all()


def _state(cache):
    """The cache's attributes: tensors by identity, lists by value."""
    return {name: list(value) if isinstance(value, list) else value for name, value in vars(cache).items()}


def _same_state(cache, state):
    now = _state(cache)
    return now.keys() == state.keys() and all(
        now[name] is value if isinstance(value, torch.Tensor) else now[name] == value for name, value in state.items()
    )


@pytest.mark.parametrize("chunk", [1, 5, 30])  # after 9 positions: into new buffers, in place, new buffers
@pytest.mark.parametrize("poison", [False, True])  # the failed chunk is the first to hold a NaN
def test_a_call_that_fails_leaves_the_cache_as_it_was(chunk, poison, monkeypatch):
    """Bad input is refused before the cache changes; should the attention itself
    raise after the keys were appended, the append is undone: a retry gives exactly
    the output of a cache that never failed."""
    import dilated_attention.functional as functional
    import dilated_attention.ops.decode as decode

    segs, rates = [4, 8], [1, 2]
    gen = torch.Generator().manual_seed(chunk)
    q, k, v = (torch.randn(2, 9 + chunk, 2, 3, generator=gen, dtype=torch.float64) for _ in range(3))
    if poison:
        k[1, 9 + chunk // 2, 1, 0] = float("nan")
    first, then = (tuple(t[:, :9] for t in (q, k, v)), tuple(t[:, 9:] for t in (q, k, v)))
    clean = DilatedKVCache(2, 2, 3, segs, rates, dtype=torch.float64)
    clean.attend(*first)
    expected = clean.attend(*then)

    cache = DilatedKVCache(2, 2, 3, segs, rates, dtype=torch.float64)
    cache.attend(*first)
    state = _state(cache)
    with pytest.raises(ValueError, match="like the cache"):
        cache.attend(*then[:2], then[2].float())
    assert _same_state(cache, state)

    def failing(*args, **kwargs):
        raise RuntimeError("out of memory (simulated)")

    monkeypatch.setattr(functional, "run", failing)  # the engine's path
    monkeypatch.setattr(decode, "attend_step", failing)  # the lean one
    with pytest.raises(RuntimeError, match="simulated"):
        cache.attend(*then)
    monkeypatch.undo()
    assert _same_state(cache, state)
    assert torch.equal(cache.attend(*then).nan_to_num(), expected.nan_to_num())
    assert cache.position.tolist() == clean.position.tolist()


def test_a_batch_of_another_size_names_the_caches():
    """The cache, the module and the model each say how many sequences the cache
    holds and how to feed fewer, not an error about positions the caller never passed."""
    from dilated_attention import MultiheadDilatedAttention
    from dilated_attention.models import LongNetConfig, LongNetLM
    from dilated_attention.nn.rotary import RotaryEmbedding

    gen = torch.Generator().manual_seed(5)
    fix = (
        "feed the next positions of every sequence in each call; to continue with other sequences of these, first "
        "cache.reorder(indices) with indices in [0, 3) (e.g. {}); for new sequences, make a new cache of {} (a "
        "cache's batch is set when it is made; reset() keeps it)"
    )
    for kind in (DilatedKVCache, StaticKVCache):
        for batch, example, indices in (
            (2, "cache.reorder(torch.arange(2)) keeps the first 2", torch.arange(2)),
            (5, "cache.reorder(torch.arange(5) % 3) repeats them, as beam search does", torch.arange(5) % 3),
        ):
            cache = kind(3, 2, 4, [4, 8], [1, 2])
            x = torch.randn(batch, 1, 2, 4, generator=gen)
            message = f"the cache holds 3 sequences, but q has a batch of {batch}: " + fix.format(example, batch)
            with pytest.raises(ValueError, match=re.escape(message)):
                cache.attend(x, x, x)
            cache.reorder(indices)  # the example the message gives
            assert cache.attend(x, x, x).shape == x.shape
    mha = MultiheadDilatedAttention(8, 2, [4, 8], [1, 2], rotary=RotaryEmbedding(4)).eval()
    with pytest.raises(ValueError, match=re.escape("the cache holds 3 sequences, but query has a batch of 2")):
        mha(torch.randn(2, 5, 8, generator=gen), is_causal=True, cache=mha.new_cache(3))
    model = LongNetLM(
        LongNetConfig(vocab_size=11, dim=8, depth=1, heads=2, ffn_dim=16, segment_lengths=(4, 8), dilation_rates=(1, 2))
    ).eval()
    cache = model.new_cache(1)
    with pytest.raises(ValueError, match=re.escape("the cache holds 1 sequence, but tokens has a batch of 3")):
        model(torch.randint(0, 11, (3, 4), generator=gen), cache=cache)
    cache = model.new_cache(3)
    model(torch.randint(0, 11, (3, 4), generator=gen), cache=cache)
    cache.reorder(torch.tensor([2]))  # the fix the message names
    assert model(torch.randint(0, 11, (1, 2), generator=gen), cache=cache).shape == (1, 2, 11)


@needs_interpreter
def test_fused_steps_over_windows_split_in_several_parts(monkeypatch):
    """Windows longer than a split's keys: each step's window is cut into up to three
    splits (one head, one sequence), which the merge joins; the reference's rows."""
    from dilated_attention.ops import ring_decode

    splits, attend = [], ring_decode.attend
    monkeypatch.setattr(ring_decode, "attend", lambda *args: splits.append(args[-1]) or attend(*args))
    (q, k, v), _, _ = random_inputs(3, 1, 150, 1, 8)
    q, k, v = (t.detach() for t in (q, k, v))
    cache = DilatedKVCache(1, 1, 8, [40, 140], [1, 3], kernel="triton")
    out = torch.cat([cache.attend(*(t[:, i : i + 1].float() for t in (q, k, v))) for i in range(150)], 1)
    ref, _ = reference_dilated_attention(q, k, v, [40, 140], [1, 3], is_causal=True)
    assert max(splits) == 3 and max_relative_error(out, ref) <= TOLERANCES[torch.float32]
