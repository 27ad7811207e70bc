"""torch.compile: the functional API and the modules compile without graph breaks
and give the eager numbers."""

import pytest
import torch

from dilated_attention import MultiheadDilatedAttention, dilated_attention
from dilated_attention.tools.check import max_relative_error
from helpers import random_inputs

SEGS, RATES = [8, 16], [1, 2]
# Compiling warns of nothing (a warning per call site would reach every user's log)
pytestmark = pytest.mark.filterwarnings("error::UserWarning")


def attention(q, k, v, mask):
    return dilated_attention(q, k, v, SEGS, RATES, is_causal=True, key_padding_mask=mask)


def check_against_eager(compiled, length: int) -> None:
    """``compiled`` gives :func:`attention`'s output and gradients at ``length``."""
    (q, k, v), (grad, _), mask = random_inputs(length, 2, length, 3, 4, masked=True)
    out = compiled(q, k, v, mask)
    grads = torch.autograd.grad(out, (q, k, v), grad)
    expected = attention(q, k, v, mask)
    expected_grads = torch.autograd.grad(expected, (q, k, v), grad)
    assert max_relative_error(out, expected) <= 1e-12
    assert max_relative_error(grads, expected_grads) <= 1e-12


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_functional_compiles_fullgraph(backend):
    torch._dynamo.reset()
    check_against_eager(torch.compile(attention, backend=backend, fullgraph=True), 40)


def test_multihead_module_compiles_fullgraph():
    torch._dynamo.reset()
    torch.manual_seed(0)
    mha = MultiheadDilatedAttention(16, 4, SEGS, RATES, mode="head_groups", dtype=torch.float64)
    x = torch.randn(2, 30, 16, dtype=torch.float64)
    compiled = torch.compile(mha, backend="aot_eager", fullgraph=True)
    out, _ = compiled(x, is_causal=True)
    expected, _ = mha(x, is_causal=True)
    assert max_relative_error(out, expected) <= 1e-12
    loss = out.square().sum()
    grads = torch.autograd.grad(loss, list(mha.parameters()))
    expected_grads = torch.autograd.grad(expected.square().sum(), list(mha.parameters()))
    assert max_relative_error(grads, expected_grads) <= 1e-12


def test_compiled_module_checks_its_masks_in_the_graph():
    """Under ``torch.compile`` a mask's values are checked inside the graph (a
    ``RuntimeError`` with the library's message at run time): the causal ``attn_mask``
    without the hint and a float padding mask give eager's output, other values fail."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    mha = MultiheadDilatedAttention(16, 4, SEGS, RATES, dtype=torch.float64)
    x = torch.randn(2, 30, 16, dtype=torch.float64)
    mask = torch.nn.Transformer.generate_square_subsequent_mask(30, dtype=torch.float64)
    pad = torch.zeros(2, 30, dtype=torch.float64)
    pad[1, :7] = -torch.inf
    compiled = torch.compile(mha, backend="aot_eager", fullgraph=True)
    for is_causal in (True, False):  # the hint, or the mask's values
        out, _ = compiled(x, None, None, pad, False, mask, True, is_causal)
        expected, _ = mha(x, key_padding_mask=pad == -torch.inf, is_causal=True)
        assert max_relative_error(out, expected) <= 1e-12
    with pytest.raises(RuntimeError, match=r"attn_mask must be None or the causal mask .* got another \(30, 30\)"):
        compiled(x, attn_mask=mask.T.contiguous())
    with pytest.raises(RuntimeError, match=r"key_padding_mask must be bool \(True = padding\) or a float mask"):
        compiled(x, key_padding_mask=pad.clamp(min=-1e9), is_causal=True)


def test_multihead_module_compiles_fullgraph_in_training_with_dropout():
    """Dropout's seed is a tensor drawn from PyTorch's generator, so the compiled
    module draws the same masks as the eager one for the same seed."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    mha = MultiheadDilatedAttention(16, 4, SEGS, RATES, dropout=0.3, dtype=torch.float64).train()
    x = torch.randn(2, 30, 16, dtype=torch.float64)
    compiled = torch.compile(mha, backend="aot_eager", fullgraph=True)
    torch.manual_seed(1)
    out, _ = compiled(x, is_causal=True)
    grads = torch.autograd.grad(out.square().sum(), list(mha.parameters()))
    torch.manual_seed(1)
    expected, _ = mha(x, is_causal=True)
    expected_grads = torch.autograd.grad(expected.square().sum(), list(mha.parameters()))
    mha.eval()
    assert max_relative_error(expected, mha(x, is_causal=True)[0]) > 0.05  # dropout did act
    assert max_relative_error(out, expected) <= 1e-12
    assert max_relative_error(grads, expected_grads) <= 1e-12


def test_inductor_draws_eagers_dropout_masks_with_fallback_random():
    """inductor lowers the draw of the dropout seed to its own random stream; with
    torch._inductor.config.fallback_random (as the docs say) a seed gives eager's masks."""
    torch._dynamo.reset()

    def dropped(q, k, v):
        return dilated_attention(q, k, v, SEGS, RATES, is_causal=True, dropout_p=0.3)

    (q, k, v), _, _ = random_inputs(7, 1, 20, 2, 4)
    compiled = torch.compile(dropped, backend="inductor", fullgraph=True)
    torch.manual_seed(5)
    with torch._inductor.config.patch(fallback_random=True):
        out = compiled(q, k, v)
    torch.manual_seed(5)
    expected = dropped(q, k, v)
    assert max_relative_error(expected, attention(q, k, v, None)) > 0.05  # dropout did act
    assert max_relative_error(out, expected) <= 1e-12


def test_compiled_function_follows_changing_sequence_lengths():
    """After the first length torch.compile would trace sizes symbolically; the library
    specialises on them instead (the plan depends on them), so each length compiles
    once, without a graph break, and gives the eager numbers."""
    torch._dynamo.reset()
    compiled = torch.compile(attention, backend="aot_eager", fullgraph=True)
    for length in (40, 47, 64):
        check_against_eager(compiled, length)


def test_a_compiled_function_follows_changing_branches():
    """Branches given anew at each call (a function shared by layers of different
    configurations): torch.compile would trace a segment length that changed as a
    symbol; the library specialises on them, so each configuration compiles once."""
    torch._dynamo.reset()

    def branches(q, k, v, segment_lengths, dilation_rates):
        return dilated_attention(q, k, v, segment_lengths, dilation_rates, is_causal=True)

    compiled = torch.compile(branches, backend="aot_eager", fullgraph=True)
    (q, k, v), _, _ = random_inputs(6, 1, 33, 2, 4)
    for segs, rates in (([8, 16], [1, 2]), ([4, 16], [1, 2]), ([3, 5, 7], [1, 3, 2])):
        expected = branches(q, k, v, segs, rates)
        assert max_relative_error(compiled(q, k, v, segs, rates), expected) <= 1e-12


def test_compiled_key_window_follows_changing_key_offsets():
    """A decode-style call whose key_offset changes every step (an int)."""
    torch._dynamo.reset()

    def window(q, k, v, offset):
        return dilated_attention(q, k, v, [4, 6], [1, 2], is_causal=True, key_offset=offset)

    compiled = torch.compile(window, backend="aot_eager", fullgraph=True)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, n, 2, 4, generator=gen, dtype=torch.float64) for n in (3, 9, 9))
    for offset in (6, 18, 30):
        assert max_relative_error(compiled(q, k, v, offset), window(q, k, v, offset)) <= 1e-12


def test_dynamic_true_traces_float_arguments_as_constants():
    """``torch.compile(dynamic=True)`` traces float and int arguments and sizes as
    symbols: the library reads the scale, the dropout rate, the key offset and the
    sizes as constants (a guard on each), so a scale given at each call (one that
    float32 rounds to 0 included) compiles without a graph break and gives the eager
    numbers, dropout masks included."""
    torch._dynamo.reset()

    def scaled(q, k, v, scale, offset, p):
        return dilated_attention(
            q, k, v, SEGS, RATES, is_causal=True, softmax_scale=scale, key_offset=offset, dropout_p=p
        )

    compiled = torch.compile(scaled, backend="aot_eager", dynamic=True, fullgraph=True)
    gen = torch.Generator().manual_seed(0)
    for length, scale, offset, p in ((24, 0.3, 16, 0.0), (33, 1e-50, 0, 0.25)):
        args = (*(torch.randn(2, length, 3, 4, generator=gen) for _ in range(3)), scale, offset, p)
        torch.manual_seed(1)
        out = compiled(*args)
        torch.manual_seed(1)
        assert max_relative_error(out, scaled(*args)) <= 1e-6
