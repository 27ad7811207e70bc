"""`dilated-attention train` / `generate`: learning, exact resume, processes, bad input."""

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from dilated_attention.cli import main
from dilated_attention.models import LongNetConfig
from dilated_attention.training import TrainSettings, load_corpus, load_model, read_log, train
from dilated_attention.training import checkpoint
from dilated_attention.training.data import Batches, split

TIMEOUT_S = 240
CONFIG = LongNetConfig(dim=32, depth=2, heads=4, ffn_dim=64, segment_lengths=(16, 32), dilation_rates=(1, 2))


@pytest.fixture
def text_file(tmp_path):
    """About 60 KB of text with structure to learn, made from a seed."""
    gen = torch.Generator().manual_seed(0)
    words = ["alpha", "beta", "gamma", "delta", "def", "return", "(x)", "self", "import", "class"]
    lines = []
    for _ in range(3000):
        picks = torch.randint(0, len(words), (4,), generator=gen).tolist()
        lines.append(" ".join(words[i] for i in picks) + ":")
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(lines), encoding="utf-8")
    return str(path)


def settings(text_file, **changes):
    base = dict(context=64, batch_size=4, steps=8, lr=3e-3, warmup_steps=2, eval_interval=4, eval_windows=4,
                checkpoint_interval=3, data=text_file)
    return TrainSettings(**{**base, **changes})


def losses(run_dir):
    return [r["loss"] for r in read_log(run_dir)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_resumed_run_repeats_the_uninterrupted_losses_exactly(tmp_path, text_file, dtype):
    whole, parts = str(tmp_path / "whole"), str(tmp_path / "parts")
    train(whole, settings(text_file, dtype=dtype), CONFIG.replace(dropout=0.1), progress=False)

    def interrupt(record):  # Ctrl-C during step 5: the run stops after it, with a checkpoint
        if record["step"] == 5:
            signal.raise_signal(signal.SIGINT)

    summary = train(parts, settings(text_file, dtype=dtype), CONFIG.replace(dropout=0.1), callback=interrupt,
                    progress=False)
    assert summary["stopped"] == "interrupted" and summary["step"] == 5
    assert checkpoint.load_checkpoint(parts)["step"] == 5
    assert train(parts, resume=True, progress=False)["step"] == 8
    assert len(losses(whole)) == 8
    assert losses(parts) == losses(whole)
    assert [r.get("val_bpb") for r in read_log(parts)] == [r.get("val_bpb") for r in read_log(whole)]
    assert [r["step"] for r in read_log(whole) if "val_bpb" in r] == [4, 8]


def test_training_learns_and_writes_its_run_folder(tmp_path, text_file):
    run = str(tmp_path / "run")
    summary = train(run, settings(text_file, steps=40, eval_interval=20), CONFIG, progress=False)
    records = read_log(run)
    assert summary["stopped"] == "done" and [r["step"] for r in records] == list(range(1, 41))
    assert sum(losses(run)[-5:]) / 5 < 0.6 * sum(losses(run)[:5]) / 5
    assert records[19]["val_bpb"] > records[39]["val_bpb"]
    assert sorted(os.listdir(run)) == ["checkpoint.pt", "config.json", "log.jsonl", "loss.png"]
    model = load_model(run)
    assert model.config == CONFIG and not model.training


def test_a_time_budget_stops_with_a_checkpoint_that_resumes(tmp_path, text_file):
    run = str(tmp_path / "run")
    summary = train(run, settings(text_file, steps=12, minutes=1e-6), CONFIG, progress=False)
    assert summary["stopped"] == "out of time" and summary["step"] == 1
    assert checkpoint.load_checkpoint(run)["step"] == 1
    assert "val_bpb" in read_log(run)[-1]  # the budget's end is evaluated
    assert train(run, resume=True, progress=False)["step"] == 12  # the limit was that invocation's
    with pytest.raises(ValueError, match="has done 12 steps already"):
        train(run, settings(text_file, steps=5, data=os.path.abspath(text_file)), resume=True, progress=False)


def _launch(argv, processes):
    prefix = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"]
    command = (prefix if processes > 1 else [sys.executable]) + ["-m", "dilated_attention", "train"] + argv
    result = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.parametrize("mode", ["data", "sequence"])
def test_two_processes_compute_the_losses_of_one(tmp_path, text_file, mode):
    config = tmp_path / "model.json"
    config.write_text(CONFIG.to_json())
    windows = "1" if mode == "data" else "3"  # rank 1 evaluates no window, or fewer than rank 0
    common = ["--config", str(config), "--data", text_file, "--context", "63", "--batch-size", "4", "--steps", "5",
              "--eval-interval", "5", "--eval-windows", windows, "--no-progress", "--device", "cpu"]
    _launch(common + ["--out", str(tmp_path / "one")], 1)
    _launch(common + ["--out", str(tmp_path / "two")] + (["--sequence-parallel"] if mode == "sequence" else []), 2)
    one, two = read_log(str(tmp_path / "one")), read_log(str(tmp_path / "two"))
    assert [r["step"] for r in two] == list(range(1, 6))
    for a, b in zip(one, two):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4)
    assert two[-1]["val_bpb"] == pytest.approx(one[-1]["val_bpb"], rel=1e-4)


def test_sequence_parallel_with_dropout_resumes_exactly(tmp_path, text_file):
    config = tmp_path / "model.json"
    config.write_text(CONFIG.replace(dropout=0.2).to_json())
    common = ["--config", str(config), "--data", text_file, "--context", "63", "--batch-size", "2", "--steps", "5",
              "--no-progress", "--device", "cpu", "--sequence-parallel"]
    _launch(common + ["--out", str(tmp_path / "whole")], 2)
    _launch(common + ["--out", str(tmp_path / "parts"), "--minutes", "1e-9"], 2)  # stops after step 1
    assert len(read_log(str(tmp_path / "parts"))) == 1
    _launch(["--resume", str(tmp_path / "parts"), "--no-progress"], 2)
    assert losses(str(tmp_path / "parts")) == losses(str(tmp_path / "whole"))


def test_command_line_trains_then_generates(tmp_path, text_file, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "model.json"
    config.write_text(CONFIG.to_json())
    assert main(["train", "--config", str(config), "--data", text_file, "--context", "64", "--batch-size", "4",
                 "--steps", "6", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "step 6/6 (done)" in out and "bits per byte" in out
    (run,) = os.listdir(tmp_path / "runs")
    assert main(["generate", "--prompt", "def alpha", "--max-new-tokens", "25", "--seed", "1"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("def alpha") and f"runs/{run}" in captured.err
    assert "25 tokens in" in captured.err and "cache" in captured.err


def test_generation_from_a_run_repeats_with_its_seed(tmp_path, text_file, capsys):
    run = str(tmp_path / "run")
    train(run, settings(text_file, steps=2), CONFIG, progress=False)
    texts = []
    for _ in range(2):
        assert main(["generate", "--run", run, "--prompt", "x", "--max-new-tokens", "40", "--seed", "3"]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] and len(texts[0]) > 1


def _error(argv, capsys) -> str:
    assert main(argv) == 2
    return capsys.readouterr().err


def test_bad_runs_and_data_give_clear_errors(tmp_path, text_file, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no runs/ folder here, whatever the working directory holds
    run = str(tmp_path / "run")
    train(run, settings(text_file, steps=2), CONFIG, progress=False)
    assert "already holds a run: continue it with --resume" in _error(
        ["train", "--out", run, "--data", text_file], capsys)
    assert "only steps and minutes may change, not ['lr']" in _error(
        ["train", "--resume", run, "--lr", "0.1"], capsys)
    assert "is not a training run folder" in _error(["generate", "--run", str(tmp_path), "--prompt", "a"], capsys)
    os.remove(os.path.join(run, "checkpoint.pt"))
    assert "no checkpoint in" in _error(["generate", "--run", run, "--prompt", "a"], capsys)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "holds no files" in _error(["train", "--out", str(tmp_path / "a"), "--data", str(empty)], capsys)
    (empty / "latin1.txt").write_bytes("café".encode("latin-1"))
    assert "latin1.txt is not UTF-8 text (byte 3" in _error(
        ["train", "--out", str(tmp_path / "b"), "--data", str(empty)], capsys)
    assert "is shorter than the longest segment (256)" in _error(
        ["train", "--out", str(tmp_path / "c"), "--context", "100", "--data", text_file], capsys)
    assert "no trained run under runs/" in _error(["generate", "--prompt", "a"], capsys)
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    assert f"--out {a_file} is a file" in _error(["train", "--out", str(a_file), "--data", text_file], capsys)
    assert "is a folder with files in it" in _error(["train", "--out", str(empty), "--data", text_file], capsys)
    config = tmp_path / "model.json"
    config.write_text(CONFIG.replace(vocab_size=100).to_json())
    assert "vocab_size must be 256, got 100" in _error(
        ["train", "--out", str(tmp_path / "d"), "--config", str(config), "--data", text_file], capsys)
    assert not (tmp_path / "d").exists()
    with pytest.raises(SystemExit):
        main(["train", "--grad-clip", "0"])
    assert "argument --grad-clip: must be a number > 0, got 0" in capsys.readouterr().err


def test_a_damaged_checkpoint_or_a_changed_config_is_refused(tmp_path, text_file, capsys):
    run = tmp_path / "run"
    train(str(run), settings(text_file, steps=2), CONFIG, progress=False)
    saved = json.loads((run / "config.json").read_text())
    saved["model"]["ffn_dim"] = 48
    (run / "config.json").write_text(json.dumps(saved))
    assert "describes a different model than" in _error(["generate", "--run", str(run), "--prompt", "a"], capsys)
    data = (run / "checkpoint.pt").read_bytes()
    (run / "checkpoint.pt").write_bytes(data[: len(data) // 2])
    assert "is not a readable checkpoint" in _error(["generate", "--run", str(run), "--prompt", "a"], capsys)


def test_a_failed_checkpoint_write_leaves_the_previous_one_whole(tmp_path, text_file, monkeypatch):
    run = tmp_path / "run"
    train(str(run), settings(text_file, steps=2), CONFIG, progress=False)
    before = (run / "checkpoint.pt").read_bytes()

    def failing_save(obj, f):
        f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(OSError, match="disk full"):
        checkpoint.save_checkpoint(str(run), {"step": 3})
    monkeypatch.undo()
    assert (run / "checkpoint.pt").read_bytes() == before
    assert checkpoint.load_checkpoint(str(run))["step"] == 2
    assert sorted(os.listdir(run)) == ["checkpoint.pt", "config.json", "log.jsonl", "loss.png"]


def test_the_default_corpus_is_the_standard_library_and_the_split_is_fixed():
    corpus = load_corpus()
    assert corpus.files > 100 and len(corpus.train) > 1_000_000
    assert 0.04 < len(corpus.validation) / (len(corpus.train) + len(corpus.validation)) < 0.06
    assert torch.equal(load_corpus().validation, corpus.validation)
    data = torch.randint(0, 256, (1000,), dtype=torch.uint8)
    train_part, validation = split(data)
    assert len(validation) == 50 and torch.equal(torch.cat([train_part, validation]).sort().values,
                                                 data.sort().values)


def test_batches_resume_from_their_state():
    data = torch.randint(0, 256, (500,), dtype=torch.uint8)
    a = Batches(data, 16, 3, seed=9)
    a.next()
    state = a.state_dict()
    expected = a.next()
    b = Batches(data, 16, 3, seed=123)
    b.load_state_dict(state)
    got = b.next()
    assert all(torch.equal(x, y) for x, y in zip(got, expected))
    assert torch.equal(got[0][:, 1:], got[1][:, :-1])
