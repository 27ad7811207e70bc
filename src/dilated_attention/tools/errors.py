"""How the command line ends on an error: the one line it prints and its exit status."""

from __future__ import annotations

import os
import select
import sys

from ..utils.extras import MissingExtra
from ..utils.memory import OutOfMemory, first_line, is_out_of_memory


def exit_status(exc: BaseException) -> int | None:
    """Print what the command line says of ``exc`` on stderr and return its exit
    status: 2 for a misuse (a bad setting, a missing extra, memory the sizes ask for),
    1 for a file or folder it cannot read or write, 130 for Ctrl-C, 141 where the
    reader of stdout went away (quietly); ``None`` for anything else, whose traceback
    is the message."""
    if isinstance(exc, (ValueError, TypeError, MissingExtra, OutOfMemory)):  # OutOfMemory: the library's advice
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if isinstance(exc, (RuntimeError, MemoryError)) and is_out_of_memory(exc):  # what the machine does not have
        print(f"error: out of memory ({first_line(exc)}): use smaller sizes (batch, context, model)", file=sys.stderr)
        return 2
    if isinstance(exc, OSError):  # a file or folder the command reads or writes, or the output's reader gone
        if isinstance(exc, BrokenPipeError) and _stdout_is_broken():  # `... | head`: stop quietly
            _discard_stdout()
            return 128 + 13  # as a process that SIGPIPE ended
        print(f"error: {describe(exc)}", file=sys.stderr)
        return 1
    if isinstance(exc, KeyboardInterrupt):
        print("\ninterrupted", file=sys.stderr)
        return 130
    return None


def describe(exc: BaseException) -> str:
    """``exc``'s message in one line; an ``OSError`` as ``path: reason (its type)``."""
    if not isinstance(exc, OSError):
        return str(exc)
    # os.replace(temporary, path) names the destination second
    path = exc.filename2 if exc.filename2 is not None else exc.filename
    where = f"{path}: " if path is not None else ""
    return f"{where}{exc.strerror or exc} ({type(exc).__name__})"


def _stdout_is_broken() -> bool:
    """Whether stdout is a pipe whose reader went away (the broken pipe was stdout's,
    not some other pipe of the command): its write end then polls as an error."""
    try:
        fd = sys.stdout.fileno()
        poller = select.poll()  # not on Windows, where no pipe is taken for stdout's
    except (AttributeError, OSError, ValueError):
        return False
    poller.register(fd, select.POLLOUT)
    return any(events & select.POLLERR for _, events in poller.poll(0))


def _discard_stdout() -> None:
    """Point stdout at ``os.devnull``, so that the interpreter's last flush at exit
    writes nowhere instead of failing on the broken pipe again (Python's advice for
    SIGPIPE)."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # not a file (a test's capture): nothing is flushed to a pipe
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)
