"""LongNetLM: whole sequences, chunks through the cache, sampling, configuration."""

import copy
import math
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dilated_attention import MultiheadDilatedAttention
from dilated_attention.models import LongNetConfig, LongNetLM, sample_next
from dilated_attention.models.config import PRESETS
from dilated_attention.nn.rotary import RotaryEmbedding
from dilated_attention.ops.plan import HEAD_OFFSETS, MODES


def small_config(**changes):
    base = dict(
        vocab_size=37, dim=24, depth=2, heads=4, ffn_dim=40, segment_lengths=(4, 8, 16), dilation_rates=(1, 2, 3)
    )
    return LongNetConfig(**{**base, **changes})


def relative_error(a, b):
    return float((a - b).abs().max() / b.abs().max()) if b.numel() else 0.0


@st.composite
def model_cases(draw):
    branches = draw(st.integers(1, 3))
    mode = draw(st.sampled_from(MODES))
    heads = draw(st.sampled_from([3, 4] if mode == "head_groups" else [1, 2, 4]))
    length = draw(st.integers(1, 90))
    chunks, left = [], length
    while left:
        chunks.append(draw(st.integers(1, left)))
        left -= chunks[-1]
    return dict(
        config=dict(
            heads=heads,
            dim=heads * 6,
            mode=mode,
            head_offsets=draw(st.sampled_from(HEAD_OFFSETS)),
            segment_lengths=tuple(draw(st.lists(st.integers(1, 24), min_size=branches, max_size=branches))),
            dilation_rates=tuple(draw(st.lists(st.integers(1, 4), min_size=branches, max_size=branches))),
            positions=draw(st.sampled_from(["rotary", "none"])),
        ),
        batch=draw(st.integers(1, 2)),
        chunks=chunks,
        seed=draw(st.integers(0, 2**31 - 1)),
    )


@settings(max_examples=50)
@given(model_cases())
def test_cached_chunks_give_the_logits_of_one_full_forward(case):
    torch.manual_seed(case["seed"])
    model = LongNetLM(small_config(**case["config"])).double().eval()
    tokens = torch.randint(0, 37, (case["batch"], sum(case["chunks"])))
    with torch.no_grad():
        full = model(tokens)
    cache, parts, start = model.new_cache(case["batch"]), [], 0
    for size in case["chunks"]:
        with torch.no_grad():
            parts.append(model(tokens[:, start : start + size], cache=cache))
        start += size
    assert torch.equal(cache.position, torch.full((case["batch"],), start))
    assert relative_error(torch.cat(parts, 1), full) <= 1e-9
    keep = case["chunks"][0]  # the last tokens' logits alone (what scoring the end of a text reads)
    with torch.no_grad():
        assert relative_error(model(tokens, logits_to_keep=keep), full[:, -keep:]) <= 1e-12


def test_cache_memory_stays_bounded_over_many_segments():
    config = small_config()
    model = LongNetLM(config).eval()
    cache = model.new_cache(2)
    bound = 2 * config.depth * 4 * (config.max_segment + 3) * config.dim * 4  # bytes, float32, chunks of 3
    peak = 0
    with torch.no_grad():
        for _ in range(200):  # 600 positions: 37 times the longest segment
            model(torch.randint(0, 37, (2, 3)), cache=cache)
            peak = max(peak, cache.nbytes)
    assert 0 < peak <= bound
    assert peak <= cache.max_nbytes(3) == 2 * 2 * 4 * (16 - 1 + 3) * config.dim * 4 * config.depth
    assert cache.layers[0].cached_positions < config.max_segment


@torch.no_grad()
def test_left_padded_prompts_give_each_prompt_its_own_logits():
    torch.manual_seed(1)
    model = LongNetLM(small_config()).double().eval()
    short, long = torch.randint(0, 37, (1, 5)), torch.randint(0, 37, (1, 11))
    padded = torch.cat([torch.zeros(1, 6, dtype=torch.long), short], 1)
    cache = model.new_cache(2, start=torch.tensor([-6, 0]))
    with torch.no_grad():
        logits = model(torch.cat([padded, long]), cache=cache)
    assert relative_error(logits[0, 6:], model(short)[0]) <= 1e-9
    assert relative_error(logits[1], model(long)[0]) <= 1e-9


def test_greedy_generation_follows_the_full_forward_argmax():
    torch.manual_seed(2)
    model = LongNetLM(small_config()).double()
    prompt = torch.randint(0, 37, (2, 9))
    out = model.generate(prompt, 30, temperature=0)
    assert out.shape == (2, 39) and torch.equal(out[:, :9], prompt)
    with torch.no_grad():
        expected = model.eval()(out[:, :-1]).argmax(-1)[:, 8:]
    assert torch.equal(out[:, 9:], expected)
    assert model.generate(prompt[0], 5, top_k=1).shape == (14,)
    for new_tokens in (0, 3):  # int64 ids whatever the prompt's integer dtype, with or without new tokens
        ids = model.generate(prompt.int(), new_tokens, temperature=0)
        assert ids.dtype == torch.int64 and torch.equal(ids, out[:, : 9 + new_tokens])
    assert torch.equal(model.generate(prompt, 12, top_k=1), out[:, :21])
    for max_chunk in (1, 4):  # the prompt fed in parts a static cache takes
        static = model.new_cache(2, static=True, max_chunk=max_chunk)
        assert torch.equal(model.generate(prompt, 30, temperature=0, cache=static), out)


def test_a_refused_prompt_leaves_the_cache_as_it_was():
    """A bad id in a later chunk of the prompt is refused before the first chunk goes
    into the cache: a retry on the same cache is exact."""
    torch.manual_seed(3)
    model = LongNetLM(small_config()).double()
    prompt = torch.randint(0, 37, (2, 40))
    expected = model.generate(prompt, 4, temperature=0)
    bad = prompt.clone()
    bad[1, 30] = 37  # the second chunk of 16
    for static in (False, True):
        cache = model.new_cache(2, static=static)
        with pytest.raises(ValueError, match=r"token ids must lie in \[0, vocab_size=37\)"):
            model.generate(bad, 4, temperature=0, cache=cache)
        assert cache.position.tolist() == [0, 0]
        assert torch.equal(model.generate(prompt, 4, temperature=0, cache=cache), expected)


def test_generation_restores_training_mode_and_repeats_with_a_seed():
    model = LongNetLM(small_config(dropout=0.1))
    prompt = torch.randint(0, 37, (7,))
    first = model.generate(prompt, 20, generator=torch.Generator().manual_seed(5))
    second = model.generate(prompt, 20, generator=torch.Generator().manual_seed(5))
    assert model.training and torch.equal(first, second)


def test_sampling_keeps_only_the_top_k_and_the_top_p_tokens():
    probabilities = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probabilities.log()
    gen = torch.Generator().manual_seed(0)

    def drawn(**kw):
        return {int(sample_next(logits, generator=gen, **kw)) for _ in range(300)}

    assert drawn(top_k=2) == {0, 1}
    assert drawn(top_p=0.5) == {0}
    assert drawn(top_p=0.8) == {0, 1}
    assert drawn(top_p=0.81) == {0, 1, 2}
    assert drawn() == {0, 1, 2, 3}
    assert int(sample_next(logits, temperature=0)) == 0


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        (dict(temperature=-1), "temperature must be a finite number >= 0"),
        (dict(top_p=0), "top_p must be a finite number in (0, 1]"),
        (dict(top_k=0), "top_k must be >= 1"),
    ],
)
def test_bad_sampling_options_are_refused(kwargs, fragment):
    model = LongNetLM(small_config())
    with pytest.raises((ValueError, TypeError), match=fragment.replace("(", r"\(").replace("]", r"\]")):
        model.generate(torch.tensor([1, 2]), 3, **kwargs)


def test_rotary_scores_depend_only_on_the_distance():
    rotary = RotaryEmbedding(8)
    gen = torch.Generator().manual_seed(3)
    q, k = (torch.randn(1, 1, 2, 8, generator=gen, dtype=torch.float64) for _ in range(2))

    def score(m, n):
        return (rotary(q, torch.tensor([m])) * rotary(k, torch.tensor([n]))).sum(-1)

    assert torch.allclose(score(7, 3), score(1_000_004, 1_000_000), rtol=0, atol=1e-9)
    assert not torch.allclose(score(7, 3), score(7, 4))
    x = torch.randn(2, 5, 2, 8, generator=gen)
    per_row = rotary(x, torch.tensor([[0, 1, 2, 3, 4], [10, 11, 12, 13, 14]]))
    assert torch.equal(per_row[1], rotary(x[1:], torch.arange(10, 15))[0])
    with pytest.raises(ValueError, match="head_dim must be even"):
        RotaryEmbedding(7)
    for dtype in (torch.float32, torch.complex64, torch.bool):  # only integer positions: nothing cast or dropped
        with pytest.raises(ValueError, match=f"positions must be integers .* got {dtype}"):
            rotary(x, torch.arange(5).to(dtype))


def test_gradient_checkpointing_gives_the_same_gradients():
    torch.manual_seed(4)
    model = LongNetLM(small_config()).double()
    tokens = torch.randint(0, 37, (2, 30))
    grads = []
    for recompute in (False, True):
        model.gradient_checkpointing = recompute
        model.zero_grad()
        model(tokens).logsumexp(-1).sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads, strict=True):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-12)


def test_magneto_initialisation_scales_with_depth():
    config = small_config(depth=6, dim=64, heads=4, ffn_dim=256)
    model = LongNetLM(config)
    gamma = math.sqrt(math.log(12))
    assert config.gamma == pytest.approx(gamma)
    fc1 = model.blocks[0].ffn.fc1.weight
    expected_std = gamma * math.sqrt(2 / (64 + 256))
    assert float(fc1.detach().std()) == pytest.approx(expected_std, rel=0.1)
    q = model.blocks[0].attention.q_proj.weight
    assert float(q.detach().std()) == pytest.approx(math.sqrt(2 / 128), rel=0.1)
    assert model.head.weight is model.embedding.weight


def test_config_round_trips_through_json_and_presets_match_the_paper():
    for name in PRESETS:
        config = LongNetConfig.preset(name)
        assert LongNetConfig.from_json(config.to_json()) == config
    base = LongNetConfig.preset("paper_base")
    assert (base.dim, base.depth, base.heads) == (768, 12, 12)
    assert base.segment_lengths == (2048, 4096, 8192, 16384, 32768)
    assert base.dilation_rates == (1, 2, 4, 6, 12)
    assert LongNetConfig.preset("tiny", depth=3).depth == 3


@pytest.mark.parametrize(
    ("changes", "fragment"),
    [
        (dict(dim=30, heads=4), "dim (30) must be divisible by heads (4)"),
        (dict(dim=12, heads=4), "rotary positions need an even head dim"),
        (dict(segment_lengths=(4, 8), dilation_rates=(1,)), "dilation_rates"),
        (dict(mode="head_groups", heads=2), "head"),
        (dict(positions="alibi"), "positions must be one of"),
        (dict(depth=0), "depth must be >= 1"),
        (dict(dim=2**31, heads=2**30), "dim x dim = 2147483648 x 2147483648 is a weight matrix"),
        (dict(ffn_dim=2**62), "use a smaller ffn_dim"),
        (dict(vocab_size=2**62), "use a smaller vocab_size"),
    ],
)
def test_bad_configs_are_refused(changes, fragment):
    with pytest.raises((ValueError, TypeError), match=fragment.replace("(", r"\(").replace(")", r"\)")):
        small_config(**changes)


def test_unknown_config_fields_and_presets_are_named():
    with pytest.raises(ValueError, match=r"unknown LongNetConfig field\(s\) \['width'\]"):
        LongNetConfig.from_dict({"width": 3})
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        LongNetConfig.preset("huge")
    with pytest.raises(ValueError, match="must be a JSON object"):
        LongNetConfig.from_json("{")


@pytest.mark.parametrize(
    ("tokens", "fragment"),
    [
        (torch.tensor([[1, 40]]), r"token ids must lie in \[0, vocab_size=37\)"),
        (torch.rand(1, 3), "int64 \\(or int32\\) token ids, got torch.float32: convert ids with .long"),
        (torch.tensor([[1, 2]], dtype=torch.uint8), "convert ids with .long"),
        (torch.tensor([1, 2]), "tokens must have shape \\(batch, seq_len >= 1\\), got \\(2,\\)"),
        (torch.zeros(1, 0, dtype=torch.int64), "got \\(1, 0\\) \\(with process_group: this rank's shard"),
    ],
)
def test_bad_tokens_are_refused(tokens, fragment):
    with pytest.raises(ValueError, match=fragment):
        LongNetLM(small_config())(tokens)


def test_the_multihead_module_checks_its_cache():
    mha = MultiheadDilatedAttention(16, 2, [4, 8], [1, 2], rotary=RotaryEmbedding(8))
    other = MultiheadDilatedAttention(16, 2, [4, 16], [1, 2])
    x = torch.randn(1, 3, 16)
    with pytest.raises(ValueError, match="pass is_causal=True"):
        mha(x, cache=mha.new_cache(1))
    with pytest.raises(ValueError, match="make it with this module's new_cache"):
        mha(x, is_causal=True, cache=other.new_cache(1))
    with pytest.raises(TypeError, match="cache must be a DilatedKVCache"):
        mha(x, is_causal=True, cache=[])
    with pytest.raises(TypeError, match="rotary must be a callable"):
        MultiheadDilatedAttention(16, 2, [4], [1], rotary=3)


def test_sampling_survives_tiny_temperatures_and_refuses_nan_logits():
    logits = torch.tensor([[3.0, 90.0, -5.0]])
    assert int(sample_next(logits, temperature=1e-39)) == 1
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="logits hold NaN or \\+inf"):
            sample_next(torch.tensor([[0.0, bad]]))
    with pytest.raises(ValueError, match="-inf throughout: every token is banned"):
        sample_next(torch.tensor([[0.0, 1.0], [-math.inf, -math.inf]]))


def test_sampling_never_draws_a_token_banned_by_a_minus_inf_logit():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 7, generator=gen)
    logits[:, [0, 4]] = -math.inf
    logits[1, [1, 3, 5, 6]] = -math.inf  # token 2 alone left in row 1
    for kw in ({}, {"temperature": 0}, {"temperature": 5.0}, {"top_k": 6}, {"top_p": 0.9}, {"temperature": 1e-300}):
        drawn = torch.stack([sample_next(logits, generator=gen, **kw) for _ in range(200)])
        assert not torch.isin(drawn, torch.tensor([0, 4])).any() and torch.all(drawn[:, 1] == 2), kw
        assert len(set(drawn[:, 0].tolist())) > 1 or kw.get("temperature", 1) < 1e-3


def test_generation_under_autocast_uses_a_cache_of_the_autocast_dtype():
    model = LongNetLM(small_config())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cache = model.new_cache(1)
        out = model.generate(torch.tensor([1, 2, 3], dtype=torch.uint8), 4, temperature=0, cache=cache)
    assert cache.layers[0].dtype == torch.bfloat16 and out.shape == (7,)


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        (dict(rotary_base=500.0), "base=10000.0 into one with base=500.0"),
        (dict(positions="none"), "Unexpected key(s) in state_dict"),
    ],
)
def test_a_checkpoint_of_other_positions_is_refused(change, fragment):
    """Same parameters, different rotary positions: the outputs would differ silently."""
    source = LongNetLM(small_config())
    target = LongNetLM(small_config(**change))
    with pytest.raises((ValueError, RuntimeError), match=re.escape(fragment)):
        target.load_state_dict(source.state_dict())
    with pytest.raises((ValueError, RuntimeError), match=r"Missing key\(s\)|base=500.0 into one with base=10000.0"):
        source.load_state_dict(target.state_dict())
    same = LongNetLM(small_config())
    same.load_state_dict(source.state_dict())
    tokens = torch.randint(0, 37, (2, 9))
    assert torch.equal(same(tokens), source(tokens))


def test_a_checkpoint_from_before_rotary_states_loads():
    """States of MultiheadDilatedAttention version 1 hold no rotary state: they load as
    if saved with the model's own (a run folder trained before it resumes)."""
    source = LongNetLM(small_config())
    state = source.state_dict()
    old = type(state)((key, value) for key, value in state.items() if not key.endswith("rotary._extra_state"))
    old._metadata = {key: dict(meta) for key, meta in state._metadata.items()}  # type: ignore[attr-defined]
    for key, meta in old._metadata.items():
        if key.endswith("attention") and meta.get("version") == 2:
            meta["version"] = 1
    target = LongNetLM(small_config())
    target.load_state_dict(old)
    tokens = torch.randint(0, 37, (2, 9))
    assert torch.equal(target(tokens), source(tokens))
    new = type(state)((key, value) for key, value in old.items())
    new._metadata = state._metadata  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="Missing key"):  # of version 2, a missing rotary state is refused
        target.load_state_dict(new)


def test_a_tied_model_refuses_an_untied_checkpoint_before_loading_anything():
    """One matrix serves a tied model's embedding and head: loading two different ones
    into it would keep the last silently (a wrong embedding, every logit changed)."""
    torch.manual_seed(6)
    untied, tied = (LongNetLM(small_config(tie_embeddings=tie)) for tie in (False, True))
    before = copy.deepcopy(tied.state_dict())
    with pytest.raises(
        ValueError, match=r"embedding\.weight and head\.weight differ .* into one with tie_embeddings=True"
    ):
        tied.load_state_dict(untied.state_dict())
    assert all(torch.equal(t, before[name]) for name, t in tied.state_dict().items() if isinstance(t, torch.Tensor))
    tokens = torch.randint(0, 37, (2, 9))
    for source, target in ((tied, LongNetLM(small_config(tie_embeddings=True))), (tied, untied)):
        target.load_state_dict(source.state_dict())  # equal matrices: both configurations compute the same
        assert torch.equal(target(tokens), source(tokens))
    other = LongNetLM(small_config(tie_embeddings=True))
    other.load_state_dict(copy.deepcopy(tied.state_dict()))  # equal, and after a deep copy still one tensor
    state = tied.state_dict()
    state["head.weight"] = state["head.weight"].clone()  # equal, two tensors (as from another format)
    other.load_state_dict(state)
    assert other.head.weight is other.embedding.weight and torch.equal(other(tokens), tied(tokens))


def test_streamed_tokens_are_ordinary_tensors():
    """``stream`` runs under inference mode; what it yields can be changed in place and
    used where autograd records."""
    from dilated_attention.models import stream

    model = LongNetLM(small_config())
    tokens = list(stream(model, torch.tensor([1, 2, 3]), 3, temperature=0))
    assert not any(t.is_inference() for t in tokens)
    tokens[0] += 1
    embedding = torch.nn.Embedding(40, 2)
    embedding(tokens[1]).sum().backward()
    assert embedding.weight.grad is not None


@pytest.mark.parametrize(
    ("call", "error", "fragment"),
    [
        (lambda m: m.new_cache(0), ValueError, "batch_size must be >= 1, got 0"),
        (lambda m: m.new_cache(2, max_chunk=-5), ValueError, "max_chunk must be >= 1, got -5"),
        (lambda m: m.new_cache(2, max_chunk="x"), TypeError, "max_chunk must be an int, got str"),
        (lambda m: sample_next(torch.zeros(2, 0)), ValueError, "vocab_size of 0"),
        (lambda m: LongNetConfig.preset(["tiny"]), TypeError, "a preset's name \\(a str\\), got list"),
    ],
)
def test_model_arguments_are_named_in_their_refusals(call, error, fragment):
    with pytest.raises(error, match=fragment):
        call(LongNetLM(small_config()))


def test_loading_ties_the_head_again_after_assign_and_to_empty():
    """``load_state_dict(..., assign=True)`` and ``to_empty`` (after building on the meta
    device) give the head its own matrix; loading ties it to the embedding again, so
    training updates one matrix, as in a model built plainly."""
    torch.manual_seed(7)
    source = LongNetLM(small_config())
    count = source.num_parameters()
    assigned = LongNetLM(small_config())
    assigned.load_state_dict(source.state_dict(), assign=True)
    with torch.device("meta"):
        empty = LongNetLM(small_config())
    empty.to_empty(device="cpu")
    assert empty.head.weight is not empty.embedding.weight  # PyTorch's to_empty unties
    empty.load_state_dict(source.state_dict())
    tokens = torch.randint(0, 37, (2, 9))
    for model in (assigned, empty):
        assert model.head.weight is model.embedding.weight and model.num_parameters() == count
        assert torch.equal(model(tokens), source(tokens))
    untied = LongNetLM(small_config(tie_embeddings=False))
    untied.tie_weights()  # nothing without tie_embeddings
    assert untied.head.weight is not untied.embedding.weight


def test_a_refused_checkpoint_changes_no_weight():
    """The layers' configurations are checked before any tensor loads (the embedding
    loaded before the first layer's branches were read)."""
    source = LongNetLM(small_config(segment_lengths=(4, 8, 32)))
    target = LongNetLM(small_config())
    before = copy.deepcopy(target.state_dict())
    with pytest.raises(
        ValueError, match=re.escape("segment_lengths=[4, 8, 32] into one with segment_lengths=[4, 8, 16]")
    ):
        target.load_state_dict(source.state_dict())
    assert all(torch.equal(t, before[name]) for name, t in target.state_dict().items() if isinstance(t, torch.Tensor))


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore:torch.quantize_per_tensor:UserWarning")
def test_a_dynamically_quantized_model_generates():
    quantize = getattr(getattr(torch.ao, "quantization", None), "quantize_dynamic", None)
    if quantize is None:
        pytest.skip("this torch has no torch.ao.quantization.quantize_dynamic")
    torch.manual_seed(8)
    model = LongNetLM(small_config()).eval()
    quantized = quantize(model, {torch.nn.Linear}, dtype=torch.qint8)
    prompt = torch.randint(0, 37, (2, 9))
    out = quantized.generate(prompt, 6, temperature=0)
    with torch.no_grad():
        assert torch.equal(out[:, 9:], quantized(out[:, :-1]).argmax(-1)[:, 8:])  # greedy: its own full forwards


def test_skeleton_loads_and_partial_head_loads_keep_what_was_loaded():
    """A model built on the meta device takes a meta state_dict with ``assign=True``
    (its values cannot be compared), and a state_dict holding the head alone loads the
    head's matrix into the tied pair with ``assign=True`` as without it."""
    with torch.device("meta"):
        skeleton = LongNetLM(small_config())
    source = LongNetLM(small_config())
    meta_state = {name: t.to("meta") if isinstance(t, torch.Tensor) else t for name, t in source.state_dict().items()}
    meta_state["head.weight"] = meta_state["embedding.weight"].clone()  # two tensors, as torch.load may give
    skeleton.load_state_dict(meta_state, assign=True)
    assert skeleton.head.weight is skeleton.embedding.weight and skeleton.head.weight.is_meta
    loaded = torch.randn(37, 24)
    for assign in (False, True):
        model = LongNetLM(small_config())
        model.load_state_dict({"head.weight": loaded.clone()}, strict=False, assign=assign)
        assert model.head.weight is model.embedding.weight and torch.equal(model.head.weight, loaded), assign
