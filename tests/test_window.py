"""Queries at the end of a longer key window (prefill chunks, decode steps): each
output row equals that row of one causal call on the whole sequence."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dilated_attention import dilated_attention, reference_dilated_attention
from dilated_attention.ops.plan import window_start_needed
from dilated_attention.tools.check import TOLERANCES, lse_error, max_relative_error
from helpers import configs, random_inputs, split_config, windows


def window_of(tensors, mask, total, queries, start):
    """``q`` for the last ``queries`` positions, ``k, v`` and the mask from ``start``."""
    q, k, v = tensors
    window = [t.detach()[:, start:total].clone().requires_grad_() for t in (k, v)]
    return q.detach()[:, total - queries :].clone().requires_grad_(), *window, None if mask is None else mask[:, start:]


@given(windows())
def test_window_rows_equal_the_whole_sequence_rows(case):
    """Output and LSE against the reference on the whole sequence; gradients (through
    both) against the reference on the same window, which must also agree with the
    whole sequence."""
    cfg, queries, start = case
    inputs, attn = split_config(cfg)
    tensors, (grad, grad_lse), mask = random_inputs(**inputs)
    total = cfg["seq_len"]
    whole, whole_lse = reference_dilated_attention(*tensors, key_padding_mask=mask, **attn)
    q, k, v, window_mask = window_of(tensors, mask, total, queries, start)
    out, lse = dilated_attention(q, k, v, key_padding_mask=window_mask, key_offset=start, return_lse=True, **attn)
    assert out.shape == q.shape and lse.shape == q.shape[:3]
    assert max_relative_error(out, whole[:, total - queries :]) <= 1e-10
    assert lse_error(lse, whole_lse[:, total - queries :]) <= 1e-10

    ref, ref_lse = reference_dilated_attention(q, k, v, key_padding_mask=window_mask, key_offset=start, **attn)
    assert max_relative_error(ref, whole[:, total - queries :]) <= 1e-12
    cotangents = (grad[:, total - queries :], grad_lse[:, total - queries :])
    grads = torch.autograd.grad((out, lse), (q, k, v), cotangents)
    ref_grads = torch.autograd.grad((ref, ref_lse), (q, k, v), cotangents)
    assert max_relative_error(grads, ref_grads) <= 1e-10


@given(configs(max_len=40, grouped_query=True), st.data())
def test_a_window_without_is_causal_is_the_tail_of_the_whole_sequence(cfg, data):
    """Without ``is_causal`` (``Lq = Lk``): rows ``a ..`` of the whole sequence's call,
    where ``a`` starts a segment in every branch; output, LSE and gradients."""
    cfg = dict(cfg, is_causal=False)
    inputs, attn = split_config(cfg)
    tensors, (grad, grad_lse), mask = random_inputs(**inputs)
    starts = [a for a in range(cfg["seq_len"]) if window_start_needed(a, cfg["segment_lengths"]) == a]
    start = data.draw(st.sampled_from(starts))
    whole, whole_lse = reference_dilated_attention(*tensors, key_padding_mask=mask, **attn)
    q, k, v = (t.detach()[:, start:].clone().requires_grad_() for t in tensors)
    window_mask = None if mask is None else mask[:, start:]
    out, lse = dilated_attention(q, k, v, key_padding_mask=window_mask, key_offset=start, return_lse=True, **attn)
    assert max_relative_error(out, whole[:, start:]) <= 1e-10
    assert lse_error(lse, whole_lse[:, start:]) <= 1e-10
    ref, ref_lse = reference_dilated_attention(q, k, v, key_padding_mask=window_mask, key_offset=start, **attn)
    cotangents = (grad[:, start:], grad_lse[:, start:])
    grads = torch.autograd.grad((out, lse), (q, k, v), cotangents)
    assert max_relative_error(grads, torch.autograd.grad((ref, ref_lse), (q, k, v), cotangents)) <= 1e-10
    if start + 1 < cfg["seq_len"] and window_start_needed(start + 1, cfg["segment_lengths"]) != start + 1:
        with pytest.raises(ValueError, match="key_offset"):  # a window that starts inside a segment
            dilated_attention(q[:, 1:], k[:, 1:], v[:, 1:], key_offset=start + 1, **attn)


@given(windows(max_len=32), st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
def test_window_in_low_precision(case, dtype):
    cfg, queries, start = case
    cfg = dict(cfg, softmax_scale=None if cfg["softmax_scale"] == -1.3 else cfg["softmax_scale"])
    inputs, attn = split_config(cfg)
    tensors, _, mask = random_inputs(dtype=dtype, **inputs)
    total = cfg["seq_len"]
    whole, _ = reference_dilated_attention(*tensors, key_padding_mask=mask, **attn)
    q, k, v, window_mask = window_of(tensors, mask, total, queries, start)
    out = dilated_attention(q, k, v, key_padding_mask=window_mask, key_offset=start, **attn)
    assert out.dtype == dtype
    assert max_relative_error(out, whole[:, total - queries :]) <= TOLERANCES[dtype]


def test_each_sequence_its_own_key_offset():
    """A ``(B,)`` ``key_offset``: each row as if called alone."""
    segs, rates = [4, 8, 16], [1, 2, 4]
    gen = torch.Generator().manual_seed(3)
    offsets = [16, 5, 16, 0]
    q, k, v = (torch.randn(4, n, 3, 5, generator=gen, dtype=torch.float64) for n in (2, 13, 13))
    for t in (q, k, v):
        t.requires_grad_()
    out, lse = dilated_attention(
        q, k, v, segs, rates, is_causal=True, key_offset=torch.tensor(offsets), return_lse=True
    )
    grads = torch.autograd.grad((out, lse), (q, k, v), (torch.ones_like(out), torch.ones_like(lse)))
    for row, offset in enumerate(offsets):
        alone = [t[row : row + 1] for t in (q, k, v)]
        ref, ref_lse = reference_dilated_attention(*alone, segs, rates, is_causal=True, key_offset=offset)
        ref_grads = torch.autograd.grad((ref, ref_lse), alone, (torch.ones_like(ref), torch.ones_like(ref_lse)))
        assert max_relative_error(out[row : row + 1], ref) <= 1e-12
        assert lse_error(lse[row : row + 1], ref_lse) <= 1e-12
        assert max_relative_error([g[row : row + 1] for g in grads], ref_grads) <= 1e-12


def test_dropout_masks_follow_positions_in_a_window():
    """The same seed gives a window's rows the masks of those rows in the whole
    sequence, also with a different offset per sequence."""
    (q, k, v), _, _ = random_inputs(5, 2, 30, 3, 4)
    q, k, v = (t.detach() for t in (q, k, v))
    torch.manual_seed(7)
    whole = dilated_attention(q, k, v, [8, 16], [1, 2], is_causal=True, dropout_p=0.3)
    torch.manual_seed(7)
    window = dilated_attention(
        q[:, 27:],
        k[:, 16:],
        v[:, 16:],
        [8, 16],
        [1, 2],
        is_causal=True,
        dropout_p=0.3,
        key_offset=torch.tensor([16, 16]),
    )
    assert max_relative_error(window, whole[:, 27:]) <= 1e-12
    torch.manual_seed(7)
    rows = dilated_attention(
        q[1:, 27:], k[1:, 16:], v[1:, 16:], [8, 16], [1, 2], is_causal=True, dropout_p=0.3, key_offset=16
    )
    assert max_relative_error(rows, whole[1:, 27:]) > 0.01  # batch row 1 alone is row 0: other masks


@pytest.mark.parametrize("mode", ["mixture", "head_groups"])
def test_head_offsets_contiguous_is_torchscales_mapping(mode):
    """``contiguous``: head ``j`` uses offset ``j // ceil(H / r)`` (against the reference);
    in ``mixture`` it differs from ``interleaved`` unless every ``r`` is 1 or ``H``, and
    ``head_groups`` ignores it."""
    (q, k, v), _, _ = random_inputs(2, 1, 24, 5, 4)
    for rates, differ in (([1, 2, 3], mode == "mixture"), ([1, 5], False)):
        segs = [6, 12, 24][: len(rates)]
        a = dilated_attention(q, k, v, segs, rates, mode=mode, head_offsets="interleaved")
        b = dilated_attention(q, k, v, segs, rates, mode=mode, head_offsets="contiguous")
        ref, _ = reference_dilated_attention(q, k, v, segs, rates, mode=mode, head_offsets="contiguous")
        assert max_relative_error(b, ref) <= 1e-12
        assert (max_relative_error(a, b) > 1e-3) == differ
