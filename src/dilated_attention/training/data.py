"""Training text as bytes: the default corpus, a user's files, the split, the batches.

Tokens are bytes (vocabulary 256), so no tokenizer is needed. The default corpus is
the Python standard library's own ``.py`` sources, read from the running
interpreter (about 11 MB on CPython 3.11), so nothing is downloaded.
"""

from __future__ import annotations

import codecs
import hashlib
import os
import sysconfig
from dataclasses import dataclass
from typing import Literal, overload

import torch

from ..ops.validation import type_name
from . import tasks

# Folders of the standard library left out of the default corpus: third-party
# packages, and the test suites (large, and full of deliberately odd text).
_SKIPPED_FOLDERS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"}
# The split: the byte stream is cut into blocks of this many bytes; every
# VALIDATION_EVERY-th block is validation text, the others training text.
BLOCK_BYTES = 32 * 1024
VALIDATION_EVERY = 20


@dataclass
class Corpus:
    """``train``, ``validation``: uint8 ``(bytes,)``; ``source``: where the text came
    from; ``fingerprint``: its size and SHA-256, which a run's checkpoints record (a
    resumed run says so where its text changed)."""

    train: torch.Tensor
    validation: torch.Tensor
    source: str
    files: int
    fingerprint: dict


def _files_under(folder: str, suffix: str = "", skipped=frozenset()) -> list[str]:
    """Every regular file under ``folder`` (or link to one), sorted; hidden ones,
    ``skipped`` folders and anything else (a FIFO, a device: reading one could wait
    forever) left out."""
    found = []
    for parent, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in skipped)
        named = [os.path.join(parent, f) for f in sorted(files) if f.endswith(suffix) and not f.startswith(".")]
        found += [path for path in named if os.path.isfile(path)]
    return found


# Bytes read and checked at a time: a binary file given by mistake is refused at its
# first bad byte, not once all of it is in memory.
READ_BYTES = 2**24


@overload
def _read_utf8(path: str, strict: Literal[True], in_folder: bool = False) -> bytes: ...
@overload
def _read_utf8(path: str, strict: Literal[False], in_folder: bool = False) -> bytes | None: ...


def _read_utf8(path: str, strict: bool, in_folder: bool = False) -> bytes | None:
    """The bytes of ``path``, checked to be UTF-8 text part by part; where they are not,
    or the file cannot be read, ``None`` unless ``strict`` (then a ``ValueError``, whose
    fix includes moving the file away when it is one of a folder's, ``in_folder``)."""
    away = " or move it out of the data folder" if in_folder else ""
    decoder = codecs.getincrementaldecoder("utf-8")()
    parts: list[bytes] = []
    done = 0
    try:
        with open(path, "rb") as f:
            while True:
                part = f.read(READ_BYTES)
                done += len(part)
                try:
                    decoder.decode(part, final=not part)
                except UnicodeDecodeError as exc:  # exc.object: the bytes held back before part, and part
                    if not strict:
                        return None
                    raise ValueError(
                        f"{path} is not UTF-8 text (byte {done - len(exc.object) + exc.start}: "
                        f"{exc.object[exc.start : exc.start + 1]!r}): the text must be UTF-8: convert it "
                        f"(e.g. iconv -t UTF-8){away}"
                    ) from None
                if not part:
                    return b"".join(parts)
                parts.append(part)
    except OSError as exc:
        if not strict:
            return None
        raise ValueError(f"cannot read {path} ({exc.strerror}): fix it{away}") from None


def load_corpus(path: str | None = None) -> Corpus:
    """The text of ``path`` (a UTF-8 file, or a folder: all its files, recursively, in
    sorted order), or by default the standard library's ``.py`` sources (files that
    are not UTF-8 left out), split into training and validation bytes."""
    if path is None:
        root = sysconfig.get_paths()["stdlib"]
        files = _files_under(root, ".py", _SKIPPED_FOLDERS)
        parts = [p for p in (_read_utf8(f, strict=False) for f in files) if p]
        source = f"the Python standard library's .py files under {root}"
    else:
        if not isinstance(path, (str, os.PathLike)):  # an int or bool would be read as a file descriptor
            raise TypeError(f"path must be a file's or folder's path, or None, got {type_name(path)}")
        if not os.path.exists(path):
            raise ValueError(f"data (--data) {path}: no such file or folder")
        files = _files_under(path) if os.path.isdir(path) else [path]
        if not files:
            raise ValueError(
                f"data (--data) {path}: the folder holds no files to read (hidden files, FIFOs and devices are skipped)"
            )
        parts = [_read_utf8(f, strict=True, in_folder=os.path.isdir(path)) for f in files]
        source = path
    text = b"\n".join(parts)
    if not text.strip():
        raise ValueError(f"{source} holds no text: give a file or folder with UTF-8 text in it")
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    train, validation = split(data)
    fingerprint = {"bytes": len(text), "sha256": hashlib.sha256(text).hexdigest()}
    return Corpus(train, validation, source, len(files), fingerprint)


def split(data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks of ``BLOCK_BYTES`` (fewer for short texts, so that validation gets one
    block in ``VALIDATION_EVERY``): every ``VALIDATION_EVERY``-th is validation."""
    block = max(1, min(BLOCK_BYTES, len(data) // VALIDATION_EVERY))
    index = torch.arange(len(data)) // block
    is_validation = index % VALIDATION_EVERY == VALIDATION_EVERY - 1
    return data[~is_validation], data[is_validation]


def check_long_enough(corpus: Corpus, context: int) -> None:
    for name, part in (("training", corpus.train), ("validation", corpus.validation)):
        if len(part) < context + 1:
            raise ValueError(
                f"the {name} split of {corpus.source} has {len(part)} bytes, fewer than context + 1 = "
                f"{context + 1}: use more text or a shorter --context"
            )


class Batches:
    """Random windows of ``context + 1`` bytes from ``data``: ``next()`` gives inputs
    and next-byte targets, int64 ``(batch_size, context)`` each. With ``task``, about
    ``task_fraction`` of the rows are examples of that retrieval task instead
    (:func:`dilated_attention.training.tasks.mix_into`; a passkey hides in ``data``).
    The batches depend only on ``seed`` and on how many came before, which
    ``state_dict`` keeps."""

    def __init__(
        self,
        data: torch.Tensor,
        context: int,
        batch_size: int,
        seed: int,
        task: str | None = None,
        task_fraction: float = 0.0,
    ):
        self.data, self.context, self.batch_size = data, context, batch_size
        self.task, self.task_fraction = task, task_fraction
        self.generator = torch.Generator().manual_seed(seed)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, len(self.data) - self.context, (self.batch_size,), generator=self.generator)
        inputs, targets = windows(self.data, starts, self.context)
        if self.task is not None:
            tasks.mix_into(inputs, targets, self.task, self.task_fraction, self.generator, filler=self.data)
        return inputs, targets

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])


def evaluation_count(data: torch.Tensor, context: int, count: int) -> int:
    """How many windows of ``context + 1`` bytes :func:`evaluation_starts` takes for
    ``count``: at most the ``len(data) - context`` different ones ``data`` holds."""
    return max(1, min(count, len(data) - context))


def evaluation_starts(data: torch.Tensor, context: int, count: int) -> torch.Tensor:
    """The starts of ``count`` windows spread evenly over ``data`` (always the same
    ones; never more than ``data`` holds: :func:`evaluation_count`), int64 ``(n,)``:
    :func:`windows` gives their bytes, a batch at a time."""
    return torch.linspace(0, len(data) - context - 1, evaluation_count(data, context, count)).long()


def windows(data: torch.Tensor, starts: torch.Tensor, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``context + 1`` bytes from each of ``starts``: inputs and next-byte targets,
    int64 ``(len(starts), context)`` each."""
    rows = data[starts[:, None] + torch.arange(context + 1)].long()
    return rows[:, :-1], rows[:, 1:]
