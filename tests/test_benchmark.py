"""The benchmark's FLOP count, memory probe and command (a smoke run on tiny sizes)."""

import dataclasses
import errno
import io
import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch
from hypothesis import given

import dilated_attention.tools.benchmark as benchmark
from dilated_attention import dilated_attention
from dilated_attention.reference import branch_offsets, branch_pattern
from dilated_attention.tools.benchmark import PeakMemory, attended_pairs
from dilated_attention.tools.cli import main
from dilated_attention.utils.files import atomic_write, fresh_folder, link_atomically
from helpers import configs

MACHINE = benchmark.machine_slug(torch.device("cpu"))  # results files name the machine


@given(configs(max_len=40))
def test_attended_pairs_counts_the_reference_patterns(cfg):
    n, h = cfg["seq_len"], cfg["heads"]
    segs, rates, mode, causal = cfg["segment_lengths"], cfg["dilation_rates"], cfg["mode"], cfg["is_causal"]
    expected = sum(
        int(branch_pattern(n, w, r, offs, causal).sum())
        for w, r, offs in zip(segs, rates, branch_offsets(h, segs, rates, mode), strict=True)
    )
    assert attended_pairs(cfg["batch"], n, h, segs, rates, mode, causal) == cfg["batch"] * expected


def test_dense_pairs():
    assert attended_pairs(2, 10, 3, [4], [1], "dense", False) == 2 * 3 * 100
    assert attended_pairs(2, 10, 3, [4], [1], "dense", True) == 2 * 3 * 55


def test_time_by_op_names_the_kernel_calls_and_accounts_for_every_operator():
    cfg = benchmark.BenchConfig(seq_lens=[64], device="cpu", segment_lengths=[16, 32], dilation_rates=[1, 2], heads=2)
    every = benchmark.time_by_op("head_groups", 64, cfg, top=1000)
    assert every[-1] == {"op": "(other)", "calls": 0, "ms": 0.0, "share": 0.0}
    assert sum(o["share"] for o in every) == pytest.approx(1.0)
    # head_groups with one head per branch: one call of PyTorch's CPU kernel per branch
    assert {o["op"]: o["calls"] for o in every}["aten::_scaled_dot_product_flash_attention_for_cpu"] == 2
    times = [o["ms"] for o in every[:-1]]
    assert times == sorted(times, reverse=True)  # the costliest first
    first = benchmark.time_by_op("head_groups", 64, cfg, top=1)
    assert [o["op"] for o in first][-1] == "(other)" and len(first) == 2
    assert first[0]["share"] + first[1]["share"] == pytest.approx(1.0)
    assert first[1]["calls"] >= 2


@pytest.mark.parametrize(
    ("model", "slug"),
    [
        ("Intel(R) Xeon(R) Processor", "intel-xeon"),
        ("AMD EPYC", "amd-epyc"),
        ("AMD EPYC 7B13 64-Core Processor", "amd-epyc-7b13-64-core"),
        ("Intel(R) Core(TM) i7-8700 CPU @ 3.20GHz", "intel-core-i7-8700-3-20ghz"),
        ("", "unknown"),
    ],
)
def test_cpu_slug_names_result_files_by_the_cpu(model, slug):
    assert benchmark.cpu_slug(model) == slug


@pytest.mark.skipif(not PeakMemory.supported(torch.device("cpu")), reason="needs Linux /proc")
def test_peak_memory_sees_a_temporary_allocation():
    size = 64 * 2**20
    with PeakMemory(torch.device("cpu")) as peak:
        x = torch.ones(size // 4)
        del x
    assert 0.9 * size <= peak.added <= 1.5 * size
    with PeakMemory(torch.device("cpu")) as peak:
        torch.ones(1024)
    assert peak.added < size / 8


class FakeGlibc:
    """Records the allocator calls PeakMemory makes instead of making them."""

    def __init__(self):
        self.calls = []

    def mallopt(self, param, value):
        self.calls.append(("mallopt", param, value))
        return 1

    def malloc_trim(self, pad):
        self.calls.append(("malloc_trim", pad))
        return 1


@pytest.mark.skipif(not PeakMemory.supported(torch.device("cpu")), reason="needs Linux /proc")
def test_peak_memory_restores_glibc_defaults_on_exit(monkeypatch):
    libc = FakeGlibc()
    monkeypatch.setattr(benchmark, "_glibc", lambda: libc)
    m_mmap_threshold, m_trim_threshold, kib = -3, -1, 1024  # glibc's malloc.h
    with pytest.raises(RuntimeError, match="inside"), PeakMemory(torch.device("cpu")):  # noqa: PT012 - the body is under test
        assert libc.calls == [
            ("mallopt", m_mmap_threshold, 256 * kib),
            ("mallopt", m_trim_threshold, 256 * kib),
            ("malloc_trim", 0),
        ]
        raise RuntimeError("inside the block")
    assert libc.calls[3:] == [("mallopt", m_mmap_threshold, 128 * kib), ("mallopt", m_trim_threshold, 128 * kib)]


@pytest.mark.skipif(not PeakMemory.supported(torch.device("cpu")), reason="needs Linux /proc")
def test_bench_measures_memory_in_a_process_of_its_own(monkeypatch):
    # PeakMemory's settings would slow whatever this process times after it.
    libc = FakeGlibc()
    monkeypatch.setattr(benchmark, "_glibc", lambda: libc)
    cfg = benchmark.BenchConfig(
        seq_lens=[32, 48],
        segment_lengths=(16, 32),
        dilation_rates=(1, 2),
        heads=2,
        head_dim=8,
        repeats=1,
        implementations=("kernel", "head_groups"),
        matmul_size=64,
    )
    result = benchmark.run(cfg, progress=False)
    assert libc.calls == []
    assert [(r.impl, r.seq_len) for r in result.rows] == [
        ("kernel", 32),
        ("kernel", 48),
        ("head_groups", 32),
        ("head_groups", 48),
    ]
    for row in result.rows:
        assert row.fwd_ms > 0 and row.fwd_bwd_ms > 0
        assert row.fwd_peak_added_bytes is not None and row.fwd_bwd_peak_added_bytes is not None


@pytest.mark.parametrize("memory_fails", [False, True])
def test_bench_measures_the_memory_of_the_timed_rows_after_every_timing(monkeypatch, capsys, memory_fails):
    events = []

    def timing(impl, seq_len, cfg, predicted, ceilings):
        events.append(("time", impl, seq_len))
        row = benchmark.Row(impl, seq_len)
        row.fwd_ms = None if seq_len == 48 and impl == "dense" else 1.0  # a row skipped for time
        row.sdpa_backend = "FLASH_ATTENTION" if impl == "dense" else None
        return row

    def memories(cfg, rows):
        events.append(("memory", tuple(rows)))
        if memory_fails:
            raise RuntimeError("the memory measurement's process ended with signal 9")
        return [(len(impl), seq_len) for impl, seq_len, _ in rows]

    monkeypatch.setattr(benchmark, "measure", timing)
    monkeypatch.setattr(benchmark, "measure_memories", memories)
    cfg = benchmark.BenchConfig(seq_lens=[48, 32], implementations=("kernel", "dense"), matmul_size=64)
    result = benchmark.run(cfg, progress=False)
    timed = [("kernel", 32, None), ("kernel", 48, None), ("dense", 32, "FLASH_ATTENTION")]  # on the timed backend
    times = [("time", "kernel", 32), ("time", "kernel", 48), ("time", "dense", 32), ("time", "dense", 48)]
    assert events == [*times, ("memory", tuple(timed))]
    for row in result.rows:
        expected = (None, None) if memory_fails or row.fwd_ms is None else (len(row.impl), row.seq_len)
        assert (row.fwd_peak_added_bytes, row.fwd_bwd_peak_added_bytes) == expected
    assert ("signal 9" in capsys.readouterr().err) == memory_fails


def test_json_from_reads_the_last_line_and_says_how_a_process_failed():
    python = [sys.executable, "-c"]
    assert benchmark.json_from([*python, "print('noise'); print('[1, 2]')"], "a child") == [1, 2]
    assert benchmark.json_from([*python, "import sys; print(sys.stdin.read())"], "a child", '{"a": 3}') == {"a": 3}
    env = {**os.environ, "DILATED_ATTENTION_TEST_VALUE": "7"}
    read_env = "import os; print(os.environ['DILATED_ATTENTION_TEST_VALUE'])"
    assert benchmark.json_from([*python, read_env], "a child", env=env) == 7
    with pytest.raises(RuntimeError, match=r"(?s)a child's process ended with exit status 3:.*boom"):
        benchmark.json_from([*python, "import sys; sys.stderr.write('boom'); sys.exit(3)"], "a child")
    with pytest.raises(RuntimeError, match="a child's process ended with signal 9"):
        benchmark.json_from([*python, "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"], "a child")


TINY_BENCH = [
    "bench",
    "--seq-lens",
    "64",
    "--impl",
    "mixture",
    "--segment-lengths",
    "16",
    "--dilation-rates",
    "1",
    "--heads",
    "1",
    "--head-dim",
    "8",
    "--repeats",
    "1",
    "--matmul-size",
    "64",
    "--no-backward",
    "--quiet",
]


def test_bench_writes_into_a_fresh_timestamped_folder_by_default(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(TINY_BENCH) == 0
    (folder,) = os.listdir(tmp_path)
    assert re.fullmatch(r"dilated-attention-bench-\d{8}-\d{6}", folder)
    assert sorted(os.listdir(folder)) == [f"bench-cpu-float32-{MACHINE}.{e}" for e in ("json", "png", "txt")]
    assert os.path.abspath(folder) in capsys.readouterr().out


def test_bench_replaces_its_files_atomically(tmp_path):
    old = {}
    for ext in ("json", "txt", "png"):
        path, other_name = tmp_path / f"smoke.{ext}", tmp_path / f"other-name.{ext}"
        other_name.write_text("old")
        os.link(other_name, path)  # writing into the file in place would change other_name too
        old[path] = other_name
    assert main([*TINY_BENCH, "--out-dir", str(tmp_path), "--name", "smoke"]) == 0
    for path, other_name in old.items():
        assert other_name.read_text() == "old" and path.read_bytes() != b"old"
    assert len(os.listdir(tmp_path)) == 6  # no temporary file left


def test_atomic_write_leaves_the_old_file_when_writing_fails(tmp_path):
    path = tmp_path / "out.txt"
    path.write_text("old")
    with pytest.raises(RuntimeError, match="half"), atomic_write(str(path)) as f:  # noqa: PT012 - the body is under test
        f.write("new, but only ")
        raise RuntimeError("half written")
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["out.txt"]
    with atomic_write(str(path), binary=True) as f:
        f.write(b"new")
    assert path.read_bytes() == b"new" and os.listdir(tmp_path) == ["out.txt"]
    with (
        pytest.raises(FileNotFoundError, match=r"the folder .*missing does not exist"),
        atomic_write(str(tmp_path / "missing" / "out.txt")),
    ):
        pass


def test_a_failed_write_names_the_file_asked_for_not_its_temporary(tmp_path, monkeypatch):
    """A full disk while the file is written, or a refused rename, raises the system's
    error about the path the caller gave (a temporary's name would mean nothing to a
    user), leaving the old file and no temporary."""
    path = tmp_path / "out.json"
    path.write_text("old")

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def refused(source, destination):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), source, None, destination)

    for name, failing, kind, code in (
        ("fsync", full, OSError, errno.ENOSPC),
        ("replace", refused, PermissionError, errno.EACCES),
    ):
        with monkeypatch.context() as patch:
            patch.setattr(os, name, failing)
            with pytest.raises(kind) as raised, atomic_write(str(path)) as f:
                f.write("new")
        assert raised.value.errno == code and raised.value.filename == str(path)
        assert str(path) in str(raised.value) and ".tmp" not in str(raised.value)
        assert path.read_text() == "old" and os.listdir(tmp_path) == ["out.json"]
    # a refused rename of a link's temporary name, as link_atomically makes
    with monkeypatch.context() as patch:
        patch.setattr(os, "replace", refused)
        with pytest.raises(PermissionError) as raised:
            link_atomically(str(path), str(tmp_path / "copy.json"))
    assert raised.value.filename == str(tmp_path / "copy.json") and os.listdir(tmp_path) == ["out.json"]
    # errors of the caller's block that name no file (they may be another file's), or
    # another file, or have no number (no system call's), are left as they are
    with pytest.raises(BrokenPipeError) as raised, atomic_write(str(path)) as f:  # noqa: PT012
        f.write("new")
        raise BrokenPipeError(errno.EPIPE, os.strerror(errno.EPIPE))
    assert raised.value.filename is None and raised.value.__cause__ is None

    class Refusal(OSError):  # another library's error class (its own fields): kept
        pass

    def refusing(fd):
        raise Refusal(errno.EIO, "refused")

    with monkeypatch.context() as patch:
        patch.setattr(os, "fsync", refusing)
        with pytest.raises(Refusal) as raised, atomic_write(str(path)) as f:
            f.write("new")
    assert raised.value.filename is None and os.listdir(tmp_path) == ["out.json"]
    # a name longer than the file system takes (its temporary's is cut to fit): the error names it
    long_name = tmp_path / ("n" * (os.pathconf(tmp_path, "PC_NAME_MAX") + 1))
    with pytest.raises(OSError, match="too long") as raised, atomic_write(str(long_name)):
        pass
    assert raised.value.errno == errno.ENAMETOOLONG and raised.value.filename == str(long_name)
    assert os.listdir(tmp_path) == ["out.json"]
    with pytest.raises(OSError, match=r"^disk full$") as raised, atomic_write(str(path)) as f:  # noqa: PT012
        f.write("new")
        raise OSError("disk full")
    assert raised.value.__cause__ is None and path.read_text() == "old"
    with pytest.raises(FileNotFoundError) as raised, atomic_write(str(path)) as f:  # noqa: PT012 - the body is under test
        f.write("new")
        (tmp_path / "missing.txt").read_text()
    assert raised.value.filename == str(tmp_path / "missing.txt") and path.read_text() == "old"


def test_fresh_folder_never_reuses_a_folder(tmp_path):
    stem = str(tmp_path / "run")
    assert fresh_folder(stem) == stem and os.path.isdir(stem)
    assert fresh_folder(stem) == stem + "-2"
    assert fresh_folder(stem) == stem + "-3"
    assert sorted(os.listdir(tmp_path)) == ["run", "run-2", "run-3"]


def test_bench_command_writes_table_json_and_plot(tmp_path, capsys):
    args = [
        "bench",
        "--seq-lens",
        "64",
        "96",
        "--segment-lengths",
        "16",
        "32",
        "--dilation-rates",
        "1",
        "2",
        "--heads",
        "2",
        "--head-dim",
        "8",
        "--repeats",
        "1",
        "--matmul-size",
        "128",
        "--quiet",
        "--out-dir",
        str(tmp_path),
        "--name",
        "smoke",
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    for impl in ("dense", "kernel", "mixture", "head_groups"):
        assert impl in out
    data = json.loads((tmp_path / "smoke.json").read_text())
    assert [(r["impl"], r["seq_len"]) for r in data["rows"]] == [
        (impl, n) for impl in ("dense", "kernel", "mixture", "head_groups") for n in (64, 96)
    ]
    for row in data["rows"]:
        assert row["fwd_ms"] > 0 and row["fwd_bwd_ms"] > 0 and row["fwd_ratio"] > 0
    mixture = [r for r in data["rows"] if r["impl"] == "mixture"]
    # useful FLOPs: GFLOP/s * seconds = 4 * D * pairs
    pairs = attended_pairs(1, 96, 2, [16, 32], [1, 2], "mixture", False)
    assert mixture[1]["fwd_gflops"] * mixture[1]["fwd_ms"] / 1e3 == pytest.approx(4 * 8 * pairs / 1e9)
    assert (tmp_path / "smoke.png").read_bytes()[:4] == b"\x89PNG"
    assert "head_groups" in (tmp_path / "smoke.txt").read_text()


def test_bench_skips_what_would_take_too_long(tmp_path, capsys):
    args = [
        "bench",
        "--seq-lens",
        "64",
        "4096",
        "--impl",
        "dense",
        "--segment-lengths",
        "16",
        "--dilation-rates",
        "1",
        "--heads",
        "1",
        "--head-dim",
        "8",
        "--repeats",
        "1",
        "--matmul-size",
        "128",
        "--max-seconds",
        "0.000001",
        "--no-backward",
        "--no-memory",
        "--no-plot",
        "--quiet",
        "--out-dir",
        str(tmp_path),
    ]
    assert main(args) == 0
    assert "skipped: predicted" in capsys.readouterr().out


class Terminal(io.StringIO):
    def isatty(self):
        return True


@pytest.mark.parametrize("terminal", [False, True])
def test_bench_progress_is_a_bar_only_on_a_terminal(terminal, tmp_path, capsys, monkeypatch):
    """A file or a pipe gets one line per measurement, not the frames of a bar
    redrawn with carriage returns."""
    stream = Terminal() if terminal else io.StringIO()
    monkeypatch.setattr("sys.stderr", stream)
    args = [
        "bench",
        "--seq-lens",
        "64",
        "96",
        "--impl",
        "dense",
        "--segment-lengths",
        "16",
        "--dilation-rates",
        "1",
        "--heads",
        "1",
        "--head-dim",
        "8",
        "--repeats",
        "1",
        "--matmul-size",
        "128",
        "--no-backward",
        "--no-memory",
        "--no-plot",
        "--out-dir",
        str(tmp_path),
    ]
    assert main(args) == 0
    progress = stream.getvalue()
    if terminal:
        assert progress.count("\r") == 3 and "2/2 done" in progress and progress.endswith("\n")
    else:
        assert "\r" not in progress
        assert progress.splitlines() == ["[0/2] dense N=64", "[1/2] dense N=96", "[2/2] done"]


def test_decode_bench_writes_its_table_json_and_plot(tmp_path, capsys):
    from dilated_attention.tools.cli import main

    args = [
        "decode-bench",
        "--positions",
        "64",
        "256",
        "--segment-lengths",
        "8",
        "32",
        "--dilation-rates",
        "1",
        "2",
        "--heads",
        "2",
        "--head-dim",
        "4",
        "--steps",
        "40",
        "--dense-steps",
        "3",
        "--out-dir",
        str(tmp_path),
    ]
    assert main(args) == 0
    written = json.loads((tmp_path / f"decode-cpu-float32-{MACHINE}.json").read_text())
    rows = written["rows"]
    padded = written["padded_against_equal"]
    assert [r["position"] for r in padded] == [64, 256]
    assert all(r["ratio"] == pytest.approx(r["padded_ms"] / r["equal_ms"]) and r["equal_ms"] > 0 for r in padded)
    assert "left-padded over B=8 at equal positions" in (tmp_path / f"decode-cpu-float32-{MACHINE}.txt").read_text()
    assert [(r["impl"], r["batch"], r["position"]) for r in rows] == [
        (impl, batch, position)
        for position in (64, 256)
        for batch in ("1", "8 equal", "8 padded")
        for impl in ("dilated", "dense")
    ]
    assert all(r["ms_per_token"] > 0 for r in rows)
    assert {r["note"] for r in rows if r["impl"] == "dense"} == {
        "SDPA (CPU flash)",
        "SDPA (CPU flash), boolean key mask",
    }
    dilated = [r["cache_bytes"] for r in rows if r["impl"] == "dilated" and r["batch"] == "1"]
    dense = [r["cache_bytes"] for r in rows if r["impl"] == "dense" and r["batch"] == "1"]
    assert dilated[0] == dilated[1] and dense[1] > 2 * dense[0]  # bounded, against growing
    assert (tmp_path / f"decode-cpu-float32-{MACHINE}.png").read_bytes()[:4] == b"\x89PNG"
    assert "dense/dilated" in (tmp_path / f"decode-cpu-float32-{MACHINE}.txt").read_text()


@pytest.mark.parametrize("is_causal", [False, True])
def test_flexattention_peer_computes_the_same_mixture(is_causal):
    """The benchmark's FlexAttention peer: its block mask is the branches' pattern and
    each pair's score gains log(branch count), which is the mixture exactly."""
    import warnings

    from dilated_attention.tools.benchmark import flex_mixture

    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 160, 4, 8, generator=gen) for _ in range(3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # uncompiled FlexAttention warns that it is slow
        fn = flex_mixture(160, 4, [32, 64, 128], [1, 2, 4], is_causal, torch.device("cpu"), compiled=False)
        out = fn(q, k, v)
    expected = dilated_attention(q, k, v, [32, 64, 128], [1, 2, 4], is_causal=is_causal)
    assert (out - expected).abs().max() < 1e-5


def test_a_flexattention_that_does_not_compile_is_a_failed_row(monkeypatch):
    """Where the compiler fails on FlexAttention (PyTorch's CPU code generation does on
    some versions), the row says so in one line and the other rows run."""

    def uncompilable(*args, **kwargs):
        def fn(q, k, v):
            raise RuntimeError("CppCompileError: C++ compile error\n" + "generated code\n" * 500)

        return fn

    monkeypatch.setattr(benchmark, "flex_mixture", uncompilable)
    cfg = benchmark.BenchConfig(seq_lens=[64], segment_lengths=[16, 32], dilation_rates=[1, 2], heads=2, head_dim=8)
    row = benchmark.measure("flex", 64, cfg, None)
    assert row.fwd_ms is None and row.note == (
        "failed: FlexAttention does not run here (RuntimeError: CppCompileError: C++ compile error)"
    )

    class NoBackward(torch.autograd.Function):  # as FlexAttention on the CPU in some versions
        @staticmethod
        def forward(ctx, q):
            return q.clone()

        @staticmethod
        def backward(ctx, grad):
            raise NotImplementedError("FlexAttention does not support backward on CPU")

    monkeypatch.setattr(benchmark, "flex_mixture", lambda *a, **k: lambda q, k, v: NoBackward.apply(q))
    row = benchmark.measure("flex", 64, cfg, None)
    assert row.note == (
        "failed: FlexAttention does not run here (NotImplementedError: FlexAttention does not support backward on CPU)"
    )
    assert benchmark.measure("flex", 64, dataclasses.replace(cfg, backward=False, repeats=1), None).fwd_ms > 0
    monkeypatch.setattr(benchmark, "flex_mixture", lambda *a, **k: lambda q, k, v: q.new_zeros(()).item(""))
    with pytest.raises(TypeError):  # a bad argument is not a compiler's failure
        benchmark.measure("flex", 64, cfg, None)


def test_bench_names_the_kernels_and_the_floor_of_each_row(tmp_path):
    args = [arg if arg != "mixture" else "dense" for arg in TINY_BENCH]
    args[args.index("dense") + 1 : args.index("dense") + 1] = ["mixture", "mixture-torch"]
    assert main([*args, "--out-dir", str(tmp_path), "--name", "kernels", "--no-plot"]) == 0
    result = json.loads((tmp_path / "kernels.json").read_text())
    assert result["copy_gbps"] > 0
    rows = {row["impl"]: row for row in result["rows"]}
    assert set(rows) == {"dense", "mixture", "mixture-torch"}
    assert rows["mixture-torch"]["kernels"].startswith("torch (CpuFlashKernel")
    cfg = benchmark.BenchConfig(seq_lens=[64], segment_lengths=[16], dilation_rates=[1], heads=1, head_dim=8)
    for row in rows.values():  # the larger of the FLOPs at the matmul's speed and the bytes at the copy's
        gflop = 4 * 8 * benchmark.work_of(row["impl"], 64, cfg)[1] / 1e9
        expected = 1e3 * max(gflop / result["matmul_gflops"], row["io_bytes"] / 1e9 / result["copy_gbps"])
        assert row["fwd_floor_ms"] == pytest.approx(expected, rel=1e-12) and expected > 0
    assert "floor" in (tmp_path / "kernels.txt").read_text()


def test_bench_refuses_what_an_implementation_would_refuse_before_measuring(monkeypatch):
    """head_groups with fewer heads than branches: refused before the matmul reference
    (and before any dense row) runs."""

    def measured(*args, **kwargs):
        raise AssertionError("measured before the refusal")

    monkeypatch.setattr(benchmark, "matmul_gflops", measured)
    cfg = benchmark.BenchConfig(seq_lens=[64], segment_lengths=[16, 32], dilation_rates=[1, 2], heads=1)
    with pytest.raises(ValueError, match="needs at least one head per branch"):
        benchmark.run(dataclasses.replace(cfg, implementations=("dense", "head_groups")), progress=False)


def test_bench_skips_a_first_length_whose_floor_passes_max_seconds(tmp_path, capsys):
    """Without an earlier length to scale from, the prediction is the row's floor at the
    run's matmul speed: dense at N=4096 is not run when --max-seconds is tiny."""
    args = [a if a != "mixture" else "dense" for a in TINY_BENCH]
    args[args.index("64")] = "4096"
    assert main([*args, "--max-seconds", "0.001", "--no-plot", "--no-memory", "--out-dir", str(tmp_path)]) == 0
    (row,) = json.loads((tmp_path / f"bench-cpu-float32-{MACHINE}.json").read_text())["rows"]
    assert row["fwd_ms"] is None and row["note"].startswith("skipped: predicted")
    assert row["note"].endswith("s > --max-seconds 0.001") and "predicted 0 s" not in row["note"]


@pytest.mark.parametrize(("seq_len", "w", "r"), [(1, 16, 1), (40, 16, 4), (64, 10**6, 1), (64, 16, 100)])
def test_kernel_row_is_the_first_branch_work_at_that_length(seq_len, w, r):
    """The kernel row times the first branch's segments at N (w and r clamped to N as
    the planner clamps them), never more rows than the sequence holds."""
    cfg = benchmark.BenchConfig(seq_lens=[seq_len], segment_lengths=[w], dilation_rates=[r], heads=2, head_dim=4)
    shape, pairs = benchmark.work_of("kernel", seq_len, cfg)
    segment = min(w, seq_len)
    rows = -(-segment // min(r, segment))
    assert shape == (seq_len // segment, 2, rows, 4) and pairs == shape[0] * 2 * rows * rows
    library = benchmark.attended_pairs(1, seq_len, 2, [w], [r], "mixture", False)
    assert pairs <= library  # whole segments only: the first branch's work, or less


def test_dense_rows_name_the_sdpa_backend_they_ran(tmp_path):
    args = [a if a != "mixture" else "dense" for a in TINY_BENCH]
    assert main([*args, "--no-plot", "--no-memory", "--out-dir", str(tmp_path)]) == 0
    (row,) = json.loads((tmp_path / f"bench-cpu-float32-{MACHINE}.json").read_text())["rows"]
    # on the CPU only the flash backend among the fused ones takes these inputs
    assert row["kernels"] == "SDPA, FLASH_ATTENTION backend forced (the only fused one that runs)"
    assert row["sdpa_backend"] == "FLASH_ATTENTION"
    assert "dense: SDPA, FLASH_ATTENTION backend forced" in (tmp_path / f"bench-cpu-float32-{MACHINE}.txt").read_text()


def test_dense_memory_is_measured_on_the_backend_the_row_timed():
    cfg = benchmark.BenchConfig(seq_lens=[64], heads=2, head_dim=8, implementations=("dense",), matmul_size=64)
    assert benchmark.measure_memory("dense", 64, cfg, "FLASH_ATTENTION")[0] >= 0
    with pytest.raises(RuntimeError, match="kernel"):  # forced: the CPU has no efficient-attention kernel
        benchmark.measure_memory("dense", 64, cfg, "EFFICIENT_ATTENTION")


def test_bench_results_record_their_options_and_drop_an_earlier_plot(tmp_path, capsys):
    assert main([*TINY_BENCH, "--no-memory", "--out-dir", str(tmp_path), "--name", "r"]) == 0
    assert (tmp_path / "r.png").is_file()
    assert main([*TINY_BENCH, "--no-memory", "--out-dir", str(tmp_path), "--name", "r", "--no-plot"]) == 0
    assert not (tmp_path / "r.png").exists()  # the plot of the earlier run would pass for this one's
    assert "the earlier run's .png removed" in capsys.readouterr().out
    written = json.loads((tmp_path / "r.json").read_text())["arguments"]
    assert written["seq_lens"] == [64] and written["no_plot"] is True and written["impl"] == ["mixture"]


def test_decode_bench_spreads_its_timed_steps_over_a_whole_cycle(monkeypatch):
    """Steps timed at a position that starts every segment would all be the cheapest
    (a window of a few keys): fewer steps than the cycle are spread evenly over it,
    the positions between them fed untimed."""
    from dilated_attention.tools import decode_benchmark as db

    cfg = db.DecodeConfig(segment_lengths=(8, 32, 128), dilation_rates=(1, 2, 4), heads=2, head_dim=4, steps=4)
    # step i moved on to phase i mod lcm(rates): spread steps 32 apart would share one phase modulo every rate
    assert db.span_of(cfg, 1024) == 128 and db.timed_offsets(cfg, 1024) == [0, 33, 66, 99]
    assert db.span_of(cfg, 100) == 100 and db.timed_offsets(cfg, 100) == [0, 25, 50, 75]  # phases 0, 1, 2, 3
    assert db.span_of(cfg, 3) == 64 and db.timed_offsets(dataclasses.replace(cfg, steps=1000), 3) == list(range(64))
    short = dataclasses.replace(cfg, segment_lengths=(48,), dilation_rates=(1,))  # a cycle of 48: two make 96
    assert [db.span_of(short, p) for p in (10, 48, 5000)] == [64, 96, 96]
    for rates, steps, position in (((3, 4), 7, 30000), ((1, 2, 4), 40, 1024), ((5,), 16, 77), ((2, 3), 64, 1)):
        spread = dataclasses.replace(cfg, dilation_rates=rates, steps=steps)
        offsets, span, phases = db.timed_offsets(spread, position), db.span_of(spread, position), math.lcm(*rates)
        assert offsets == sorted(set(offsets)) and len(offsets) == min(steps, span) and offsets[-1] < span
        places = [i * span // len(offsets) for i in range(len(offsets))] + [span]
        for i, offset in enumerate(offsets):  # each on its phase where its gap holds one, else on its place
            has_phase = any((position + p) % phases == i % phases for p in range(places[i], places[i + 1]))
            assert (position + offset) % phases == i % phases if has_phase else offset == places[i]
    cache, tokens = db._fed_cache(cfg, 1024, [0, 0])
    assert cache.position.tolist() == [1024 - db.SETTLING_STEPS] * 2  # the first timed step settles too
    timed_at = []

    def timed(cache, tokens, i, device):
        timed_at.append(int(cache.position[0]))
        cache.attend(tokens[0], tokens[0], tokens[0])
        return 1.0

    monkeypatch.setattr(db, "_step_seconds", timed)
    assert list(db._timed_steps(cache, tokens, cfg, 1024)) == [1.0] * 4
    # the last SETTLING_STEPS positions before each timed step are taken (untimed) as steps
    settle = db.SETTLING_STEPS
    expected = [p for at in (1024, 1057, 1090, 1123) for p in range(at - settle, at + 1)]
    assert timed_at == expected and int(cache.position[0]) == 1124


def test_decode_bench_measures_each_batch_and_position_once(tmp_path, capsys):
    args = ["decode-bench", "--positions", "40", "40", "--batch", "1", "--segment-lengths", "8", "16"]
    args += ["--dilation-rates", "1", "2", "--heads", "2", "--head-dim", "4", "--steps", "8", "--dense-steps", "2"]
    assert main([*args, "--no-plot", "--out-dir", str(tmp_path), "--name", "d"]) == 0
    rows = json.loads((tmp_path / "d.json").read_text())["rows"]
    assert [(r["impl"], r["batch"], r["position"]) for r in rows] == [("dilated", "1", 40), ("dense", "1", 40)]
    captured = capsys.readouterr()
    assert "position        40" in captured.err and "position        40" not in captured.out  # progress: stderr
    assert main([*args, "--no-plot", "--out-dir", str(tmp_path), "--name", "d", "--quiet"]) == 0
    assert capsys.readouterr().err == ""


class _FullStream(io.StringIO):
    def write(self, text):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_measurement_is_written_before_its_table_is_printed(tmp_path, monkeypatch):
    """stdout gone (a closed pipe, a full disk): the result files, the command's
    product, are there all the same."""
    args = ["decode-bench", "--positions", "40", "--batch", "1", "--segment-lengths", "8", "--dilation-rates", "1"]
    args += ["--heads", "1", "--head-dim", "4", "--steps", "2", "--dense-steps", "2", "--quiet", "--no-plot"]
    monkeypatch.setattr(sys, "stdout", _FullStream())
    assert main([*args, "--out-dir", str(tmp_path), "--name", "d"]) != 0
    assert json.loads((tmp_path / "d.json").read_text())["rows"] and (tmp_path / "d.txt").read_text()


@pytest.mark.parametrize(
    "command",
    [
        ["targets.py", "--threads", "0"],
        ["edge_costs.py", "--threads", "0"],
        ["distributed.py", "--nprocs", "0"],
        ["longnet_training.py", "speed", "--repeats", "0"],
        ["transformers_generation.py", "--new-tokens", "0"],
    ],
)
def test_benchmark_scripts_refuse_bad_options_in_one_line(command):
    script = os.path.join(os.path.dirname(__file__), "..", "benchmarks", command[0])
    done = subprocess.run([sys.executable, script, *command[1:]], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "must be" in done.stderr and "Traceback" not in done.stderr


def test_a_gpu_name_becomes_a_file_name(monkeypatch):
    """GPU names may hold "/" ("AMD Instinct MI250X / MI250"): the results' file name
    would point into a folder that does not exist."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "AMD Instinct MI250X / MI250")
    assert benchmark.machine_slug(torch.device("cuda")) == "AMD-Instinct-MI250X-MI250"
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    assert benchmark.machine_slug(torch.device("cuda")) == "NVIDIA-H200"  # as gpu.sh names its files


def test_a_name_that_fits_the_file_system_is_written_and_a_longer_one_refused_first(tmp_path, capsys):
    """A file name up to the file system's limit is written (its temporary's name,
    ``.NAME.<hex>.tmp``, is cut short to fit); a longer one is refused before any work,
    with nothing made."""
    longest = os.pathconf(tmp_path, "PC_NAME_MAX")
    fits = "a" * (longest - len(".json"))
    with atomic_write(str(tmp_path / f"{fits}.json")) as f:
        f.write("{}")
    assert os.listdir(tmp_path) == [f"{fits}.json"]
    out_dir = tmp_path / "out"
    assert main([*TINY_BENCH, "--out-dir", str(out_dir), "--name", fits + "a"]) == 2
    assert not out_dir.exists()
    assert f"is {longest + 1} bytes, longer than the file system takes ({longest}): pick a shorter name" in (
        capsys.readouterr().err
    )


def test_a_plot_that_is_not_redrawn_is_not_left_beside_new_numbers(tmp_path, monkeypatch):
    """The earlier run's plot goes before the new JSON and table are written: a run
    interrupted while it draws leaves no plot rather than one of other numbers."""
    stem = tmp_path / "smoke"
    stem.with_suffix(".png").write_text("an earlier run's plot")

    def interrupted(*args, **kwargs):
        assert not stem.with_suffix(".png").exists() and stem.with_suffix(".json").exists()
        raise KeyboardInterrupt

    monkeypatch.setattr(benchmark, "plot", interrupted)
    assert main([*TINY_BENCH, "--out-dir", str(tmp_path), "--name", "smoke"]) == 130  # Ctrl-C's status
    assert sorted(os.listdir(tmp_path)) == ["smoke.json", "smoke.txt"]


def test_the_gpu_script_refuses_unknown_steps_and_a_machine_without_cuda(tmp_path):
    """Before anything is written: no files named after an empty card's name, and a
    status that says so (it exited 0 whatever its steps did)."""
    script = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", "gpu.sh")
    out = tmp_path / "out"
    unknown = subprocess.run(["bash", script, str(out), "chek"], capture_output=True, text=True, timeout=60)
    assert unknown.returncode == 2 and "unknown step chek: the steps are check tests" in unknown.stderr
    if torch.cuda.is_available():
        return
    result = subprocess.run(["bash", script, str(out), "check"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "no CUDA device" in result.stderr and not out.exists()


def test_a_file_system_with_short_names_gets_a_temporary_without_the_name(tmp_path, monkeypatch):
    """Where names are shorter than the temporary's random tail, the name is left out
    (the loop that shortened it never ended); the write itself then says what the
    system says."""
    from dilated_attention.utils import files

    monkeypatch.setattr(os, "pathconf", lambda path, name: 30)
    temporary = files.temporary_path(str(tmp_path / "results.json"))
    assert os.path.dirname(temporary) == str(tmp_path) and re.fullmatch(
        r"\.\.[0-9a-f]{32}\.tmp", os.path.basename(temporary)
    )
    monkeypatch.setattr(os, "pathconf", lambda path, name: -1)  # "no limit": names are still written
    assert files.name_max(str(tmp_path)) == 255
    with atomic_write(str(tmp_path / "results.json")) as f:
        f.write("{}")
    assert os.listdir(tmp_path) == ["results.json"]


def test_a_folder_in_the_place_of_a_results_file_is_named_as_in_the_way(tmp_path, capsys):
    """The results' names are the command's: a folder of that name is in the way (a
    file suggested inside it would not be written)."""
    (tmp_path / "smoke.json").mkdir()
    assert main([*TINY_BENCH, "--out-dir", str(tmp_path), "--name", "smoke"]) == 2
    assert f"{tmp_path / 'smoke.json'} is a folder: move that folder away" in capsys.readouterr().err
    assert os.listdir(tmp_path) == ["smoke.json"]
