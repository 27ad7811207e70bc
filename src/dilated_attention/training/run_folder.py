"""A run folder's files: ``config.json`` (the model and the settings), ``log.jsonl``
(one record per step) and ``loss.png``; the checkpoint is :mod:`.checkpoint`'s."""

from __future__ import annotations

import dataclasses
import json
import os

from ..files import atomic_write
from ..models import LongNetConfig
from .settings import TrainSettings

CONFIG = "config.json"
LOG = "log.jsonl"
PLOT = "loss.png"


def read_run_config(run_dir: str) -> tuple[LongNetConfig, TrainSettings]:
    """The model configuration and settings a run folder was started with."""
    path = os.path.join(run_dir, CONFIG)
    if not os.path.isfile(path):
        raise ValueError(f"{run_dir} is not a training run folder: {path} is missing")
    try:
        with open(path, encoding="utf-8") as f:
            saved = json.load(f)
        return LongNetConfig.from_dict(saved["model"]), TrainSettings(**saved["training"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{path} is not a valid run configuration: {exc}") from None


def start_run_folder(run_dir: str, model_config: LongNetConfig, settings: TrainSettings) -> None:
    try:
        os.makedirs(run_dir, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"--out {run_dir}: cannot create the run folder ({exc.strerror})") from None
    with atomic_write(os.path.join(run_dir, CONFIG)) as f:
        json.dump({"model": model_config.to_dict(), "training": dataclasses.asdict(settings)}, f, indent=1)
    with atomic_write(os.path.join(run_dir, LOG)) as f:
        f.write("")


def read_log(run_dir: str) -> list[dict]:
    """The run's log records, oldest first (a last line cut short by a crash is left out)."""
    path = os.path.join(run_dir, LOG)
    if not os.path.isfile(path):
        return []
    with open(path, encoding="utf-8") as f:
        lines = [line for line in f if line.strip()]
    if lines and not lines[-1].endswith("\n"):
        lines.pop()
    records = []
    for number, line in enumerate(lines, 1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            raise ValueError(f"{path}, line {number}, is not a JSON record: the log is damaged") from None
    return records


def truncate_log(run_dir: str, step: int) -> None:
    """Drop the records of steps after the checkpoint (a resumed run redoes them)."""
    kept = [r for r in read_log(run_dir) if r["step"] <= step]
    with atomic_write(os.path.join(run_dir, LOG)) as f:
        f.writelines(json.dumps(r) + "\n" for r in kept)


def append_log(run_dir: str, record: dict) -> None:
    with open(os.path.join(run_dir, LOG), "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def plot(run_dir: str) -> None:
    """``loss.png``: training and validation bits per byte against the step."""
    from ..plotting import pyplot, save

    records = read_log(run_dir)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.plot([r["step"] for r in records], [r["bpb"] for r in records], lw=0.8, label="training (batch)")
    evaluated = [r for r in records if "val_bpb" in r]
    ax.plot([r["step"] for r in evaluated], [r["val_bpb"] for r in evaluated], "o-", ms=3, label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("bits per byte")
    ax.grid(True, alpha=0.3)
    ax.legend()
    save(fig, os.path.join(run_dir, PLOT), f"{os.path.basename(os.path.abspath(run_dir))}: loss")
