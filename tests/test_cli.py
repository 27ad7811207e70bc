"""The command line: check's exit code, pattern's picture."""

import subprocess
import sys

import torch

import dilated_attention.check as check
from dilated_attention.cli import main


def test_check_passes_and_prints_a_table(capsys):
    assert main(["check", "--dtype", "float64", "float32", "--seed", "3"]) == 0
    out = capsys.readouterr().out
    assert "float64 on cpu" in out and "float32 on cpu" in out
    assert "all passed: 0 failing case(s)" in out
    assert out.count(" yes") == 2 * len(check.default_cases())


def test_check_fails_when_a_case_exceeds_its_tolerance(capsys, monkeypatch):
    monkeypatch.setitem(check.TOLERANCES, torch.float32, 1e-12)
    assert main(["check", "--dtype", "float32"]) == 1
    assert "FAILED" in capsys.readouterr().out


def test_check_refuses_missing_cuda(capsys):
    if torch.cuda.is_available():
        return
    assert main(["check", "--device", "cuda"]) == 2
    assert "torch.cuda.is_available() is False" in capsys.readouterr().err


def test_pattern_writes_a_png(tmp_path, capsys):
    path = tmp_path / "pattern.png"
    args = ["pattern", "--segment-lengths", "8", "16", "--dilation-rates", "1", "2"]
    assert main(args + ["--length", "32", "--heads", "4", "--causal", "--out", str(path)]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines[:4]] == ["head 0", "head 1", "head 2", "head 3"]
    # head 1: offsets [0, 1]; causal, so query 0 sees only itself
    assert lines[1].startswith("head 1: offsets per branch [0, 1], keys per query min 1")


def test_pattern_rejects_bad_configuration(tmp_path, capsys):
    args = ["pattern", "--segment-lengths", "8", "--dilation-rates", "1", "2", "--length", "8", "--heads", "2"]
    assert main(args + ["--out", str(tmp_path / "p.png")]) == 2
    assert "same length" in capsys.readouterr().err


def test_module_entry_point_runs():
    result = subprocess.run(
        [sys.executable, "-m", "dilated_attention", "check", "--dtype", "float64"],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "all passed" in result.stdout
