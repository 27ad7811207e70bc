"""Every bad input raises ValueError/TypeError naming the argument and the fix; odd
but valid input (huge ints, NumPy bools) works."""

import math
import re
import time

import pytest
import torch

from dilated_attention import (
    DilatedAttention,
    GridAttention,
    MultiheadDilatedAttention,
    dilated_attention,
    reference_dilated_attention,
)
from dilated_attention.ops.plan import make_plan
from dilated_attention.tools.check import max_relative_error


def qkv(shape=(2, 16, 4, 8), dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=gen).to(dtype) for _ in range(3)]


def call(**overrides):
    q, k, v = qkv()
    args = dict(q=q, k=k, v=v, segment_lengths=[4, 8], dilation_rates=[1, 2])
    args.update(overrides)
    return dilated_attention(
        args.pop("q"), args.pop("k"), args.pop("v"), args.pop("segment_lengths"), args.pop("dilation_rates"), **args
    )


q0, k0, v0 = qkv()


@pytest.mark.parametrize(
    ("overrides", "exc", "fragment"),
    [
        (dict(segment_lengths=[4, 8, 16]), ValueError, "same length"),
        (dict(segment_lengths=[]), ValueError, "segment_lengths must not be empty"),
        (dict(segment_lengths=[0, 8]), ValueError, "segment_lengths must contain values >= 1"),
        (dict(dilation_rates=[1, -2]), ValueError, "dilation_rates must contain values >= 1"),
        (dict(segment_lengths=[4.0, 8]), TypeError, "segment_lengths must contain ints"),
        (dict(dilation_rates=[1, True]), TypeError, "dilation_rates must contain ints"),
        (dict(segment_lengths=8), TypeError, "segment_lengths must be a list"),
        (dict(q=q0[0]), ValueError, "q must have 4 dims"),
        (dict(k=k0[:, :8]), ValueError, "v must have the shape of k"),
        (dict(k=k0[:, :8], v=v0[:, :8]), ValueError, "q has 16 positions but k and v only 8"),
        (
            dict(k=k0[:, :, :3], v=v0[:, :, :3]),
            ValueError,
            (
                "k and v have 3 heads and q 4: grouped-query attention needs the key/value heads H_kv to divide the "
                "query heads H (each key/value head serves H / H_kv query heads); give k and v one of 1, 2, 4 heads"
            ),
        ),
        (
            dict(k=k0[:1], v=v0[:1]),
            ValueError,
            "k must have the batch size and head_dim of q (2, 16, 4, 8), got (1, 16, 4, 8)",
        ),
        (dict(k=k0[..., :4], v=v0[..., :4]), ValueError, "k must have the batch size and head_dim of q"),
        (
            dict(segment_lengths=[4], dilation_rates=[1, 2]),
            ValueError,
            "segment_lengths (1 value) and dilation_rates (2 values) must have the same length",
        ),
        (dict(q=q0[:, :8]), ValueError, "need is_causal=True"),
        (dict(q=q0[:, :8], is_causal=True, key_offset=-1), ValueError, "key_offset must be >= 0"),
        (dict(q=q0[:, :8], is_causal=True, key_offset=2.0), TypeError, "key_offset must be an int"),
        (
            dict(q=q0[:, :8], is_causal=True, key_offset=torch.zeros(3, dtype=torch.long)),
            ValueError,
            "key_offset must be an int or an integer tensor of shape (batch,) = (2,)",
        ),
        (
            dict(q=q0[:, :2], k=k0[:, :3], v=v0[:, :3], is_causal=True, key_offset=5),
            ValueError,
            (
                "the keys start at position key_offset=5, but the first query (position 6) attends to keys from "
                "position 0"
            ),
        ),
        (
            dict(key_offset=6),
            ValueError,
            (
                "attends to keys from position 0, where its segment starts: without is_causal the queries are the "
                "keys' rows, so they must start a segment of every branch (key_offset a multiple of every segment "
                "length): pass q, k and v from position 0 on"
            ),
        ),
        (dict(head_offsets="blocked"), ValueError, "head_offsets must be one of"),
        (dict(v=v0.double()), ValueError, "v must have the dtype of q"),
        (dict(q=q0.int(), k=k0.int(), v=v0.int()), ValueError, "q must be float64, float32"),
        (dict(q=q0.numpy()), TypeError, "q must be a torch.Tensor"),
        (dict(v=v0[:, :, :, :0]), ValueError, "v must have every dim >= 1"),
        (
            dict(q=q0[:, -4:], is_causal=True, key_offset=torch.tensor([0, 4], device="meta")),
            ValueError,
            "key_offset is a tensor on the meta device, which holds no values",
        ),
        (dict(mode="dilated"), ValueError, "mode must be one of"),
        (dict(mode=3), TypeError, "mode must be one of ('mixture', 'head_groups') (a str), got int"),
        (dict(head_offsets=None), TypeError, "head_offsets must be one of ('interleaved', 'contiguous') (a str)"),
        (
            dict(mode="head_groups", segment_lengths=[2, 4, 8, 16, 32], dilation_rates=[1] * 5),
            ValueError,
            "needs at least one head per branch",
        ),
        (dict(key_padding_mask=torch.zeros(2, 16)), ValueError, "key_padding_mask must be a bool tensor"),
        (dict(key_padding_mask=torch.zeros(2, 15, dtype=torch.bool)), ValueError, "key_padding_mask must have shape"),
        (dict(key_padding_mask=[[False] * 16] * 2), TypeError, "key_padding_mask must be a torch.Tensor"),
        (dict(dropout_p=1.0), ValueError, "dropout_p must be in [0, 1)"),
        (dict(dropout_p="0.1"), TypeError, "dropout_p must be a float"),
        (dict(dropout_p=10**400), ValueError, "dropout_p must be in [0, 1), got an int of 1329 bits"),
        (dict(dropout_p=-(10**5000)), ValueError, "dropout_p must be in [0, 1), got an int of 16610 bits"),
        (dict(softmax_scale=10**5000), ValueError, "softmax_scale must be finite, got an int of 16610 bits"),
        (dict(dropout_p=float("nan")), ValueError, "dropout_p must be in [0, 1)"),
        (dict(softmax_scale=float("nan")), ValueError, "softmax_scale must be finite"),
        (dict(dropout_p=0.5, softmax_scale=3e38), ValueError, "softmax_scale=3e+38 does not fit float32"),
        (dict(softmax_scale="1"), TypeError, "softmax_scale must be a float"),
        (dict(is_causal=1), TypeError, "is_causal must be a bool"),
        (dict(dropout_p=0.5, kernel="cuda"), ValueError, "kernel must be one of ('auto', 'triton', 'torch')"),
        (dict(dropout_p=0.5, kernel=3), TypeError, "kernel must be one of ('auto', 'triton', 'torch') (a str)"),
        (dict(dropout_p=0.5, kernel="triton"), ValueError, "kernel='triton' cannot run this call: dropout is not"),
    ],
)
def test_bad_input(overrides, exc, fragment):
    """Refused before any side effect: the random state (a dropout seed's draw) included."""
    before = torch.get_rng_state()
    with pytest.raises(exc, match=re.escape(fragment)):
        call(**overrides)
    assert torch.equal(torch.get_rng_state(), before)


def test_device_mismatch_is_reported():
    meta = torch.empty(2, 16, 4, 8, device="meta")
    with pytest.raises(ValueError, match="k must be on the device of q"):
        dilated_attention(q0, meta, v0, [4], [1])


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("empty_dim", [0, 1])
def test_an_empty_query_is_named_in_the_multihead_layout(batch_first, empty_dim):
    """The module names ``query`` and the shape it was given, not the projected heads."""
    shape = [3, 5, 8]
    shape[empty_dim] = 0
    layout = "(batch, seq_len, " if batch_first else "(seq_len, batch, "
    with pytest.raises(ValueError, match=re.escape(f"query must have shape {layout}embed_dim=8) with batch_first=")):
        MultiheadDilatedAttention(8, 2, [2], [1], batch_first=batch_first)(torch.randn(shape))


def test_module_errors():
    with pytest.raises(ValueError, match="same length"):
        DilatedAttention([4, 8], [1])
    with pytest.raises(ValueError, match="dropout must be in"):
        DilatedAttention([4], [1], dropout=1.5)
    with pytest.raises(ValueError, match="embed_dim \\(30\\) must be divisible by num_heads \\(4\\)"):
        MultiheadDilatedAttention(30, 4, [4], [1])
    with pytest.raises(ValueError, match="needs at least one head per branch"):
        MultiheadDilatedAttention(32, 2, [4, 8, 16], [1, 2, 4], mode="head_groups")
    mha = MultiheadDilatedAttention(32, 4, [4, 8], [1, 2])
    x = torch.randn(2, 8, 32)
    with pytest.raises(ValueError, match="need_weights=True is not supported"):
        mha(x, need_weights=True)
    with pytest.raises(ValueError, match="query must have shape \\(batch, seq_len, embed_dim=32\\)"):
        mha(torch.randn(2, 8, 16))
    with pytest.raises(ValueError, match=re.escape("key must have the shape of query (2, 8, 32), got (2, 9, 32)")):
        mha(x, torch.randn(2, 9, 32))
    with pytest.raises(ValueError, match=re.escape("query must be torch.float32 on cpu like the module's parameters")):
        mha(x.double())
    with pytest.raises(TypeError, match="need_weights must be a bool"):
        mha(x, need_weights=None)


@pytest.mark.parametrize(
    ("option", "exc", "fragment"),
    [
        (dict(layer_norm_eps=-1.0), ValueError, "layer_norm_eps must be a finite number > 0"),
        (dict(layer_norm_eps="a"), TypeError, "layer_norm_eps must be a number"),
        (dict(gamma_init=math.inf), ValueError, "gamma_init must be a finite number >= 0"),
        (dict(gamma_init=-1.0), ValueError, "gamma_init must be a finite number >= 0"),
        (dict(gamma_init="a"), TypeError, "gamma_init must be a number"),
        (dict(bias=1), TypeError, "bias must be a bool"),
        (dict(sub_layernorm=None), TypeError, "sub_layernorm must be a bool"),
        (dict(dtype=torch.int64), ValueError, "dtype must be float64, float32, bfloat16 or float16"),
    ],
)
def test_multihead_options_are_checked_when_built(option, exc, fragment):
    """Values the layers would take silently (a NaN output, inf weights) or fail on
    later with errors that name no argument are refused when the module is built."""
    with pytest.raises(exc, match=re.escape(fragment)):
        MultiheadDilatedAttention(8, 2, [4], [1], **option)


def test_grid_attention_names_the_mask_when_the_mask_is_wrong():
    grid = GridAttention(MultiheadDilatedAttention(8, 2, [4], [1]), "hilbert", extra_tokens=1)
    x = torch.randn(2, 7, 8)
    with pytest.raises(ValueError, match=re.escape("key_padding_mask must have one entry per token of x (7 along")):
        grid(x, (2, 3), key_padding_mask=torch.zeros(2, 6, dtype=torch.bool))
    with pytest.raises(ValueError, match=re.escape("x must have extra_tokens + height * width")):
        grid(x[:, :6], (2, 3), key_padding_mask=torch.zeros(2, 6, dtype=torch.bool))


def test_process_group_without_torch_distributed_initialized():
    with pytest.raises(ValueError, match=r"torch\.distributed is not initialized"):
        dilated_attention(q0, k0, v0, [4], [1], process_group=object())


def test_numpy_bools_are_bools():
    np = pytest.importorskip("numpy")
    assert torch.equal(call(is_causal=np.bool_(True)), call(is_causal=True))
    with pytest.raises(TypeError, match=re.escape("is_causal must be a bool, got 1 (int)")):
        call(is_causal=1)


def test_numpy_strings_are_kept_as_plain_strings():
    """A choice given as a str subclass (NumPy's) is kept as a str, a constant for
    torch.compile (a numpy.str_ attribute broke a compiled module's graph)."""
    np = pytest.importorskip("numpy")
    from dilated_attention import DilatedAttention, StaticKVCache
    from dilated_attention.models import LongNetConfig

    module = DilatedAttention([4], [2], mode=np.str_("head_groups"), head_offsets=np.str_("contiguous"))
    cache = StaticKVCache(1, 2, 4, [4], [2], kernel=np.str_("torch"))
    config = LongNetConfig(
        vocab_size=8,
        dim=8,
        depth=1,
        heads=2,
        segment_lengths=(4,),
        dilation_rates=(2,),
        mode=np.str_("head_groups"),
        positions=np.str_("none"),
    )
    for value in (module.mode, module.head_offsets, cache.kernel, config.mode, config.positions):
        assert type(value) is str
    assert torch.equal(call(mode=np.str_("head_groups")), call(mode="head_groups"))


@pytest.mark.parametrize("huge", [2**62, 2**63, 2**64, 10**30])
def test_huge_segment_lengths_and_rates_are_exact(huge):
    """``w >= N`` is one segment; a rate beyond the segment selects one row per head
    offset: both computed exactly, for any Python int."""
    q, k, v = qkv((2, 16, 4, 8), torch.float64)
    for segs, rates in (([huge], [1]), ([8], [huge]), ([huge, 4], [huge, 2])):
        for mode in ("mixture", "head_groups"):
            out = dilated_attention(q, k, v, segs, rates, mode=mode, is_causal=True)
            ref, _ = reference_dilated_attention(q, k, v, segs, rates, mode=mode, is_causal=True)
            assert max_relative_error(out, ref) <= 1e-12
    assert torch.equal(dilated_attention(q, k, v, [huge], [1]), dilated_attention(q, k, v, [16], [1]))


def test_planning_does_not_grow_with_the_number_of_segments():
    """A million one-position segments: a plan of a few blocks, made at once."""
    start = time.perf_counter()
    blocks = make_plan(2**20 + 3, 8, [1, 3, 2048], [1, 2, 4], "mixture", True)
    assert time.perf_counter() - start < 1.0
    assert len(blocks) == len(make_plan(2**12 + 3, 8, [1, 3, 2048], [1, 2, 4], "mixture", True)) == 11


def test_layout_is_named_in_errors():
    q, k, v = qkv()
    expected = "layout must be one of ('bnhd', 'bhnd') ('bnhd' for (batch, seq_len, heads, head_dim)"
    with pytest.raises(ValueError, match=re.escape(expected)):
        dilated_attention(q, k, v, [4], [1], layout="bshd")
    with pytest.raises(ValueError, match=re.escape("(batch, heads, seq_len, head_dim) (layout='bhnd')")):
        dilated_attention(q[0], k[0], v[0], [4], [1], layout="bhnd")
    with pytest.raises(ValueError, match=re.escape("(batch, seq_len, heads, head_dim) (layout='bnhd')")):
        dilated_attention(q[0], k[0], v[0], [4], [1])


def test_scales_beyond_what_the_compute_dtype_holds():
    """A scale that rounds to 0 in float32 (where scores of float32 inputs are computed)
    is a zero scale, causal included; one beyond float32 is refused; beyond float64 too."""
    q, k, v = qkv((1, 12, 2, 4), torch.float32)
    for causal in (False, True):
        tiny = dilated_attention(q, k, v, [4, 8], [1, 2], is_causal=causal, softmax_scale=1e-46)
        zero = dilated_attention(q, k, v, [4, 8], [1, 2], is_causal=causal, softmax_scale=0.0)
        assert torch.isfinite(tiny).all() and torch.equal(tiny, zero)
    for huge in (1e39, -3e38):  # 3e38 fits float32, its product with log2(e) does not
        with pytest.raises(ValueError, match=re.escape(f"softmax_scale={huge} does not fit float32")):
            dilated_attention(q, k, v, [4], [1], softmax_scale=huge)
    assert torch.isfinite(dilated_attention(q.double(), k.double(), v.double(), [4], [1], softmax_scale=1e39)).all()
    with pytest.raises(ValueError, match="softmax_scale must be finite"):
        dilated_attention(q, k, v, [4], [1], softmax_scale=10**400)


def test_sparse_inputs_are_refused():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=re.escape("q must be a dense tensor, got layout torch.sparse_coo")):
        dilated_attention(q.to_sparse(), k, v, [4], [1])


def test_fused_kernels_refuse_dropout_and_selection_says_what_supports_it():
    from dilated_attention.ops.dropout import DropoutMask
    from dilated_attention.ops.kernels import (
        CpuFlashKernel,
        CudaEfficientKernel,
        CudaFlashKernel,
        MathKernel,
        select_kernel,
    )

    q = torch.randn(1, 2, 4, 8)
    mask = DropoutMask(0.5, torch.zeros(1, 2, 4, dtype=torch.long), torch.zeros(1, 1, 4, dtype=torch.long))
    for kernel in (CpuFlashKernel, CudaFlashKernel, CudaEfficientKernel):
        with pytest.raises(ValueError, match=f"{kernel.__name__} has no dropout"):
            kernel.forward(q, q, q, None, False, 0.5, mask)
    cpu = torch.device("cpu")
    assert select_kernel(cpu, torch.float32, 0.0) is CpuFlashKernel
    assert select_kernel(cpu, torch.float32, 0.1) is MathKernel
    assert select_kernel(torch.device("cuda"), torch.float64, 0.0) is MathKernel
    flash = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0)
    expected = CudaFlashKernel if flash else CudaEfficientKernel
    assert select_kernel(torch.device("cuda"), torch.bfloat16, 0.0) is expected
    assert select_kernel(torch.device("cuda"), torch.float32, 0.0) is CudaEfficientKernel


def test_positions_beyond_int64_are_refused_and_huge_offsets_are_cheap():
    q, k, v = qkv((1, 4, 2, 3), torch.float64)
    with pytest.raises(ValueError, match=re.escape("key_offset must be at most 2**62")):
        dilated_attention(q[:, :1], k, v, [8], [1], is_causal=True, key_offset=2**63)
    start = time.perf_counter()
    far = 2**61  # a multiple of 8: the window starts a segment
    out = dilated_attention(q[:, :1], k, v, [8], [1], is_causal=True, key_offset=far, dropout_p=0.1)
    ref, _ = reference_dilated_attention(q[:, :1], k, v, [8], [1], is_causal=True, key_offset=far)
    assert time.perf_counter() - start < 5 and out.shape == ref.shape
