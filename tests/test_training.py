"""`dilated-attention train` / `generate`: learning, exact resume, processes, bad input."""

import dataclasses
import errno
import json
import math
import os
import pathlib
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from dilated_attention.models import LongNetConfig
from dilated_attention.tools.cli import main
from dilated_attention.training import TrainSettings, checkpoint, load_corpus, load_model, read_log, train
from dilated_attention.training.commands import newest_run
from dilated_attention.training.data import Batches, split
from dilated_attention.training.run_folder import read_run_config
from dilated_attention.utils.memory import OutOfMemory

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
    base = dict(
        context=64,
        batch_size=4,
        steps=8,
        lr=3e-3,
        warmup_steps=2,
        eval_interval=4,
        eval_windows=4,
        checkpoint_interval=3,
        data=text_file,
    )
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

    summary = train(
        parts, settings(text_file, dtype=dtype), CONFIG.replace(dropout=0.1), callback=interrupt, progress=False
    )
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
    assert sorted(os.listdir(run)) == sorted(
        [".lock", "checkpoint.pt", "checkpoint.previous.pt", "config.json", "log.jsonl", "loss.png"]
    )
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
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=TIMEOUT_S, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.parametrize("mode", ["data", "sequence"])
def test_two_processes_compute_the_losses_of_one(tmp_path, text_file, mode):
    config = tmp_path / "model.json"
    config.write_text(CONFIG.to_json())
    windows = "1" if mode == "data" else "3"  # rank 1 evaluates no window, or fewer than rank 0
    common = [
        "--config",
        str(config),
        "--data",
        text_file,
        "--context",
        "63",
        "--batch-size",
        "4",
        "--steps",
        "5",
        "--eval-interval",
        "5",
        "--eval-windows",
        windows,
        "--no-progress",
        "--device",
        "cpu",
    ]
    _launch([*common, "--out", str(tmp_path / "one")], 1)
    _launch(common + ["--out", str(tmp_path / "two")] + (["--sequence-parallel"] if mode == "sequence" else []), 2)
    one, two = read_log(str(tmp_path / "one")), read_log(str(tmp_path / "two"))
    assert [r["step"] for r in two] == list(range(1, 6))
    for a, b in zip(one, two, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4)
    assert two[-1]["val_bpb"] == pytest.approx(one[-1]["val_bpb"], rel=1e-4)


def test_sequence_parallel_with_dropout_resumes_exactly(tmp_path, text_file):
    config = tmp_path / "model.json"
    config.write_text(CONFIG.replace(dropout=0.2).to_json())
    common = [
        "--config",
        str(config),
        "--data",
        text_file,
        "--context",
        "63",
        "--batch-size",
        "2",
        "--steps",
        "5",
        "--no-progress",
        "--device",
        "cpu",
        "--sequence-parallel",
    ]
    _launch([*common, "--out", str(tmp_path / "whole")], 2)
    _launch([*common, "--out", str(tmp_path / "parts"), "--minutes", "1e-9"], 2)  # stops after step 1
    assert len(read_log(str(tmp_path / "parts"))) == 1
    _launch(["--resume", str(tmp_path / "parts"), "--no-progress"], 2)
    assert losses(str(tmp_path / "parts")) == losses(str(tmp_path / "whole"))


def test_command_line_trains_then_generates(tmp_path, text_file, capsysbinary, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "model.json"
    config.write_text(CONFIG.to_json())
    assert (
        main(
            [
                "train",
                "--config",
                str(config),
                "--data",
                text_file,
                "--context",
                "64",
                "--batch-size",
                "4",
                "--steps",
                "6",
                "--no-progress",
            ]
        )
        == 0
    )
    out = capsysbinary.readouterr().out.decode()
    assert "step 6/6 (done)" in out and "bits per byte" in out and "sessions" not in out  # never resumed
    (run,) = os.listdir(tmp_path / "runs")
    assert main(["generate", "--prompt", "def alpha", "--max-new-tokens", "25", "--seed", "1"]) == 0
    captured = capsysbinary.readouterr()
    err = captured.err.decode()
    assert captured.out.startswith(b"def alpha") and f"runs/{run}" in err
    assert "25 tokens in" in err and "cache" in err


def test_generation_from_a_run_repeats_with_its_seed(tmp_path, text_file, capsysbinary):
    run = str(tmp_path / "run")
    train(run, settings(text_file, steps=2), CONFIG, progress=False)
    texts = []
    for _ in range(2):
        assert main(["generate", "--run", run, "--prompt", "x", "--max-new-tokens", "40", "--seed", "3"]) == 0
        texts.append(capsysbinary.readouterr().out)
    assert texts[0] == texts[1] and len(texts[0]) > 1


def _error(argv, capsys) -> str:
    assert main(argv) == 2
    return capsys.readouterr().err


def test_bad_runs_and_data_give_clear_errors(tmp_path, text_file, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no runs/ folder here, whatever the working directory holds
    run = str(tmp_path / "run")
    train(run, settings(text_file, steps=2), CONFIG, progress=False)
    assert "already holds a run: continue it with --resume" in _error(
        ["train", "--out", run, "--data", text_file], capsys
    )
    assert "only steps, minutes and data may change, not ['lr']" in _error(
        ["train", "--resume", run, "--lr", "0.1"], capsys
    )
    assert "is not a training run folder" in _error(["generate", "--run", str(tmp_path), "--prompt", "a"], capsys)
    assert "does not exist (or is not a folder)" in _error(["train", "--resume", str(tmp_path / "none")], capsys)
    config = os.path.join(run, "config.json")
    kept = pathlib.Path(config).read_text()
    for damaged in ("[1, 2]", '{"model": {}}'):
        pathlib.Path(config).write_text(damaged)
        message = _error(["generate", "--run", run, "--prompt", "a"], capsys)
        assert 'is not a valid run configuration: it must be a JSON object with "model" and "training"' in message
    pathlib.Path(config).write_text(kept)
    os.remove(os.path.join(run, "checkpoint.pt"))
    assert "checkpoint.pt is missing. The checkpoint before it, of step 0, is intact" in _error(
        ["generate", "--run", run, "--prompt", "a"], capsys
    )
    os.remove(os.path.join(run, "checkpoint.previous.pt"))
    assert "no checkpoint in" in _error(["generate", "--run", run, "--prompt", "a"], capsys)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "holds no files" in _error(["train", "--out", str(tmp_path / "a"), "--data", str(empty)], capsys)
    (empty / "latin1.txt").write_bytes("café".encode("latin-1"))
    assert (
        "latin1.txt is not UTF-8 text (byte 3: b'\\xe9'): the text must be UTF-8: convert it (e.g. iconv -t "
        "UTF-8) or move it out of the data folder"
        in _error(["train", "--out", str(tmp_path / "b"), "--data", str(empty)], capsys)
    )
    # a file given alone: no folder to move it out of
    alone = _error(["train", "--out", str(tmp_path / "b"), "--data", str(empty / "latin1.txt")], capsys)
    assert alone.rstrip().endswith("convert it (e.g. iconv -t UTF-8)")
    assert "is shorter than the longest segment (256)" in _error(
        ["train", "--out", str(tmp_path / "c"), "--context", "100", "--data", text_file], capsys
    )
    assert "no trained run under runs/" in _error(["generate", "--prompt", "a"], capsys)
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    assert f"--out {a_file} is a file" in _error(["train", "--out", str(a_file), "--data", text_file], capsys)
    assert "is a folder with files in it" in _error(["train", "--out", str(empty), "--data", text_file], capsys)
    config = tmp_path / "model.json"
    config.write_text(CONFIG.replace(vocab_size=100).to_json())
    assert "vocab_size must be 256, got 100" in _error(
        ["train", "--out", str(tmp_path / "d"), "--config", str(config), "--data", text_file], capsys
    )
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
    assert "is damaged (not a readable archive" in _error(["generate", "--run", str(run), "--prompt", "a"], capsys)


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
    assert ".checkpoint.pt" not in " ".join(os.listdir(run))  # no temporary left


def test_a_full_disk_is_found_in_an_error_chain_even_one_that_loops():
    """``torch.save`` reports a failed write as a ``RuntimeError`` caused by the
    system's error; a chain that loops back on itself ends the search, not the run."""
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    reported = RuntimeError("write failed")
    reported.__cause__, full.__context__ = full, reported
    assert checkpoint._out_of_space(reported)
    looping = OSError("disk full")
    looping.__cause__ = looping
    assert not checkpoint._out_of_space(looping)


def test_the_default_corpus_is_the_standard_library_and_the_split_is_fixed():
    corpus = load_corpus()
    assert corpus.files > 100 and len(corpus.train) > 1_000_000
    assert 0.04 < len(corpus.validation) / (len(corpus.train) + len(corpus.validation)) < 0.06
    assert torch.equal(load_corpus().validation, corpus.validation)
    data = torch.randint(0, 256, (1000,), dtype=torch.uint8)
    train_part, validation = split(data)
    assert len(validation) == 50 and torch.equal(torch.cat([train_part, validation]).sort().values, data.sort().values)


def test_batches_resume_from_their_state():
    data = torch.randint(0, 256, (500,), dtype=torch.uint8)
    a = Batches(data, 16, 3, seed=9)
    a.next()
    state = a.state_dict()
    expected = a.next()
    b = Batches(data, 16, 3, seed=123)
    b.load_state_dict(state)
    got = b.next()
    assert all(torch.equal(x, y) for x, y in zip(got, expected, strict=True))
    assert torch.equal(got[0][:, 1:], got[1][:, :-1])


# Hardening: a run folder belongs to one process, damage is refused, nothing is lost.


def _flip_inside_a_tensor(path, count=64):
    """Flip ``count`` bytes in the middle of the largest tensor record of a checkpoint."""
    import zipfile

    with zipfile.ZipFile(path) as archive:
        record = max((i for i in archive.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
        with archive.open(record) as f:
            f.read()
    data = bytearray(pathlib.Path(path).read_bytes())
    start = record.header_offset + 30 + len(record.filename) + len(record.extra) + record.file_size // 2
    data[start : start + count] = bytes(b ^ 0xFF for b in data[start : start + count])
    pathlib.Path(path).write_bytes(bytes(data))


def test_a_damaged_checkpoint_is_refused_and_the_previous_one_recovers_the_run(tmp_path, text_file, capsys):
    run = str(tmp_path / "run")
    train(run, settings(text_file, steps=6), CONFIG, progress=False)  # checkpoints at steps 3 and 6
    latest = os.path.join(run, "checkpoint.pt")
    _flip_inside_a_tensor(latest)
    for argv in (["generate", "--run", run, "--prompt", "a"], ["train", "--resume", run, "--steps", "9"]):
        message = _error(argv, capsys)
        assert "checkpoint.pt is damaged (the bytes of its record" in message
        assert "The checkpoint before it, of step 3, is intact" in message and "checkpoint.previous.pt" in message
    previous = os.path.join(run, "checkpoint.previous.pt")
    os.replace(latest, latest + ".bad")  # moved away by hand: the same way back
    message = _error(["train", "--resume", run, "--steps", "9"], capsys)
    assert "checkpoint.pt is missing. The checkpoint before it, of step 3, is intact" in message
    os.replace(previous, latest)  # what the message says to do
    assert (
        train(run, settings(text_file, steps=6, data=os.path.abspath(text_file)), resume=True, progress=False)["step"]
        == 6
    )
    assert [r["step"] for r in read_log(run)] == list(range(1, 7))

    whole = bytearray(pathlib.Path(latest).read_bytes())  # 100 KB zeroed, and no earlier checkpoint kept
    whole[len(whole) // 4 : len(whole) // 4 + 100_000] = bytes(100_000)
    pathlib.Path(latest).write_bytes(bytes(whole))
    os.remove(previous)
    message = _error(["generate", "--run", run, "--prompt", "a"], capsys)
    assert "is damaged" in message and "No earlier checkpoint of this run is kept" in message


def test_a_second_process_on_a_run_folder_is_refused_while_the_first_holds_it(tmp_path, text_file, capsys):
    from dilated_attention.training.run_folder import RunLock

    run = str(tmp_path / "run")
    train(run, settings(text_file, steps=2), CONFIG, progress=False)
    with RunLock(run):  # as a running process holds it
        message = _error(["train", "--resume", run, "--steps", "4"], capsys)
        assert f"{run} is in use by another process (PID {os.getpid()} holds" in message
        assert "already holds a run" in _error(["train", "--out", run, "--data", text_file], capsys)
        fresh = str(tmp_path / "fresh")
        with RunLock(str(tmp_path)):  # a lock on another folder is no obstacle
            assert train(fresh, settings(text_file, steps=1), CONFIG, progress=False)["step"] == 1
    assert len(read_log(run)) == 2
    assert (
        train(run, settings(text_file, steps=3, data=os.path.abspath(text_file)), resume=True, progress=False)["step"]
        == 3
    )  # released: the next run takes it


def test_concurrent_runs_into_one_folder_leave_one_whole_run(tmp_path, text_file):
    config = tmp_path / "model.json"
    config.write_text(CONFIG.to_json())
    run = str(tmp_path / "same")
    argv = [
        sys.executable,
        "-m",
        "dilated_attention",
        "train",
        "--out",
        run,
        "--config",
        str(config),
        "--data",
        text_file,
        "--context",
        "64",
        "--batch-size",
        "4",
        "--steps",
        "30",
        "--no-progress",
    ]
    processes = [
        subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}
        )
        for _ in range(3)
    ]
    results = [(p.wait(timeout=TIMEOUT_S), p.stderr.read()) for p in processes]
    assert sorted(code for code, _ in results) == [0, 2, 2], results
    for code, err in results:
        assert code == 0 or "is in use by another process" in err or "already holds a run" in err
    assert [r["step"] for r in read_log(run)] == list(range(1, 31))
    assert checkpoint.load_checkpoint(run)["step"] == 30


def test_resume_with_minutes_continues_in_timed_sittings(tmp_path, text_file, capsys):
    run = str(tmp_path / "run")
    train(run, settings(text_file, steps=6, minutes=1e-9), CONFIG, progress=False)  # stops after step 1
    assert main(["train", "--resume", run, "--minutes", "1e-9", "--no-progress"]) == 0  # one more step
    assert "step 2/6 (out of time)" in capsys.readouterr().out
    assert main(["train", "--resume", run, "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "step 6/6 (done)" in out and "the sessions before step 2 included" in out
    assert [r["step"] for r in read_log(run)] == list(range(1, 7))


def test_a_run_stopped_before_its_first_checkpoint_starts_again(tmp_path, text_file, monkeypatch):
    original = checkpoint.save_checkpoint

    def interrupted(run_dir, state):
        raise KeyboardInterrupt  # Ctrl-C between config.json and the first checkpoint

    for how in ("resume", "out"):
        run = str(tmp_path / how)
        monkeypatch.setattr(checkpoint, "save_checkpoint", interrupted)
        with pytest.raises(KeyboardInterrupt):
            train(run, settings(text_file, steps=3), CONFIG, progress=False)
        monkeypatch.setattr(checkpoint, "save_checkpoint", original)
        assert sorted(os.listdir(run)) == [".lock", "config.json", "log.jsonl"]
        if how == "resume":
            summary = train(run, resume=True, progress=False)
        else:
            summary = train(run, settings(text_file, steps=3), CONFIG, progress=False)
        assert summary["step"] == 3 and [r["step"] for r in read_log(run)] == [1, 2, 3]


def test_a_run_out_of_memory_in_its_first_step_starts_again_smaller(tmp_path, text_file, capsys, monkeypatch):
    from dilated_attention.models import LongNetLM

    forward = LongNetLM.forward

    def limited(self, tokens, **kwargs):  # as a GPU whose memory holds batches of 2 sequences
        if tokens.shape[0] > 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return forward(self, tokens, **kwargs)

    monkeypatch.setattr(LongNetLM, "forward", limited)
    model = tmp_path / "model.json"
    model.write_text(CONFIG.to_json())
    run = str(tmp_path / "run")
    argv = ["train", "--out", run, "--config", str(model), "--data", text_file, "--context", "64", "--steps", "3"]
    argv += ["--warmup-steps", "1"]
    message = _error([*argv, "--batch-size", "4", "--no-progress"], capsys)
    assert message.startswith(
        "error: out of memory in the run's first training step (CUDA out of memory. Tried to allocate 2.00 GiB): "
        "use a smaller --batch-size or --context, --grad-checkpointing, or a smaller model. "
        f"{run} holds no trained step, so the run can start again there with other settings: --out {run}\n"
    )
    with pytest.raises(torch.OutOfMemoryError, match="first training step"):  # from Python: torch's type
        train(run, settings(text_file, steps=3), CONFIG, progress=False)
    assert checkpoint.load_checkpoint(run)["step"] == 0  # the step-0 checkpoint of batches of 4
    assert main([*argv, "--batch-size", "2", "--no-progress"]) == 0
    assert [r["step"] for r in read_log(run)] == [1, 2, 3]
    assert checkpoint.load_checkpoint(run)["settings"]["batch_size"] == 2
    assert checkpoint.load_checkpoint(run, checkpoint.PREVIOUS)["settings"]["batch_size"] == 2  # not the failed start's
    message = _error([*argv, "--batch-size", "4", "--no-progress"], capsys)  # trained: the folder is the run's now
    assert "already holds a run: continue it with --resume" in message

    def no_memory(path):
        raise MemoryError

    monkeypatch.setattr("dilated_attention.training.trainer.load_corpus", no_memory)
    message = _error([*argv[:2], str(tmp_path / "other"), *argv[3:]], capsys)  # not in a step: no step advice
    assert message.startswith("error: out of memory (MemoryError): use smaller sizes (batch, context, model)")


def test_a_run_interrupted_in_its_first_step_resumes_to_the_uninterrupted_losses(tmp_path, text_file, monkeypatch):
    from dilated_attention.models import LongNetLM

    whole, parts = str(tmp_path / "whole"), str(tmp_path / "parts")
    train(whole, settings(text_file, steps=3), CONFIG.replace(dropout=0.1), progress=False)
    forward = LongNetLM.forward

    def interrupted(self, tokens, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(LongNetLM, "forward", interrupted)
    with pytest.raises(KeyboardInterrupt):
        train(parts, settings(text_file, steps=3), CONFIG.replace(dropout=0.1), progress=False)
    monkeypatch.setattr(LongNetLM, "forward", forward)
    assert checkpoint.load_checkpoint(parts)["step"] == 0 and not read_log(parts)
    assert train(parts, resume=True, progress=False)["step"] == 3
    assert losses(parts) == losses(whole)


def test_a_run_resumed_on_changed_text_says_so(tmp_path, text_file, capsys):
    run = str(tmp_path / "run")
    train(run, settings(text_file, steps=2), CONFIG, progress=False)
    capsys.readouterr()
    assert train(run, settings(text_file, steps=3), resume=True, progress=False)["step"] == 3
    assert "changed" not in capsys.readouterr().err  # the same text: no note
    size = os.path.getsize(text_file)
    with open(text_file, "r+b") as f:  # the same length, one byte changed
        f.seek(size // 2)
        byte = f.read(1)
        f.seek(size // 2)
        f.write(b"Z" if byte != b"Z" else b"Y")
    assert train(run, settings(text_file, steps=4), resume=True, progress=False)["step"] == 4
    err = capsys.readouterr().err
    assert f"note: the text of {text_file} changed since {run}'s checkpoint ({size:,} bytes then, {size:,} now)" in err
    with open(text_file, "a", encoding="utf-8") as f:
        f.write(" more text")
    assert train(run, settings(text_file, steps=5), resume=True, progress=False)["step"] == 5
    assert f"({size:,} bytes then, {size + 10:,} now)" in capsys.readouterr().err


def test_temporaries_of_a_killed_writer_are_removed_when_the_run_restarts(tmp_path, text_file):
    run = tmp_path / "run"
    train(str(run), settings(text_file, steps=2), CONFIG, progress=False)
    stale = run / f".checkpoint.pt.{'0123456789abcdef' * 2}.tmp"  # what SIGKILL during a write leaves
    stale.write_bytes(b"partial checkpoint")
    # an evaluate takes no lock: its file being written (or left by a kill) is not the run's to remove
    evaluating = run / f".retrieval-recall.png.{'fedcba9876543210' * 2}.tmp"
    evaluating.write_bytes(b"half a plot")
    train(str(run), settings(text_file, steps=3, data=os.path.abspath(text_file)), resume=True, progress=False)
    assert not stale.exists() and evaluating.read_bytes() == b"half a plot"


def test_a_full_disk_says_so_and_keeps_the_previous_checkpoint(tmp_path, text_file, capsys, monkeypatch):
    import errno

    from dilated_attention.utils import files

    run = str(tmp_path / "run")
    train(run, settings(text_file, steps=2), CONFIG, progress=False)
    before = pathlib.Path(run, "checkpoint.pt").read_bytes()

    class FullDisk:
        """A file on a device that takes 1000 bytes more, then reports ENOSPC."""

        def __init__(self, f):
            self.f, self.room = f, 1000

        def write(self, data):
            if len(data) > self.room:
                raise OSError(errno.ENOSPC, "No space left on device")
            self.room -= len(data)
            return self.f.write(data)

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

    def full_disk_open(*args, **kwargs):
        return FullDisk(open(*args, **kwargs))

    monkeypatch.setattr(files, "open", full_disk_open, raising=False)
    message = _error(["train", "--resume", run, "--steps", "3", "--no-progress"], capsys)
    monkeypatch.undo()
    assert "no space left on the device writing the checkpoint" in message
    assert "the previous checkpoint is intact" in message and "Traceback" not in message
    assert pathlib.Path(run, "checkpoint.pt").read_bytes() == before
    assert not [name for name in os.listdir(run) if name.endswith(".tmp")]


def test_evaluation_runs_in_batches_no_larger_than_the_training_batch(tmp_path, text_file, monkeypatch):
    from dilated_attention.training import trainer
    from dilated_attention.training.data import evaluation_starts, windows

    rows = []

    class Recording(trainer.LongNetLM):
        def forward(self, tokens, **kwargs):
            if not self.training:
                rows.append(tokens.shape[0])
            return super().forward(tokens, **kwargs)

    monkeypatch.setattr(trainer, "LongNetLM", Recording)
    run = str(tmp_path / "run")
    train(run, settings(text_file, steps=2, eval_interval=2, eval_windows=10, batch_size=4), CONFIG, progress=False)
    assert rows == [4, 4, 2]
    validation = load_corpus(text_file).validation
    inputs, targets = windows(validation, evaluation_starts(validation, 64, 10), 64)
    with torch.no_grad():
        logits = load_model(run)(inputs)
    whole = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()).item() / math.log(2)
    assert read_log(run)[-1]["val_bpb"] == pytest.approx(whole, rel=1e-5)


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["train", "--lr", "1e308"], "lr must be a finite number in (0, 1]"),
        (["train", "--weight-decay", "1e5"], "weight_decay must be a finite number in [0, 333.333]"),
        (["train", "--seed", str(2**70)], "argument --seed: must be below 2**63"),
        (["generate", "--prompt", "a", "--seed", str(2**70)], "argument --seed: must be below 2**63"),
        (["check", "--seed", "-1"], "argument --seed: must be >= 0"),
    ],
)
def test_out_of_range_numbers_name_their_argument(argv, fragment, capsys):
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    assert code == 2 and fragment in capsys.readouterr().err


def test_numbers_of_the_wrong_type_are_type_errors_and_ranges_value_errors():
    with pytest.raises(TypeError, match="lr must be a number, got str"):
        TrainSettings(lr="0.1")
    with pytest.raises(ValueError, match=re.escape("seed must be in [0, 2**63), got -1")):
        TrainSettings(seed=-1)
    with pytest.raises(TypeError, match="rotary_base must be a number"):
        LongNetConfig(rotary_base=None)
    with pytest.raises(ValueError, match="layer_norm_eps must be a finite number > 0"):
        LongNetConfig(layer_norm_eps=float("nan"))


def test_generated_bytes_are_written_as_they_are(tmp_path, text_file, capsysbinary):
    """A prompt that is not UTF-8 is taken as its bytes and written back as them; on a
    stdout of another encoding (ASCII here) the bytes go out unchanged too."""
    run = str(tmp_path / "run")
    train(run, settings(text_file, steps=2), CONFIG, progress=False)
    prompt = os.fsdecode(b"caf\xe9 \xff")  # Latin-1 bytes, as a shell passes them
    assert main(["generate", "--run", run, "--prompt", prompt, "--max-new-tokens", "5"]) == 0
    out = capsysbinary.readouterr().out
    assert out.startswith(b"caf\xe9 \xff") and out.endswith(b"\n") and len(out) == 6 + 5 + 1
    command = [sys.executable, "-m", "dilated_attention", "generate", "--run", run, "--prompt", "h\u00e9llo"]
    done = subprocess.run(
        [*command, "--max-new-tokens", "3"],
        capture_output=True,
        env={**os.environ, "PYTHONIOENCODING": "ascii"},
        timeout=TIMEOUT_S,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("h\u00e9llo".encode()) and len(done.stdout) == 6 + 3 + 1
    closed = subprocess.run(  # started with stdout closed: refused in one line
        f"{shlex.quote(sys.executable)} -m dilated_attention generate --run {shlex.quote(run)} --prompt x >&-",
        shell=True,
        stderr=subprocess.PIPE,
        timeout=TIMEOUT_S,
    )
    assert closed.returncode == 2 and b"stdout, which is closed" in closed.stderr


def test_a_tiny_temperature_samples_the_likeliest_tokens():
    from dilated_attention.models.generate import sample_next

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 256, generator=gen)
    for temperature in (1e-50, 1e-320):
        assert torch.equal(sample_next(logits, temperature, generator=gen), logits.argmax(-1))
    tied = torch.tensor([[1.0, 3.0, 3.0, -2.0]])
    assert {int(sample_next(tied, 1e-300, generator=gen)) for _ in range(60)} == {1, 2}


def test_training_checks_its_extra_before_writing_anything(tmp_path, text_file, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # as after a plain `pip install .`
    out = tmp_path / "run"
    message = _error(["train", "--out", str(out), "--data", text_file], capsys)
    assert "training needs tqdm (the 'train' extra)" in message and 'pip install -e ".[train]"' in message
    assert not out.exists()
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    message = _error(
        [
            "pattern",
            "--segment-lengths",
            "4",
            "--dilation-rates",
            "1",
            "--length",
            "8",
            "--heads",
            "1",
            "--out",
            str(tmp_path / "p.png"),
        ],
        capsys,
    )
    assert "pattern needs matplotlib (the 'plot' extra)" in message and not (tmp_path / "p.png").exists()


def test_progress_reports_bits_per_byte_and_the_mean_speed_of_the_interval(tmp_path, text_file, capsys, monkeypatch):
    from dilated_attention.training import trainer

    postfixes = []

    class Bar:
        disable = True  # output to a file: one line per evaluation

        def update(self, n):
            pass

        def set_postfix(self, **values):
            postfixes.append(values)

        def close(self):
            pass

    monkeypatch.setattr(trainer, "_progress_bar", lambda *args, **kwargs: Bar())
    run = str(tmp_path / "run")
    train(run, settings(text_file, steps=6, eval_interval=3), CONFIG, progress=True)
    assert all(set(p) == {"bpb", "tokens_per_s"} for p in postfixes) and len(postfixes) == 6
    records = read_log(run)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("step ")]
    assert len(lines) == 2
    for line, interval in zip(lines, (records[:3], records[3:]), strict=True):
        tokens = sum(4 * 64 for _ in interval)
        seconds = sum(4 * 64 / r["tokens_per_s"] for r in interval)
        shown = float(line.split(", ")[-1].split(" tokens/s")[0])
        assert f"loss {interval[-1]['bpb']:.3f} bits per byte" in line
        assert shown == pytest.approx(tokens / seconds, abs=1)


def test_a_longer_run_is_remembered_so_a_plain_resume_works_later(tmp_path, text_file, capsys):
    run = str(tmp_path / "run")
    train(run, settings(text_file, steps=2), CONFIG, progress=False)
    assert main(["train", "--resume", run, "--steps", "4", "--no-progress"]) == 0
    printed = capsys.readouterr()
    assert "sessions before step 2" in printed.out
    assert "note: the learning rate" not in printed.err  # step 2 ends the warm-up of both schedules
    assert main(["train", "--resume", run, "--no-progress"]) == 0  # the total is now 4
    assert "step 4/4 (done)" in capsys.readouterr().out


def test_a_sequence_parallel_run_resumed_by_one_process_says_the_run_asks_for_processes(tmp_path, text_file):
    from dilated_attention.training import run_folder

    run = str(tmp_path / "run")
    train(run, settings(text_file, steps=2), CONFIG, progress=False)
    config, saved = run_folder.read_run_config(run)
    run_folder.write_run_config(run, config, dataclasses.replace(saved, sequence_parallel=True))  # as torchrun saves it
    expected = f"{run} was trained with --sequence-parallel, which its resumed runs keep .* needs several processes"
    with pytest.raises(ValueError, match=expected):
        train(run, resume=True, progress=False)
    with pytest.raises(ValueError, match=r"^--sequence-parallel needs several processes: launch with torchrun"):
        train(str(tmp_path / "new"), settings(text_file, sequence_parallel=True), CONFIG, progress=False)


def test_ranks_a_checkpoint_lacks_draw_numbers_of_their_own_on_resume():
    """A resume on more processes: saved ranks get their states back, new ranks are
    seeded apart (no two ranks share dropout masks)."""
    from dilated_attention.training import trainer
    from dilated_attention.training.parallel import Parallel

    states = []
    for seed in (11, 12):
        torch.manual_seed(seed)
        states.append(trainer._rng_state(torch.device("cpu")))
    draws = []
    for rank in range(4):
        trainer._restore_rng(states, Parallel(rank=rank, world=4, mode="data"), fresh_seed=100 + rank)
        if rank < 2:
            assert torch.equal(torch.get_rng_state(), states[rank]["torch"])
        draws.append(torch.rand(8))
    assert all(not torch.equal(draws[i], draws[j]) for i in range(4) for j in range(i))


def test_a_resume_that_moves_the_learning_rate_says_so(tmp_path, text_file, capsys):
    """The cosine schedule spans the steps: a finished 3-step run resumed to 8 steps
    goes from the end of its decay back up the longer one's (a jump the user is told
    of; see the test below for a resume whose rate stays where it was)."""
    run = str(tmp_path / "run")
    saved = settings(text_file, steps=3)
    train(run, saved, CONFIG, progress=False)
    assert main(["train", "--resume", run, "--steps", "8", "--no-progress"]) == 0
    before, now = saved.learning_rate(3), dataclasses.replace(saved, steps=8).learning_rate(3)
    assert now > 3 * before
    assert f"now spans 8 steps, not 3: at step 3 it is {now:.3g}, where it was {before:.3g}" in capsys.readouterr().err
    # the log's rate is the one each step took: the saved schedule's, then the new one's from the first resumed step
    longer = dataclasses.replace(saved, steps=8)
    expected = [saved.learning_rate(s) for s in range(3)] + [longer.learning_rate(s) for s in range(3, 8)]
    assert [r["lr"] for r in read_log(run)] == pytest.approx(expected, rel=1e-12)


def test_every_failed_write_into_the_run_folder_says_so(tmp_path, text_file, capsys, monkeypatch):
    """Not only the checkpoint: a full disk while appending to the log or drawing the
    plot stops the run with one line, the latest checkpoint intact."""
    import errno

    from dilated_attention.training import run_folder as folder

    run = str(tmp_path / "run")
    train(run, settings(text_file, steps=2), CONFIG, progress=False)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", os.path.join(run, "log.jsonl"))

    monkeypatch.setattr(folder, "append_log", full)
    message = _error(["train", "--resume", run, "--steps", "4", "--no-progress"], capsys)
    assert f"no space left on the device writing {run}/log.jsonl; the latest checkpoint" in message
    monkeypatch.undo()
    assert checkpoint.load_checkpoint(run)["step"] == 2


@pytest.mark.parametrize(("where", "value"), [(6, 0x80), (10, 8), (10, 99), (8, 1)])
def test_damage_to_the_archive_directory_is_refused_like_any_other(tmp_path, text_file, capsys, where, value):
    run = tmp_path / "run"
    train(str(run), settings(text_file, steps=2), CONFIG, progress=False)
    data = bytearray((run / "checkpoint.pt").read_bytes())
    data[data.find(b"PK\x01\x02") + where] = value  # the central directory's version, flags, method
    (run / "checkpoint.pt").write_bytes(bytes(data))
    message = _error(["generate", "--run", str(run), "--prompt", "a"], capsys)
    assert "checkpoint.pt is damaged" in message and "Traceback" not in message


def test_a_refused_folder_is_left_as_it_was_and_a_symlinked_lock_is_not_followed(tmp_path, text_file, capsys):
    user = tmp_path / "mine"
    user.mkdir()
    (user / "notes.txt").write_text("x")
    (user / ".draft.tmp").write_text("keep")
    assert "is a folder with files in it" in _error(["train", "--out", str(user), "--data", text_file], capsys)
    assert sorted(os.listdir(user)) == [".draft.tmp", "notes.txt"]
    own_config = tmp_path / "conf"
    own_config.mkdir()
    (own_config / "config.json").write_text('{"not": "a run"}')
    assert "is a folder with files in it" in _error(["train", "--out", str(own_config), "--data", text_file], capsys)
    run = tmp_path / "run"
    train(str(run), settings(text_file, steps=2), CONFIG, progress=False)
    precious = tmp_path / "precious.txt"
    precious.write_text("keep me")
    os.remove(run / ".lock")
    os.symlink(precious, run / ".lock")
    assert ".lock is a symbolic link" in _error(["train", "--resume", str(run), "--steps", "3"], capsys)
    assert precious.read_text() == "keep me"


def test_empty_folder_names_and_damaged_logs_are_refused(tmp_path, text_file, capsys):
    for argv in (["train", "--resume", ""], ["train", "--out", ""], ["generate", "--run", "", "--prompt", "a"]):
        with pytest.raises(SystemExit):
            main(argv)
        assert "must name a folder, got an empty string" in capsys.readouterr().err
    # --data "" named the current folder; a path the file system gave in other bytes
    # than UTF-8 made a run that PyTorch could not load back
    for argv, fragment in (
        (["train", "--data", " "], "argument --data: must name a file or folder, got an empty string"),
        (["train", "--out", "r\udcff/run"], "argument --out: must be a path in UTF-8"),
    ):
        with pytest.raises(SystemExit):
            main(argv)
        assert fragment in capsys.readouterr().err
    assert not os.path.exists("r\udcff")
    with pytest.raises(ValueError, match="data must name a file or folder, got an empty path"):
        TrainSettings(data="")
    with pytest.raises(ValueError, match="run_dir must be a path in UTF-8"):
        train(str(tmp_path / "r\udcff"), settings(text_file), CONFIG, progress=False)
    assert TrainSettings(data=os.fsencode(text_file)).data == str(text_file)  # bytes paths: as the config holds them
    empty = tmp_path / "empty"
    empty.mkdir()
    for argv in (["generate", "--prompt", "a"], ["evaluate", "--task", "recall"]):
        argv += ["--run", str(empty)]
        assert f"{empty} is empty: pass a folder a train run wrote, or train one there" in _error(argv, capsys)
    (empty / ".lock").touch()
    message = _error(["train", "--resume", str(empty)], capsys)
    assert "holds no run: a train run was stopped before it wrote config.json; start it anew" in message
    run = tmp_path / "run"
    train(str(run), settings(text_file, steps=2), CONFIG, progress=False)
    log = (run / "log.jsonl").read_text()
    for damaged in (log.replace('"step"', '"stap"', 1), log + "[1, 2]\n"):
        (run / "log.jsonl").write_text(damaged)
        assert "is not a step's record: the log is damaged" in _error(
            ["train", "--resume", str(run), "--steps", "3"], capsys
        )
    (run / "log.jsonl").write_bytes(log.encode() + b"\xff\xfe\n")
    message = _error(["train", "--resume", str(run), "--steps", "3"], capsys)
    assert "log.jsonl is not UTF-8 text" in message and "the checkpoint does not need it" in message
    os.rename(run / "log.jsonl", run / "log.jsonl.damaged")  # what the message says to do
    assert main(["train", "--resume", str(run), "--steps", "3", "--no-progress"]) == 0
    assert [r["step"] for r in read_log(str(run))] == [3]


def test_settings_and_configs_hold_python_numbers_and_sampling_is_checked():
    numpy = pytest.importorskip("numpy")
    from dilated_attention.models.generate import sample_next

    s = TrainSettings(steps=numpy.int64(3), lr=numpy.float32(0.01), data=pathlib.Path("x"))
    assert type(s.steps) is int and type(s.lr) is float and s.data == "x"
    c = LongNetConfig(dim=numpy.int64(32), heads=4, dropout=numpy.float32(0.1))
    assert type(c.dim) is int and type(c.dropout) is float and json.loads(c.to_json())["dim"] == 32
    logits = torch.randn(2, 8)
    for kwargs, fragment in [
        (dict(temperature=-1.0), "temperature must be"),
        (dict(top_p=2.0), "top_p must be"),
        (dict(top_p=float("nan")), "top_p must be"),
        (dict(top_k=0), "top_k must be >= 1"),
    ]:
        with pytest.raises(ValueError, match=fragment):
            sample_next(logits, **kwargs)


def test_linking_over_a_second_name_of_the_same_file_leaves_no_temporary(tmp_path):
    """A kill between the link to checkpoint.previous.pt and the next write leaves both
    names on one file; rename then does nothing, and its temporary must not stay."""
    from dilated_attention.utils.files import link_atomically

    latest, previous = tmp_path / "checkpoint.pt", tmp_path / "checkpoint.previous.pt"
    latest.write_bytes(b"state")
    os.link(latest, previous)
    link_atomically(str(latest), str(previous))
    assert sorted(os.listdir(tmp_path)) == ["checkpoint.previous.pt", "checkpoint.pt"]
    assert previous.read_bytes() == b"state"


def test_the_api_resumes_a_run_whose_data_path_is_relative(tmp_path, text_file, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    relative = os.path.relpath(text_file)
    first = settings(relative, steps=2)
    train("runs/demo", first, CONFIG, progress=False)
    assert train("runs/demo", dataclasses.replace(first, steps=3), resume=True, progress=False)["step"] == 3
    assert main(["train", "--resume", "runs/demo", "--data", relative, "--steps", "4", "--no-progress"]) == 0


# A short command-line run of CONFIG (see _config_file).
TINY_RUN = ["--context", "64", "--batch-size", "2", "--steps", "2", "--no-progress"]


def _config_file(tmp_path) -> str:
    """CONFIG as a JSON file for --config."""
    path = tmp_path / "model.json"
    path.write_text(CONFIG.to_json())
    return str(path)


def test_a_run_whose_text_moved_resumes_with_data_where_it_is_now(tmp_path, text_file, capsys):
    moved = tmp_path / "moved.txt"
    shutil.copy(text_file, moved)
    run = str(tmp_path / "run")
    assert main(["train", "--config", _config_file(tmp_path), "--out", run, "--data", str(moved), *TINY_RUN]) == 0
    renamed = tmp_path / "renamed.txt"
    moved.rename(renamed)
    message = _error(["train", "--resume", run, "--steps", "3", "--no-progress"], capsys)
    assert f"{run}'s text {moved} (its config.json's data) is not there any more: pass --data" in message
    assert main(["train", "--resume", run, "--steps", "3", "--data", str(renamed), "--no-progress"]) == 0
    assert read_log(run)[-1]["step"] == 3 and read_run_config(run)[1].data == str(renamed)
    assert "changed since" not in capsys.readouterr().err  # the same text: no note


def test_runs_that_cannot_start_are_refused_before_their_folder(tmp_path, text_file, capsys, monkeypatch):
    """A kernel setting, a batch, or a data folder holding the run folder: refused with
    nothing written (a step-0 folder left under runs/ became generate's default run)."""
    monkeypatch.chdir(tmp_path)
    config = _config_file(tmp_path)
    monkeypatch.setenv("DILATED_ATTENTION_KERNEL", "bogus")
    message = _error(["train", "--config", config, "--data", text_file], capsys)
    assert "DILATED_ATTENTION_KERNEL must be one of" in message
    monkeypatch.setenv("DILATED_ATTENTION_KERNEL", "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert "DILATED_ATTENTION_KERNEL=triton cannot run this training" in _error(
        ["train", "--config", config, "--data", text_file, "--device", "cpu"], capsys
    )
    monkeypatch.delenv("DILATED_ATTENTION_KERNEL")
    message = _error(["train", "--config", config, "--data", text_file, "--batch-size", str(10**20)], capsys)
    assert "batch_size x (context + 1) = 100000000000000000000 x 513 tokens a step" in message
    texts = tmp_path / "texts"
    texts.mkdir()
    shutil.copy(text_file, texts / "a.txt")
    monkeypatch.chdir(texts)
    assert f"lies inside the data folder {texts}, so the run's own checkpoints" in _error(
        ["train", "--config", config, "--data", "."], capsys
    )
    assert sorted(os.listdir(texts)) == ["a.txt"] and not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    ("sent", "ignored", "code"), [("SIGTERM", False, 143), ("SIGINT", False, 130), ("SIGINT", True, 0)]
)
def test_train_ends_as_the_signal_that_stopped_it(tmp_path, text_file, monkeypatch, sent, ignored, code):
    """SIGTERM: exit status 143, Ctrl-C 130, as a shell reports them; a signal ignored
    when the run starts (a run in the background of a script) stays ignored."""
    make = Batches.next
    calls = []

    def next_with_signal(self):
        calls.append(1)
        if len(calls) == 2:  # during step 2: the run stops after it
            signal.raise_signal(getattr(signal, sent))
        return make(self)

    monkeypatch.setattr(Batches, "next", next_with_signal)
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN if ignored else signal.default_int_handler)
    try:
        run = str(tmp_path / "run")
        argv = ["train", "--config", _config_file(tmp_path), "--out", run, "--data", text_file, *TINY_RUN]
        assert main([*argv, "--steps", "4"]) == code  # the last --steps counts
    finally:
        signal.signal(signal.SIGINT, previous)
    assert [r["step"] for r in read_log(run)] == ([1, 2, 3, 4] if ignored else [1, 2])


def test_a_second_ctrl_c_stops_at_once_and_says_how_to_continue(tmp_path, text_file, monkeypatch, capsys):
    make = Batches.next
    calls = []

    def next_with_signals(self):
        calls.append(1)
        if len(calls) == 3:  # during step 3: Ctrl-C twice, the second before the step ends
            signal.raise_signal(signal.SIGINT)
            signal.raise_signal(signal.SIGINT)
        return make(self)

    monkeypatch.setattr(Batches, "next", next_with_signals)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    run = str(tmp_path / "run")
    try:
        argv = ["train", "--config", _config_file(tmp_path), "--out", run, "--data", text_file, *TINY_RUN]
        assert main([*argv, "--steps", "4", "--checkpoint-interval", "1"]) == 130
    finally:
        signal.signal(signal.SIGINT, previous)
    assert f"interrupted: continue from the last checkpoint with: dilated-attention train --resume {run}" in (
        capsys.readouterr().err
    )
    assert checkpoint.load_checkpoint(run)["step"] == 2
    assert train(run, resume=True, progress=False)["step"] == 4


def test_a_warmup_as_long_as_the_run_is_noted(tmp_path, text_file, capsys):
    train(str(tmp_path / "run"), settings(text_file, steps=2, warmup_steps=2), CONFIG, progress=False)
    assert "note: warmup_steps 2 is not below steps 2: the learning rate rises for the whole run" in (
        capsys.readouterr().err
    )


def test_generate_defaults_to_the_newest_run_that_finished_a_step(tmp_path, text_file, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    trained = str(tmp_path / "runs" / "trained")
    train(trained, settings(text_file, steps=1), CONFIG, progress=False)
    untrained = tmp_path / "runs" / "untrained"
    untrained.mkdir()

    def out_of_memory(self):
        raise MemoryError("the first batch")

    monkeypatch.setattr(Batches, "next", out_of_memory)
    with pytest.raises(OutOfMemory, match=r"out of memory in the run's first training step .* holds no trained step"):
        train(str(untrained), settings(text_file, steps=1), CONFIG, progress=False)
    assert os.path.isfile(untrained / "checkpoint.pt")  # the step-0 checkpoint, written later than the trained run's
    assert newest_run() == os.path.join("runs", "trained")
    shutil.rmtree(trained)
    assert "no trained run under runs/ (1 run stopped before a step ended)" in _error(
        ["generate", "--prompt", "a"], capsys
    )


def test_train_checks_every_argument_before_writing(tmp_path, text_file):
    """Settings changed after they were made, and each other argument, are checked as
    the constructor checks settings: before the run folder is made."""
    run = tmp_path / "run"
    late = settings(text_file)
    late.min_lr_ratio = math.nan  # a NaN learning rate from step 2 on, and a config.json no reader took
    for kwargs, error, fragment in (
        ({"settings": late}, ValueError, "min_lr_ratio must be a finite number in [0, 1], got nan"),
        ({"settings": dataclasses.replace(settings(text_file), data=None)}, None, None),
        ({"callback": "print"}, TypeError, "callback must be a function of the step's log record"),
        ({"resume": "no"}, TypeError, "resume must be a bool, got 'no' (str)"),
        ({"device": "gpu"}, ValueError, "device must be cpu or cuda (cuda:N for one GPU of several), got 'gpu'"),
        ({"device": 0}, TypeError, "device must be 'cpu', 'cuda' or a torch.device, got int"),
    ):
        if error is None:  # settings without data, changed later: checked too
            kwargs["settings"].steps = -3
            error, fragment = ValueError, "steps must be >= 1, got -3"
        arguments = {"settings": settings(text_file), "model_config": CONFIG, "progress": False, **kwargs}
        with pytest.raises(error, match=re.escape(fragment)):
            train(str(run), **arguments)
        assert not run.exists()
    with pytest.raises(TypeError, match=re.escape("run_dir must be a path (a str), got NoneType")):
        train(None, settings(text_file), CONFIG, progress=False)
    assert late.min_lr_ratio != late.min_lr_ratio  # the caller's settings are not changed


def test_a_resumed_run_refuses_another_model(tmp_path, text_file):
    run = str(tmp_path / "run")
    train(run, settings(text_file, steps=1), CONFIG, progress=False)
    with pytest.raises(ValueError, match=re.escape("model_config differs from") + ".*depth 3 vs 2"):
        train(run, settings(text_file, steps=2), CONFIG.replace(depth=3), resume=True, progress=False)
    assert train(run, settings(text_file, steps=2), CONFIG, resume=True, progress=False)["step"] == 2  # its own


def test_a_run_whose_last_step_ends_out_of_time_is_done(tmp_path, text_file):
    summary = train(str(tmp_path / "run"), settings(text_file, steps=1, minutes=1e-9), CONFIG, progress=False)
    assert summary["stopped"] == "done" and summary["step"] == 1  # not "out of time" with nothing left to resume


def test_damaged_logs_and_configs_are_named(tmp_path, text_file):
    run = tmp_path / "run"
    train(str(run), settings(text_file, steps=1), CONFIG, progress=False)
    log = run / "log.jsonl"
    kept = log.read_text()
    log.write_text('{"step": true}\n')  # a bool is not a step
    with pytest.raises(ValueError, match="line 1, is not a step's record"):
        read_log(str(run))
    log.write_text("[" * 100_000 + "\n")  # nested past the parser's recursion limit
    with pytest.raises(ValueError, match="line 1, is not a step's record"):
        read_log(str(run))
    log.unlink()
    log.mkdir()
    with pytest.raises(ValueError, match=re.escape("log.jsonl is not a file: move it away")):
        read_log(str(run))
    log.rmdir()
    log.write_text(kept)
    (run / "config.json").write_text("[" * 100_000)
    with pytest.raises(ValueError, match=re.escape("config.json is not a valid run configuration: it nests too deep")):
        read_run_config(str(run))


def test_subclasses_of_the_settings_and_config_run_and_resume_as_their_base(tmp_path, text_file):
    """A run folder records the base classes' fields: a subclass's own field made a
    config.json that no reader took (the run could not resume or load)."""

    @dataclasses.dataclass
    class NotedSettings(TrainSettings):
        note: str = "first try"

    @dataclasses.dataclass(frozen=True)
    class NamedConfig(LongNetConfig):
        name: str = "tiny"

    run = str(tmp_path / "run")
    noted = NotedSettings(**dataclasses.asdict(settings(text_file, steps=1)))
    train(run, noted, NamedConfig(**CONFIG.to_dict()), progress=False)
    assert read_run_config(run) == (CONFIG, dataclasses.replace(settings(text_file, steps=1), data=text_file))
    assert train(run, settings(text_file, steps=2), resume=True, progress=False)["step"] == 2
    assert isinstance(load_model(run), torch.nn.Module)


def test_run_folder_readers_name_their_argument(tmp_path):
    for reader in (read_log, read_run_config):
        with pytest.raises(TypeError, match="run_dir must be a path"):
            reader(5)
    with pytest.raises(ValueError, match="does not exist"):
        read_log(str(tmp_path / "typo"))  # [] before, as for a run that has logged nothing
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 'empty'} is empty: pass a folder a train run")):
        read_run_config(tmp_path / "empty")  # a path object: its message's command quoted it as a str


def test_load_corpus_refuses_what_is_not_a_path():
    for value in (False, 2):  # read as file descriptors before: stdin, and stderr closed after
        with pytest.raises(TypeError, match="path must be a file's or folder's path, or None, got"):
            load_corpus(value)
    with pytest.raises(TypeError, match=re.escape("dtype must be one of ('bfloat16', 'float32') (a str), got list")):
        TrainSettings(dtype=["float32"])


def test_settings_and_model_config_of_the_wrong_type_are_type_errors(tmp_path, text_file):
    run = tmp_path / "run"
    with pytest.raises(TypeError, match=re.escape("settings must be a TrainSettings or None, got dict")):
        train(str(run), {"steps": 3}, CONFIG, progress=False)
    with pytest.raises(TypeError, match=re.escape("model_config must be a LongNetConfig or None, got dict")):
        train(str(run), settings(text_file), {"dim": 3}, progress=False)
    assert not run.exists()


def test_a_model_too_large_for_the_memory_is_refused_before_the_run_folder(tmp_path, text_file, capsys, monkeypatch):
    huge = CONFIG.replace(dim=2**24, ffn_dim=2**24)  # under what a tensor holds, over any memory
    with pytest.raises(ValueError, match="GiB of physical memory of this machine: use a smaller dim"):
        train(str(tmp_path / "run"), settings(text_file), huge, device="cpu", progress=False)
    assert not (tmp_path / "run").exists()
    config = tmp_path / "model.json"
    config.write_text(huge.to_json())
    monkeypatch.chdir(tmp_path)  # the default run folder would go into runs/ here
    message = _error(["train", "--config", str(config), "--data", text_file, "--device", "cpu"], capsys)
    assert "the model's parameters (at least" in message and "Traceback" not in message
    assert not (tmp_path / "runs").exists()


def test_evaluation_windows_are_at_most_those_the_validation_split_holds(tmp_path, text_file, capsys):
    from dilated_attention.training.data import evaluation_starts

    data = torch.arange(100, dtype=torch.uint8)
    assert evaluation_starts(data, 16, 10**12).tolist() == list(range(84))  # every window once, no huge list
    run, short = str(tmp_path / "run"), tmp_path / "short.txt"
    short.write_text(pathlib.Path(text_file).read_text()[:4_000])  # 200 bytes of validation text
    assert train(run, settings(str(short), steps=1, eval_windows=10**8, context=180), CONFIG, progress=False)
    assert "holds 20 windows of context + 1 = 181 bytes: each evaluation uses those 20" in capsys.readouterr().err
    assert math.isfinite(read_log(run)[-1]["val_bpb"])


def test_text_is_checked_as_it_is_read(tmp_path, monkeypatch):
    """A file is read and checked in parts (a binary file given by mistake is refused at
    its first bad byte, not once all of it is in memory): the bad byte's place is the
    file's, characters split between parts are whole."""
    from dilated_attention.training import data

    monkeypatch.setattr(data, "READ_BYTES", 4)
    path = tmp_path / "t.txt"
    for content in ["abc€de€f".encode(), b"abcd\xe2\x82\xacx\xe2", "é".encode() * 7 + b"\x80", b"ab\xffcdefgh"]:
        path.write_bytes(content)
        try:
            expected = content.decode()
        except UnicodeDecodeError as exc:
            bad = content[exc.start : exc.start + 1]
            with pytest.raises(ValueError, match=re.escape(f"is not UTF-8 text (byte {exc.start}: {bad!r})")):
                data.load_corpus(str(path))
        else:
            assert bytes(data._read_utf8(str(path), strict=True)).decode() == expected


def test_only_regular_files_of_a_data_folder_are_read(tmp_path, text_file):
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "text.txt").write_text(pathlib.Path(text_file).read_text())
    os.symlink(folder / "text.txt", folder / "link.txt")  # a link to a regular file is read
    pipe = folder / "pipe"
    os.mkfifo(pipe)  # reading it waits for a writer, forever without one
    text = pathlib.Path(text_file).read_bytes()
    writer = threading.Thread(target=lambda: pipe.write_bytes(text), daemon=True)
    writer.start()  # should the folder's pipe be read after all, the count is 3: a failure, not a hang
    assert load_corpus(str(folder)).files == 2
    # given as --data itself, a pipe is read, as --data <(zcat corpus.gz) is
    assert load_corpus(str(pipe)).validation.numel() > 0
    writer.join(timeout=10)


def test_a_closed_output_pipe_ends_generate_quietly(tmp_path, text_file):
    run = str(tmp_path / "run")
    train(run, settings(text_file, steps=1), CONFIG, progress=False)
    command = [sys.executable, "-m", "dilated_attention", "generate", "--run", run, "--prompt", "x"]
    process = subprocess.Popen(
        [*command, "--max-new-tokens", "100000", "--device", "cpu"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    process.stdout.read(20)  # as `| head -c 20` does, then it exits
    process.stdout.close()
    assert process.wait(timeout=TIMEOUT_S) == 141
    err = process.stderr.read().decode()
    assert "Traceback" not in err and "BrokenPipeError" not in err and "Exception ignored" not in err


def test_suggested_commands_are_quoted_for_the_shell_and_config_errors_name_the_file(tmp_path, text_file, capsys):
    from dilated_attention.models.generate import generate

    run = str(tmp_path / "sp ace" / "m r")
    assert main(["train", "--out", run, "--data", text_file, "--minutes", "1e-9", "--no-progress"]) == 0
    assert f"continue with: dilated-attention train --resume '{run}'" in capsys.readouterr().out
    assert f"continue it with --resume '{run}'" in _error(["train", "--out", run, "--data", text_file], capsys)
    config = tmp_path / "model.json"
    for text, fragment in ((b"\xff\xfe", "is not UTF-8 text"), (b"{dim: 3", "a LongNetConfig must be a JSON object")):
        config.write_bytes(text)
        message = _error(["train", "--out", str(tmp_path / "new"), "--config", str(config)], capsys)
        assert f"--config {config}" in message and fragment in message
    with pytest.raises(ValueError, match=r"prompt must be .* batch >= 1"):
        generate(load_model(run), torch.zeros(0, 5, dtype=torch.long), 3)


def _agreeing_worker(rank, init_file, result_dir):
    """Two gloo processes: a failure on rank 1 only, one on both, and texts that differ."""
    import datetime

    import torch.distributed as dist

    from dilated_attention.training import parallel, trainer
    from dilated_attention.training.data import Corpus

    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120)
    )
    place = parallel.Parallel(rank=rank, world=2, mode="data")
    report = {}

    def fails_on(ranks, message):
        def fn():
            if rank in ranks:
                raise (OSError(2, "No such file or directory", "/data/x") if message == "os" else ValueError(message))
            return rank

        return fn

    for name, fn in (
        ("one", fails_on({1}, "rank 1's own problem")),
        ("both", fails_on({0, 1}, "the same problem")),
        ("os", fails_on({0}, "os")),
        ("none", fails_on(set(), "")),
    ):
        try:
            report[name] = place.agree(fn)
        except ValueError as exc:
            report[name] = f"ValueError: {exc}"

    def reads(sizes):  # what load_corpus gives each rank: text of a size, or None for a pipe left empty
        def load(data):
            if sizes[rank] is None:
                raise ValueError(f"{data} holds no text: give a file or folder with UTF-8 text in it")
            text = torch.zeros(sizes[rank], dtype=torch.uint8)
            return Corpus(text, text, data, 1, {"bytes": sizes[rank], "sha256": str(sizes[rank])})

        return load

    for name, sizes in (
        ("same", (40, 40)),
        ("different", (40, 43)),
        ("one empty", (None, 40)),
        ("empty", (None, None)),
    ):
        trainer.load_corpus = reads(sizes)
        try:
            report[name] = trainer._read_text("fifo", place).fingerprint["bytes"]
        except ValueError as exc:
            report[name] = str(exc)
    with open(os.path.join(result_dir, f"{rank}.json"), "w") as f:
        json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # torch 2.13's gloo can abort at interpreter exit after the errors (see test_distributed)


def test_a_failure_on_one_process_stops_every_process_alike(tmp_path):
    """Train's preparation (checks, reading the text) runs as one collective step: what
    fails on one process fails on all with its message (a process left waiting would
    end with gloo's traceback), and processes that read different texts (a pipe gives
    each part of its stream) are refused."""
    import torch.multiprocessing as mp

    ctx = mp.start_processes(
        _agreeing_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + TIMEOUT_S
    while not ctx.join(timeout=1):
        assert time.monotonic() < deadline, "the two processes did not end"
    reports = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in range(2)]
    assert [r.pop("none") for r in reports] == [0, 1]  # nothing failed: each its own result
    assert reports[0] == reports[1]
    report = reports[0]
    assert report["one"] == "ValueError: process 1 of 2: rank 1's own problem"
    assert report["both"] == "ValueError: the same problem"
    assert report["os"] == "ValueError: process 0 of 2: /data/x: No such file or directory (FileNotFoundError)"
    assert report["same"] == 40
    fix = "a pipe given as --data gives each process part of its stream; write the text to a file, which every "
    assert report["different"] == (
        f"the 2 processes read different texts from fifo (process 0: 40 bytes; process 1: 43 bytes): {fix}"
        "process reads whole"
    )
    assert report["one empty"] == (
        "the 2 processes read different texts from fifo (process 0: fifo holds no text: give a file or folder "
        f"with UTF-8 text in it; process 1: 40 bytes): {fix}process reads whole"
    )
    assert report["empty"] == "fifo holds no text: give a file or folder with UTF-8 text in it"


def test_ctrl_c_forwarded_by_torchrun_counts_once(monkeypatch):
    """Under torchrun a terminal's Ctrl-C reaches a process from the terminal and again
    from torchrun within milliseconds: one request to stop after the step. A Ctrl-C
    pressed later, or without torchrun, stops at once."""
    from dilated_attention.training.trainer import _StopRequest

    now = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    for under_torchrun in (True, False):
        if under_torchrun:
            monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
        else:
            monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
        stop = _StopRequest()
        stop._handle(signal.SIGINT, None)
        assert stop.requested and stop.signal == "SIGINT"
        now[0] += 0.01
        if under_torchrun:
            try:
                stop._handle(signal.SIGINT, None)  # torchrun's forward
                stop._handle(signal.SIGTERM, None)  # and its shutdown
            except KeyboardInterrupt:
                pytest.fail("torchrun's forward of the Ctrl-C was taken as a second Ctrl-C")
            assert stop.signal == "SIGINT"
            now[0] += _StopRequest.ECHO_S
        with pytest.raises(KeyboardInterrupt):
            stop._handle(signal.SIGINT, None)


def test_split_and_resume_refusals_name_the_processes_that_work(tmp_path, text_file):
    from dilated_attention.training import parallel, trainer

    def place(world, mode="data"):
        fake = parallel.Parallel(rank=0, world=world, mode=mode)
        fake.gather = lambda value: [value] * world  # one process standing for all
        return fake

    six = settings(text_file, batch_size=6)
    launch = "launch a number of processes that divides it (1, 2, 3, 6)"
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"--batch-size 6 must be divisible by the 4 processes: {launch}, or a --batch-size they divide"
        ),
    ):
        trainer._check_split(six, place(4), resume=False, dropout=0.0)
    with pytest.raises(
        ValueError,
        match=re.escape(f"--batch-size 6 (the run's) must be divisible by the 4 processes: {launch}") + "$",
    ):
        trainer._check_split(six, place(4), resume=True, dropout=0.0)
    with pytest.raises(ValueError, match=r"processes: resume it on as many processes as trained it$"):
        trainer._check_split(six, place(4), resume=True, dropout=0.1)
    with pytest.raises(
        ValueError,
        match=re.escape(
            "--batch-size 1 must be divisible by the 2 processes: launch a number of processes that divides it (1)"
        ),
    ):
        trainer._check_split(settings(text_file, batch_size=1), place(2), resume=False, dropout=0.0)
    # With dropout, a run resumes on the number of processes that trained it; without, on any.
    for dropout in (0.1, 0.0):
        run = str(tmp_path / f"run-{dropout}")
        train(run, settings(text_file, steps=2), CONFIG.replace(dropout=dropout), progress=False)
        config, saved = read_run_config(run)
        if dropout:
            with pytest.raises(
                ValueError,
                match=re.escape(
                    f"{run} was trained by 1 process with dropout 0.1, and its resumed runs keep that number: the "
                    "dropout masks depend on how the processes split a step (without dropout, any number resumes a "
                    "run exactly): run it with one process"
                ),
            ):
                trainer._checked_state(run, config, saved, place(2))
        else:
            assert trainer._checked_state(run, config, saved, place(2))["step"] == 2


def test_a_shell_pipe_that_did_not_reach_the_process_is_named():
    from dilated_attention.training import parallel, trainer

    with pytest.raises(ValueError, match=r"^data \(--data\) /dev/fd/987: no such file or folder$"):
        load_corpus("/dev/fd/987")
    place = parallel.Parallel(rank=0, world=2, mode="data")  # one of the processes torchrun started
    place.gather = lambda value: [value] * 2  # the other process failed alike
    with pytest.raises(
        ValueError,
        match=re.escape(
            "data (--data) /dev/fd/987: no such file or folder (a shell's <(...) reaches only the process the "
            "shell starts, not those torchrun starts: write the text to a file)"
        ),
    ):
        trainer._read_text("/dev/fd/987", place)
