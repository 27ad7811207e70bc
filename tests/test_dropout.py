"""Dropout on the attention probabilities: exact gradients, right expectation, masks
keyed by position (so independent of how the work is cut), bounded memory."""

import pytest
import torch

import dilated_attention.ops.kernels as kernels
from dilated_attention import DilatedAttention, dilated_attention, reference_dilated_attention
from dilated_attention.ops.dropout import DropoutMask, column_keys, row_keys
from dilated_attention.tools.check import max_relative_error
from helpers import LargestTensor, call_budget, random_inputs

SEGS, RATES = [4, 6, 16], [1, 2, 3]


@pytest.mark.parametrize("mode", ["mixture", "head_groups"])
@pytest.mark.parametrize("call_elements", [None, 5])
def test_dropout_gradient_is_exact(mode, call_elements):
    """With the RNG reset before each call the dropout mask is fixed, so finite
    differences check the backward (which regenerates the mask) exactly, for the
    output and the LSE; also with blocks cut into one kernel call per segment."""
    (q, k, v), _, mask = random_inputs(21, 1, 11, 3, 2, masked=True)

    def fn(q, k, v):
        torch.manual_seed(1234)
        out, lse = dilated_attention(
            q, k, v, SEGS, RATES, mode=mode, is_causal=True, dropout_p=0.3, key_padding_mask=mask, return_lse=True
        )
        return out, lse.masked_fill(torch.isneginf(lse), 0.0)

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


def test_masks_are_bernoulli_and_independent():
    """Kept fraction, and the correlation of neighbouring cells, of (row, column) and
    (column, row), and of the same cell in two batch rows or heads, or two seeds."""
    p, n = 0.3, 384
    positions = torch.arange(n)
    cols = column_keys(positions).view(1, 1, n)

    def keep(seed, batch=1, heads=(0,)):
        rows = row_keys(torch.tensor(seed), torch.arange(batch), torch.tensor(heads), positions)  # (B, n, h)
        mask = DropoutMask(p, rows.permute(0, 2, 1), cols.expand(batch, 1, n))
        return mask.multiplier(slice(0, n), slice(0, n), torch.float64) > 0  # (B, h, n, n)

    a = keep(7, batch=2, heads=(0, 1)).double()
    cells = a.numel()
    assert abs(a.mean().item() - (1 - p)) < 4 * (p * (1 - p) / cells) ** 0.5

    def correlation(x, y):
        x, y = x - x.mean(), y - y.mean()
        return ((x * y).mean() / (x.std() * y.std())).item()

    first = a[0, 0]
    pairs = {
        "next row": (first[1:], first[:-1]),
        "next column": (first[:, 1:], first[:, :-1]),
        "transpose": (first, first.T),
        "other batch row": (first, a[1, 0]),
        "other head": (first, a[0, 1]),
        "other seed": (first, keep(8)[0, 0].double()),
    }
    for name, (x, y) in pairs.items():
        assert abs(correlation(x, y)) < 4 / x.numel() ** 0.5, name


def test_dropout_does_not_depend_on_how_the_work_is_cut(monkeypatch):
    """Masks are keyed by position: cutting blocks into one call per segment, or the
    unfused kernel's score matrix into single query rows, changes only the rounding
    (a different mask would change results by O(1))."""
    (q, k, v), (grad, grad_lse), mask = random_inputs(3, 2, 37, 3, 4, masked=True)

    def run():
        torch.manual_seed(11)
        out, lse = dilated_attention(
            q, k, v, [8, 16, 64], [1, 2, 4], is_causal=True, dropout_p=0.4, key_padding_mask=mask, return_lse=True
        )
        return [out, lse, *torch.autograd.grad((out, lse), (q, k, v), (grad, grad_lse.float()))]

    whole = run()
    monkeypatch.setattr(kernels, "MATH_CHUNK_ELEMENTS", 1)
    with call_budget(1):
        cut = run()
    assert all(max_relative_error(a, b) <= 1e-13 for a, b in zip(whole, cut, strict=True))


@pytest.mark.parametrize("head_offsets", ["interleaved", "contiguous"])
def test_grouped_query_dropout_is_that_of_repeated_keys(head_offsets):
    """Shared key/value heads keep each query head's dropout mask: the output and the
    gradients equal those of the keys repeated per query head (summed back)."""
    (q, k, v), (grad, grad_lse), mask = random_inputs(8, 2, 29, 6, 4, masked=True, kv_heads=2)
    repeated = [t.detach().repeat_interleave(3, dim=2).requires_grad_() for t in (k, v)]

    def run(k, v):
        torch.manual_seed(5)
        out, lse = dilated_attention(
            q,
            k,
            v,
            SEGS,
            RATES,
            head_offsets=head_offsets,
            is_causal=True,
            dropout_p=0.3,
            key_padding_mask=mask,
            return_lse=True,
        )
        return [out, lse, *torch.autograd.grad((out, lse), (q, k, v), (grad, grad_lse.float()))]

    shared, full = run(k, v), run(*repeated)
    full[3:] = [g.unflatten(2, (2, 3)).sum(3) for g in full[3:]]
    assert all(max_relative_error(a, b) <= 1e-12 for a, b in zip(shared, full, strict=True))


def test_dropout_temporaries_are_bounded(monkeypatch):
    """One 128-row segment: its score matrix (2 * 4 * 128 * 128 = 131072 elements)
    is never formed at once; no temporary exceeds the chunk budget or the inputs."""
    monkeypatch.setattr(kernels, "MATH_CHUNK_ELEMENTS", 2048)
    (q, k, v), _, mask = random_inputs(1, 2, 128, 4, 2, masked=True)
    with LargestTensor() as largest:
        out = dilated_attention(q, k, v, [128], [1], dropout_p=0.2, key_padding_mask=mask, is_causal=True)
        torch.autograd.grad(out.square().sum(), (q, k, v))
    assert largest.numel <= max(2048, q.numel())


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
