"""dilated attention inside transformers models (tiny ones built from configs, no downloads)."""

import re
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

transformers = pytest.importorskip("transformers")
# The imports below follow the importorskip (hence E402), which skips this file without transformers.
from transformers import (  # noqa: E402
    AttentionInterface,
    DynamicCache,
    GemmaConfig,
    GemmaForCausalLM,
    GPTBigCodeConfig,
    GPTBigCodeForCausalLM,
    GptOssConfig,
    GptOssForCausalLM,
    Llama4ForCausalLM,
    Llama4TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)
from transformers.cache_utils import DynamicSlidingWindowLayer  # noqa: E402
from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask  # noqa: E402
from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward as gpt_oss_eager  # noqa: E402

from dilated_attention import dilated_attention, reference_dilated_attention  # noqa: E402
from dilated_attention.integrations.transformers import DilatedCache, dilated_attention_forward, register  # noqa: E402
from dilated_attention.ops import decode  # noqa: E402
from dilated_attention.reference import branch_offsets, branch_pattern  # noqa: E402

BRANCHES = dict(segment_lengths=[4, 8], dilation_rates=[1, 2])


@pytest.fixture(autouse=True)
def _registered():
    """The registrations these tests use, made before each test: other tests (the docs'
    blocks) may register the same names with other branches in this process."""
    register("dilated", **BRANCHES)
    register("dilated_one_segment", segment_lengths=[4096], dilation_rates=[1])


# The tests pass the cache as past_key_values=, the name every supported transformers version
# takes (5.24 renamed it cache= and warns about the old name).
pytestmark = pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")


def _reference_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """The same attention through the dense float64 reference (no padding)."""
    groups = module.num_key_value_groups
    key, value = (t.repeat_interleave(groups, dim=1).transpose(1, 2) for t in (key, value))
    out, _ = reference_dilated_attention(
        query.transpose(1, 2), key, value, is_causal=True, softmax_scale=scaling, **BRANCHES
    )
    return out.to(query.dtype), None


def _sink_reference_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, s_aux=None, **kwargs):
    """Dilated attention with GPT-OSS's sinks as one dense softmax (no padding), built
    from the definition of ``mixture``: every key weighted by the number of branches
    that see it, and the sink appended as one more logit, as GPT-OSS's eager attention
    does."""
    batch, heads, length, _ = query.shape
    key, value = (t.repeat_interleave(heads // t.shape[1], dim=1) for t in (key, value))
    segs, rates = BRANCHES["segment_lengths"], BRANCHES["dilation_rates"]
    seen = sum(
        branch_pattern(length, w, r, offsets, is_causal=True).double()
        for w, r, offsets in zip(segs, rates, branch_offsets(heads, segs, rates, "mixture"), strict=True)
    )
    logits = query @ key.transpose(2, 3) * scaling + seen.log()
    logits = torch.cat([logits, s_aux.view(1, heads, 1, 1).expand(batch, heads, length, 1)], dim=-1)
    return (logits.softmax(-1)[..., :-1] @ value).transpose(1, 2), None


for name, function in (("dilated_reference", _reference_forward), ("dilated_sink_reference", _sink_reference_forward)):
    AttentionInterface.register(name, function)
    AttentionMaskInterface.register(name, flash_attention_mask)


def tiny(family, **changes):
    torch.manual_seed(0)
    common = dict(
        vocab_size=61,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    common.update(changes)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif family == "gemma":  # its default head_dim (256) is not hidden_size / heads
        model = GemmaForCausalLM(GemmaConfig(**{"head_dim": 8, **common}))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    return model.double().eval()


def left_padded(batch_tokens, lengths):
    """Right-aligned rows: the last ``lengths[b]`` tokens of each row are real."""
    mask = torch.zeros(batch_tokens.shape, dtype=torch.long)
    for row, length in enumerate(lengths):
        mask[row, batch_tokens.shape[1] - length :] = 1
    return mask


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma"])
@torch.no_grad()
def test_one_whole_segment_gives_the_sdpa_logits(family):
    model = tiny(family)
    tokens = torch.randint(0, 61, (3, 37))
    mask = left_padded(tokens, [37, 30, 12])
    logits = {}
    for name in ("sdpa", "dilated_one_segment"):
        model.set_attn_implementation(name)
        logits[name] = model(tokens, attention_mask=mask).logits
    real = mask.bool()
    a, b = logits["sdpa"][real], logits["dilated_one_segment"][real]
    assert float((a - b).abs().max() / a.abs().max()) <= 1e-10


def test_under_autocast_the_model_runs_trains_and_decodes_as_with_sdpa():
    """Under autocast a Llama's rotary step gives float32 queries and keys and its
    projections bfloat16 values, which SDPA casts to bfloat16: the registration does the
    same (it refused the mixed dtypes), with its bounded cache too."""
    model = tiny("llama").float()
    tokens = torch.randint(0, 61, (2, 37), generator=torch.Generator().manual_seed(5))
    logits = {}
    for name in ("sdpa", "dilated_one_segment", "dilated"):
        model.set_attn_implementation(name)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            logits[name] = model(tokens).logits
    # one whole segment is dense causal attention: SDPA's logits up to bfloat16 rounding
    assert logits["dilated_one_segment"].dtype == torch.bfloat16
    assert float((logits["dilated_one_segment"] - logits["sdpa"]).abs().max() / logits["sdpa"].abs().max()) < 0.05
    with torch.no_grad():
        full = model(tokens).logits  # float32, no autocast
    assert float((logits["dilated"] - full).abs().max() / full.abs().max()) < 0.05
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):  # a prefill then a step, bounded cache
        cache = DilatedCache(model)
        model(tokens[:, :-1], past_key_values=cache)
        step = model(tokens[:, -1:], past_key_values=cache).logits
    assert float((step[:, -1] - logits["dilated"][:, -1]).abs().max() / full.abs().max()) < 0.05
    model.train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(tokens, labels=tokens).loss
    loss.backward()
    assert all(p.grad is not None and bool(p.grad.isfinite().all()) for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma"])
def test_dilated_layers_and_gradients_match_the_reference(family):
    model = tiny(family)
    tokens = torch.randint(0, 61, (2, 29))
    results = {}
    for name in ("dilated", "dilated_reference"):
        model.set_attn_implementation(name)
        model.zero_grad()
        logits = model(tokens).logits
        logits.logsumexp(-1).sum().backward()
        results[name] = (logits.detach(), [p.grad.clone() for p in model.parameters()])
    (a, grads_a), (b, grads_b) = results["dilated"], results["dilated_reference"]
    assert float((a - b).abs().max() / b.abs().max()) <= 1e-10
    for ga, gb in zip(grads_a, grads_b, strict=True):
        assert torch.allclose(ga, gb, rtol=1e-9, atol=1e-11)


def test_the_attention_function_handles_gqa_left_padding_windows_and_holes():
    class Module(torch.nn.Module):
        num_key_value_groups, is_causal = 3, True

    gen = torch.Generator().manual_seed(1)
    q = torch.randn(3, 6, 5, 8, generator=gen, dtype=torch.float64)  # (B, H, Lq, D): the last 5 of 19 slots
    k, v = (torch.randn(3, 2, 19, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    mask = torch.ones(3, 19, dtype=torch.bool)
    mask[1, :7] = False  # row 1: 7 padding slots, then tokens at positions 0 .. 11
    mask[2, 3] = False  # row 2: a window of positions 16 .. 34 (as DilatedCache keeps), one key masked
    positions = torch.stack([torch.arange(14, 19), torch.arange(7, 12), torch.arange(30, 35)])
    out, weights = dilated_attention_forward(
        Module(),
        q,
        k,
        v,
        mask,
        scaling=0.3,
        position_ids=positions,
        mode="mixture",
        head_offsets="interleaved",
        **BRANCHES,
    )
    assert weights is None and out.shape == (3, 5, 6, 8)
    for row, skip, first in ((0, 0, 0), (1, 7, 0), (2, 0, 16)):
        keys = [t[row : row + 1, :, skip:].repeat_interleave(3, dim=1).transpose(1, 2) for t in (k, v)]
        expected, _ = reference_dilated_attention(
            q[row : row + 1].transpose(1, 2),
            *keys,
            is_causal=True,
            softmax_scale=0.3,
            key_padding_mask=~mask[row : row + 1, skip:],
            key_offset=first,
            **BRANCHES,
        )
        assert torch.allclose(out[row : row + 1], expected, rtol=1e-12, atol=1e-12)


def test_rows_of_one_left_padding_give_the_reference_rows_and_gradients():
    """Every row padded alike (one call for all, its padding queries cut): the output has
    every query row, the padding's 0, and the gradients are the reference's."""

    class Module(torch.nn.Module):
        num_key_value_groups, is_causal = 2, True

    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 11, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 2, 11, 8, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(2))
    mask = torch.ones(2, 11, dtype=torch.bool)
    mask[:, :4] = False  # both rows: 4 padding slots, then positions 0 .. 6
    positions = torch.arange(-4, 7).clamp(min=0).expand(2, -1)
    out, _ = dilated_attention_forward(
        Module(), q, k, v, mask, position_ids=positions, mode="mixture", head_offsets="interleaved", **BRANCHES
    )
    assert out.shape == (2, 11, 4, 8) and torch.equal(out[:, :4], torch.zeros_like(out[:, :4]))
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    for row in range(2):
        window = [t.detach()[row : row + 1, :, 4:].requires_grad_() for t in (q, k, v)]
        keys = [t.repeat_interleave(2, dim=1).transpose(1, 2) for t in window[1:]]
        expected, _ = reference_dilated_attention(window[0].transpose(1, 2), *keys, is_causal=True, **BRANCHES)
        assert torch.allclose(out[row : row + 1, 4:], expected, rtol=1e-12, atol=1e-12)
        expected_grads = torch.autograd.grad(expected.square().sum(), window)
        for grad, expected_grad in zip(grads, expected_grads, strict=True):
            assert torch.allclose(grad[row : row + 1, :, 4:], expected_grad, rtol=1e-10, atol=1e-12)
            assert torch.equal(grad[row, :, :4], torch.zeros_like(grad[row, :, :4]))


def test_position_ids_and_a_mask_changed_in_place_between_calls_are_read_again(monkeypatch):
    """The layers of a step pass the attention function the same position_ids and mask
    tensors: one changed in place between calls is read again."""

    class Module(torch.nn.Module):
        num_key_value_groups, is_causal = 1, True

    gen = torch.Generator().manual_seed(2)
    q = torch.randn(1, 2, 1, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(1, 2, 19, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    positions, mask = torch.tensor([[18]]), torch.ones(1, 19, dtype=torch.bool)

    def attend(with_mask):
        out, _ = dilated_attention_forward(
            Module(),
            q,
            keys,
            v,
            mask if with_mask else None,
            position_ids=positions,
            mode="mixture",
            head_offsets="interleaved",
            **BRANCHES,
        )
        return out

    steps = []
    original = decode.attend_step
    monkeypatch.setattr(decode, "attend_step", lambda *a, **kw: steps.append(1) or original(*a, **kw))
    for keys_finite in (False, True):  # keys as any caller's, or a DilatedCache window's (the lean step)
        keys = k.view_as(k)
        if keys_finite:
            keys.dilated_finite = True
        for with_mask in (False, True):
            for first in (0, 5):  # the same position_ids tensor, another position
                positions.fill_(first + 18)
                expected, _ = reference_dilated_attention(
                    *(t.transpose(1, 2) for t in (q, k, v)), is_causal=True, key_offset=first, **BRANCHES
                )
                steps.clear()
                assert torch.allclose(attend(with_mask), expected, rtol=1e-12, atol=1e-12)
                assert steps == [1]
        mask[0, 18] = False  # the query's own slot is now padding: it outputs 0
        assert torch.all(attend(True) == 0)
        mask[0, 18] = True


def test_the_model_runs_and_generates_under_inference_mode():
    """Under torch.inference_mode (inference tensors track no version counter) the
    forward gives the no_grad logits, and generation with a DilatedCache the same tokens."""
    model = tiny("llama")
    model.set_attn_implementation("dilated")
    tokens = torch.randint(1, 61, (2, 13), generator=torch.Generator().manual_seed(3))
    options = dict(attention_mask=torch.ones_like(tokens), max_new_tokens=4, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        expected = model(tokens).logits
        greedy = model.generate(tokens, past_key_values=DilatedCache(model), **options)
    with torch.inference_mode():
        assert torch.equal(model(tokens).logits, expected)
        assert torch.equal(model.generate(tokens, past_key_values=DilatedCache(model), **options), greedy)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("bounded", [False, True], ids=["default-cache", "DilatedCache"])
@torch.no_grad()
@pytest.mark.parametrize("way", ["cheaper", "branch-by-branch"])
@pytest.mark.parametrize("lengths", [[13, 6], [6, 6], [6]], ids=["two-paddings", "one-padding", "one-padded-row"])
def test_greedy_generation_is_the_full_forward_argmax_and_left_padding_changes_nothing(
    family, bounded, way, lengths, monkeypatch
):
    """Each step's way (the cheaper one; or every step branch by branch, its calls
    merged) gives the tokens and logits of the full forward, whether the rows' left
    paddings differ or are one (the prompt's padding queries then in one call)."""
    ran = []
    if way == "branch-by-branch":
        monkeypatch.setattr(decode, "BRANCH_CALLS_COST", -(10**12))
        original = decode.branch_attention
        monkeypatch.setattr(decode, "branch_attention", lambda *a, **kw: ran.append(1) or original(*a, **kw))
    model = tiny(family)
    model.set_attn_implementation("dilated")
    tokens = torch.randint(0, 61, (len(lengths), 13))
    mask = left_padded(tokens, lengths)
    # With DilatedCache each layer keeps max(w) - 1 = 7 positions: the window slides
    # through the prompt and past row 1's padding while generating.
    cache = DilatedCache(model) if bounded else None
    result = model.generate(
        tokens,
        attention_mask=mask,
        max_new_tokens=12,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
        past_key_values=cache,
    )
    for row, length in enumerate(lengths):
        sequence = tokens[row : row + 1, 13 - length :]
        for step in range(12):
            logits = model(sequence).logits[0, -1]
            # generate hands its logits out in float32: equal up to that rounding.
            assert torch.allclose(result.logits[step][row], logits.float(), rtol=1e-6, atol=1e-6)
            sequence = torch.cat([sequence, logits.argmax().view(1, 1)], 1)
        assert torch.equal(result.sequences[row, 13:], sequence[0, length:])
    if bounded:
        layers = cache.layers
        assert len(layers) == 2 and all(layer.keys.shape[2] == max(BRANCHES["segment_lengths"]) - 1 for layer in layers)
    assert len(ran) >= (2 * 11 if way == "branch-by-branch" else 0)  # both layers, every step after the first


def test_a_bounded_cache_filled_under_inference_mode_continues_outside_it():
    """Buffers made under inference_mode cannot be written outside it: the next step
    moves the window into new ones, and generation goes on as with the default cache."""
    model = tiny("llama")
    model.set_attn_implementation("dilated")
    tokens = torch.randint(3, 61, (1, 12), generator=torch.Generator().manual_seed(1))
    options = dict(do_sample=False, pad_token_id=0)
    ends = {}
    for name in ("default", "bounded"):
        cache = DilatedCache(model) if name == "bounded" else None
        with torch.inference_mode():
            first = model.generate(tokens, past_key_values=cache, max_new_tokens=3, **options).clone()
        more = torch.cat([first, torch.tensor([[5, 6]])], 1)
        with torch.no_grad():
            ends[name] = model.generate(more, past_key_values=cache, max_new_tokens=6, **options)
    assert torch.equal(ends["bounded"], ends["default"])


@pytest.mark.skipif(
    not hasattr(DynamicSlidingWindowLayer, "activate_past_recording"),
    reason="transformers 4.x cannot crop a sliding-window layer past its window (docs/transformers.md)",
)
@torch.no_grad()
def test_after_prompt_lookup_a_reset_cache_keeps_only_its_window_again():
    """Assisted generation (here prompt lookup) has each layer record every position
    until it crops, and never turns that off: a reset cache is bounded again."""
    model = tiny("llama")
    model.set_attn_implementation("dilated")
    gen = torch.Generator().manual_seed(5)
    repeated = torch.randint(3, 61, (6,), generator=gen).repeat(3).view(1, -1)
    options = dict(do_sample=False, pad_token_id=0)
    cache = DilatedCache(model)
    looked_up = model.generate(
        repeated, past_key_values=cache, prompt_lookup_num_tokens=3, max_new_tokens=10, **options
    )
    assert torch.equal(looked_up, model.generate(repeated, max_new_tokens=10, **options))
    cache.reset()
    prompt = torch.randint(3, 61, (1, 9), generator=gen)
    reused = model.generate(prompt, past_key_values=cache, max_new_tokens=60, **options)
    assert torch.equal(reused, model.generate(prompt, max_new_tokens=60, **options))
    assert [layer.keys.shape[-2] for layer in cache.layers] == [7, 7]  # max(segment_lengths) - 1


@torch.no_grad()
def test_beam_search_with_the_bounded_cache_picks_the_default_caches_beams():
    """Beam search reorders every layer between the steps DilatedCache appends in
    place: the sequences are those of transformers' default cache, left padding too."""
    model = tiny("llama")
    model.set_attn_implementation("dilated")
    tokens = torch.randint(0, 61, (2, 11))
    options = dict(
        attention_mask=left_padded(tokens, [11, 5]), max_new_tokens=20, num_beams=3, do_sample=False, pad_token_id=0
    )
    default = model.generate(tokens, **options)
    bounded = model.generate(tokens, **options, past_key_values=DilatedCache(model))
    assert torch.equal(default, bounded)


@torch.no_grad()
def test_the_bounded_cache_fed_in_chunks_gives_the_full_forward():
    model = tiny("llama")
    model.set_attn_implementation("dilated")
    tokens = torch.randint(0, 61, (2, 41))
    expected = model(tokens).logits
    cache = DilatedCache(model)
    pieces, start = [], 0
    for size in (9, 1, 5, 13, 1, 1, 11):
        pieces.append(model(tokens[:, start : start + size], past_key_values=cache, use_cache=True).logits)
        start += size
        # layers x (k, v) x kept positions (max(w) - 1) x batch x key/value heads x head dim x 8 bytes,
        # in memory of at most twice that (never the whole of a long chunk's keys)
        kept = 2 * 2 * min(start, 7) * 2 * 2 * 8 * 8
        assert kept <= cache.nbytes <= 2 * kept
    got = torch.cat(pieces, 1)
    assert float((got - expected).abs().max() / expected.abs().max()) <= 1e-12


def test_the_bounded_cache_fed_in_short_chunks_gives_the_default_caches_gradients():
    """Short chunks with gradients, only the queries' projection trained (the keys and
    values need none): the attention keeps views of the cache's window for the queries'
    gradient, which no later chunk may write into."""
    model = tiny("llama")
    model.set_attn_implementation("dilated")
    for name, parameter in model.named_parameters():
        parameter.requires_grad_("q_proj" in name)
    tokens = torch.randint(0, 61, (2, 12))
    grads = []
    for cache in (DynamicCache(config=model.config), DilatedCache(model)):
        loss = sum((model(tokens[:, at : at + 2], past_key_values=cache).logits ** 2).sum() for at in range(0, 12, 2))
        trained = [p for p in model.parameters() if p.requires_grad]
        grads.append(torch.autograd.grad(loss, trained))
    for ours, theirs in zip(*grads, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)


def test_the_bounded_cache_needs_the_model_to_run_the_registration():
    model = tiny("llama")
    with pytest.raises(ValueError, match="not a dilated attention registration"):
        DilatedCache(model)  # still "sdpa"
    # sdpa would read the kept window as a sliding window: refused, whatever name says
    with pytest.raises(ValueError, match=r"runs attention implementation 'sdpa'.*set_attn_implementation\('dilated'\)"):
        DilatedCache(model, name="dilated")
    with pytest.raises(ValueError, match="runs attention implementation 'sdpa'"):
        DilatedCache(model.config, name="dilated")
    model.set_attn_implementation("dilated")
    assert DilatedCache(model).window == DilatedCache(model.config, name="dilated").window == 8
    with pytest.raises(ValueError, match="runs attention implementation 'dilated', not 'dilated_one_segment'"):
        DilatedCache(model, name="dilated_one_segment")
    with pytest.raises(TypeError, match="transformers model or config"):
        DilatedCache("llama")
    cache = DilatedCache(model)
    model.set_attn_implementation("sdpa")  # after the cache was built: refused when it is used
    with pytest.raises(ValueError, match="runs attention implementation 'sdpa', not 'dilated'"):
        model(torch.randint(0, 61, (1, 5)), past_key_values=cache)
    model.set_attn_implementation("dilated")
    deeper = tiny("llama", num_hidden_layers=3)
    deeper.set_attn_implementation("dilated")
    with pytest.raises(ValueError, match=r"has 2 layers, for the model it was built for, and layer 2 asks"):
        deeper(torch.randint(0, 61, (1, 5)), past_key_values=DilatedCache(model))


@torch.no_grad()
def test_the_bounded_cache_refuses_another_batch_and_numbering_that_does_not_continue():
    """A batch other than the one the cache holds (its rows were spread over the new
    ones), and position_ids that jump between calls, or skip a 0 of the mask (the kept
    keys were renumbered), are refused; a cache continued consistently, or reset, runs."""
    model = tiny("llama")
    model.set_attn_implementation("dilated")
    tokens = torch.randint(0, 61, (2, 12))
    for held, fed in ((1, 2), (2, 1)):
        cache = DilatedCache(model)
        model(tokens[:held, :10], past_key_values=cache)
        with pytest.raises(ValueError, match=f"holds {held} sequences and the call feeds {fed}"):
            model(tokens[:fed, 10:11], past_key_values=cache)
        assert cache.get_seq_length() == 10  # refused before it was appended
    for positions, row in (([[15], [15]], 0), ([[10], [9]], 1)):  # a jump; row 1 numbered as if a slot were skipped
        cache = DilatedCache(model)
        model(tokens[:, :10], past_key_values=cache)
        message = f"position_ids of row {row} number its next token {positions[row][0]}, where the tokens the cache"
        with pytest.raises(ValueError, match=message):
            model(tokens[:, 10:11], past_key_values=cache, position_ids=torch.tensor(positions))
        # its first layer took the refused call's keys, the second did not: refused until reset
        with pytest.raises(ValueError, match=r"holds part of a call that failed .* reset\(\) it"):
            model(tokens[:, 10:11], past_key_values=cache)
        cache.reorder_cache(torch.tensor([1, 0]))  # as beam search does between steps: refused still
        with pytest.raises(ValueError, match="holds part of a call that failed"):
            model(tokens[:, 10:11], past_key_values=cache)
        cache.reset()
        model(tokens[:, :10], past_key_values=cache)
        assert [layer.cumulative_length for layer in cache.layers] == [10, 10]
    cache = DilatedCache(model)
    model(tokens[:, :10], past_key_values=cache)
    expected = model(tokens[:, :11]).logits[:, -1]
    step = model(tokens[:, 10:11], past_key_values=cache, position_ids=torch.tensor([[10], [10]])).logits[:, -1]
    assert float((step - expected).abs().max()) <= 1e-12
    cache.reset()
    model(tokens[:, 3:8], past_key_values=cache)  # numbered anew after a reset
    with pytest.raises(TypeError, match=re.escape("position_ids must be integers (torch.long), got torch.float64")):
        model(tokens[:, :3], position_ids=torch.arange(3.0, dtype=torch.float64)[None])


@torch.no_grad()
def test_the_bounded_cache_counts_the_buffers_a_reorder_leaves_until_the_next_step():
    model = tiny("llama")
    model.set_attn_implementation("dilated")
    cache = DilatedCache(model)
    tokens = torch.randint(0, 61, (4, 12))
    model(tokens[:, :10], past_key_values=cache)
    model(tokens[:, 10:11], past_key_values=cache)  # a step: appended in place, into buffers
    before = cache.nbytes
    cache.batch_select_indices(torch.tensor([0]))  # transformers' new keys: the buffers stay until the next step
    assert cache.nbytes > before
    model(tokens[:1, 11:12], past_key_values=cache)
    assert cache.nbytes < before  # one row's buffers now


def test_a_bounded_cache_refuses_a_name_that_is_not_a_str_and_a_registration_grown_since():
    model = tiny("llama")
    model.set_attn_implementation("dilated")
    for name in (["dilated"], 123):
        with pytest.raises(TypeError, match="name must be a registration's name"):
            DilatedCache(model, name)
    cache = DilatedCache(model)
    with torch.no_grad():
        model(torch.randint(0, 61, (1, 9)), past_key_values=cache)
        register("dilated", segment_lengths=[4, 16], dilation_rates=[1, 2])  # the autouse fixture restores it
        with pytest.raises(ValueError, match=r"keeps the positions segments of up to 8 reach.*segments of 16"):
            model(torch.randint(0, 61, (1, 1)), past_key_values=cache)


@torch.no_grad()
def test_a_cache_the_model_does_not_take_is_refused_not_ignored():
    """past_key_values= is the keyword every supported transformers version takes. A
    DilatedCache under a name the model's forward does not take (cache= before
    transformers 5.24) reaches the attention function unused: refused there."""
    model = tiny("llama")
    model.set_attn_implementation("dilated")
    tokens = torch.randint(0, 61, (2, 21))
    expected = model(tokens).logits
    cache = DilatedCache(model)
    try:
        pieces = [model(part, cache=cache, use_cache=True).logits for part in tokens.split([13, 8], dim=1)]
    except ValueError as error:  # transformers < 5.24: the model passes cache= on unused
        assert "did not use the DilatedCache passed as cache=" in str(error)  # noqa: PT017 - either outcome is checked
    else:  # transformers >= 5.24 takes cache=
        assert float((torch.cat(pieces, 1) - expected).abs().max() / expected.abs().max()) <= 1e-12

    class Module(torch.nn.Module):
        is_causal = True

    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 4, 6, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    for keyword in ("cache", "past_key_values"):
        with pytest.raises(ValueError, match=f"did not use the DilatedCache passed as {keyword}=.*past_key_values="):
            dilated_attention_forward(
                Module(),
                q,
                k,
                v,
                None,
                mode="mixture",
                head_offsets="interleaved",
                **BRANCHES,
                **{keyword: DilatedCache(model)},
            )


@torch.no_grad()
def test_a_model_that_passes_no_position_ids_uses_the_cache_window():
    """GPTBigCode (multi-query: one key/value head) hands its attention no
    position_ids: DilatedCache tells the function where its window starts, so the
    bounded cache generates what the default cache does; left padding, whose
    positions such a model does not say, is refused."""
    torch.manual_seed(0)
    model = (
        GPTBigCodeForCausalLM(
            GPTBigCodeConfig(
                n_embd=48, n_layer=2, n_head=6, vocab_size=61, multi_query=True, bos_token_id=0, eos_token_id=None
            )
        )
        .double()
        .eval()
    )
    model.set_attn_implementation("dilated")
    model.generation_config.eos_token_id = None
    tokens = torch.randint(1, 61, (1, 12))
    options = dict(max_new_tokens=10, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    default = model.generate(tokens, **options)
    bounded = model.generate(tokens, **options, past_key_values=DilatedCache(model))
    assert torch.equal(default.sequences, bounded.sequences)
    assert max(float((a - b).abs().max()) for a, b in zip(default.logits, bounded.logits, strict=True)) <= 1e-5
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :7] = 0
    with pytest.raises(ValueError, match="passes no position_ids"):
        model(tokens.expand(2, -1), attention_mask=mask)


@torch.no_grad()
def test_an_empty_prompt_row_outputs_nothing_and_a_static_cache_is_refused():
    model = tiny("llama")
    model.set_attn_implementation("dilated")
    tokens = torch.randint(1, 61, (2, 10))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1] = 0  # row 1: no prompt at all
    out = model.generate(
        tokens,
        attention_mask=mask,
        max_new_tokens=3,
        do_sample=False,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    alone = model.generate(
        tokens[:1], max_new_tokens=3, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True
    )
    assert torch.equal(out.sequences[0], alone.sequences[0])
    with pytest.raises(ValueError, match="a static cache"):
        model.generate(tokens[:1], max_new_tokens=3, do_sample=False, pad_token_id=0, cache_implementation="static")


def test_unsupported_uses_are_refused_clearly():
    model = tiny("llama")
    model.set_attn_implementation("dilated")
    tokens = torch.randint(0, 61, (2, 9))
    with pytest.raises(ValueError, match="dropped keys still needed"):  # a fresh sequence starting at 5
        model(tokens, position_ids=torch.arange(5, 14).expand(2, -1))
    with pytest.raises(ValueError, match="packed sequences"):
        model(tokens, position_ids=torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4, 5]] * 2))
    hole, right = torch.ones_like(tokens), torch.ones_like(tokens)
    hole[1, 5], right[1, 6:] = 0, 0
    for mask in (hole, right):  # generate numbers the tokens from the mask: only left padding works
        with pytest.raises(ValueError, match=r"attention_mask: pad on the left only \(tokenizer.padding_side"):
            model.generate(tokens, attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=0)
    with pytest.raises(ValueError, match="output_attentions"):
        model(tokens, output_attentions=True)
    model.model.layers[0].self_attn.is_causal = False
    with pytest.raises(ValueError, match="causal self-attention only"):
        model(tokens)
    # A sliding layer is refused for its type, whatever its window: a wider window (or
    # narrower segments) would not make it run. Its first full layer runs.
    for window in (4, 64):
        windowed = tiny("qwen2", use_sliding_window=True, sliding_window=window, max_window_layers=1)
        assert windowed.config.layer_types[:2] == ["full_attention", "sliding_attention"]
        windowed.set_attn_implementation("dilated")
        with pytest.raises(ValueError, match=r"layer 1 is a 'sliding_attention' layer"):
            windowed(tokens)
    with pytest.raises(ValueError, match="new attention implementation name"):
        register("sdpa", **BRANCHES)


def tiny_gpt_oss():
    """A GPT-OSS whose layers are all full attention (its sliding layers are refused),
    with sinks large enough to matter."""
    torch.manual_seed(0)
    config = GptOssConfig(
        vocab_size=61,
        hidden_size=32,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=4,
        num_experts_per_tok=2,
        layer_types=["full_attention"] * 2,
    )
    config._experts_implementation = "eager"  # the grouped expert kernels take no float64
    model = GptOssForCausalLM(config).double().eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_()
    return model


def logits_and_gradients(model, name, tokens, mask=None):
    """Logits and every parameter's gradient (by name) of a loss on the real tokens."""
    model.set_attn_implementation(name)
    model.zero_grad()
    logits = model(tokens, attention_mask=mask).logits
    real = torch.ones(tokens.shape, dtype=torch.bool) if mask is None else mask.bool()
    logits[real].logsumexp(-1).sum().backward()
    return logits.detach()[real], {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_close_results(got, expected, tolerance):
    (a, grads_a), (b, grads_b) = got, expected
    assert float((a - b).abs().max() / b.abs().max()) <= tolerance
    assert grads_a.keys() == grads_b.keys() and any("sinks" in n for n in grads_b)
    for n in grads_b:
        assert float((grads_a[n] - grads_b[n]).abs().max()) <= tolerance * float(grads_b[n].abs().max()), n


def test_attention_sinks_enter_each_softmax_as_gpt_oss_eager_does():
    """GPT-OSS's eager attention appends each head's sink as one more logit: one whole
    segment gives its outputs and gradients (queries, keys, values and sinks), for
    a whole sequence and for the last queries of a key window."""

    class Module(torch.nn.Module):
        num_key_value_groups, is_causal, training = 3, True, False

    gen = torch.Generator().manual_seed(3)
    sinks = (2 * torch.randn(6, generator=gen, dtype=torch.float64)).requires_grad_()
    module = Module()
    module.sinks = sinks
    attentions = (
        lambda q, k, v, causal: gpt_oss_eager(module, q, k, v, causal, scaling=0.4),
        lambda q, k, v, causal: dilated_attention_forward(
            module,
            q,
            k,
            v,
            None,
            scaling=0.4,
            s_aux=sinks,
            segment_lengths=[64],
            dilation_rates=[1],
            mode="mixture",
            head_offsets="interleaved",
        ),
    )
    for num_queries in (13, 4):
        q = torch.randn(2, 6, num_queries, 8, generator=gen, dtype=torch.float64, requires_grad=True)
        k, v = (torch.randn(2, 2, 13, 8, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(2))
        causal = torch.full((1, 1, num_queries, 13), float("-inf"), dtype=torch.float64).triu(14 - num_queries)
        results = []
        for attend in attentions:
            out, _ = attend(q, k, v, causal)
            grads = torch.autograd.grad((out * out.detach().cos()).sum(), (q, k, v, sinks))
            results.append((out.detach(), grads))
        (a, grads_a), (b, grads_b) = results
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-13)
        for ga, gb in zip(grads_a, grads_b, strict=True):
            assert torch.allclose(ga, gb, rtol=1e-12, atol=1e-13)


def test_gpt_oss_with_one_whole_segment_gives_eager_logits_and_gradients():
    """Logits and every gradient, the sinks' included, with left padding. GPT-OSS's
    norms compute in float32, so the float64 model agrees to float32 rounding."""
    model = tiny_gpt_oss()
    tokens = torch.randint(0, 61, (2, 19))
    mask = left_padded(tokens, [19, 11])
    expected = logits_and_gradients(model, "eager", tokens, mask)
    assert_close_results(logits_and_gradients(model, "dilated_one_segment", tokens, mask), expected, 1e-6)


def test_gpt_oss_dilated_layers_with_sinks_match_a_dense_reference():
    model = tiny_gpt_oss()
    tokens = torch.randint(0, 61, (2, 23))
    expected = logits_and_gradients(model, "dilated_sink_reference", tokens)
    assert_close_results(logits_and_gradients(model, "dilated", tokens), expected, 1e-6)


def tiny_llama4(**changes):
    torch.manual_seed(0)
    config = Llama4TextConfig(
        vocab_size=61,
        hidden_size=32,
        intermediate_size=48,
        intermediate_size_mlp=48,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=2,
        **changes,
    )
    config._experts_implementation = "eager"
    return Llama4ForCausalLM(config).double().eval()


@torch.no_grad()
def test_layers_that_are_not_full_attention_are_refused():
    """Llama 4's chunked layers attend within chunks (as do sliding layers within a
    window): refused, naming the layer type. With layer_types all full attention, one
    whole segment gives the sdpa logits (to float32 rounding: Llama 4's norms and rotary
    embedding compute in float32)."""
    tokens = torch.randint(0, 61, (2, 17))
    chunked = tiny_llama4(attention_chunk_size=5)
    assert chunked.config.layer_types[0] == "chunked_attention"
    chunked.set_attn_implementation("dilated")
    with pytest.raises(ValueError, match=r"layer 0 is a 'chunked_attention' layer.*'full_attention'"):
        chunked(tokens)
    full = tiny_llama4(attention_chunk_size=5, layer_types=["full_attention"] * 4)
    logits = {}
    for name in ("sdpa", "dilated_one_segment"):
        full.set_attn_implementation(name)
        logits[name] = full(tokens).logits
    a, b = logits["sdpa"], logits["dilated_one_segment"]
    assert float((a - b).abs().max() / a.abs().max()) <= 1e-6


def test_a_sliding_window_as_wide_as_the_longest_segment_changes_nothing():
    """Mistral's sliding window: one of at least max(segment_lengths) = 8 drops no key a
    query attends to (the logits, and generation through DilatedCache, are those
    without it); a narrower one is refused."""
    common = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4)
    torch.manual_seed(0)
    plain = MistralForCausalLM(MistralConfig(**common, num_key_value_heads=2, sliding_window=None)).double().eval()
    plain.set_attn_implementation("dilated")
    tokens = torch.randint(1, 61, (2, 21))  # no pad token (0): no padding
    expected = plain(tokens).logits
    greedy = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    for window, wide_enough in ((8, True), (100, True), (7, False)):
        windowed = MistralForCausalLM(MistralConfig(**common, num_key_value_heads=2, sliding_window=window))
        windowed.load_state_dict(plain.state_dict())
        windowed = windowed.double().eval()
        windowed.set_attn_implementation("dilated")
        if wide_enough:
            assert torch.equal(windowed(tokens).logits, expected)
            got = windowed.generate(tokens, past_key_values=DilatedCache(windowed), **greedy)
            assert torch.equal(got, plain.generate(tokens, **greedy))
        else:
            with pytest.raises(ValueError, match=r"sliding_window=7, narrower than max\(segment_lengths\) = 8"):
                windowed(tokens)


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("softcap", 30.0),
        ("sliding_window", 4),
        ("head_mask", torch.ones(4)),
        ("position_bias", torch.zeros(1, 4, 6, 6)),
        ("sinks", torch.zeros(1, 4, 6, 1)),
        ("indices", torch.zeros(1, 6, 2, dtype=torch.long)),
        ("cu_seq_lens_q", torch.tensor([0, 3, 6])),
        ("s_aux", torch.zeros(1, 4, 6, 1)),
    ],
)
def test_options_that_change_the_attention_are_refused(option, value):
    class Module(torch.nn.Module):
        is_causal = True

    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 4, 6, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    with pytest.raises(ValueError, match=option):
        dilated_attention_forward(
            Module(), q, k, v, None, mode="mixture", head_offsets="interleaved", **BRANCHES, **{option: value}
        )


def test_the_core_package_does_not_import_transformers():
    import subprocess
    import sys

    code = "import sys, dilated_attention, dilated_attention.models; print('transformers' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "False", result.stderr


def test_without_transformers_the_integration_says_how_to_install_it(monkeypatch):
    import importlib

    from dilated_attention.utils.extras import MissingExtra

    monkeypatch.setitem(sys.modules, "transformers", None)
    monkeypatch.delitem(sys.modules, "dilated_attention.integrations.transformers")
    with pytest.raises(MissingExtra, match=re.escape('python3 -m pip install -e ".[hf]"')):
        importlib.import_module("dilated_attention.integrations.transformers")


def test_the_bounded_cache_knows_when_its_window_holds_a_nan_and_the_attention_honours_it():
    """Each chunk is checked as it arrives; the window is marked finite again once the
    NaN's position has left it, and a window marked non-finite gets the library's NaN rows."""
    from dilated_attention.integrations.transformers import _WindowLayer

    class Module(torch.nn.Module):
        num_key_value_groups, is_causal = 2, True

    gen = torch.Generator().manual_seed(4)
    layer = _WindowLayer(sliding_window=8)  # keeps 7 positions, returns them with the new ones

    def chunk(length, nan_at=None):
        k, v = (torch.randn(1, 2, length, 4, generator=gen, dtype=torch.float64) for _ in range(2))
        if nan_at is not None:
            k[0, 1, nan_at, 2] = float("nan")
        return layer.update(k, v)

    keys, _ = chunk(5)
    assert keys.dilated_finite
    keys, values = chunk(1, nan_at=0)  # position 5
    assert not keys.dilated_finite
    q = torch.randn(1, 4, 1, 4, generator=gen, dtype=torch.float64)
    positions = torch.tensor([[5]])
    out, _ = dilated_attention_forward(
        Module(),
        q,
        keys,
        values,
        None,
        scaling=0.5,
        position_ids=positions,
        mode="mixture",
        head_offsets="interleaved",
        **BRANCHES,
    )
    expected = dilated_attention(
        q, keys, values, is_causal=True, softmax_scale=0.5, layout="bhnd", key_offset=0, **BRANCHES
    )
    torch.testing.assert_close(out.transpose(1, 2), expected, equal_nan=True)
    assert out.isnan().any() and not out.isnan().all()  # the rows that attend to it, only
    for length in range(7, 14):  # the window [length - 8, length) still holds position 5
        keys, _ = chunk(1)
        assert layer.cumulative_length == length and not keys.dilated_finite
    keys, _ = chunk(1)  # the window is [6, 14)
    assert keys.dilated_finite and not keys.isnan().any()


@settings(max_examples=30, deadline=None)
@given(st.data())
@torch.no_grad()  # as generate runs (with gradients a layer concatenates)
def test_the_bounded_cache_appends_in_place_as_transformers_concatenates(data):
    """A DilatedCache layer writes short chunks into buffers with room to spare: it
    returns what transformers' sliding-window layer returns, chunk after chunk, with beam
    reorders, batch selections, crops and resets in between; what it returned earlier
    never changes; and its buffers stay within half as many slots again as a call returns."""
    from dilated_attention.integrations.transformers import _WindowLayer

    window = data.draw(st.integers(2, 12))
    ours, theirs = _WindowLayer(sliding_window=window), DynamicSlidingWindowLayer(sliding_window=window)
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
    batch, returned = 3, []
    for _ in range(data.draw(st.integers(1, 25))):
        action = data.draw(st.sampled_from(["chunk", "chunk", "chunk", "reorder", "select", "reset"]))
        if action == "reorder" and ours.get_seq_length():
            beams = torch.randint(0, batch, (batch,), generator=gen)
            ours.reorder_cache(beams)
            theirs.reorder_cache(beams)
            continue
        if action == "select" and ours.get_seq_length() and batch > 1:
            batch -= 1
            kept = torch.arange(batch)
            ours.batch_select_indices(kept)
            theirs.batch_select_indices(kept)
            continue
        if action == "reset":
            ours.reset()
            # what 5.x's reset leaves (4.x's zeroed its positions in place and kept them)
            theirs = DynamicSlidingWindowLayer(sliding_window=window)
            continue
        length = data.draw(st.integers(1, 2 * window))
        k, v = (torch.randn(batch, 2, length, 3, generator=gen, dtype=torch.float64) for _ in range(2))
        got, expected = ours.update(k, v), theirs.update(k, v)
        for a, b in zip(got, expected, strict=True):
            assert torch.equal(a, b)
        assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)
        assert ours.get_seq_length() == theirs.get_seq_length()
        returned.append((got[0], got[0].clone()))
        row_bytes = batch * 2 * 3 * 8  # one position of keys: batch x heads x head_dim x float64
        slots = ours.keys.untyped_storage().nbytes() // row_bytes
        # in place: half as many again as a call returns, a call of at most window // 2 - 1 new
        assert slots <= max((window - 1 + window // 2 - 1) * 3 // 2 + 1, 2 * ours.keys.shape[2])
    for tensor, snapshot in returned:
        assert torch.equal(tensor, snapshot)
