"""How much memory a device has, and refusing sizes that cannot fit in it before any work."""

from __future__ import annotations

import os

import torch


def device_memory(device) -> int | None:
    """The bytes of memory of ``device`` (a GPU's own, else the machine's), or ``None``
    where the system does not say."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows) or no such name
        return None


def check_fits(nbytes: float, device, what: str, fix: str) -> None:
    """A ``ValueError`` saying ``fix`` where ``what``, ``nbytes`` bytes, exceeds the
    memory of ``device``: sizes that cannot fit are refused before any work."""
    memory = device_memory(device)
    if memory is not None and nbytes > memory:
        kind = torch.device(device).type
        where = "physical memory of this machine" if kind == "cpu" else f"memory of the {kind} device"
        size = f"{nbytes / 2**30:.3g} GiB, more than the {memory / 2**30:.3g} GiB"
        raise ValueError(f"{what} take {size} of {where}: {fix}")


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` says the memory ran out: torch's out-of-memory error, Python's
    ``MemoryError``, or a ``RuntimeError`` from a failed allocation of the CPU's."""
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    return any(text in str(exc) for text in ("can't allocate memory", "std::bad_alloc", "not enough memory"))


def first_line(exc: BaseException, most: int = 300) -> str:
    """The first non-empty line of ``exc``'s message (cut to ``most`` characters, with
    "..."), or its type's name where it has none: what an error says, in one line."""
    line = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
    return line if len(line) <= most else line[: most - 3] + "..."


class OutOfMemory(torch.OutOfMemoryError):
    """PyTorch's out-of-memory error with the library's advice as its message (what to
    change, and what became of the work): the command line prints it as it is."""
