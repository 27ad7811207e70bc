"""Dropout on the attention probabilities: exact gradients, right expectation."""

import pytest
import torch
from helpers import call_budget, random_inputs

from dilated_attention import DilatedAttention, dilated_attention, reference_dilated_attention
from dilated_attention.check import max_relative_error

SEGS, RATES = [4, 6, 16], [1, 2, 3]


@pytest.mark.parametrize("mode", ["mixture", "head_groups"])
@pytest.mark.parametrize("call_elements", [None, 5])
def test_dropout_gradient_is_exact(mode, call_elements):
    """With the RNG reset before each call the dropout mask is fixed, so finite
    differences check the backward (which regenerates the mask) exactly; also with
    blocks cut into one kernel call per segment."""
    (q, k, v), _, mask = random_inputs(21, 1, 11, 3, 2, masked=True)

    def fn(q, k, v):
        torch.manual_seed(1234)
        return dilated_attention(q, k, v, SEGS, RATES, mode=mode, is_causal=True, dropout_p=0.3, key_padding_mask=mask)

    if call_elements is None:
        assert torch.autograd.gradcheck(fn, (q, k, v))
    else:
        with call_budget(call_elements):
            assert torch.autograd.gradcheck(fn, (q, k, v))


@pytest.mark.parametrize("mode", ["mixture", "head_groups"])
def test_dropout_is_unbiased(mode):
    """Averaged over 4000 independent masks (one per batch row) the output is the
    output without dropout."""
    (q, k, v), _, _ = random_inputs(8, 1, 14, 3, 4)
    draws = 4000
    big = [t.detach().expand(draws, -1, -1, -1) for t in (q, k, v)]
    torch.manual_seed(0)
    out = dilated_attention(*big, SEGS, RATES, mode=mode, dropout_p=0.25)
    expected, _ = reference_dilated_attention(q, k, v, SEGS, RATES, mode=mode)
    assert not torch.allclose(out[0], out[1])  # masks differ between rows
    assert (out.mean(0, keepdim=True) - expected).abs().max() < 0.03


def test_dropout_changes_the_output_and_is_reproducible():
    (q, k, v), _, _ = random_inputs(2, 2, 20, 4, 8)
    torch.manual_seed(5)
    a = dilated_attention(q, k, v, SEGS, RATES, dropout_p=0.5)
    torch.manual_seed(5)
    b = dilated_attention(q, k, v, SEGS, RATES, dropout_p=0.5)
    c = dilated_attention(q, k, v, SEGS, RATES, dropout_p=0.5)
    plain = dilated_attention(q, k, v, SEGS, RATES)
    assert torch.equal(a, b)
    assert not torch.allclose(a, c)
    assert max_relative_error(a, plain) > 0.05


def test_module_applies_dropout_only_in_training():
    (q, k, v), _, _ = random_inputs(3, 2, 20, 4, 8)
    module = DilatedAttention(SEGS, RATES, dropout=0.5)
    plain = dilated_attention(q, k, v, SEGS, RATES)
    module.eval()
    assert torch.equal(module(q, k, v), plain)
    module.train()
    assert max_relative_error(module(q, k, v), plain) > 0.05
