"""The benchmark's FLOP count, memory probe and command (a smoke run on tiny sizes)."""

import json

import pytest
import torch
from helpers import configs
from hypothesis import given

from dilated_attention.benchmark import PeakMemory, attended_pairs
from dilated_attention.cli import main
from dilated_attention.reference import branch_offsets, branch_pattern


@given(configs(max_len=40))
def test_attended_pairs_counts_the_reference_patterns(cfg):
    n, h = cfg["seq_len"], cfg["heads"]
    segs, rates, mode, causal = cfg["segment_lengths"], cfg["dilation_rates"], cfg["mode"], cfg["is_causal"]
    expected = sum(
        int(branch_pattern(n, w, r, offs, causal).sum())
        for w, r, offs in zip(segs, rates, branch_offsets(h, segs, rates, mode))
    )
    assert attended_pairs(cfg["batch"], n, h, segs, rates, mode, causal) == cfg["batch"] * expected


def test_dense_pairs():
    assert attended_pairs(2, 10, 3, [4], [1], "dense", False) == 2 * 3 * 100
    assert attended_pairs(2, 10, 3, [4], [1], "dense", True) == 2 * 3 * 55


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


def test_bench_command_writes_table_json_and_plot(tmp_path, capsys):
    args = [
        "bench", "--seq-lens", "64", "96", "--segment-lengths", "16", "32", "--dilation-rates", "1", "2",
        "--heads", "2", "--head-dim", "8", "--repeats", "1", "--matmul-size", "128", "--quiet",
        "--out-dir", str(tmp_path), "--name", "smoke",
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
        "bench", "--seq-lens", "64", "4096", "--impl", "dense", "--segment-lengths", "16",
        "--dilation-rates", "1", "--heads", "1", "--head-dim", "8", "--repeats", "1",
        "--matmul-size", "128", "--max-seconds", "0.000001", "--no-backward", "--no-memory",
        "--no-plot", "--quiet", "--out-dir", str(tmp_path),
    ]
    assert main(args) == 0
    assert "skipped: predicted" in capsys.readouterr().out
