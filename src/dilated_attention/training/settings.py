"""``TrainSettings``: how a run trains (the model's shape is a ``LongNetConfig``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

AUTOCAST_DTYPES = {"float32": None, "bfloat16": torch.bfloat16}


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
    library's sources).
    """

    context: int = 512
    batch_size: int = 8
    steps: int = 600
    minutes: Optional[float] = None
    lr: float = 3e-3
    warmup_steps: int = 30
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    dtype: str = "float32"
    grad_checkpointing: bool = False
    seed: int = 0
    data: Optional[str] = None
    eval_interval: int = 50
    eval_windows: int = 16
    checkpoint_interval: int = 100
    sequence_parallel: bool = False

    def __post_init__(self):
        for name in ("context", "batch_size", "steps", "eval_interval", "eval_windows", "checkpoint_interval"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be an int >= 0, got {self.warmup_steps!r}")
        for name, low, high in (("lr", 0, math.inf), ("min_lr_ratio", 0, 1), ("weight_decay", 0, math.inf),
                                ("grad_clip", 0, math.inf)):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not low <= value <= high:
                raise ValueError(f"{name} must be a number in [{low}, {high}], got {value!r}")
            if name in ("lr", "grad_clip") and not 0 < value < math.inf:
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        if self.minutes is not None and not 0 < self.minutes < math.inf:
            raise ValueError(f"minutes must be a number > 0, got {self.minutes!r}")
        if self.dtype not in AUTOCAST_DTYPES:
            raise ValueError(f"dtype must be one of {sorted(AUTOCAST_DTYPES)}, got {self.dtype!r}")

    def learning_rate(self, step: int) -> float:
        """The learning rate of step ``step`` (0-based)."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        progress = (step - self.warmup_steps) / max(1, self.steps - self.warmup_steps)
        cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * cosine)
