"""Optional dependencies: which of the package's extras provides what, and one clear
error, raised before anything is done, when a feature's extra is missing."""

from __future__ import annotations

import importlib

# extra -> the modules it installs that the library imports
EXTRAS = {
    "plot": ("matplotlib", "numpy"),
    "train": ("tqdm", "matplotlib", "numpy"),
    "hf": ("transformers",),
}


class MissingExtra(ImportError):
    """A feature needs an optional dependency that is not installed; the message says
    how to install it."""


def install_hint(extra: str, modules=None) -> str:
    """The commands that install ``extra`` (or just ``modules`` of it)."""
    names = " ".join(f"'{name}'" if ">" in name else name for name in modules or EXTRAS[extra])
    return (
        f'install it with `python3 -m pip install -e ".[{extra}]"` in a clone of dilated-attention, '
        f"or `python3 -m pip install {names}`"
    )


def require(extra: str, feature: str) -> None:
    """Import the modules of ``extra``; a :class:`MissingExtra` naming ``feature`` and
    how to install the extra if any is missing."""
    missing = []
    for module in EXTRAS[extra]:
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(module)
    if missing:
        raise MissingExtra(
            f"{feature} needs {' and '.join(missing)} (the '{extra}' extra): {install_hint(extra, missing)}"
        )
