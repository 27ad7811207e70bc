"""The examples: the distributed one states its verdict, tolerance and worst error."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from dilated_attention.tools.check import ONE_PROCESS_TOLERANCES
from helpers import option_help

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples")
TIMEOUT_S = 300


def load_example(name):
    """Import ``examples/<name>.py`` as a module (its ``main`` does not run)."""
    spec = importlib.util.spec_from_file_location(f"example_{name}", os.path.join(EXAMPLES, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_distributed_example_ends_with_pass_naming_its_tolerance():
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            os.path.join(EXAMPLES, "distributed.py"),
            "--seq-len",
            "101",
            "--segment-lengths",
            "16",
            "32",
            "--dilation-rates",
            "1",
            "2",
            "--heads",
            "2",
            "--head-dim",
            "4",
        ],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    last = result.stdout.splitlines()[-1]
    assert last.startswith("PASS: ") and f"tolerance {ONE_PROCESS_TOLERANCES[torch.float32]:g}" in last, last


def test_distributed_example_without_torchrun_says_how_to_launch_it():
    env = {name: value for name, value in os.environ.items() if name not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    result = subprocess.run(
        [sys.executable, os.path.join(EXAMPLES, "distributed.py"), "--seq-len", "16"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env=env,
    )
    assert result.returncode == 1 and result.stdout == ""
    assert "launch it with torchrun, e.g. torchrun --nproc_per_node 2 examples/distributed.py" in result.stderr
    assert "Traceback" not in result.stderr


def test_distributed_example_verdict():
    verdict = load_example("distributed").verdict
    tol = ONE_PROCESS_TOLERANCES[torch.float32]
    table = [dict(out_error=tol / 8, grad_error=tol / 4), dict(out_error=tol / 5, grad_error=0.0)]
    assert verdict(table, torch.float32, check=True) == (
        True,
        f"PASS: worst error {tol / 4:.2g} <= tolerance {tol:g} (float32, every rank against one process)",
    )
    table[1]["grad_error"] = 4 * tol
    assert verdict(table, torch.float32, check=True) == (
        False,
        f"FAIL: worst error {4 * tol:.2g} > tolerance {tol:g} (float32, every rank against one process)",
    )
    ok, line = verdict([dict(), dict()], torch.float32, check=False)
    assert ok and line.startswith("PASS: ") and "--no-check" in line


def test_distributed_example_help_matches_its_flags(capsys, monkeypatch):
    example = load_example("distributed")
    monkeypatch.setenv("COLUMNS", "100")
    monkeypatch.setattr(sys, "argv", ["distributed.py", "--help"])
    with pytest.raises(SystemExit):
        example.parse_args()
    text = capsys.readouterr().out
    assert "--check, the default" not in text and "unless --no-check" in text and "``" not in text
    options = option_help(text)
    del options["-h, --help"]
    assert "--no-check" in options
    for invocation, help_text in options.items():
        assert "(default: " in help_text and not help_text.startswith("(default"), f"{invocation}: {help_text!r}"


def test_transformers_example_trains_and_generates():
    pytest.importorskip("transformers")
    result = subprocess.run(
        [sys.executable, os.path.join(EXAMPLES, "transformers_llama.py"), "--steps", "3"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    assert lines[0].startswith("step 1: loss ") and lines[1].startswith("3 steps in ")
    assert lines[2].startswith("def ")


def test_image_ordering_example_trains_each_order(tmp_path):
    result = subprocess.run(
        [sys.executable, os.path.join(EXAMPLES, "image_ordering.py"), "--steps", "2", "--out-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["order", "test", "accuracy", "train", "s"]
    assert [line.split()[0] for line in lines[1:]] == ["row_major", "zorder", "hilbert"]
    for line in lines[1:]:
        assert 0 < float(line.split()[1].rstrip("%")) <= 100
    progress = [line for line in result.stderr.splitlines() if ": step " in line]  # as it goes, on stderr
    assert [line.split(",")[0] for line in progress] == [
        f"{order}: step {step}/2" for order in ("row_major", "zorder", "hilbert") for step in (1, 2)
    ]
    written = (tmp_path / "image-ordering-cpu.txt").read_text().splitlines()
    assert "2 steps of 16 images each" in written[0] and "float32" in written[0] and written[2:] == lines
    saved = json.loads((tmp_path / "image-ordering-cpu.json").read_text())
    assert [r["order"] for r in saved["results"]] == ["row_major", "zorder", "hilbert"] and "torch" in saved["machine"]
