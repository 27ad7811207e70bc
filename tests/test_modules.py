"""The nn.Module wrappers."""

import io
import re
import warnings

import pytest
import torch

from dilated_attention import (
    DilatedAttention,
    MultiheadDilatedAttention,
    dilated_attention,
    reference_dilated_attention,
)
from dilated_attention.tools.check import max_relative_error
from helpers import random_inputs

SEGS, RATES = [4, 8, 32], [1, 2, 4]


def test_dilated_attention_module_matches_function():
    (q, k, v), _, mask = random_inputs(0, 2, 30, 5, 4, masked=True)
    module = DilatedAttention(SEGS, RATES, mode="head_groups", softmax_scale=0.3)
    out = module(q, k, v, is_causal=True, key_padding_mask=mask)
    expected = dilated_attention(
        q, k, v, SEGS, RATES, mode="head_groups", softmax_scale=0.3, is_causal=True, key_padding_mask=mask
    )
    assert torch.equal(out, expected)
    assert "segment_lengths=[4, 8, 32]" in repr(module)


def reference_mha(mha, query, key, value, **kwargs):
    """The module's computation with the dense reference in place of the library."""
    heads = (mha.num_heads, mha.embed_dim // mha.num_heads)
    q, k, v = (
        proj(x).unflatten(-1, heads) for proj, x in ((mha.q_proj, query), (mha.k_proj, key), (mha.v_proj, value))
    )
    att = mha.attention
    x, _ = reference_dilated_attention(q, k, v, att.segment_lengths, att.dilation_rates, mode=att.mode, **kwargs)
    x = x.flatten(-2)
    if mha.norm is not None:
        x = mha.norm(x)
    return mha.out_proj(x)


@pytest.mark.parametrize("mode", ["mixture", "head_groups"])
@pytest.mark.parametrize("sub_layernorm", [True, False])
def test_multihead_matches_reference_with_parameter_gradients(mode, sub_layernorm):
    torch.manual_seed(0)
    mha = MultiheadDilatedAttention(24, 3, SEGS, RATES, mode=mode, sub_layernorm=sub_layernorm, dtype=torch.float64)
    gen = torch.Generator().manual_seed(1)
    query, key, value = (torch.randn(2, 19, 24, generator=gen, dtype=torch.float64) for _ in range(3))
    mask = torch.rand(2, 19, generator=gen) < 0.3
    out, weights = mha(query, key, value, key_padding_mask=mask, is_causal=True)
    assert weights is None and out.shape == (2, 19, 24)
    grads = torch.autograd.grad(out.square().sum(), list(mha.parameters()))
    expected = reference_mha(mha, query, key, value, key_padding_mask=mask, is_causal=True)
    ref_grads = torch.autograd.grad(expected.square().sum(), list(mha.parameters()))
    assert max_relative_error(out, expected) <= 1e-10
    assert max_relative_error(grads, ref_grads) <= 1e-10


def test_multihead_takes_nn_multihead_attentions_arguments_in_its_order():
    """``(query, key, value, key_padding_mask, need_weights, attn_mask,
    average_attn_weights, is_causal)``: the causal mask (bool or float) makes the call
    causal, a float padding mask of 0 and -inf is the bool one; the result equals the
    reference's."""
    torch.manual_seed(0)
    mha = MultiheadDilatedAttention(24, 3, SEGS, RATES, dtype=torch.float64)
    x = torch.randn(2, 19, 24, dtype=torch.float64)
    pad = torch.rand(2, 19) < 0.3
    expected = reference_mha(mha, x, x, x, key_padding_mask=pad, is_causal=True)
    float_pad = torch.zeros(2, 19, dtype=torch.float64).masked_fill(pad, -torch.inf)
    bool_causal = torch.ones(19, 19, dtype=torch.bool).triu(1)
    float_causal = torch.nn.Transformer.generate_square_subsequent_mask(19, dtype=torch.float32)
    for padding in (pad, float_pad):
        for mask in (bool_causal, float_causal):
            out, weights = mha(x, x, x, padding, False, mask, True, False)
            assert weights is None and max_relative_error(out, expected) <= 1e-10
    causal = mha(x, is_causal=True)[0]
    assert torch.equal(mha(x, attn_mask=float_causal, is_causal=True)[0], causal)
    # With is_causal=True the mask is PyTorch's hint: its values are not read.
    assert torch.equal(mha(x, attn_mask=torch.zeros(19, 19), is_causal=True)[0], causal)


@pytest.mark.parametrize(
    ("kwargs", "exc", "fragment"),
    [
        (dict(attn_mask=torch.zeros(7, 7)), ValueError, "attn_mask must be None or the causal mask of the sequence"),
        (dict(attn_mask=torch.ones(7, 7, dtype=torch.bool).tril(-1)), ValueError, "got another (7, 7) mask"),
        (dict(attn_mask=torch.ones(7, 7, dtype=torch.bool).triu(1)[None]), ValueError, "of shape (1, 7, 7)"),
        (dict(attn_mask=torch.ones(7, 7, dtype=torch.int64).triu(1)), ValueError, "got a torch.int64 mask"),
        (dict(attn_mask=[[0.0] * 7] * 7), TypeError, "attn_mask must be a torch.Tensor or None, got list"),
        (dict(average_attn_weights=None), TypeError, "average_attn_weights must be a bool"),
        (
            dict(attn_mask=torch.ones(7, 7, dtype=torch.bool, device="meta").triu(1)),
            ValueError,
            "attn_mask must be on the device of the query (cpu), got meta",
        ),
        (
            dict(key_padding_mask=torch.zeros(2, 7, device="meta")),
            ValueError,
            "key_padding_mask must be on the device of the query (cpu), got meta",
        ),
        (
            dict(attn_mask=torch.ones(2, 2, dtype=torch.bool).triu(1)),
            ValueError,
            "(the query was read as (batch, seq_len, embed_dim) with batch_first=True: is that its layout?)",
        ),
        (
            dict(key_padding_mask=torch.full((2, 7), -1e9)),
            ValueError,
            "key_padding_mask must be bool (True = padding) or a float mask of 0 and -inf",
        ),
    ],
)
def test_multihead_refuses_what_dilated_attention_cannot_mean(kwargs, exc, fragment):
    mha = MultiheadDilatedAttention(8, 2, [4], [1])
    with pytest.raises(exc, match=re.escape(fragment)):
        mha(torch.randn(2, 7, 8), **kwargs)


@pytest.mark.parametrize("norm_first", [False, True])
def test_multihead_is_the_self_attention_of_pytorchs_transformer_layers(norm_first):
    """As ``self_attn`` of ``nn.TransformerEncoderLayer`` (training and eval: the layer's
    fast path checks its attributes) and of ``nn.TransformerDecoderLayer``, with the
    causal mask and padding the layers pass (both made float): the layer computes what
    its own formula computes with the module called directly."""
    torch.manual_seed(0)
    dim, heads, length = 24, 3, 21
    layer = torch.nn.TransformerEncoderLayer(
        dim, heads, dim_feedforward=32, dropout=0.0, batch_first=True, norm_first=norm_first, dtype=torch.float64
    )
    layer.self_attn = MultiheadDilatedAttention(dim, heads, SEGS, RATES, dtype=torch.float64)
    x = torch.randn(2, length, dim, dtype=torch.float64)
    pad = torch.zeros(2, length, dtype=torch.bool)
    pad[0, :4] = True
    mask = torch.nn.Transformer.generate_square_subsequent_mask(length, dtype=torch.float64)
    float_pad = torch.zeros(2, length, dtype=torch.float64).masked_fill(pad, -torch.inf)

    def attend(z):
        return layer.self_attn(z, key_padding_mask=pad, is_causal=True)[0]

    if norm_first:
        h = x + attend(layer.norm1(x))
        expected = h + layer._ff_block(layer.norm2(h))
    else:
        h = layer.norm1(x + attend(x))
        expected = layer.norm2(h + layer._ff_block(h))
    for training in (True, False):
        layer.train(training)
        for is_causal in (True, False):  # the layer's hint, or the mask alone
            out = layer(x, src_mask=mask, is_causal=is_causal, src_key_padding_mask=float_pad)
            assert max_relative_error(out, expected) <= 1e-12
    with pytest.raises(ValueError, match="attn_mask must be None or the causal mask"):
        layer(x, src_mask=torch.zeros(length, length, dtype=torch.float64))
    decoder = torch.nn.TransformerDecoderLayer(dim, heads, 32, 0.0, batch_first=True, dtype=torch.float64)
    decoder.self_attn = layer.self_attn
    out = decoder(x, x, tgt_mask=mask, tgt_is_causal=True)
    h = decoder.norm1(x + layer.self_attn(x, is_causal=True)[0])
    h = decoder.norm2(h + decoder._mha_block(h, x, None, None))
    assert max_relative_error(out, decoder.norm3(h + decoder._ff_block(h))) <= 1e-12


def test_nested_tensors_are_refused_saying_how_to_avoid_them():
    """``nn.TransformerEncoder`` built around ``nn.MultiheadAttention`` hands its layers
    nested tensors in eval mode with a padding mask; built around this module, or
    without nested tensors, it runs."""
    torch.manual_seed(0)
    x = torch.randn(2, 12, 16)
    pad = torch.zeros(2, 12, dtype=torch.bool)
    pad[0, -5:] = True
    with warnings.catch_warnings():  # PyTorch's notes on nested tensors and on its fast path
        warnings.simplefilter("ignore")
        encoder = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(16, 2, 32, 0.0, batch_first=True), 2)
        for layer in encoder.layers:
            layer.self_attn = MultiheadDilatedAttention(16, 2, [4, 8], [1, 2])
        encoder.eval()
        with torch.no_grad(), pytest.raises(ValueError, match="query must be a dense tensor, got a nested tensor"):
            encoder(x, src_key_padding_mask=pad)
        encoder.use_nested_tensor = False  # as the message says
        with torch.no_grad():
            once = encoder.layers[0](x, src_key_padding_mask=pad)
            assert torch.allclose(
                encoder(x, src_key_padding_mask=pad),
                encoder.layers[1](once, src_key_padding_mask=pad),
                rtol=1e-6,
                atol=1e-6,
            )
        layer = encoder.layers[0]
        rebuilt = torch.nn.TransformerEncoder(layer, 2).eval()  # built around this module: two copies of layer
        with torch.no_grad():
            twice = layer(layer(x, src_key_padding_mask=pad), src_key_padding_mask=pad)
            assert torch.allclose(rebuilt(x, src_key_padding_mask=pad), twice, rtol=1e-6, atol=1e-6)
        nested = torch.nested.nested_tensor([torch.randn(5, 2, 4), torch.randn(3, 2, 4)])
    with pytest.raises(ValueError, match="q must be a dense tensor, got a nested tensor: pad the sequences"):
        dilated_attention(nested, nested, nested, [4], [1])


def test_multihead_runs_on_the_meta_device_for_shapes():
    """As ``nn.MultiheadAttention`` does (deferred initialisation, shape inference): no
    value is read, and a device without autocast is not asked about it."""
    mha = MultiheadDilatedAttention(16, 2, SEGS, RATES, device="meta")
    out, _ = mha(torch.empty(2, 9, 16, device="meta"), is_causal=True)
    assert out.shape == (2, 9, 16) and out.device.type == "meta"
    assert mha.new_cache(2).device.type == "meta"


def test_key_and_value_default_to_query():
    torch.manual_seed(0)
    mha = MultiheadDilatedAttention(16, 4, SEGS, RATES)
    x = torch.randn(2, 10, 16)
    assert torch.equal(mha(x)[0], mha(x, x, x)[0])


def test_state_dict_round_trip():
    torch.manual_seed(0)
    source = MultiheadDilatedAttention(32, 4, SEGS, RATES, gamma_init=0.5)
    buffer = io.BytesIO()
    torch.save(source.state_dict(), buffer)
    buffer.seek(0)
    torch.manual_seed(1)
    target = MultiheadDilatedAttention(32, 4, SEGS, RATES)
    x = torch.randn(2, 12, 32)
    assert not torch.allclose(source(x)[0], target(x)[0])
    target.load_state_dict(torch.load(buffer))
    assert torch.equal(source(x)[0], target(x)[0])
    assert set(source.state_dict()) == {
        f"{name}.{p}" for name in ("q_proj", "k_proj", "v_proj", "out_proj", "norm") for p in ("weight", "bias")
    } | {"_extra_state", "attention._extra_state"}


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        (dict(num_heads=8), "num_heads=4 into one with num_heads=8"),
        (dict(segment_lengths=[4, 8, 16]), "segment_lengths=[4, 8, 32] into one with segment_lengths=[4, 8, 16]"),
        (dict(dilation_rates=[1, 2, 8]), "dilation_rates"),
        (dict(mode="head_groups"), "mode='mixture' into one with mode='head_groups'"),
    ],
)
def test_state_dict_of_another_configuration_is_refused(change, fragment):
    """Same parameter shapes, different computation: loading must fail, not succeed
    silently, and before any weight loads (the projections load before the inner
    attention's configuration would be read), inside another module too."""
    config = dict(embed_dim=32, num_heads=4, segment_lengths=SEGS, dilation_rates=RATES)
    source = MultiheadDilatedAttention(**config)
    buffer = io.BytesIO()
    torch.save(source.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer)
    target = MultiheadDilatedAttention(**{**config, **change})
    outer, outer_source = (
        torch.nn.Sequential(torch.nn.Identity(), target),
        torch.nn.Sequential(torch.nn.Identity(), source),
    )
    before = [p.clone() for p in target.parameters()]
    for module, state in ((target, saved), (outer, outer_source.state_dict())):
        with pytest.raises(ValueError, match=re.escape(fragment)):
            module.load_state_dict(state)
        assert all(torch.equal(p, b) for p, b in zip(target.parameters(), before, strict=True))


def test_sequence_first_inputs_with_batch_first_false():
    """``batch_first=False`` takes and returns ``(N, B, E)`` like ``nn.MultiheadAttention``'s
    default; the padding mask stays ``(B, N)``."""
    torch.manual_seed(0)
    mha = MultiheadDilatedAttention(16, 4, SEGS, RATES, dtype=torch.float64)
    seq_first = MultiheadDilatedAttention(16, 4, SEGS, RATES, batch_first=False, dtype=torch.float64)
    seq_first.load_state_dict(mha.state_dict())
    x = torch.randn(2, 13, 16, dtype=torch.float64)
    mask = torch.rand(2, 13) < 0.3
    expected, _ = mha(x, key_padding_mask=mask, is_causal=True)
    out, _ = seq_first(x.transpose(0, 1), key_padding_mask=mask, is_causal=True)
    assert torch.equal(out.transpose(0, 1), expected)
    with pytest.raises(ValueError, match="is that its layout"):
        mha(x.transpose(0, 1), key_padding_mask=mask)


def test_jit_trace_of_the_multihead_module():
    """Traced as ``nn.MultiheadAttention`` is traced (through its output tensor: ``None``
    cannot be a traced output), for the input shape it was traced with, which a
    warning says (the plan depends on the shape)."""

    class OutputOnly(torch.nn.Module):
        def __init__(self, mha):
            super().__init__()
            self.mha = mha

        def forward(self, x):
            return self.mha(x, is_causal=True)[0]

    torch.manual_seed(0)
    mha = MultiheadDilatedAttention(16, 4, SEGS, RATES, dtype=torch.float64).eval()
    x = torch.randn(2, 30, 16, dtype=torch.float64)
    with warnings.catch_warnings():
        # pytest.warns records every warning and passes on those it does not match: here, ignored.
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.warns(UserWarning, match=r"for q of shape \(2, 30, 4, 4\)"):
            traced = torch.jit.trace(OutputOnly(mha), (x,), check_trace=False)
    y = torch.randn_like(x)
    assert max_relative_error(traced(y), mha(y, is_causal=True)[0]) <= 1e-12


def test_magneto_initialisation():
    torch.manual_seed(0)
    mha = MultiheadDilatedAttention(512, 8, SEGS, RATES, gamma_init=2.0)
    xavier_std = (2.0 / (512 + 512)) ** 0.5
    for proj, gain in ((mha.q_proj, 1.0), (mha.k_proj, 1.0), (mha.v_proj, 2.0), (mha.out_proj, 2.0)):
        assert abs(proj.weight.std().item() / (gain * xavier_std) - 1) < 0.02
        assert torch.all(proj.bias == 0)


def test_state_dicts_saved_before_head_offsets_existed_load_as_interleaved():
    module = DilatedAttention(SEGS, RATES)
    state = module.state_dict()
    del state["_extra_state"]["head_offsets"]
    module.load_state_dict(state)
    with pytest.raises(ValueError, match="head_offsets='interleaved' into one with head_offsets='contiguous'"):
        DilatedAttention(SEGS, RATES, head_offsets="contiguous").load_state_dict(state)


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore:torch.quantize_per_tensor:UserWarning")
def test_dynamically_quantized_projections_run_with_and_without_a_cache():
    """``torch.ao.quantization.quantize_dynamic`` makes each projection's ``weight`` a
    method (int8 values): the module takes float32 inputs as before, whole or through
    its cache (each call quantizes its own activations, so chunks round differently)."""
    quantize = getattr(getattr(torch.ao, "quantization", None), "quantize_dynamic", None)
    if quantize is None:
        pytest.skip("this torch has no torch.ao.quantization.quantize_dynamic")
    torch.manual_seed(5)
    mha = MultiheadDilatedAttention(32, 4, SEGS, RATES).eval()
    quantized = quantize(mha, {torch.nn.Linear}, dtype=torch.qint8)
    x = torch.randn(2, 37, 32)
    with torch.no_grad():
        exact = mha(x, is_causal=True)[0]
        assert max_relative_error(quantized(x, is_causal=True)[0], exact) < 0.1  # int8 rounding
        cache = quantized.new_cache(2)
        assert cache.dtype == torch.float32
        chunks = [quantized(part, is_causal=True, cache=cache)[0] for part in x.split([20, 1, 16], dim=1)]
    assert max_relative_error(torch.cat(chunks, 1), exact) < 0.1


def test_a_cache_of_another_dtype_than_the_projections_is_named():
    """A cache made outside ``torch.autocast`` and used inside it (or the reverse): the
    module says which dtype each has and how to make the cache."""
    mha = MultiheadDilatedAttention(16, 2, [4], [1]).eval()
    x = torch.randn(1, 3, 16)
    outside = mha.new_cache(1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = mha.new_cache(1)
        with pytest.raises(ValueError, match=re.escape("give torch.bfloat16 (torch.autocast's dtype): make")):
            mha(x, is_causal=True, cache=outside)
    with pytest.raises(ValueError, match=re.escape("or pass dtype=torch.float32 to new_cache")):
        mha(x, is_causal=True, cache=inside)
    assert outside.position.tolist() == [0] and inside.position.tolist() == [0]


def test_autocast_leaves_float64_projections_and_quantized_ones_run_under_it():
    """Inside ``torch.autocast`` a float64 module's projections stay float64: its cache
    is float64 (made inside or outside) and gives the whole call's output; dynamically
    quantized projections take the attention's output in float32."""
    torch.manual_seed(9)
    mha = MultiheadDilatedAttention(16, 2, [4, 8], [1, 2], dtype=torch.float64).eval()
    x = torch.randn(1, 11, 16, dtype=torch.float64)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        whole = mha(x, is_causal=True)[0]
        cache = mha.new_cache(1)
        assert cache.dtype == torch.float64
        chunks = torch.cat([mha(part, is_causal=True, cache=cache)[0] for part in x.split([6, 5], dim=1)], 1)
    assert max_relative_error(chunks, whole) < 1e-12
    quantize = getattr(getattr(torch.ao, "quantization", None), "quantize_dynamic", None)
    if quantize is None:
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantized = quantize(MultiheadDilatedAttention(16, 2, [4, 8], [1, 2]).eval(), {torch.nn.Linear})
        y = torch.randn(1, 11, 16)
        with torch.no_grad():
            plain = quantized(y, is_causal=True)[0]
            with torch.autocast("cpu", dtype=torch.bfloat16):
                mixed = quantized(y, is_causal=True)[0]
    assert mixed.dtype == torch.float32 and max_relative_error(mixed, plain) < 0.05  # bfloat16 attention
