"""Writing result files safely: whole files only, in folders never reused."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from collections.abc import Iterator
from typing import IO, NoReturn

# The suffix of atomic_write's temporary files (``.NAME.<random hex>.tmp``).
TEMPORARY_SUFFIX = ".tmp"


def temporary_path(path: str) -> str:
    """A new name beside ``path`` for a file that becomes ``path`` once written whole:
    ``.NAME.<random hex>.tmp``, with ``NAME`` cut short where the whole would pass the
    file system's limit on a name (a ``path`` that fits must not fail for its temporary's)."""
    folder, name = os.path.split(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"cannot write {path}: the folder {folder} does not exist")
    tail = f".{uuid.uuid4().hex}{TEMPORARY_SUFFIX}"
    room = name_max(folder) - len(os.fsencode(tail)) - 1
    while name and len(os.fsencode(name)) > room:  # (a limit below the tail's leaves no name: the system says)
        name = name[:-1]
    return os.path.join(folder, f".{name}{tail}")


def name_max(folder: str) -> int:
    """The longest file name, in bytes, that the file system of ``folder`` (or of its
    nearest existing parent) takes; 255 where it does not say (or says no limit, -1)."""
    try:
        longest = os.pathconf(_nearest_existing(folder), "PC_NAME_MAX")
    except (OSError, ValueError):
        return 255
    return longest if longest > 0 else 255


@contextlib.contextmanager
def atomic_write(path: str, binary: bool = False) -> Iterator[IO]:
    """Open a new temporary file beside ``path`` for writing; when the ``with`` block
    ends without error, replace ``path`` by it (``os.replace``), else delete it.

    A reader of ``path`` sees the old file or the new one, never part of one. A write
    of it that fails (a full disk, a refused rename) raises the system's error about
    ``path``; the block's own errors pass as they are, but those naming the temporary."""
    temporary = temporary_path(path)
    mode, encoding = ("xb", None) if binary else ("x", "utf-8")
    try:
        f = open(temporary, mode, encoding=encoding)  # noqa: SIM115 - opened before the try: a failed open removes nothing
    except OSError as exc:
        _raise_about(exc, path)
    in_body = True  # the caller's block runs (its errors may be other files')
    try:
        with f:
            yield f
            in_body = False
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException as exc:
        os.remove(temporary)
        if isinstance(exc, OSError) and (exc.filename == temporary or (exc.filename is None and not in_body)):
            _raise_about(exc, path)
        raise


def _raise_about(exc: OSError, path: str) -> NoReturn:
    """Raise ``exc``, a failed write of the file that becomes ``path``, as the system's
    error about ``path`` (the name the caller gave, not its temporary's). As it is where
    that would lose something: no error number, a class of its own (not Python's, which
    the number picks again)."""
    if exc.errno is None or type(exc).__module__ != "builtins":
        raise exc
    raise OSError(exc.errno, exc.strerror, path) from exc  # the class of the number: PermissionError, ...


def link_atomically(source: str, path: str) -> None:
    """Make ``path`` name the file ``source`` names (a hard link; a copy where the file
    system has none), replacing what ``path`` named in one step."""
    temporary = temporary_path(path)
    try:
        os.link(source, temporary)
    except OSError:
        with atomic_write(path, binary=True) as f, open(source, "rb") as original:
            shutil.copyfileobj(original, f)
        return
    try:
        os.replace(temporary, path)
    except OSError as exc:
        _raise_about(exc, path)
    finally:
        # Where ``path`` already names the file (a kill between the link and the next
        # write leaves two names for it), rename does nothing (POSIX) and leaves the
        # temporary name: remove it, as after a failed replace.
        with contextlib.suppress(FileNotFoundError):
            os.remove(temporary)


def check_output_file(path: str, option: str, example: str | None = None) -> None:
    """A ``ValueError`` naming ``option`` unless ``path`` can be written as a file: a
    new name or a regular file's (written anew, atomically: a link is replaced, not
    followed), in a folder that exists or can be created and is writable. For checks
    before any work is done. ``example``: a file name to suggest inside a folder given
    as ``path`` (``None``: the name is the program's, so the folder is in its way)."""
    if not path or path.endswith(("/", os.sep)):
        raise ValueError(f"{option} must name a file, got {path!r}")
    if os.path.isdir(path):
        fix = f"name a file, such as {os.path.join(path, example)}" if example else "move that folder away"
        raise ValueError(f"{option} {path} is a folder: {fix}")
    if os.path.lexists(path) and not (os.path.isfile(path) or os.path.islink(path)):
        raise ValueError(f"{option} {path} is not a regular file (a device or a pipe): name a file")
    folder, name = os.path.split(os.path.abspath(path))
    longest = name_max(folder)
    if len(os.fsencode(name)) > longest:
        raise ValueError(
            f"{option}: the file name {name!r} is {len(os.fsencode(name))} bytes, longer than the file system "
            f"takes ({longest}): pick a shorter name"
        )
    _check_writable(folder, f"{option} {path}")


def check_output_folder(path: str, option: str) -> None:
    """A ``ValueError`` naming ``option`` unless ``path`` is a folder that exists or can
    be created, and is writable. For checks before any work is done."""
    if not path:
        raise ValueError(f"{option} must name a folder, got an empty string")
    _check_writable(path, f"{option} {path}")


def _nearest_existing(path: str) -> str:
    """``path``, or the nearest of its parents that exists (through links, as the system
    resolves ``link/..``)."""
    existing = os.path.realpath(path)
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    return existing


def _check_writable(folder: str, what: str) -> None:
    """The nearest existing one of ``folder`` and its parents must be a writable folder
    (then ``folder`` can be created and written into); else a ``ValueError``."""
    existing = _nearest_existing(folder)
    if not os.path.isdir(existing):
        raise ValueError(f"{what}: {existing} is not a folder: pick another path")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(
            f"{what}: {existing} cannot be written into (no permission, or a read-only file system): "
            "pick a writable folder"
        )


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
