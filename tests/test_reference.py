"""The reference itself, against a scalar loop written straight from the definition
(docs/definition.md), and its argument checks."""

import math
import re

import pytest
import torch
from hypothesis import given

from dilated_attention.reference import attention_weights_uniform, reference_dilated_attention
from helpers import configs, random_inputs, split_config


def spec_loop(q, k, v, segment_lengths, dilation_rates, mode, head_offsets, is_causal, softmax_scale, mask):
    """The definition, one (batch, position, head) at a time, in Python floats."""
    batch, n, heads, dim = q.shape
    scale = dim**-0.5 if softmax_scale is None else softmax_scale
    groups = len(segment_lengths)
    sizes = [heads // groups + (1 if i < heads % groups else 0) for i in range(groups)]
    group_of = [i for i, size in enumerate(sizes) for _ in range(size)]
    out = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.full(q.shape[:3], -math.inf, dtype=torch.float64)
    for b in range(batch):
        for h in range(heads):
            for p in range(n):
                results = []
                for i, (w, r) in enumerate(zip(segment_lengths, dilation_rates, strict=True)):
                    if mode == "head_groups" and group_of[h] != i:
                        continue
                    if mode == "head_groups":
                        offset = i % r
                    elif head_offsets == "interleaved":
                        offset = h % r
                    else:
                        offset = h // math.ceil(heads / r)
                    s = p // w
                    if (p - s * w) % r != offset:
                        continue
                    keys = [
                        key
                        for key in range(s * w, min((s + 1) * w, n))
                        if (key - s * w) % r == offset
                        and not (is_causal and key > p)
                        and not (mask is not None and mask[b, key])
                    ]
                    if not keys:
                        continue
                    logits = [float(q[b, p, h] @ k[b, key, h]) * scale for key in keys]
                    top = max(logits)
                    weights = [math.exp(x - top) for x in logits]
                    total = sum(weights)
                    o = sum(wt * v[b, key, h].double() for wt, key in zip(weights, keys, strict=True)) / total
                    results.append((o, math.log(total) + top))
                if not results:
                    continue
                if mode == "mixture":
                    big = math.log(sum(math.exp(part) for _, part in results))
                    out[b, p, h] = sum(math.exp(part - big) * o for o, part in results)
                    lse[b, p, h] = big
                else:
                    ((o, part),) = results
                    out[b, p, h] = o / groups
                    lse[b, p, h] = part
    return out, lse


@given(configs(max_len=20, max_heads=4))
def test_reference_matches_the_spec_loop(cfg):
    inputs, attn = split_config(cfg)
    (q, k, v), _, mask = random_inputs(**inputs)
    out, lse = reference_dilated_attention(q, k, v, key_padding_mask=mask, **attn)
    loop_out, loop_lse = spec_loop(q.detach(), k.detach(), v.detach(), mask=mask, **attn)
    assert torch.allclose(out, loop_out, rtol=0, atol=1e-12)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(loop_lse))
    finite = torch.isfinite(loop_lse)
    assert torch.allclose(lse[finite], loop_lse[finite], rtol=0, atol=1e-12)


@pytest.mark.parametrize("head_offsets", ["interleaved", "contiguous"])
@pytest.mark.parametrize("mode", ["mixture", "head_groups"])
def test_uniform_weights_are_the_reference_at_equal_scores(mode, head_offsets):
    """Weights times random values are the reference's output where every score is
    equal (q = 0), for either head offsets (contiguous: heads 0, 1 share offset 0)."""
    gen = torch.Generator().manual_seed(7)
    n, heads, segs, rates = 21, 4, [6, 12], [2, 4]
    w = attention_weights_uniform(n, heads, segs, rates, mode=mode, head_offsets=head_offsets, is_causal=True)
    q, k, v = (torch.randn(1, n, heads, 3, dtype=torch.float64, generator=gen) for _ in range(3))
    out, _ = reference_dilated_attention(q * 0, k, v, segs, rates, mode=mode, head_offsets=head_offsets, is_causal=True)
    assert torch.allclose(torch.einsum("hpt,thd->phd", w, v[0]), out[0], rtol=0, atol=1e-12)
    other = attention_weights_uniform(n, heads, segs, rates, mode=mode, is_causal=True)
    # mixture's offsets differ between the two (head 1: 1 interleaved, 0 contiguous); head_groups ignores them
    assert torch.equal(w, other) == (mode == "head_groups" or head_offsets == "interleaved")
    with pytest.raises(ValueError, match="head_offsets must be one of"):
        attention_weights_uniform(n, heads, segs, rates, head_offsets="blocked")


@pytest.mark.parametrize("mode", ["mixture", "head_groups"])
def test_uniform_weights_rows_sum_to_the_mode_total(mode):
    w = attention_weights_uniform(24, 3, [6, 12], [1, 3], mode=mode, is_causal=True)
    assert w.shape == (3, 24, 24)
    rows = w.sum(-1)
    expected = 1.0 if mode == "mixture" else 0.5  # head_groups divides by G = 2
    attended = rows > 0
    assert torch.allclose(rows[attended], torch.full_like(rows[attended], expected))
    assert torch.all(torch.triu(w, diagonal=1) == 0)  # causal: no key after its query
    # mixture, head 0 (offsets 0, 0): query 0 sees key 0 in both branches
    if mode == "mixture":
        assert w[0, 0, 0] == 1.0
        # query 3, head 1: branch (6,1) sees keys 0..3 ; branch (12,3) offset 1 does not select 3
        assert torch.allclose(w[1, 3, :4], torch.full((4,), 0.25, dtype=torch.float64))


@pytest.mark.parametrize(
    ("kwargs", "exc", "fragment"),
    [
        (dict(mode="mixtur"), ValueError, "mode must be one of"),
        (dict(segment_lengths=[4, 8]), ValueError, "same length"),
        (dict(is_causal="yes"), TypeError, "is_causal must be a bool"),
        (dict(softmax_scale=float("inf")), ValueError, "softmax_scale must be finite"),
        (dict(key_padding_mask=torch.zeros(1, 8)), ValueError, "key_padding_mask must be a bool tensor"),
    ],
)
def test_reference_validates_its_arguments(kwargs, exc, fragment):
    q = torch.randn(1, 8, 2, 4)
    args = {"segment_lengths": [4], "dilation_rates": [1], **kwargs}
    with pytest.raises(exc, match=re.escape(fragment)):
        reference_dilated_attention(q, q, q, args.pop("segment_lengths"), args.pop("dilation_rates"), **args)
