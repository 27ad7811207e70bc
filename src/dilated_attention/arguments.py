"""argparse types shared by the command-line commands."""

from __future__ import annotations

import argparse
import math
from typing import Optional

import torch

from .validation import SEED_LIMIT


def number(kind, low: float, inclusive: bool = True):
    """An argparse type: a finite ``kind`` (``int`` or ``float``) ``>= low`` (``> low``
    unless ``inclusive``)."""

    def parse(text: str):
        value = kind(text)
        if not math.isfinite(value) or not (value >= low if inclusive else value > low):
            what = "" if kind is int else "a number "
            raise argparse.ArgumentTypeError(f"must be {what}{'>=' if inclusive else '>'} {low}, got {text}")
        return value

    return parse


positive_int = number(int, 1)
positive_float = number(float, 0, inclusive=False)


def seed(text: str) -> int:
    """An argparse type: a seed, an int in ``[0, 2**63)`` (what every torch generator accepts)."""
    value = number(int, 0)(text)
    if value >= SEED_LIMIT:
        raise argparse.ArgumentTypeError(f"must be below 2**63, got {text}")
    return value


def device_type(name: Optional[str]) -> str:
    """The ``--device`` to run on: ``name``, or ``"cuda"`` if available else ``"cpu"``;
    a ``ValueError`` for ``"cuda"`` without a GPU."""
    if name is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda, but torch.cuda.is_available() is False: use --device cpu")
    return name
