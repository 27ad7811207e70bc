"""Checkpoints of a training run: one file, written whole or not at all."""

from __future__ import annotations

import os
import pickle
import zipfile

import torch

from ..files import atomic_write

CHECKPOINT = "checkpoint.pt"
FORMAT = "dilated-attention-train/1"


def save_checkpoint(run_dir: str, state: dict) -> str:
    """Write ``state`` (tensors, numbers, strings, lists, dicts) to ``run_dir/checkpoint.pt``
    through a temporary file and a rename: a reader, or a run killed while writing,
    sees the previous checkpoint or this one, never part of one."""
    path = os.path.join(run_dir, CHECKPOINT)
    with atomic_write(path, binary=True) as f:
        torch.save({"format": FORMAT, **state}, f)
    return path


KEYS = ("model", "optimizer", "scheduler", "data", "step", "elapsed_s", "model_config", "rng", "settings")


def load_checkpoint(run_dir: str) -> dict:
    """The state saved in ``run_dir`` (on the CPU, memory-mapped: what is not used is
    not read), or a ``ValueError`` saying what is wrong with it."""
    path = os.path.join(run_dir, CHECKPOINT)
    if not os.path.isfile(path):
        raise ValueError(
            f"no checkpoint in {run_dir} (expected {path}): pass the folder a `dilated-attention train` run "
            "wrote (its --out)"
        )
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except (RuntimeError, EOFError, OSError, pickle.UnpicklingError, zipfile.BadZipFile) as exc:
        reason = (str(exc).strip().splitlines() or [""])[0][:200]
        raise ValueError(f"{path} is not a readable checkpoint ({type(exc).__name__}: {reason}); it is damaged or "
                         "was not written by dilated-attention train") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ValueError(f"{path} is not a dilated-attention training checkpoint (format {FORMAT} expected)")
    missing = [key for key in KEYS if key not in state]
    if missing:
        raise ValueError(f"{path} lacks {missing}: it is damaged or was not written by dilated-attention train")
    return state
