"""The fused Triton kernels against the float64 reference, run by Triton's interpreter
on the CPU: outputs, LSE and every gradient over drawn configurations (both modes,
both head-offset mappings, causal or not, padding, grouped-query heads, key windows
with a key offset per sequence, odd lengths, ``w > N``, ``w % r != 0``, ``r > w``,
any scale, strided inputs, non-finite values), decode steps through the cache, and
the choice of kernels."""

import math
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dilated_attention import DilatedKVCache, dilated_attention, reference_dilated_attention
from dilated_attention.ops import fused
from dilated_attention.tools.check import TOLERANCES, lse_error, max_relative_error
from helpers import cache_from_config, configs, feed, poison, random_inputs, split_config, windows

pytest.importorskip("triton")
# conftest.py sets TRITON_INTERPRET=1 before anything imports Triton.
pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="the interpreter tests need TRITON_INTERPRET=1 before Triton is imported",
)

# Interpreted kernels run a few programs per second: a handful of drawn cases per
# property keeps each test to seconds.
FEW = settings(max_examples=int(os.environ.get("TRITON_MAX_EXAMPLES", "12")))
DTYPES = st.sampled_from([torch.float32, torch.float16, torch.bfloat16])


def tolerance(dtype, scale) -> float:
    # |scale| > 1 amplifies input rounding beyond the tolerances, which are for scales <= 1.
    return TOLERANCES[dtype] * max(1.0, abs(scale or 0.0)) ** 2


def assert_matches_reference(q, k, v, grad, grad_lse, mask, dtype, attn, key_offset=0, reference=None):
    """The Triton path's output, LSE and gradients against the reference's (by default
    the reference on these very inputs; ``reference``: ``(out, lse)`` rows of the whole
    sequence, for a window, whose gradients are then checked on the window)."""
    out, lse = dilated_attention(
        q, k, v, key_padding_mask=mask, key_offset=key_offset, return_lse=True, kernel="triton", **attn
    )
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = reference_dilated_attention(*ref_in, key_padding_mask=mask, key_offset=key_offset, **attn)
    tol = tolerance(dtype, attn.get("softmax_scale"))
    assert out.dtype == dtype and lse.dtype == torch.float32 and out.shape == q.shape
    for expected_out, expected_lse in [(ref_out, ref_lse)] + ([reference] if reference is not None else []):
        assert max_relative_error(out, expected_out) <= tol
        assert lse_error(lse, expected_lse) <= tol
    grads = torch.autograd.grad((out, lse), (q, k, v), (grad.to(dtype), grad_lse.float()))
    ref_grads = torch.autograd.grad((ref_out, ref_lse), ref_in, (grad.double(), grad_lse.double()))
    assert all(g.dtype == dtype and g.shape == t.shape for g, t in zip(grads, (q, k, v), strict=True))
    assert max_relative_error(grads, ref_grads) <= tol


@FEW
@given(configs(max_len=40, max_heads=4, grouped_query=True), DTYPES)
def test_triton_matches_the_reference(cfg, dtype):
    inputs, attn = split_config(cfg)
    (q, k, v), (grad, grad_lse), mask = random_inputs(dtype=dtype, **inputs)
    assert_matches_reference(q, k, v, grad, grad_lse, mask, dtype, attn)


@FEW
@given(windows(max_len=40, max_heads=4), DTYPES, st.data())
def test_triton_windows_with_a_key_offset_per_sequence(case, dtype, data):
    """Queries at the end of a key window (prefill chunks, decode steps), each batch row
    with its own key offset: rows of the whole sequence's output."""
    cfg, queries, start = case
    inputs, attn = split_config(cfg)
    (q, k, v), (grad, grad_lse), mask = random_inputs(dtype=dtype, **inputs)
    total = cfg["seq_len"]
    whole, whole_lse = reference_dilated_attention(q.double(), k.double(), v.double(), key_padding_mask=mask, **attn)
    # Each batch row shifted by a whole number of lcm(w) positions: the same rows, elsewhere.
    period = math.lcm(*cfg["segment_lengths"])
    shifts = torch.tensor([data.draw(st.integers(0, 3)) * period for _ in range(cfg["batch"])])
    window = [t.detach()[:, start:total].clone().requires_grad_() for t in (k, v)]
    q_window = q.detach()[:, total - queries :].clone().requires_grad_()
    assert_matches_reference(
        q_window,
        *window,
        grad[:, total - queries :],
        grad_lse[:, total - queries :],
        None if mask is None else mask[:, start:],
        dtype,
        attn,
        key_offset=shifts + start,
        reference=(whole[:, total - queries :], whole_lse[:, total - queries :]),
    )


@FEW
@given(configs(max_len=32, max_heads=4, grouped_query=True), st.data())
def test_triton_non_finite_inputs_follow_the_definition(cfg, data):
    """NaN and infinities anywhere, padded or not: NaN in exactly the rows a non-finite
    value reaches (the reference says which), no gradient from them, all finite."""
    inputs, attn = split_config(cfg)
    (q, k, v), (grad, grad_lse), mask = random_inputs(dtype=torch.float32, **inputs)
    q, k, v = (t.detach().clone() for t in (q, k, v))
    poison(data, [q, k, v])
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, lse = dilated_attention(q, k, v, key_padding_mask=mask, return_lse=True, kernel="triton", **attn)
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref, ref_lse = reference_dilated_attention(*ref_in, key_padding_mask=mask, **attn)
    tol = tolerance(torch.float32, attn["softmax_scale"])
    assert torch.equal(out.isnan(), ref.isnan()) and torch.equal(lse.isnan(), ref_lse.isnan())
    assert max_relative_error(out, ref) <= tol and lse_error(lse, ref_lse) <= tol
    grads = torch.autograd.grad((out, lse), (q, k, v), (grad, grad_lse.float()))
    ref_grads = torch.autograd.grad((ref, ref_lse), ref_in, (grad.double(), grad_lse))
    assert all(torch.isfinite(g).all() for g in grads)
    assert max_relative_error(grads, ref_grads) <= tol


@FEW
@given(configs(max_len=24, max_heads=4), st.data())
def test_decode_steps_through_the_cache_run_the_fused_kernels(cfg, data):
    """A cache fed a prompt then one token at a time, sequences left-padded to different
    lengths (a key offset per row), with the Triton kernels chosen by the environment:
    row for row the reference's whole-sequence output."""
    cfg = dict(cfg, is_causal=True, masked=False, memory="contiguous")
    inputs, attn = split_config(cfg)
    tensors, _, _ = random_inputs(dtype=torch.float32, **inputs)
    tensors = [t.detach() for t in tensors]
    batch, total = cfg["batch"], cfg["seq_len"]
    pads = [data.draw(st.integers(0, total - 1)) for _ in range(batch)]
    prompt = data.draw(st.integers(1, total))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(fused.KERNEL_ENV, "triton")  # read when the cache is made
        cache = cache_from_config(DilatedKVCache, cfg, attn, pads)
        outs = [cache.attend(*(t[:, :prompt] for t in tensors))]
        outs += [cache.attend(*(t[:, i : i + 1] for t in tensors)) for i in range(prompt, total)]
    out = torch.cat(outs, 1)
    assert cache.kernel == "triton"
    for row, pad in enumerate(pads):
        ref, _ = reference_dilated_attention(*(t[row : row + 1, pad:].double() for t in tensors), **attn)
        assert max_relative_error(out[row : row + 1, pad:], ref) <= tolerance(torch.float32, attn["softmax_scale"])
        assert torch.all(out[row, :pad] == 0)


# The interpreter runs the kernels in numpy, which warns of the NaN the poisoned tiles give.
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@FEW
@given(configs(max_len=48, max_heads=3), st.data())
def test_fused_cache_steps_find_non_finite_values_themselves(cfg, data):
    """NaN and infinities anywhere (padding included), fed by fused steps of a few
    rows, which read them unchecked, and by chunks of more rows than a fused step
    takes, which run the engine on the flags of every key before them: NaN in exactly
    the rows the reference says, every other row the reference's."""
    cfg = dict(cfg, is_causal=True, masked=False, memory="contiguous")
    inputs, attn = split_config(cfg)
    tensors, _, _ = random_inputs(dtype=torch.float32, **inputs)
    tensors = [t.detach().clone() for t in tensors]
    poison(data, tensors)
    batch, total = cfg["batch"], cfg["seq_len"]
    pads = [data.draw(st.integers(0, total - 1)) for _ in range(batch)]
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(fused.KERNEL_ENV, "triton")  # read when the cache is made
        cache = cache_from_config(DilatedKVCache, cfg, attn, pads)
    sizes = []
    while sum(sizes) < total:
        sizes.append(min(total - sum(sizes), data.draw(st.sampled_from([1, 2, 17, 20]))))
    out = feed(cache, tensors, sizes)
    for row, pad in enumerate(pads):
        ref, _ = reference_dilated_attention(*(t[row : row + 1, pad:].double() for t in tensors), **attn)
        assert torch.equal(out[row : row + 1, pad:].isnan(), ref.isnan())
        assert max_relative_error(out[row : row + 1, pad:], ref) <= tolerance(torch.float32, attn["softmax_scale"])
        assert torch.all(out[row, :pad] == 0)


def test_infinities_of_fused_steps_reach_a_later_chunk_as_nan():
    """An infinite key element and an infinite value element fed by fused steps (not
    checked as they arrive) are flagged before a longer chunk runs the engine over
    them: the rows they reach are NaN, as the definition says (an infinity counts as
    NaN, where a softmax alone could give a finite or infinite row)."""
    segs, rates = [32, 64], [1, 2]
    tensors = [torch.randn(1, 40, 2, 8) for _ in range(3)]
    tensors[1][0, 3, 0, 1] = float("inf")
    tensors[2][0, 5, 1, 2] = float("-inf")
    cache = DilatedKVCache(1, 2, 8, segs, rates, kernel="triton")
    sizes = [1] * 8 + [20] + [1] * 12
    out = feed(cache, tensors, sizes)
    ref, _ = reference_dilated_attention(*(t.double() for t in tensors), segs, rates, is_causal=True)
    assert torch.equal(out.isnan(), ref.isnan()) and ref[:, 8:28].isnan().any()
    assert max_relative_error(out, ref) <= TOLERANCES[torch.float32]


def test_a_cache_flagged_in_inference_mode_takes_unchecked_keys_outside_it():
    """Non-finite keys flagged under ``inference_mode`` (by a long chunk), another
    appended unchecked by a fused step there, then a long chunk outside it: the flags
    are remade writable, and the rows are the reference's."""
    segs, rates = [8, 16], [1, 2]
    tensors = [torch.randn(1, 60, 2, 4) for _ in range(3)]
    tensors[1][0, 5, 1, 0] = float("nan")
    tensors[2][0, 18, 0, 3] = float("inf")
    cache = DilatedKVCache(1, 2, 4, segs, rates, kernel="triton")
    with torch.inference_mode():
        outs = [cache.attend(*(t[:, :17] for t in tensors)), cache.attend(*(t[:, 17:19] for t in tensors))]
    outs.append(cache.attend(*(t[:, 19:40] for t in tensors)))
    out = torch.cat(outs, 1)
    ref, _ = reference_dilated_attention(*(t[:, :40].double() for t in tensors), segs, rates, is_causal=True)
    assert torch.equal(out.isnan(), ref.isnan()) and ref[:, 19:40].isnan().any()
    assert max_relative_error(out, ref) <= TOLERANCES[torch.float32]


@pytest.mark.parametrize("kind", ["StaticKVCache", "DilatedKVCache"])
def test_huge_finite_values_never_come_out_nan_from_the_fused_steps(kind):
    """NaN is for rows a NaN or an infinity reaches: values near float32's largest,
    finite, never read as non-finite (a sum of them may still overflow to infinity)."""
    import dilated_attention

    cache = getattr(dilated_attention, kind)(1, 2, 4, [4], [1], kernel="triton")
    q, k = torch.randn(1, 12, 2, 4), torch.randn(1, 12, 2, 4)
    v = torch.full((1, 12, 2, 4), 2e38)
    out = feed(cache, (q, k, v), [1] * 12)
    assert not out.isnan().any() and torch.equal(out[:, 0], v[:, 0])  # the first attends to itself alone


def test_fused_cache_steps_wait_for_nothing_on_the_host():
    """After its first step, a fused step of the cache makes no operation that copies
    to or from the host (``.item()``, a tensor made from Python values): the keys'
    NaN and infinities are the launches' to find, the positions stay on the device."""
    from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

    from dilated_attention.ops import ring_decode

    class HostTransfers(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.lift_fresh.default):
                self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    class OutsideTheMode:  # a kernel whose launches run outside the mode: the interpreter's copies are not the step's
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                with _disable_current_modes():
                    return self.kernel[grid](*args, **kwargs)

            return launch

    cache = DilatedKVCache(2, 4, 16, [8, 16], [1, 2], start=torch.tensor([0, -3]), kernel="triton")
    tensors = [torch.randn(2, 30, 4, 16) for _ in range(3)]
    tensors[1][0, 6, 2, 5] = float("nan")
    cache.attend(*(t[:, :2] for t in tensors))
    with pytest.MonkeyPatch.context() as patch:
        for name in ("_ring_kernel", "_combine_kernel"):
            patch.setattr(ring_decode, name, OutsideTheMode(getattr(ring_decode, name)))
        with HostTransfers() as mode:
            out = feed(cache, [t[:, 2:] for t in tensors], [1] * 28)
    assert mode.seen == []
    ref, _ = reference_dilated_attention(*(t[:1].double() for t in tensors), [8, 16], [1, 2], is_causal=True)
    assert torch.equal(out[:1].isnan(), ref[:, 2:].isnan()) and out[:1].isnan().any()
    assert max_relative_error(out[:1], ref[:, 2:]) <= TOLERANCES[torch.float32]


def test_the_interpreter_really_runs_the_triton_kernels(monkeypatch):
    """Every pass of a forward and backward is a launch of the Triton kernels."""
    kernels = fused.kernels()
    assert kernels.INTERPRETED
    launches = []

    class Counted:
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            launches.append(self.name)
            return self.kernel[grid]

    for name in ("_forward_kernel", "_key_grads_kernel", "_delta_kernel"):
        monkeypatch.setattr(kernels, name, Counted(name, getattr(kernels, name)))
    (q, k, v), (grad, _), _ = random_inputs(3, 1, 20, 2, 8, dtype=torch.float32)
    out = dilated_attention(q, k, v, [4, 8], [1, 2], is_causal=True, kernel="triton")
    assert launches == ["_forward_kernel"]
    out.backward(grad)
    assert launches == ["_forward_kernel", "_delta_kernel", "_forward_kernel", "_key_grads_kernel"]


def test_kernel_choice_is_explicit_and_never_silently_changed(monkeypatch):
    q = torch.randn(1, 8, 2, 16)
    assert not fused.use_triton(q, 0.0, False, None)  # auto: Triton runs on CUDA only
    assert fused.use_triton(q, 0.0, False, "triton")
    assert not fused.use_triton(q.half(), 0.0, False, "torch")
    for dropout, distributed, dtype, fragment in [
        (0.1, False, torch.float32, "dropout is not fused"),
        (0.0, True, torch.float32, "process_group"),
        (0.0, False, torch.float64, "torch.float64 is not fused"),
    ]:
        with pytest.raises(ValueError, match=f"kernel='triton' cannot run this call: {fragment}"):
            fused.use_triton(q.to(dtype), dropout, distributed, "triton")
    with pytest.raises(ValueError, match="head_dim 300 is above 256"):
        fused.use_triton(torch.randn(1, 2, 1, 300), 0.0, False, "triton")
    # a launch's grid holds at most 65535 heads and batch rows (CUDA's y and z limits)
    for shape in [(fused.MAX_GRID_YZ + 1, 1, 1, 16), (1, 1, fused.MAX_GRID_YZ + 1, 16)]:
        with pytest.raises(ValueError, match=r"at most 65535 batch rows and 65535 heads.*split the batch"):
            fused.use_triton(torch.empty(shape).normal_(), 0.0, False, "triton")
    assert fused.use_triton(torch.randn(fused.MAX_GRID_YZ, 1, 1, 16), 0.0, False, "triton")
    # the caches' launches put every (row, head) on one axis: the limit is not theirs
    assert fused.why_not_triton(torch.empty(fused.MAX_GRID_YZ + 1, 1, 1, 16), 0.0, False, capturable=True) is None
    with pytest.raises(ValueError, match="kernel must be one of"):
        dilated_attention(q, q, q, [4], [1], kernel="cuda")
    monkeypatch.setenv(fused.KERNEL_ENV, "fast")
    with pytest.raises(ValueError, match="DILATED_ATTENTION_KERNEL must be one of"):
        dilated_attention(q, q, q, [4], [1])
    monkeypatch.setenv(fused.KERNEL_ENV, "triton")
    with pytest.raises(ValueError, match="dropout is not fused"):
        dilated_attention(q, q, q, [4], [1], dropout_p=0.5)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="set TRITON_INTERPRET=1"):
        dilated_attention(q, q, q, [4], [1])


def test_the_kernels_take_any_head_dim_up_to_256_and_long_segments():
    (q, k, v), (grad, grad_lse), _ = random_inputs(4, 1, 9, 2, 200, dtype=torch.float32)
    attn = dict(
        segment_lengths=[2**70, 3],
        dilation_rates=[2**65, 2],
        mode="mixture",
        head_offsets="interleaved",
        is_causal=True,
        softmax_scale=None,
    )
    assert_matches_reference(q, k, v, grad, grad_lse, None, torch.float32, attn)


def test_head_offsets_past_two_to_the_31_elements_are_exact():
    """Views whose head stride times head index passes 2**31 elements (a long
    ``(B, H, N, D)`` tensor): heads 2 and up of q, k, v lie beyond it. Their storage
    is reserved, not filled (only the views' rows are written), and the rows an int32
    offset would wrap to hold zeros."""
    length, heads, dim, stride = 16, 3, 16, 2**30 + 1024
    try:
        storage = torch.empty(2**31 + (heads - 1) * stride + 2048 + length * dim, dtype=torch.float16)
    except RuntimeError as exc:  # the allocation itself (8 GiB of address space, untouched)
        pytest.skip(f"cannot reserve 8 GiB of address space here: {exc}")
    gen = torch.Generator().manual_seed(0)
    views = []
    for offset in (0, 1, 2):  # q, k, v: one row block each, apart within every head's stride
        view = storage.as_strided((1, length, heads, dim), (heads * stride, dim, stride, 1), 2**31 + offset * 512)
        views.append(view.copy_(torch.randn(view.shape, generator=gen)).requires_grad_())
    grad = torch.randn(1, length, heads, dim, generator=gen, dtype=torch.float16)
    attn = dict(segment_lengths=[8, 16], dilation_rates=[1, 2], is_causal=True)
    out = dilated_attention(*views, kernel="triton", **attn)
    grads = torch.autograd.grad(out, views, grad)
    exact = [t.detach().double().requires_grad_() for t in views]
    expected, _ = reference_dilated_attention(*exact, **attn)
    expected_grads = torch.autograd.grad(expected, exact, grad.double())
    assert max_relative_error(out, expected) <= TOLERANCES[torch.float16]
    for got, want in zip(grads, expected_grads, strict=True):
        assert max_relative_error(got, want) <= TOLERANCES[torch.float16]


@pytest.mark.parametrize("is_causal", [False, True])
def test_segment_interiors_take_the_unmasked_tiles_and_stay_exact(is_causal):
    """Long enough segments that whole tiles of keys (forward, dq) and of queries
    (dk, dv) are attended in full by every row, which the kernels run unmasked."""
    (q, k, v), (grad, grad_lse), _ = random_inputs(8, 1, 160, 2, 16, dtype=torch.float32)
    attn = dict(
        segment_lengths=[64, 128],
        dilation_rates=[1, 2],
        mode="mixture",
        head_offsets="interleaved",
        is_causal=is_causal,
        softmax_scale=None,
    )
    assert_matches_reference(q, k, v, grad, grad_lse, None, torch.float32, attn)


def test_check_says_which_kernels_ran(capsys, monkeypatch):
    from dilated_attention.tools.cli import main

    assert main(["check", "--dtype", "float32", "--kernel", "torch"]) == 0
    assert "kernels: torch (CpuFlashKernel on each block of the plan)" in capsys.readouterr().out
    described = fused.describe(torch.empty(1, 1, 1, 16), kernel="triton")
    assert described == "triton (the fused kernels: every branch in one launch in Triton's interpreter)"
    # a dtype the Triton kernels do not take: refused before any case runs, naming the flag's fix
    assert main(["check", "--dtype", "float32", "float64", "--kernel", "triton"]) == 2
    printed = capsys.readouterr()
    assert printed.out == ""
    assert "--kernel triton cannot check float64: torch.float64 is not fused" in printed.err
    assert "pass --dtype with those only, or use --kernel auto or torch" in printed.err
    monkeypatch.setenv(fused.KERNEL_ENV, "bogus")  # the variable's own message, not a dtype's
    assert main(["check", "--dtype", "float32"]) == 2
    assert "error: DILATED_ATTENTION_KERNEL must be one of" in capsys.readouterr().err
    monkeypatch.setenv(fused.KERNEL_ENV, "triton")
    assert main(["check", "--dtype", "float64"]) == 2
    assert "error: DILATED_ATTENTION_KERNEL=triton cannot check float64" in capsys.readouterr().err


def test_a_refusal_names_the_environment_where_it_chose_triton(monkeypatch):
    from dilated_attention import StaticKVCache

    monkeypatch.setenv("DILATED_ATTENTION_KERNEL", "triton")
    for kind in (StaticKVCache, DilatedKVCache):
        with pytest.raises(
            ValueError, match=r"^DILATED_ATTENTION_KERNEL=triton cannot run this cache's steps: torch\.f"
        ):
            kind(1, 2, 4, [8], [1], dtype=torch.float64)
    q = torch.randn(1, 16, 2, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"^DILATED_ATTENTION_KERNEL=triton cannot run this call: torch\.float64"):
        dilated_attention(q, q, q, [8], [1])


def test_triton_imported_before_the_interpreter_was_asked_for_is_refused_by_name():
    """``import dilated_attention`` imports Triton (through torch's compiler): setting
    ``TRITON_INTERPRET=1`` after it leaves Triton's own functions made for a GPU, and a
    call failed deep in Triton's interpreter; it is refused with the fix instead."""
    import subprocess
    import sys

    script = (
        "import os, torch\n"
        "from dilated_attention import DilatedKVCache, dilated_attention\n"
        "os.environ['TRITON_INTERPRET'] = '1'\n"
        "q = torch.randn(1, 20, 2, 16)\n"
        "for call in (lambda: dilated_attention(q, q, q, [8], [1], kernel='triton'),\n"
        "             lambda: DilatedKVCache(1, 2, 16, [8], [1], kernel='triton')):\n"
        "    try:\n"
        "        call()\n"
        "    except ValueError as exc:\n"
        "        print(exc)\n"
    )
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    assert len(lines) == 2 and all("TRITON_INTERPRET=1 was set after Triton was imported" in line for line in lines)
    assert lines[0].startswith("kernel='triton' cannot run this call")


def test_the_kernels_compile_for_the_gpus_they_target():
    """The interpreter runs what the GPU compiler may refuse: compile each pass for
    sm_90 (Triton's bundled ptxas, no GPU needed), in a process without the interpreter."""
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", "triton_compile.py")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, script, "--capability", "90", "--head-dims", "64", "--quick"],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "9 of 9 variants compiled" in result.stdout


def test_compiled_calls_take_the_engine_path():
    """Under torch.compile the fused kernels' launch (host values, lazily imported
    kernels) is not traced: auto takes PyTorch's kernels, a forced choice is refused."""
    q = torch.randn(1, 12, 2, 16)

    def auto(q):
        return dilated_attention(q, q, q, [4, 8], [1, 2], is_causal=True)

    compiled = torch.compile(auto, backend="eager", fullgraph=True)
    assert torch.allclose(compiled(q), auto(q), atol=1e-6)
    forced = torch.compile(lambda q: dilated_attention(q, q, q, [4], [1], kernel="triton"), backend="eager")
    with pytest.raises(Exception, match=r"under torch\.compile the calls run PyTorch's operations"):
        forced(q)


@pytest.mark.parametrize(
    ("arguments", "fragment"),
    [
        (["--capability", "0"], "--capability: must be >= 80, got 0"),
        (["--head-dims", "-5"], "--head-dims: must be >= 1, got -5"),
        (["--head-dims", "512"], "--head-dims must be at most 256"),
        (["--out", os.curdir], "is a folder: name a file"),
    ],
)
def test_the_compile_report_refuses_bad_options_before_compiling(arguments, fragment):
    """A capability the compiler does not know crashed it (LLVM's abort), a negative
    head dim was reported as compiled, and a folder as --out failed after the work."""
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", "triton_compile.py")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, script, "--quick", *arguments], capture_output=True, text=True, timeout=120, env=env
    )
    assert result.returncode == 2 and fragment in result.stderr and "compiled" not in result.stdout
