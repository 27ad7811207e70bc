"""Random inputs and hypothesis strategies shared by the tests."""

import contextlib

import torch
from hypothesis import strategies as st

import dilated_attention.functional as functional
from dilated_attention.plan import MODES


def random_inputs(seed, batch, seq_len, heads, head_dim, dtype=torch.float64, masked=False):
    """Fresh standard-normal ``q, k, v`` (requiring grad), an output gradient and an
    optional padding mask (about a third of the keys padded), from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    shape = (batch, seq_len, heads, head_dim)
    q, k, v, grad = (torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype) for _ in range(4))
    mask = (torch.rand(batch, seq_len, generator=gen) < 0.35) if masked else None
    return [t.requires_grad_() for t in (q, k, v)], grad, mask


@st.composite
def configs(draw, max_len=48, max_heads=6):
    """A configuration anywhere in what SPEC.md allows: odd lengths, w > N,
    w % r != 0, short last segments, H not divisible by the branch count, masks."""
    branches = draw(st.integers(1, 3))
    mode = draw(st.sampled_from(MODES))
    return dict(
        segment_lengths=draw(st.lists(st.integers(1, 40), min_size=branches, max_size=branches)),
        dilation_rates=draw(st.lists(st.integers(1, 5), min_size=branches, max_size=branches)),
        mode=mode,
        is_causal=draw(st.booleans()),
        masked=draw(st.booleans()),
        batch=draw(st.integers(1, 2)),
        seq_len=draw(st.integers(1, max_len)),
        heads=draw(st.integers(branches if mode == "head_groups" else 1, max_heads)),
        head_dim=draw(st.sampled_from([1, 3, 8])),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def split_config(cfg):
    """``(input kwargs, attention kwargs)`` of a config drawn by :func:`configs`."""
    inputs = {key: cfg[key] for key in ("seed", "batch", "seq_len", "heads", "head_dim", "masked")}
    attention = {key: cfg[key] for key in ("segment_lengths", "dilation_rates", "mode", "is_causal")}
    return inputs, attention


@contextlib.contextmanager
def forced_kernel(kernel):
    """Make the functional API use ``kernel`` whatever the device and dtype."""
    original = functional.select_kernel
    functional.select_kernel = lambda *args: kernel
    try:
        yield
    finally:
        functional.select_kernel = original


@contextlib.contextmanager
def call_budget(elements):
    """Cut every block into kernel calls of at most ``elements`` output elements."""
    original = dict(functional.MAX_CALL_ELEMENTS)
    functional.MAX_CALL_ELEMENTS.update(cpu=elements, default=elements)
    try:
        yield
    finally:
        functional.MAX_CALL_ELEMENTS.update(original)
