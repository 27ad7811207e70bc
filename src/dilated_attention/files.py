"""Writing result files safely: whole files only, in folders never reused."""

from __future__ import annotations

import contextlib
import json
import os
import uuid
from typing import IO, Iterator


@contextlib.contextmanager
def atomic_write(path: str, binary: bool = False) -> Iterator[IO]:
    """Open a new temporary file beside ``path`` for writing; when the ``with`` block
    ends without error, replace ``path`` by it (``os.replace``), else delete it.

    A reader of ``path`` sees the old file or the new one, never part of one."""
    folder, name = os.path.split(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"cannot write {path}: the folder {folder} does not exist")
    temporary = os.path.join(folder, f".{name}.{uuid.uuid4().hex}.tmp")
    mode, encoding = ("xb", None) if binary else ("x", "utf-8")
    f = open(temporary, mode, encoding=encoding)
    try:
        with f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        os.remove(temporary)
        raise


def write_results(stem: str, payload: dict, table: str) -> None:
    """``stem.json`` (``payload``) and ``stem.txt`` (``table``), each written atomically."""
    with atomic_write(stem + ".json") as f:
        json.dump(payload, f, indent=1)
    with atomic_write(stem + ".txt") as f:
        f.write(table + "\n")


def fresh_folder(stem: str) -> str:
    """Create and return the folder ``stem``, or ``stem-2``, ``stem-3``, ... if it
    exists: a folder no earlier run wrote into."""
    path, number = stem, 1
    while True:
        try:
            os.makedirs(path)
            return path
        except FileExistsError:
            number += 1
            path = f"{stem}-{number}"
