"""The device a command or a training function runs on, checked."""

from __future__ import annotations

import torch


def device_type(name, argument: str = "--device") -> str:
    """The device to run on: ``name`` (``"cpu"``, ``"cuda"``, ``"cuda:1"`` or such a
    ``torch.device``) as a string, or ``"cuda"`` if available else ``"cpu"`` for
    ``None``; a ``TypeError`` or ``ValueError`` naming ``argument`` (an option, or a
    Python argument) for anything else, and for CUDA without a GPU."""
    if name is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    option = argument.startswith("--")
    if not isinstance(name, (str, torch.device)):
        raise TypeError(f"{argument} must be 'cpu', 'cuda' or a torch.device, got {type(name).__name__}")
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(f"{argument} must be cpu or cuda (cuda:N for one GPU of several), got {str(name)!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        given, fix = (
            (f"{argument} {name}", f"{argument} cpu") if option else (f"{argument}={str(name)!r}", f"{argument}='cpu'")
        )
        raise ValueError(f"{given}, but torch.cuda.is_available() is False: use {fix}")
    return str(device)
