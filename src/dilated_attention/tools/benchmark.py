"""Time and memory of dilated attention against dense attention, as a ratio of the
machine's own matrix-multiply speed measured in the same run.

FLOPs are *useful* FLOPs: ``4 * D`` per (query, key) pair the configuration
actually attends (``2 * D`` for ``q @ k^T``, ``2 * D`` for ``p @ v``), counted from
the plan; forward + backward counts 3.5x the forward (backward = 2.5x, the
FlashAttention convention); causal counts the pairs on or below the diagonal.

Memory: the peak bytes one call adds on top of its inputs, without its output: on
CUDA from the caching allocator's statistics, on CPU (Linux) from the process's
peak resident set, reset before each call (``/proc/self/clear_refs``), with glibc
told, while it measures, to return large blocks to the system at once so that freed
memory is not silently reused.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..functional import dilated_attention
from ..ops import fused, validation
from ..ops.intmath import ceil_div
from ..ops.kernels import select_kernel
from ..ops.plan import make_plan
from ..utils.memory import first_line
from ..utils.plotting import log_log, pyplot, save

# What ``bench`` measures by default, and what it can measure: ``mixture-torch`` is the
# library forced to PyTorch's kernels (``mixture`` takes the fused Triton kernels where
# they apply), ``flex`` PyTorch's FlexAttention computing the same mixture.
IMPLEMENTATIONS = ("dense", "kernel", "mixture", "head_groups")
ALL_IMPLEMENTATIONS = (*IMPLEMENTATIONS, "mixture-torch", "flex")


# ----------------------------------------------------------------------------- FLOPs


def attended_pairs(
    batch: int, seq_len: int, heads: int, segment_lengths, dilation_rates, mode: str, is_causal: bool
) -> int:
    """Number of (query, key) pairs attended, from the plan (``dense``: all pairs)."""
    if mode == "dense":
        per_head = seq_len * (seq_len + 1) // 2 if is_causal else seq_len * seq_len
        return batch * heads * per_head
    total = 0
    for block in make_plan(seq_len, heads, segment_lengths, dilation_rates, mode, is_causal):
        queries, keys = block.queries.count, block.keys.count
        per_segment = queries * (queries + 1) // 2 if block.is_causal else queries * keys
        total += batch * block.queries.nseg * block.queries.head_count * per_segment
    return total


# ----------------------------------------------------------------------------- timing


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _seconds(call: Callable[[], object], device: torch.device) -> float:
    """Wall-clock seconds of one ``call()``, the device synchronised on both sides."""
    _synchronize(device)
    start = time.perf_counter()
    call()
    _synchronize(device)
    return time.perf_counter() - start


def _matmul(device: torch.device, dtype: torch.dtype, size: int) -> Callable[[], object]:
    """A ``size x size`` product to time, and its operands."""
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    return lambda: a @ b


def time_against_matmul(fn: Callable[[], object], device: torch.device, dtype, repeats: int, size: int = 4096):
    """Run ``fn`` and a ``size x size`` matmul alternately ``repeats`` times (after one
    warm-up of each) and return the median seconds of ``fn`` and the median of
    ``(1 / t_fn) / (matmul GFLOP/s)`` pairs, so that drifts of the machine's speed
    between measurements cancel. Multiply that by ``fn``'s GFLOP to get the ratio."""
    return time_against(fn, _matmul(device, dtype, size), 2 * size**3 / 1e9, device, repeats)


def time_against(
    fn: Callable[[], object], reference: Callable[[], object], reference_gflop: float, device, repeats: int
) -> tuple[float, float]:
    """:func:`time_against_matmul` with any ``reference`` call of ``reference_gflop``
    GFLOP: the median seconds of ``fn`` and the median of ``(1 / t_fn) / (reference
    GFLOP/s)`` over pairs run alternately."""
    _seconds(fn, device)
    _seconds(reference, device)
    fn_times, per_reference = [], []
    for _ in range(repeats):
        t_ref = _seconds(reference, device)
        t_fn = _seconds(fn, device)
        fn_times.append(t_fn)
        per_reference.append((1.0 / t_fn) / (reference_gflop / t_ref))
    return statistics.median(fn_times), statistics.median(per_reference)


def kernel_fraction(impl: str, seq_len: int, cfg: BenchConfig, backward: bool) -> float:
    """GFLOP/s of the library's ``impl`` over the fused kernel's alone (``kernel``: the
    first branch's work in one contiguous call), the two run alternately ``cfg.repeats``
    times: the median of the pairs' ratios. With ``backward``: forward and backward
    (the kernel's own backward; the library's through autograd)."""
    device = torch.device(cfg.device)
    (q, k, v, grad), fn, _, pairs = _workload(impl, seq_len, cfg)
    (kq, kk, kv, kgrad), kernel, kernel_with_grad, kernel_pairs = _workload("kernel", seq_len, cfg)
    if not backward:
        with torch.no_grad():
            _, per_kernel = time_against(
                lambda: fn(q, k, v),
                lambda: kernel(kq, kk, kv),
                4 * cfg.head_dim * kernel_pairs / 1e9,
                device,
                cfg.repeats,
            )
        return 4 * cfg.head_dim * pairs / 1e9 * per_kernel
    for t in (q, k, v):
        t.requires_grad_()
    assert kernel_with_grad is not None
    _, per_kernel = time_against(
        lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), grad),
        lambda: kernel_with_grad(kq, kk, kv, kgrad),
        3.5 * 4 * cfg.head_dim * kernel_pairs / 1e9,
        device,
        cfg.repeats,
    )
    return 3.5 * 4 * cfg.head_dim * pairs / 1e9 * per_kernel


def time_by_op(impl: str, seq_len: int, cfg: BenchConfig, top: int = 5) -> list[dict]:
    """Where one forward of ``impl`` (after a warm-up) spends its time, by PyTorch
    operator: ``torch.profiler``'s self time (on the CPU; the host's time on other
    devices), the ``top`` operators by it and the rest as ``"(other)"``, each
    ``{"op", "calls", "ms", "share"}``. An operator's self time includes the page
    faults of the fresh memory it touches first."""
    from torch.profiler import ProfilerActivity, profile

    (q, k, v, _), fn, _, _ = _workload(impl, seq_len, cfg)
    device = torch.device(cfg.device)
    with torch.no_grad():
        fn(q, k, v)
        _synchronize(device)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            fn(q, k, v)
            _synchronize(device)
    ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in ops) or 1.0
    rows = [
        {"op": e.key, "calls": e.count, "ms": e.self_cpu_time_total / 1e3, "share": e.self_cpu_time_total / total}
        for e in ops[:top]
    ]
    rest = sum(e.self_cpu_time_total for e in ops[top:])
    calls = sum(e.count for e in ops[top:])
    return [*rows, {"op": "(other)", "calls": calls, "ms": rest / 1e3, "share": rest / total}]


def matmul_gflops(device: torch.device, dtype: torch.dtype, size: int = 4096, repeats: int = 5) -> float:
    """GFLOP/s of one large square ``size x size`` product: the fastest of ``repeats``
    (a ceiling, which a slowed run of a shared machine should not lower)."""
    matmul = _matmul(device, dtype, size)
    _seconds(matmul, device)
    return 2 * size**3 / min(_seconds(matmul, device) for _ in range(repeats)) / 1e9


# ----------------------------------------------------------------------------- memory


# glibc's mallopt parameters (malloc.h) and the values PeakMemory sets and restores.
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MEASURING_THRESHOLD_BYTES = 256 * 1024  # blocks from here up are mmapped and trimmed at once
GLIBC_DEFAULT_THRESHOLD_BYTES = 128 * 1024  # glibc's documented default of both


class PeakMemory:
    """Peak bytes allocated during a ``with`` block above what was allocated before.

    On CPU with glibc, the block runs with ``M_MMAP_THRESHOLD`` and
    ``M_TRIM_THRESHOLD`` at 256 KiB, so that freed memory leaves the resident set,
    and both are set back to glibc's documented default (128 KiB) on exit. glibc's
    dynamic mmap threshold (which rises as large blocks are freed) stays off once
    either is set: glibc offers no way to turn it back on. From then on every block
    over 128 KiB is a fresh mapping whose pages fault on first touch, which slows
    code that allocates many large temporaries (the library's forward and backward at
    N=32768 took an eighth longer on a 2-core AMD EPYC VM), so the benchmarks measure
    memory in a process of its own (:func:`measure_memories`) or after every timing."""

    def __init__(self, device: torch.device):
        self.device = device
        self.added: int | None = None

    @staticmethod
    def supported(device: torch.device) -> bool:
        if device.type == "cuda":
            return True
        return sys.platform.startswith("linux") and os.path.exists("/proc/self/clear_refs")

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._before = torch.cuda.memory_allocated(self.device)
        else:
            _set_malloc_thresholds(MEASURING_THRESHOLD_BYTES)
            _trim_heap()
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset the peak resident set size to the current one
            self._before = _proc_status_kb("VmRSS") * 1024
        return self

    def _peak_added(self) -> int:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device) - self._before
        return _proc_status_kb("VmHWM") * 1024 - self._before

    def restart(self) -> int:
        """The peak added so far; from now on the peak is taken afresh (over the same
        baseline), so that :attr:`added` covers only what follows."""
        peak = self._peak_added()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            _trim_heap()
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        return peak

    def __exit__(self, *exc):
        self.added = self._peak_added()
        if self.device.type != "cuda":
            _set_malloc_thresholds(GLIBC_DEFAULT_THRESHOLD_BYTES)
        return False


def _proc_status_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{key} not in /proc/self/status")


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """glibc, or ``None`` where the C library is another one."""
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def _set_malloc_thresholds(size: int) -> None:
    """glibc: serve blocks of ``size`` bytes and more by mmap (returned to the system
    on free) and trim the heap's top once ``size`` bytes are free."""
    libc = _glibc()
    if libc is not None:
        libc.mallopt(M_MMAP_THRESHOLD, size)
        libc.mallopt(M_TRIM_THRESHOLD, size)


def _trim_heap() -> None:
    """glibc: return the heap's free memory to the system."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


# ----------------------------------------------------------------------------- runs


@dataclass
class BenchConfig:
    seq_lens: Sequence[int]
    segment_lengths: Sequence[int] = (2048, 4096, 8192)
    dilation_rates: Sequence[int] = (1, 2, 4)
    batch: int = 1
    heads: int = 8
    head_dim: int = 64
    dtype: str = "float32"
    device: str = "cpu"
    is_causal: bool = False
    implementations: Sequence[str] = IMPLEMENTATIONS
    repeats: int = 3
    backward: bool = True
    memory: bool = True
    max_seconds: float = 60.0  # skip a measurement predicted to take longer than this
    matmul_size: int = 4096  # side of the square matmul the ratios refer to


@dataclass
class Row:
    impl: str
    seq_len: int
    fwd_ms: float | None = None
    fwd_bwd_ms: float | None = None
    fwd_gflops: float | None = None
    fwd_bwd_gflops: float | None = None
    fwd_ratio: float | None = None
    fwd_bwd_ratio: float | None = None
    fwd_peak_added_bytes: int | None = None
    fwd_bwd_peak_added_bytes: int | None = None
    io_bytes: int = 0  # bytes of q, k, v and the output
    fwd_floor_ms: float | None = None  # the larger of FLOPs / matmul rate and io bytes / copy bandwidth
    fwd_bwd_floor_ms: float | None = None  # the same with 3.5x the FLOPs and 3x the bytes
    kernels: str = ""  # which kernels ran: the library's, or the dense row's SDPA backend
    sdpa_backend: str | None = None  # the dense row's SDPA backend, by name (its memory is measured on it)
    note: str = ""


@dataclass
class BenchResult:
    config: BenchConfig
    machine: dict
    matmul_gflops: float
    copy_gbps: float
    rows: list[Row] = field(default_factory=list)


def work_of(impl: str, seq_len: int, cfg: BenchConfig) -> tuple[tuple[int, int, int, int], int]:
    """``(shape, pairs)``: the shape of each input of ``impl`` at ``seq_len`` and the
    (query, key) pairs it attends (see :func:`_workload`), without a tensor made."""
    if impl != "kernel":
        mode = "mixture" if impl == "flex" else impl.partition("-")[0]
        args = (cfg.batch, seq_len, cfg.heads, cfg.segment_lengths, cfg.dilation_rates)
        return (cfg.batch, seq_len, cfg.heads, cfg.head_dim), attended_pairs(*args, mode, cfg.is_causal)
    w = min(cfg.segment_lengths[0], seq_len)  # the first branch, clamped as the planner does
    rows = ceil_div(w, min(cfg.dilation_rates[0], w))
    shape = (cfg.batch * (seq_len // w), cfg.heads, rows, cfg.head_dim)
    return shape, shape[0] * shape[1] * (rows * (rows + 1) // 2 if cfg.is_causal else rows * rows)


def _workload(impl: str, seq_len: int, cfg: BenchConfig, sdpa_backend: str | None = None):
    """``(inputs, fn, fn_with_grad, pairs)`` of one implementation at one length
    (``fn_with_grad``: the kernel's own forward and backward, else ``None``).

    ``dense``: PyTorch SDPA over the whole sequence, on ``sdpa_backend`` (the name of
    a ``torch.nn.attention.SDPBackend``; ``None``: SDPA's own choice; :func:`measure`
    forces the fastest, :func:`fastest_dense`). ``kernel``: the fused kernel the
    engine uses, alone, on one contiguous batch shaped like the first branch's work
    (``B * N // w`` segments of ``ceil(w / r)`` rows, all heads, with ``w`` and ``r``
    at most ``N``): the ceiling the
    engine's overhead is measured against. ``mixture``/``head_groups``: the library
    (``mixture-torch``: on PyTorch's kernels). ``flex``: FlexAttention with the
    mixture's pattern as a block mask and each key's branch count in the score (see
    :func:`flex_mixture`): the same function, the nearest peer.
    """
    device, dtype = torch.device(cfg.device), getattr(torch, cfg.dtype)
    shape, pairs = work_of(impl, seq_len, cfg)
    if impl == "kernel":
        kernel = select_kernel(device, dtype, 0.0)
        scale = cfg.head_dim**-0.5

        def fn(q, k, v):
            return kernel.forward(q, k, v, None, cfg.is_causal, scale)[0]

        def kernel_with_grad(q, k, v, grad):  # the kernel's own backward
            out, lse = kernel.forward(q, k, v, None, cfg.is_causal, scale)
            return kernel.backward(grad, q, k, v, out, lse, None, cfg.is_causal, scale)

        fn_with_grad: Callable | None = kernel_with_grad

    else:
        fn_with_grad = None
        if impl == "dense":
            fn = dense_attention(cfg.is_causal, sdpa_backend)

        elif impl == "flex":
            fn = flex_mixture(seq_len, cfg.heads, cfg.segment_lengths, cfg.dilation_rates, cfg.is_causal, device)
        else:
            mode, _, kernel_name = impl.partition("-")

            def fn(q, k, v):
                return dilated_attention(
                    q,
                    k,
                    v,
                    cfg.segment_lengths,
                    cfg.dilation_rates,
                    mode=mode,
                    is_causal=cfg.is_causal,
                    kernel=kernel_name or None,
                )

    inputs = [torch.randn(shape, device=device, dtype=dtype) for _ in range(4)]
    return inputs, fn, fn_with_grad, pairs


# SDPA's backends a dense row chooses from, fused ones: the math backend (which holds
# an ``N x N`` matrix) only where none of them runs.
FUSED_SDPA_BACKENDS = ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION")


def dense_attention(is_causal: bool, backend: str | None = None) -> Callable:
    """``fn(q, k, v)`` on ``(B, N, H, D)`` tensors: PyTorch's SDPA over the whole
    sequence, on ``backend`` (the name of a ``torch.nn.attention.SDPBackend``) or its
    own choice."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def fn(q, k, v):
        with contextlib.nullcontext() if backend is None else sdpa_kernel([getattr(SDPBackend, backend)]):
            out = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=is_causal
            )
        return out.transpose(1, 2)

    return fn


def fastest_dense(seq_len: int, cfg: BenchConfig) -> tuple[str, str]:
    """``(backend, words)``: the name of the SDPA backend that runs the dense row at
    ``seq_len`` fastest (forward, and backward with ``cfg.backward``), of the fused
    backends that take its inputs here, each run once, then timed once where more than
    one runs (the math backend where none runs)."""
    inputs = _workload("dense", seq_len, cfg)[0]
    steps = {}
    with torch.no_grad() if not cfg.backward else contextlib.nullcontext():
        for name in FUSED_SDPA_BACKENDS:
            call = dense_attention(cfg.is_causal, name)
            step = _with_backward(inputs, call, None) if cfg.backward else functools.partial(call, *inputs[:3])
            try:
                step()
            except RuntimeError:  # "No available kernel": the backend does not take these inputs here
                continue
            steps[name] = step
        if not steps:
            return "MATH", "SDPA, MATH backend forced (no fused backend takes these inputs)"
        if len(steps) == 1:
            (only,) = steps
            return only, f"SDPA, {only} backend forced (the only fused one that runs)"
        times = {name: _seconds(step, torch.device(cfg.device)) for name, step in steps.items()}
    best = min(times, key=times.__getitem__)
    return best, f"SDPA, {best} backend forced (the fastest of {', '.join(sorted(times))})"


def flex_mixture(
    seq_len: int,
    heads: int,
    segment_lengths,
    dilation_rates,
    is_causal: bool,
    device,
    head_offsets: str = "interleaved",
    compiled: bool = True,
):
    """``fn(q, k, v)`` on ``(B, N, H, D)`` tensors: PyTorch's FlexAttention computing the
    ``mixture`` of these branches exactly. The block mask allows the pairs some branch
    attends; the score of a pair gains ``log(m)``, ``m`` the number of branches that
    attend it, so that it counts ``m`` times in the softmax, as the mixture counts it.
    ``compiled``: through ``torch.compile`` (FlexAttention's fast path)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from ..reference import branch_offsets

    offsets = [o.to(device) for o in branch_offsets(heads, segment_lengths, dilation_rates, "mixture", head_offsets)]
    branches = [(min(w, seq_len), min(r, w, seq_len)) for w, r in zip(segment_lengths, dilation_rates, strict=True)]

    def multiplicity(h, q_idx, kv_idx):
        count = torch.zeros_like(q_idx)
        for (w, r), offset in zip(branches, offsets, strict=True):
            same = (q_idx // w) == (kv_idx // w)
            chosen = (q_idx % w % r == offset[h]) & (kv_idx % w % r == offset[h])
            count = count + (same & chosen).to(count.dtype)
        return count

    def mask_mod(b, h, q_idx, kv_idx):
        allowed = multiplicity(h, q_idx, kv_idx) > 0
        return allowed & (kv_idx <= q_idx) if is_causal else allowed

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + torch.log(multiplicity(h, q_idx, kv_idx).to(score.dtype))

    block_mask = create_block_mask(mask_mod, None, heads, seq_len, seq_len, device=device, _compile=compiled)
    attend = torch.compile(flex_attention, dynamic=False) if compiled else flex_attention

    def fn(q, k, v):
        out = attend(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), score_mod=score_mod, block_mask=block_mask
        )
        return out.transpose(1, 2)

    return fn


def copy_gbps(device: torch.device, megabytes: int = 1024, repeats: int = 5) -> float:
    """GB/s of a large device-to-device copy (bytes read plus bytes written): the
    memory ceiling (the fastest of ``repeats``)."""
    src = torch.randn(megabytes * 2**18, device=device)
    dst = torch.empty_like(src)
    _seconds(lambda: dst.copy_(src), device)
    fastest = min(_seconds(lambda: dst.copy_(src), device) for _ in range(repeats))
    return 2 * src.numel() * src.element_size() / fastest / 1e9


def machine_info(device: torch.device) -> dict:
    info = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "cpu": _cpu_model(),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def cpu_slug(model: str) -> str:
    """A file-name part for a CPU model name: ``"Intel(R) Xeon(R) Processor"`` ->
    ``"intel-xeon"``, ``"AMD EPYC 7B13"`` -> ``"amd-epyc-7b13"``."""
    plain = re.sub(r"\((r|tm)\)", " ", model.lower())
    words = [w for w in re.split(r"[^a-z0-9]+", plain) if w and w not in ("processor", "cpu")]
    return "-".join(words) or "unknown"


def machine_words(machine: dict) -> str:
    """The machine of :func:`machine_info` in words, for a results table's header:
    ``"AMD EPYC, 2 threads, torch 2.13.0+cpu"`` (the GPU's name first on CUDA)."""
    where = f"{machine['gpu']} ({machine['cpu']})" if "gpu" in machine else machine["cpu"]
    return f"{where}, {machine['threads']} threads, torch {machine['torch']}"


def machine_slug(device: torch.device) -> str:
    """A file-name part for the machine a benchmark runs on: the GPU's name on CUDA
    (``"NVIDIA-H200"``), else the CPU's model (:func:`cpu_slug`)."""
    if device.type == "cuda":  # "NVIDIA H200" -> "NVIDIA-H200"; "AMD Instinct MI250X / MI250" has a "/"
        return re.sub(r"[^A-Za-z0-9._-]+", "-", torch.cuda.get_device_name(device)).strip("-") or "gpu"
    return cpu_slug(_cpu_model())


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def measure(
    impl: str,
    seq_len: int,
    cfg: BenchConfig,
    predicted_s: float | None = None,
    ceilings: tuple[float, float] = (math.inf, math.inf),
) -> Row:
    """One row: forward (and forward + backward) time, GFLOP/s, ratio to the matmul
    GFLOP/s measured alongside, and the floor the ``ceilings`` (matmul GFLOP/s, copy
    GB/s) put under the time; :func:`run` measures its memory afterwards, apart."""
    device, dtype = torch.device(cfg.device), getattr(torch, cfg.dtype)
    row = Row(impl, seq_len)
    if predicted_s is not None and predicted_s > cfg.max_seconds:
        row.note = f"skipped: predicted {predicted_s:.3g} s > --max-seconds {cfg.max_seconds:g}"
        return row
    if impl == "dense":
        row.sdpa_backend, row.kernels = fastest_dense(seq_len, cfg)
    try:
        (q, k, v, grad), fn, fn_with_grad, pairs = _workload(impl, seq_len, cfg, row.sdpa_backend)
        if impl == "flex":  # compiled here: where the compiler (or its backward) fails, the row says so
            with torch.no_grad():
                fn(q, k, v)
            if cfg.backward:
                _with_backward([t.clone() for t in (q, k, v, grad)], fn, None)()
    except Exception as error:
        if impl != "flex" or isinstance(error, (ValueError, TypeError, torch.OutOfMemoryError)):
            raise
        row.note = f"failed: FlexAttention does not run here ({type(error).__name__}: {first_line(error, 160)})"
        return row
    row.io_bytes = 4 * q.numel() * q.element_size()
    gflop = 4 * cfg.head_dim * pairs / 1e9
    rate, bandwidth = ceilings
    row.fwd_floor_ms = 1e3 * max(gflop / rate, row.io_bytes / 1e9 / bandwidth)
    row.fwd_bwd_floor_ms = 1e3 * max(3.5 * gflop / rate, 3 * row.io_bytes / 1e9 / bandwidth)
    if impl in ("mixture", "head_groups", "mixture-torch"):
        row.kernels = fused.describe(q, kernel=impl.partition("-")[2] or None)
    with torch.no_grad():
        seconds, per_matmul = time_against_matmul(lambda: fn(q, k, v), device, dtype, cfg.repeats, cfg.matmul_size)
    row.fwd_ms, row.fwd_gflops, row.fwd_ratio = 1e3 * seconds, gflop / seconds, gflop * per_matmul
    if cfg.backward:
        step = _with_backward((q, k, v, grad), fn, fn_with_grad)
        seconds, per_matmul = time_against_matmul(step, device, dtype, cfg.repeats, cfg.matmul_size)
        row.fwd_bwd_ms = 1e3 * seconds
        row.fwd_bwd_gflops, row.fwd_bwd_ratio = 3.5 * gflop / seconds, 3.5 * gflop * per_matmul
    return row


def _with_backward(inputs, fn, fn_with_grad) -> Callable[[], object]:
    """One forward and backward: ``fn_with_grad`` (a kernel's own backward), else
    ``fn`` through autograd (``q, k, v`` made to require grad)."""
    q, k, v, grad = inputs
    if fn_with_grad is not None:
        return lambda: fn_with_grad(q, k, v, grad)
    for t in (q, k, v):
        t.requires_grad_()
    return lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), grad)


def forward_peak_added(call: Callable[[], torch.Tensor], device: torch.device) -> int:
    """The peak bytes a forward ``call`` (no gradient) adds, its output excluded, after
    one call not measured (what a first call sets up once is not the call's)."""
    with torch.no_grad():
        call()
        with PeakMemory(device) as peak:
            out = call()
    return peak.added - out.numel() * out.element_size()


def measure_memory(
    impl: str, seq_len: int, cfg: BenchConfig, sdpa_backend: str | None = None
) -> tuple[int, int | None]:
    """The peak bytes a forward call adds (its output excluded), and a forward and
    backward (``None`` without ``cfg.backward``), each after one call not measured (what
    a first call sets up once, such as autograd's machinery, is not the call's);
    ``sdpa_backend`` as in :func:`_workload`."""
    device = torch.device(cfg.device)
    inputs, fn, fn_with_grad, _ = _workload(impl, seq_len, cfg, sdpa_backend)
    forward = forward_peak_added(lambda: fn(*inputs[:3]), device)
    if not cfg.backward:
        return forward, None
    step = _with_backward(inputs, fn, fn_with_grad)
    step()
    with PeakMemory(device) as peak:
        step()
    return forward, peak.added


def measure_memories(cfg: BenchConfig, rows: Sequence[tuple[str, int, str | None]]) -> list[tuple[int, int | None]]:
    """:func:`measure_memory` of each ``(impl, seq_len, sdpa_backend)``: on the CPU in a fresh Python
    process (with this one's threads), which :class:`PeakMemory` may change for good and
    whose allocator holds nothing of the timings before; on CUDA in this process."""
    if torch.device(cfg.device).type == "cuda":
        return [measure_memory(impl, n, cfg, backend) for impl, n, backend in rows]
    request = {"config": asdict(cfg), "rows": list(rows), "threads": torch.get_num_threads()}
    package_parent = str(Path(__file__).resolve().parents[2])
    # the package this process runs, where the child would not find it on its own path
    code = (
        f"import sys\nif {package_parent!r} not in sys.path: sys.path.insert(1, {package_parent!r})\n"
        f"from {__name__} import _memory_process\n_memory_process()"
    )
    pairs = json_from([sys.executable, "-c", code], "the memory measurement", json.dumps(request, default=_plain))
    return [tuple(pair) for pair in pairs]


def json_from(command: Sequence[str], what: str, stdin: str | None = None, env: dict[str, str] | None = None):
    """The JSON value a process (``command``, fed ``stdin``, with environment ``env`` or
    this one's) prints on its last line of output; a ``RuntimeError`` naming ``what``
    with its exit status or signal and the end of its stderr where it fails."""
    done = subprocess.run(list(command), input=stdin, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        how = f"signal {-done.returncode}" if done.returncode < 0 else f"exit status {done.returncode}"
        raise RuntimeError(f"{what}'s process ended with {how}:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _plain(value) -> int | list:
    """JSON for a config's values that are not JSON types: ranges, NumPy ints."""
    return list(value) if isinstance(value, range) else int(value)


def _memory_process() -> None:
    """The process :func:`measure_memories` starts: its request on stdin, the
    measurements as JSON on stdout."""
    request = json.loads(sys.stdin.read())
    torch.set_num_threads(request["threads"])
    cfg = BenchConfig(**request["config"])
    print(json.dumps([measure_memory(impl, n, cfg, backend) for impl, n, backend in request["rows"]]))


def _progress(done: int, total: int, label: str) -> None:
    """On stderr: a bar redrawn in place on a terminal; one plain line per call in a
    file or a pipe, which would keep every frame of a redrawn bar."""
    if not sys.stderr.isatty():
        sys.stderr.write(f"[{done}/{total}] {label}\n")
        sys.stderr.flush()
        return
    width = 30
    filled = int(width * done / total) if total else width
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {label:<40}")
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def check_config(cfg: BenchConfig) -> None:
    """A ``ValueError`` for a configuration some implementation would refuse, before
    any measurement."""
    validation.check_branches(cfg.segment_lengths, cfg.dilation_rates)
    if "head_groups" in cfg.implementations:
        validation.check_head_groups(cfg.heads, len(cfg.segment_lengths))


def _predicted_seconds(impl: str, seq_len: int, cfg: BenchConfig, previous: Row | None, matmul_gflops: float) -> float:
    """What measuring ``impl`` at ``seq_len`` would take: from its ``previous`` timed
    row, grown as its work grows (``N^2`` for dense, ``N`` for the rest); for its first
    length, from the row's floor at ``matmul_gflops`` (a lower bound)."""
    calls = cfg.repeats + 2  # a warm-up and the timed runs, one more selecting a dense backend
    if previous is not None:
        growth = (seq_len / previous.seq_len) ** (2 if impl == "dense" else 1)
        return calls * (previous.fwd_bwd_ms or previous.fwd_ms or 0.0) / 1e3 * growth
    gflop = 4 * cfg.head_dim * work_of(impl, seq_len, cfg)[1] / 1e9
    return calls * (3.5 if cfg.backward else 1.0) * gflop / matmul_gflops


def run(cfg: BenchConfig, progress: bool = True) -> BenchResult:
    """Measure every implementation at every length, after the matmul reference: the
    timings, then the peak memory of what was timed (:func:`measure_memories`)."""
    device, dtype = torch.device(cfg.device), getattr(torch, cfg.dtype)
    check_config(cfg)
    torch.manual_seed(0)
    result = BenchResult(cfg, machine_info(device), matmul_gflops(device, dtype, cfg.matmul_size), copy_gbps(device))
    track_memory = cfg.memory and PeakMemory.supported(device)
    impls, lengths = list(dict.fromkeys(cfg.implementations)), sorted(set(cfg.seq_lens))
    total = len(impls) * len(lengths) + (1 if track_memory else 0)
    last: dict[str, Row | None] = {}
    for impl in impls:
        for seq_len in lengths:
            if progress:
                _progress(len(result.rows), total, f"{impl} N={seq_len}")
            predicted = _predicted_seconds(impl, seq_len, cfg, last.get(impl), result.matmul_gflops)
            row = measure(impl, seq_len, cfg, predicted, (result.matmul_gflops, result.copy_gbps))
            result.rows.append(row)
            if row.fwd_ms is not None:
                last[impl] = row
    timed = [row for row in result.rows if row.fwd_ms is not None]
    if track_memory and timed:
        if progress:
            _progress(len(result.rows), total, "memory" + (", in another process" if device.type == "cpu" else ""))
        memories: list[tuple[int | None, int | None]]
        try:
            memories = list(measure_memories(cfg, [(r.impl, r.seq_len, r.sdpa_backend) for r in timed]))
        except RuntimeError as error:  # the timings stand; the memory columns stay empty
            sys.stderr.write(f"no memory figures: {error}\n")
            memories = [(None, None)] * len(timed)
        for row, (forward, both) in zip(timed, memories, strict=True):
            row.fwd_peak_added_bytes, row.fwd_bwd_peak_added_bytes = forward, both
    if progress:
        _progress(total, total, "done")
    return result


# ----------------------------------------------------------------------------- output


def _fmt(value, width: int, precision: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}.{precision}f}"


def format_table(result: BenchResult) -> str:
    cfg = result.config
    lines = [
        (
            f"device {cfg.device} ({result.machine.get('gpu', result.machine['cpu'])}), "
            f"{result.machine['threads']} threads, torch {result.machine['torch']}, {cfg.dtype}, "
            f"B={cfg.batch} H={cfg.heads} D={cfg.head_dim}, "
            f"segment_lengths={list(cfg.segment_lengths)} dilation_rates={list(cfg.dilation_rates)}"
            f"{', causal' if cfg.is_causal else ''}"
        ),
        (
            f"matmul reference: {result.matmul_gflops:.1f} GFLOP/s ({cfg.matmul_size} x {cfg.matmul_size} product, "
            f"{cfg.dtype}, at the start); copy: {result.copy_gbps:.1f} GB/s (read + written)"
        ),
        "floor = max(useful FLOPs / matmul rate, bytes of q, k, v, out (x3 with backward) / copy rate)",
        (
            "ratio = useful GFLOP/s / matmul GFLOP/s, median of runs alternating with the matmul; "
            "mem = peak bytes a call adds (forward: output excluded) / bytes of q, k, v and output"
        ),
        "kernel = the fused kernel alone on one contiguous batch shaped like the first branch's work",
        "",
        (
            f"{'impl':13} {'N':>8} {'fwd ms':>9} {'floor':>8} {'tok/s':>9} {'GFLOP/s':>8} {'ratio':>6} "
            f"{'f+b ms':>9} {'floor':>8} {'GFLOP/s':>8} {'ratio':>6} {'fwd mem':>8} {'f+b mem':>8}"
        ),
    ]
    for r in result.rows:
        if r.fwd_ms is None:
            lines.append(f"{r.impl:13} {r.seq_len:>8} {r.note}")
            continue
        tokens = cfg.batch * r.seq_len / (r.fwd_ms / 1e3)
        mem_f = None if r.fwd_peak_added_bytes is None else r.fwd_peak_added_bytes / r.io_bytes
        mem_fb = None if r.fwd_bwd_peak_added_bytes is None else r.fwd_bwd_peak_added_bytes / r.io_bytes
        lines.append(
            f"{r.impl:13} {r.seq_len:>8} {r.fwd_ms:>9.1f} {_fmt(r.fwd_floor_ms, 8, 2)} {tokens:>9.0f} "
            f"{r.fwd_gflops:>8.1f} {r.fwd_ratio:>6.2f} {_fmt(r.fwd_bwd_ms, 9, 1)} {_fmt(r.fwd_bwd_floor_ms, 8, 2)} "
            f"{_fmt(r.fwd_bwd_gflops, 8, 1)} {_fmt(r.fwd_bwd_ratio, 6, 2)} {_fmt(mem_f, 8, 2)} {_fmt(mem_fb, 8, 2)}"
        )
    kernels = sorted({f"{r.impl}: {r.kernels}" for r in result.rows if r.kernels})
    return "\n".join(lines + (["", *kernels] if kernels else []))


def to_json(result: BenchResult) -> dict:
    return {
        "config": asdict(result.config),
        "machine": result.machine,
        "matmul_gflops": result.matmul_gflops,
        "copy_gbps": result.copy_gbps,
        "rows": [asdict(r) for r in result.rows],
    }


def plot(result: BenchResult, path: str) -> None:
    """Log-log time and peak memory against N, dense vs dilated."""
    plt = pyplot()
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4.2))
    for impl in dict.fromkeys(result.config.implementations):  # a repeated --impl was measured once
        rows = [r for r in result.rows if r.impl == impl and r.fwd_ms is not None]
        if not rows:
            continue
        n = [r.seq_len for r in rows]
        ax_t.plot(n, [r.fwd_ms for r in rows], "o-", label=f"{impl} forward")
        if all(r.fwd_bwd_ms is not None for r in rows):
            ax_t.plot(n, [r.fwd_bwd_ms for r in rows], "s--", label=f"{impl} fwd+bwd")
        fwd_peaks = [r.fwd_peak_added_bytes for r in rows if r.fwd_peak_added_bytes is not None]
        if len(fwd_peaks) == len(rows):
            ax_m.plot(n, [max(p, 1) / 2**20 for p in fwd_peaks], "o-", label=f"{impl} forward")
        fwd_bwd_peaks = [r.fwd_bwd_peak_added_bytes for r in rows if r.fwd_bwd_peak_added_bytes is not None]
        if len(fwd_bwd_peaks) == len(rows):
            ax_m.plot(n, [max(p, 1) / 2**20 for p in fwd_bwd_peaks], "s--", label=f"{impl} fwd+bwd")
    log_log([(ax_t, "time (ms)"), (ax_m, "peak memory added (MiB)")], "sequence length N")
    cfg = result.config
    save(
        fig,
        path,
        f"{cfg.device} ({result.machine.get('gpu', result.machine['cpu'])}), {cfg.dtype}, "
        f"H={cfg.heads} D={cfg.head_dim}, w={list(cfg.segment_lengths)} r={list(cfg.dilation_rates)}",
    )
