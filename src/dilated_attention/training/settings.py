"""``TrainSettings``: how a run trains (the model's shape is a ``LongNetConfig``)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from ..ops import validation
from . import tasks

AUTOCAST_DTYPES = {"float32": None, "bfloat16": torch.bfloat16}
# Tokens a training step's batch may hold (its int64 tensor's elements).
MAX_STEP_TOKENS = 2**60


@dataclass
class TrainSettings:
    """How to train (the model's shape is a :class:`LongNetConfig`).

    ``steps``: the run's total optimizer steps (the schedule's length), also when
    resuming; ``minutes``: stop earlier once the training steps have taken this long
    (evaluation and checkpoints not counted; the run can be resumed). ``batch_size``:
    sequences per step over all processes.
    ``lr``: the peak learning rate, reached linearly over ``warmup_steps``, then a
    cosine down to ``lr * min_lr_ratio``. AdamW (``weight_decay`` on matrices only),
    gradients clipped to norm ``grad_clip``. ``dtype``: ``"bfloat16"`` runs under
    autocast (CPU too). ``data``: a UTF-8 file or folder (default: the standard
    library's sources). ``task``: ``"passkey"`` or ``"recall"`` mixes examples of that
    long-range retrieval task (:mod:`dilated_attention.training.tasks`) into the
    batches, a ``task_fraction`` of the sequences, at random distances.
    """

    context: int = 512
    batch_size: int = 8
    steps: int = 600
    minutes: float | None = None
    lr: float = 3e-3
    warmup_steps: int = 30
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    dtype: str = "float32"
    grad_checkpointing: bool = False
    seed: int = 0
    data: str | None = None
    eval_interval: int = 50
    eval_windows: int = 16
    checkpoint_interval: int = 100
    sequence_parallel: bool = False
    task: str | None = None
    task_fraction: float = 0.5

    def __post_init__(self):
        for name in ("context", "batch_size", "steps", "eval_interval", "eval_windows", "checkpoint_interval"):
            setattr(self, name, validation.check_positive_int(getattr(self, name), name))
        if self.batch_size * (self.context + 1) > MAX_STEP_TOKENS:
            raise ValueError(
                f"batch_size x (context + 1) = {self.batch_size} x {self.context + 1} tokens a step is beyond what a "
                "tensor holds (2**60): use a smaller batch_size or context"
            )
        self.warmup_steps = validation.check_non_negative_int(self.warmup_steps, "warmup_steps")
        self.seed = validation.check_int(self.seed, "seed", 0, validation.SEED_LIMIT)
        self.lr = validation.check_number(
            self.lr, "lr", 0, 1, low_open=True, meaning=" (AdamW moves each weight by about lr per step)"
        )
        self.min_lr_ratio = validation.check_number(self.min_lr_ratio, "min_lr_ratio", 0, 1)
        self.weight_decay = validation.check_number(
            self.weight_decay,
            "weight_decay",
            0,
            1 / self.lr,
            meaning=" (AdamW multiplies each matrix by 1 - lr * weight_decay per step)",
        )
        self.grad_clip = validation.check_number(self.grad_clip, "grad_clip", 0, low_open=True)
        if self.minutes is not None:
            self.minutes = validation.check_number(self.minutes, "minutes", 0, low_open=True)
        for name in ("grad_checkpointing", "sequence_parallel"):
            setattr(self, name, validation.check_flag(getattr(self, name), name))
        if self.task is not None:
            self.task = tasks.check_task(self.task)
            fix = "train on a shorter context, or on the passkey task"
            tasks.check_length(self.task, self.context + 1, "context", fix)  # a sequence and its next byte
        self.task_fraction = validation.check_number(self.task_fraction, "task_fraction", 0, 1)
        self.dtype = validation.check_choice(self.dtype, "dtype", sorted(AUTOCAST_DTYPES))
        if self.data is not None:
            try:
                self.data = os.fsdecode(self.data)  # a str (bytes paths too): the run's config holds it
            except TypeError:
                raise TypeError(f"data must be a path or None, got {validation.type_name(self.data)}") from None
            if not self.data.strip():
                raise ValueError("data must name a file or folder, got an empty path: pass None for the default")

    def learning_rate(self, step: int) -> float:
        """The learning rate of step ``step`` (0-based)."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        progress = (step - self.warmup_steps) / max(1, self.steps - self.warmup_steps)
        cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * cosine)
