"""dilated attention inside transformers models (tiny ones built from configs, no downloads)."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import (  # noqa: E402
    AttentionInterface,
    GPTBigCodeConfig,
    GPTBigCodeForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)
from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask  # noqa: E402

from dilated_attention import reference_dilated_attention  # noqa: E402
from dilated_attention.integrations.transformers import DilatedCache, dilated_attention_forward, register  # noqa: E402

BRANCHES = dict(segment_lengths=[4, 8], dilation_rates=[1, 2])
register("dilated", **BRANCHES)
register("dilated_one_segment", segment_lengths=[4096], dilation_rates=[1])
# generate's argument for a cache: renamed in transformers 5
CACHE_ARGUMENT = "cache" if int(transformers.__version__.split(".")[0]) >= 5 else "past_key_values"


def _reference_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """The same attention through the dense float64 reference (no padding)."""
    groups = module.num_key_value_groups
    key, value = (t.repeat_interleave(groups, dim=1).transpose(1, 2) for t in (key, value))
    out, _ = reference_dilated_attention(query.transpose(1, 2), key, value, is_causal=True, softmax_scale=scaling,
                                         **BRANCHES)
    return out.to(query.dtype), None


AttentionInterface.register("dilated_reference", _reference_forward)
AttentionMaskInterface.register("dilated_reference", flash_attention_mask)


def tiny(family, **changes):
    torch.manual_seed(0)
    common = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common, **changes))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**common, **changes))
    return model.double().eval()


def left_padded(batch_tokens, lengths):
    """Right-aligned rows: the last ``lengths[b]`` tokens of each row are real."""
    mask = torch.zeros(batch_tokens.shape, dtype=torch.long)
    for row, length in enumerate(lengths):
        mask[row, batch_tokens.shape[1] - length :] = 1
    return mask


@pytest.mark.parametrize("family", ["llama", "qwen2"])
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


@pytest.mark.parametrize("family", ["llama", "qwen2"])
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
    for ga, gb in zip(grads_a, grads_b):
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
    out, weights = dilated_attention_forward(Module(), q, k, v, mask, scaling=0.3, position_ids=positions,
                                             mode="mixture", head_offsets="interleaved", **BRANCHES)
    assert weights is None and out.shape == (3, 5, 6, 8)
    for row, skip, first in ((0, 0, 0), (1, 7, 0), (2, 0, 16)):
        keys = [t[row : row + 1, :, skip:].repeat_interleave(3, dim=1).transpose(1, 2) for t in (k, v)]
        expected, _ = reference_dilated_attention(q[row : row + 1].transpose(1, 2), *keys, is_causal=True,
                                                  softmax_scale=0.3, key_padding_mask=~mask[row : row + 1, skip:],
                                                  key_offset=first, **BRANCHES)
        assert torch.allclose(out[row : row + 1], expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("bounded", [False, True], ids=["default-cache", "DilatedCache"])
@torch.no_grad()
def test_greedy_generation_is_the_full_forward_argmax_and_left_padding_changes_nothing(family, bounded):
    model = tiny(family)
    model.set_attn_implementation("dilated")
    tokens = torch.randint(0, 61, (2, 13))
    mask = left_padded(tokens, [13, 6])
    # With DilatedCache each layer keeps max(w) - 1 = 7 positions: the window slides
    # through the prompt and past row 1's padding while generating.
    cache = {CACHE_ARGUMENT: DilatedCache(model)} if bounded else {}
    result = model.generate(tokens, attention_mask=mask, max_new_tokens=12, do_sample=False,
                            output_logits=True, return_dict_in_generate=True, pad_token_id=0, **cache)
    for row, length in enumerate([13, 6]):
        sequence = tokens[row : row + 1, 13 - length :]
        for step in range(12):
            logits = model(sequence).logits[0, -1]
            # generate hands its logits out in float32: equal up to that rounding.
            assert torch.allclose(result.logits[step][row], logits.float(), rtol=1e-6, atol=1e-6)
            sequence = torch.cat([sequence, logits.argmax().view(1, 1)], 1)
        assert torch.equal(result.sequences[row, 13:], sequence[0, length:])
    if bounded:
        layers = cache[CACHE_ARGUMENT].layers
        assert len(layers) == 2 and all(layer.keys.shape[2] == max(BRANCHES["segment_lengths"]) - 1 for layer in layers)


@torch.no_grad()
def test_the_bounded_cache_fed_in_chunks_gives_the_full_forward():
    model = tiny("llama")
    model.set_attn_implementation("dilated")
    tokens = torch.randint(0, 61, (2, 41))
    expected = model(tokens).logits
    cache = DilatedCache(model)
    pieces, start = [], 0
    for size in (9, 1, 5, 13, 1, 1, 11):
        pieces.append(model(tokens[:, start : start + size], **{CACHE_ARGUMENT: cache}, use_cache=True).logits)
        start += size
        # layers x (k, v) x kept positions (max(w) - 1) x batch x key/value heads x head dim x 8 bytes,
        # in memory of at most twice that (never the whole of a long chunk's keys)
        kept = 2 * 2 * min(start, 7) * 2 * 2 * 8 * 8
        assert kept <= cache.nbytes <= 2 * kept
    got = torch.cat(pieces, 1)
    assert float((got - expected).abs().max() / expected.abs().max()) <= 1e-12


def test_the_bounded_cache_needs_a_registration():
    model = tiny("llama")
    with pytest.raises(ValueError, match="not a dilated attention registration"):
        DilatedCache(model)  # still "eager"/"sdpa"
    assert DilatedCache(model, name="dilated").window == 8
    with pytest.raises(TypeError, match="transformers model or config"):
        DilatedCache("llama")


@torch.no_grad()
def test_a_model_that_passes_no_position_ids_uses_the_cache_window():
    """GPTBigCode (multi-query: one key/value head) hands its attention no
    position_ids: DilatedCache tells the function where its window starts, so the
    bounded cache generates what the default cache does; left padding, whose
    positions such a model does not say, is refused."""
    torch.manual_seed(0)
    model = GPTBigCodeForCausalLM(GPTBigCodeConfig(n_embd=48, n_layer=2, n_head=6, vocab_size=61, multi_query=True,
                                                   bos_token_id=0, eos_token_id=None)).double().eval()
    model.set_attn_implementation("dilated")
    model.generation_config.eos_token_id = None
    tokens = torch.randint(1, 61, (1, 12))
    options = dict(max_new_tokens=10, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    default = model.generate(tokens, **options)
    bounded = model.generate(tokens, **options, **{CACHE_ARGUMENT: DilatedCache(model)})
    assert torch.equal(default.sequences, bounded.sequences)
    assert max(float((a - b).abs().max()) for a, b in zip(default.logits, bounded.logits)) <= 1e-5
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
    out = model.generate(tokens, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0,
                         output_logits=True, return_dict_in_generate=True)
    alone = model.generate(tokens[:1], max_new_tokens=3, do_sample=False, pad_token_id=0, output_logits=True,
                           return_dict_in_generate=True)
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
    with pytest.raises(ValueError, match="output_attentions"):
        model(tokens, output_attentions=True)
    model.model.layers[0].self_attn.is_causal = False
    with pytest.raises(ValueError, match="causal self-attention only"):
        model(tokens)
    windowed = tiny("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=0)
    windowed.set_attn_implementation("dilated")
    with pytest.raises(ValueError, match="sliding_window"):
        windowed(tokens)
    with pytest.raises(ValueError, match="new attention implementation name"):
        register("sdpa", **BRANCHES)


def test_the_core_package_does_not_import_transformers():
    import subprocess
    import sys

    code = "import sys, dilated_attention, dilated_attention.models; print('transformers' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "False", result.stderr
