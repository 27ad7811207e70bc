"""Random inputs and hypothesis strategies shared by the tests."""

import contextlib
import importlib.util
import os

import pytest
import torch
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import dilated_attention.functional as functional
from dilated_attention import StaticKVCache, reference_dilated_attention
from dilated_attention.ops.plan import HEAD_OFFSETS, MODES, window_start_needed
from dilated_attention.tools.check import TOLERANCES, max_relative_error

MEMORY_LAYOUTS = ("contiguous", "head_dim_strided", "sliced", "expanded")
# Whether Triton's interpreter runs the fused kernels here (conftest.py sets
# TRITON_INTERPRET=1 before anything imports Triton, where CUDA is absent).
INTERPRETED = importlib.util.find_spec("triton") is not None and os.environ.get("TRITON_INTERPRET") == "1"
needs_interpreter = pytest.mark.skipif(
    not INTERPRETED, reason="needs Triton's interpreter (TRITON_INTERPRET=1 before Triton is imported: conftest.py)"
)


def with_memory_layout(x: torch.Tensor, memory: str) -> torch.Tensor:
    """The values of ``x`` ``(B, N, H, D)`` in another memory layout: ``head_dim_strided``
    (``(B, N, D, H)`` transposed, as einops' ``b n (d h)`` gives), ``sliced`` (every
    other row of a longer tensor), ``expanded`` (stride 0 over the batch, where the
    rows are equal; else as ``sliced``)."""
    if memory == "contiguous":
        return x.contiguous()
    if memory == "head_dim_strided":
        return x.transpose(2, 3).contiguous().transpose(2, 3)
    if memory == "expanded" and x.shape[0] > 1 and bool((x == x[:1]).all()):
        return x[:1].expand_as(x)
    wide = torch.zeros(x.shape[0], 2 * x.shape[1], *x.shape[2:], dtype=x.dtype)
    wide[:, ::2] = x
    return wide[:, ::2]


def random_inputs(
    seed, batch, seq_len, heads, head_dim, dtype=torch.float64, masked=False, memory="contiguous", kv_heads=None
):
    """Fresh standard-normal ``q, k, v`` (requiring grad), output and LSE gradients and
    an optional padding mask (about a third of the keys padded), from ``seed``;
    ``memory`` picks the inputs' memory layout (see :func:`with_memory_layout`;
    ``expanded`` makes every batch row of ``q`` equal, stride 0); ``kv_heads``: the
    heads of ``k, v`` (grouped-query attention; default ``heads``)."""
    gen = torch.Generator().manual_seed(seed)
    shape = (batch, seq_len, heads, head_dim)
    kv_shape = (batch, seq_len, kv_heads or heads, head_dim)
    q, k, v, grad = (
        torch.randn(s, generator=gen, dtype=torch.float64).to(dtype) for s in (shape, kv_shape, kv_shape, shape)
    )
    grad_lse = torch.randn(shape[:3], generator=gen, dtype=torch.float64)
    mask = (torch.rand(batch, seq_len, generator=gen) < 0.35) if masked else None
    if memory == "expanded":
        q = q[:1].expand_as(q)
    q, k, v, grad = (with_memory_layout(t, memory) for t in (q, k, v, grad))
    return [t.requires_grad_() for t in (q, k, v)], (grad, grad_lse), mask


@st.composite
def configs(draw, max_len=48, max_heads=6, grouped_query=False):
    """A configuration anywhere in what the definition allows: odd lengths, w > N,
    w % r != 0, r > w, short last segments, H not divisible by the branch count,
    masks, any finite scale (0 and negative included), strided inputs; with
    ``grouped_query``, key/value heads that are any divisor of the query heads."""
    branches = draw(st.integers(1, 3))
    mode = draw(st.sampled_from(MODES))
    heads = draw(st.integers(branches if mode == "head_groups" else 1, max_heads))
    kv_heads = draw(st.sampled_from([d for d in range(1, heads + 1) if heads % d == 0])) if grouped_query else heads
    return dict(
        segment_lengths=draw(st.lists(st.integers(1, 40), min_size=branches, max_size=branches)),
        dilation_rates=draw(st.lists(st.integers(1, 5), min_size=branches, max_size=branches)),
        mode=mode,
        head_offsets=draw(st.sampled_from(HEAD_OFFSETS)),
        is_causal=draw(st.booleans()),
        masked=draw(st.booleans()),
        batch=draw(st.integers(1, 2)),
        seq_len=draw(st.integers(1, max_len)),
        heads=heads,
        kv_heads=kv_heads,
        head_dim=draw(st.sampled_from([1, 3, 8])),
        softmax_scale=draw(st.sampled_from([None, None, 0.7, -1.3, 0.0])),
        memory=draw(st.sampled_from(MEMORY_LAYOUTS)),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


@st.composite
def windows(draw, max_len=40, max_heads=6):
    """A causal configuration, a sequence, how many of its last positions are queries,
    and where the key window starts (anywhere from 0 to the latest start allowed)."""
    cfg = draw(configs(max_len=max_len, max_heads=max_heads, grouped_query=True))
    cfg["is_causal"] = True
    total = cfg["seq_len"]
    queries = draw(st.integers(1, total))
    latest = window_start_needed(total - queries, cfg["segment_lengths"])
    return cfg, queries, draw(st.integers(0, latest))


def poison(data, tensors, most: int = 3) -> None:
    """Put a NaN or an infinity at 1 to ``most`` drawn places of ``tensors`` (in place),
    drawn by hypothesis's ``data``."""
    for _ in range(data.draw(st.integers(1, most))):
        tensor = data.draw(st.sampled_from(tensors))
        index = tuple(data.draw(st.integers(0, size - 1)) for size in tensor.shape)
        tensor[index] = data.draw(st.sampled_from([float("nan"), float("inf"), -float("inf")]))


def split_config(cfg):
    """``(input kwargs, attention kwargs)`` of a config drawn by :func:`configs`."""
    inputs = {key: cfg[key] for key in ("seed", "batch", "seq_len", "heads", "head_dim", "masked", "memory")}
    if cfg["kv_heads"] != cfg["heads"]:
        inputs["kv_heads"] = cfg["kv_heads"]
    attention = {
        key: cfg[key]
        for key in ("segment_lengths", "dilation_rates", "mode", "head_offsets", "is_causal", "softmax_scale")
    }
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


def option_help(help_text):
    """``{invocation: help}`` of each option listed in an argparse ``--help`` text
    (the help joined over its lines; ``""`` for an option without help)."""
    options, current = {}, None
    for line in help_text.splitlines():
        if line.startswith("  -"):
            current, _, rest = line.strip().partition("  ")
            options[current] = rest.strip()
        elif current is not None and line.startswith("   ") and line.strip():
            options[current] = f"{options[current]} {line.strip()}".strip()
        else:
            current = None
    return options


class LargestTensor(TorchDispatchMode):
    """Records the most elements of any tensor an operator returns."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for t in result if isinstance(result, (tuple, list)) else [result]:
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return result


def cache_from_config(kind, cfg, attn, pads, **kwargs):
    """A cache of class ``kind`` (``DilatedKVCache`` or ``StaticKVCache``) for a config
    drawn by :func:`configs`, row ``b`` left-padded by ``pads[b]``."""
    return kind(
        cfg["batch"],
        cfg["heads"],
        cfg["head_dim"],
        attn["segment_lengths"],
        attn["dilation_rates"],
        mode=attn["mode"],
        head_offsets=attn["head_offsets"],
        softmax_scale=attn["softmax_scale"],
        start=torch.tensor([-p for p in pads]),
        **kwargs,
    )


def static_cache(cfg, attn, pads, max_chunk, dtype=torch.float64, kernel=None, device="cpu"):
    return cache_from_config(
        StaticKVCache, cfg, attn, pads, max_chunk=max_chunk, dtype=dtype, kernel=kernel, device=device
    )


def feed(cache, tensors, sizes):
    """The cache's outputs for the whole sequence fed in chunks of ``sizes``."""
    outs, at = [], 0
    for size in sizes:
        outs.append(cache.attend(*(t[:, at : at + size] for t in tensors)))
        at += size
    return torch.cat(outs, 1)


@st.composite
def chunks(draw, total, most):
    sizes = []
    while sum(sizes) < total:
        sizes.append(draw(st.integers(1, min(most, total - sum(sizes)))))
    return sizes


def kernel_against_reference(data, cfg, dtype, device, most_rows=3, kind=StaticKVCache):
    """A cache of class ``kind`` on the fused Triton launches, fed chunks of up to
    ``most_rows`` rows of left-padded sequences, some values NaN or infinite: each
    sequence's rows are the reference's on it, the padding's rows 0."""
    cfg = dict(cfg, is_causal=True, masked=False)
    inputs, attn = split_config(cfg)
    tensors = [t.detach().clone() for t in random_inputs(dtype=dtype, **inputs)[0]]
    if data.draw(st.booleans()):
        poison(data, tensors, most=2)
    pads = [data.draw(st.integers(0, cfg["seq_len"] - 1)) for _ in range(cfg["batch"])]
    max_chunk = data.draw(st.integers(1, most_rows))
    sized = {"max_chunk": max_chunk} if kind is StaticKVCache else {}
    cache = cache_from_config(kind, cfg, attn, pads, dtype=dtype, kernel="triton", device=device, **sized)
    out = feed(cache, [t.to(device) for t in tensors], data.draw(chunks(cfg["seq_len"], max_chunk))).cpu()
    scale = max(1.0, abs(attn["softmax_scale"] or 0.0)) ** 2  # |scale| > 1 amplifies the inputs' rounding
    for row, pad in enumerate(pads):
        ref, _ = reference_dilated_attention(*(t[row : row + 1, pad:].double() for t in tensors), **attn)
        assert out.dtype == dtype and max_relative_error(out[row : row + 1, pad:], ref) <= TOLERANCES[dtype] * scale
        assert torch.all(out[row, :pad] == 0)
    assert cache.position.tolist() == [cfg["seq_len"] - p for p in pads]
