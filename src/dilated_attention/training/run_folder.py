"""A run folder's files: ``config.json`` (the model and the settings), ``log.jsonl``
(one record per step) and ``loss.png``; the checkpoint is :mod:`.checkpoint`'s; and
``.lock``, which the process running the run holds (:class:`RunLock`)."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import re
import shlex
import sys

from ..models import LongNetConfig
from ..ops.validation import type_name
from ..utils.files import TEMPORARY_SUFFIX, atomic_write
from .checkpoint import CHECKPOINT, PREVIOUS, load_checkpoint
from .settings import TrainSettings

CONFIG = "config.json"
LOG = "log.jsonl"
PLOT = "loss.png"
LOCK = ".lock"


class RunLock:
    """An OS lock on a run folder, held by the one process that runs the run, for as
    long as it runs: ``run_dir/.lock`` (created if missing, never deleted) is locked
    with ``flock`` (``msvcrt.locking`` on Windows) and holds the holder's PID. The OS
    releases the lock when the process ends, however it ends, so a killed run never
    leaves its folder locked. A second process gets a ``ValueError`` naming the
    folder and the holder's PID."""

    def __init__(self, run_dir: str):
        path = os.path.join(run_dir, LOCK)
        try:  # never through a link: the lock file is written
            self._fd: int | None = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
        except OSError as exc:
            if os.path.islink(path):
                raise ValueError(f"{path} is a symbolic link, not the run's lock file: remove it") from None
            raise ValueError(f"cannot lock the run folder {run_dir} ({exc.strerror} creating {path})") from None
        try:
            _lock(self._fd)
        except OSError as exc:
            holder = _holder(self._fd)
            self.release()
            if exc.errno not in (errno.EACCES, errno.EAGAIN, errno.EDEADLK):
                raise ValueError(f"cannot lock the run folder {run_dir} ({exc.strerror})") from None
            raise ValueError(
                f"{run_dir} is in use by another process (PID {holder} holds {path}): wait until that run ends "
                "or stop it; two processes on one run folder would corrupt it"
            ) from None
        os.ftruncate(self._fd, 0)
        os.lseek(self._fd, 0, os.SEEK_SET)
        os.write(self._fd, f"{os.getpid()}\n".encode("ascii"))

    def release(self) -> None:
        """Give the lock up (closing the file does); a second call does nothing."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _lock(fd: int) -> None:
    """Lock ``fd`` exclusively without waiting; ``OSError`` if another process holds it."""
    if sys.platform == "win32":
        import msvcrt

        msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
    else:
        import fcntl

        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)


def _holder(fd: int) -> str:
    """The PID the lock file ``fd`` holds, as text (``unknown`` if it cannot be read)."""
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        return os.read(fd, 32).decode("ascii", "replace").strip() or "unknown"
    except OSError:  # Windows: the holder's locked byte cannot be read
        return "unknown"


def remove_stale_temporaries(run_dir: str) -> list[str]:
    """Delete the temporary files that training writers killed mid-write left in
    ``run_dir`` (``.NAME.<id>.tmp`` of the files a run writes, see
    :func:`dilated_attention.utils.files.atomic_write`); call it holding the folder's
    :class:`RunLock`, so that no live writer owns one. Others (an ``evaluate``'s, which
    takes no lock) are left alone. Returns their names."""
    written = (CONFIG, LOG, PLOT, CHECKPOINT, PREVIOUS)
    stale = [name for name in os.listdir(run_dir) if _becomes(name) in written]
    for name in stale:
        os.remove(os.path.join(run_dir, name))
    return stale


def never_started(run_dir: str) -> bool:
    """Whether ``run_dir`` holds nothing but (part of) what a new run writes before its
    first step ends: ``config.json``, an empty log and the checkpoint of step 0 (a run
    stopped, or failed, in its first step), or nothing at all. Such a folder can start
    its run again, with other settings too: it holds no training."""
    names = {name for name in os.listdir(run_dir) if name != LOCK and _becomes(name) is None}
    if not names <= {CONFIG, LOG, CHECKPOINT, PREVIOUS}:
        return False
    try:  # a config.json of the user's own is not a run's
        if CONFIG in names:
            read_run_config(run_dir)
        # the log first: a trained run's is not empty, and its checkpoint is not read
        return not read_log(run_dir) and all(
            load_checkpoint(run_dir, name)["step"] == 0 for name in sorted(names & {CHECKPOINT, PREVIOUS})
        )
    except ValueError:
        return False


def _becomes(name: str) -> str | None:
    """The file that ``name`` becomes when written whole, if it is one of
    :func:`dilated_attention.utils.files.temporary_path`'s names; else ``None``."""
    match = re.fullmatch(r"\.(.+)\.[0-9a-f]{32}" + re.escape(TEMPORARY_SUFFIX), name)
    return None if match is None else match.group(1)


def not_utf8(path: str) -> str | None:
    """What is wrong with a run folder's ``path`` in other bytes than UTF-8 (bytes the
    file system gave back as surrogates), or ``None``: PyTorch reads checkpoints from
    UTF-8 paths only."""
    if path.encode("utf-8", "replace").decode("utf-8") == path:
        return None
    return f"must be a path in UTF-8 (PyTorch reads checkpoints from no other), got {path!r}: rename it"


def run_dir_path(run_dir) -> str:
    """``run_dir`` (a str or a path-like object) as a str, or a ``TypeError`` naming it."""
    run_dir = os.fspath(run_dir) if isinstance(run_dir, os.PathLike) else run_dir
    if not isinstance(run_dir, str):
        raise TypeError(f"run_dir must be a path (a str), got {type_name(run_dir)}")
    return run_dir


def read_run_config(run_dir: str) -> tuple[LongNetConfig, TrainSettings]:
    """The model configuration and settings a run folder was started with."""
    run_dir = run_dir_path(run_dir)
    path = os.path.join(run_dir, CONFIG)
    if not os.path.isfile(path):
        held = set(os.listdir(run_dir)) if os.path.isdir(run_dir) else None
        train_it = f"dilated-attention train --out {shlex.quote(run_dir)}"
        if held == {LOCK}:
            raise ValueError(
                f"{run_dir} holds no run: a train run was stopped before it wrote {CONFIG}; start it anew: {train_it}"
            )
        if held == set():
            raise ValueError(f"{run_dir} is empty: pass a folder a train run wrote, or train one there: {train_it}")
        if held is None:
            raise ValueError(f"{run_dir} does not exist (or is not a folder): pass a run folder train wrote")
        raise ValueError(f"{run_dir} is not a training run folder: {path} is missing")
    try:
        with open(path, encoding="utf-8") as f:
            saved = json.load(f)
        if not isinstance(saved, dict) or not {"model", "training"} <= set(saved):
            raise ValueError('it must be a JSON object with "model" and "training", as train writes it')
        return LongNetConfig.from_dict(saved["model"]), TrainSettings(**saved["training"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{path} is not a valid run configuration: {exc}") from None
    except RecursionError:  # JSON nested deeper than Python's parser goes: not what train writes
        raise ValueError(f"{path} is not a valid run configuration: it nests too deep for JSON train writes") from None


def make_run_folder(run_dir: str) -> None:
    """Create ``run_dir`` (and its parents) if missing."""
    if os.path.exists(run_dir) and not os.path.isdir(run_dir):
        raise ValueError(f"--out {run_dir} is a file, not a folder: pick a new folder for the run")
    try:
        os.makedirs(run_dir, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"cannot create the run folder {run_dir} ({exc.strerror}): pick another with --out") from None


def write_run_config(run_dir: str, model_config: LongNetConfig, settings: TrainSettings) -> None:
    """``config.json``: what :func:`read_run_config` reads back."""
    with atomic_write(os.path.join(run_dir, CONFIG)) as f:
        json.dump({"model": model_config.to_dict(), "training": dataclasses.asdict(settings)}, f, indent=1)


def start_run_folder(run_dir: str, model_config: LongNetConfig, settings: TrainSettings) -> None:
    """A new run's ``config.json`` and empty log, in a folder that :func:`never_started`
    (the step-0 checkpoints of an earlier start, of other settings perhaps, removed)."""
    for name in (PREVIOUS, CHECKPOINT):
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(run_dir, name))
    write_run_config(run_dir, model_config, settings)
    with atomic_write(os.path.join(run_dir, LOG)) as f:
        f.write("")


def read_log(run_dir: str) -> list[dict]:
    """The run's log records, oldest first (a last line cut short by a crash is left out;
    none before the log is written)."""
    run_dir = run_dir_path(run_dir)
    path = os.path.join(run_dir, LOG)
    if not os.path.isdir(run_dir):
        raise ValueError(f"{run_dir} does not exist (or is not a folder): pass a run folder train wrote")
    if not os.path.exists(path):
        return []
    aside = (
        "the checkpoint does not need it: to go on without its records (the loss plot loses them), run "
        f"`mv {shlex.quote(path)} {shlex.quote(path + '.damaged')}`"
    )
    if not os.path.isfile(path):
        raise ValueError(f"{path} is not a file: move it away (the checkpoint does not need the log)")
    try:
        with open(path, encoding="utf-8") as f:
            lines = [line for line in f if line.strip()]
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not UTF-8 text: the log is damaged; {aside}") from None
    if lines and not lines[-1].endswith("\n"):
        lines.pop()
    records = []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, RecursionError):  # RecursionError: nested deeper than the parser goes
            record = None
        step = record.get("step") if isinstance(record, dict) else None
        if not isinstance(step, int) or isinstance(step, bool):
            raise ValueError(f"{path}, line {number}, is not a step's record: the log is damaged; {aside}") from None
        records.append(record)
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
    from ..utils.plotting import pyplot, save

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
