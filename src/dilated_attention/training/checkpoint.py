"""Checkpoints of a training run: one file, written whole or not at all, checked
whole when read, with the one before it kept.

``checkpoint.pt`` is a ``torch.save`` archive: a zip file whose every record carries
the CRC-32 checksum of its bytes. Reading one checks every record against its
checksum first, so a file damaged after it was written is refused, never used.
Each save first keeps the checkpoint it replaces as ``checkpoint.previous.pt`` (a
second name for the same file: no copy), which the error for a damaged latest
checkpoint points to.
"""

from __future__ import annotations

import errno
import os
import shlex
import zipfile

import torch

from ..utils.files import atomic_write, link_atomically

CHECKPOINT = "checkpoint.pt"
PREVIOUS = "checkpoint.previous.pt"
FORMAT = "dilated-attention-train/1"
KEYS = ("model", "optimizer", "scheduler", "data", "step", "elapsed_s", "model_config", "rng", "settings")


def save_checkpoint(run_dir: str, state: dict) -> str:
    """Write ``state`` (tensors, numbers, strings, lists, dicts) to ``run_dir/checkpoint.pt``
    through a temporary file and a rename: a reader, or a run killed while writing,
    sees the previous checkpoint or this one, never part of one. The checkpoint
    replaced stays as ``checkpoint.previous.pt``. A full disk is a ``ValueError``
    that says so (the latest checkpoint is then still the previous one, whole)."""
    path = os.path.join(run_dir, CHECKPOINT)
    try:
        if os.path.isfile(path):
            link_atomically(path, os.path.join(run_dir, PREVIOUS))
        with atomic_write(path, binary=True) as f:
            torch.save({"format": FORMAT, **state}, f)
    except (OSError, RuntimeError) as exc:
        if _out_of_space(exc):
            raise ValueError(
                f"no space left on the device writing the checkpoint {path}; the previous checkpoint is intact: "
                f"free some space, then continue the run with --resume {shlex.quote(run_dir)}"
            ) from None
        raise
    return path


def _out_of_space(exc: BaseException | None) -> bool:
    """Whether ``exc``, or an error it was raised while handling (``torch.save``
    reports a failed write as a ``RuntimeError``), is a full disk or quota."""
    seen = set()
    while exc is not None and id(exc) not in seen:  # (a chain may loop: `raise e from e`)
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


def damage(path: str) -> str | None:
    """Why the file ``path`` is not a whole ``torch.save`` archive, or ``None``: every
    record is read and checked against its CRC-32."""
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except Exception as exc:  # noqa: BLE001 - whatever a damaged archive makes zipfile raise
        return f"not a readable archive: {type(exc).__name__}: {str(exc)[:200]}"
    return None if bad is None else f"the bytes of its record {bad} do not match their checksum"


def load_checkpoint(run_dir: str, name: str = CHECKPOINT) -> dict:
    """The state saved in ``run_dir`` (on the CPU, memory-mapped: what is not used is
    not read), or a ``ValueError`` saying what is wrong with it and, for a damaged
    file, how to go back to the checkpoint before it."""
    path = os.path.join(run_dir, name)
    if not os.path.isfile(path):
        if name == CHECKPOINT and os.path.isfile(os.path.join(run_dir, PREVIOUS)):  # moved or deleted by hand
            raise ValueError(f"{path} is missing. {_recovery(run_dir, name)}")
        raise ValueError(
            f"no checkpoint in {run_dir} (expected {path}): pass the folder a `dilated-attention train` run "
            "wrote (its --out)"
        )
    problem = damage(path)
    if problem is not None:
        raise ValueError(f"{path} is damaged ({problem}), so it is not used. {_recovery(run_dir, name)}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # noqa: BLE001 - whatever a damaged file makes torch.load raise
        reason = (str(exc).strip().splitlines() or [""])[0][:200]
        raise ValueError(
            f"{path} is not a readable checkpoint ({type(exc).__name__}: {reason}); it is damaged or "
            "was not written by dilated-attention train"
        ) from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ValueError(f"{path} is not a dilated-attention training checkpoint (format {FORMAT} expected)")
    missing = [key for key in KEYS if key not in state]
    if missing:
        raise ValueError(f"{path} lacks {missing}: it is damaged or was not written by dilated-attention train")
    return state


def _recovery(run_dir: str, damaged: str) -> str:
    """What to do about the damaged checkpoint ``damaged`` of ``run_dir``."""
    previous = os.path.join(run_dir, PREVIOUS)
    if damaged != CHECKPOINT or not os.path.isfile(previous):
        return "No earlier checkpoint of this run is kept: train a new run."
    try:
        step = load_checkpoint(run_dir, PREVIOUS)["step"]
    except ValueError:
        return f"The checkpoint before it, {previous}, is damaged too: train a new run."
    back = f"mv {shlex.quote(previous)} {shlex.quote(os.path.join(run_dir, CHECKPOINT))}"
    return (
        f"The checkpoint before it, of step {step}, is intact: to go back to it, run `{back}`, then the "
        f"command again (a resumed run trains the steps after {step} again)."
    )
