"""Matplotlib access shared by the pictures the command line draws (optional extra)."""

from __future__ import annotations

from .files import atomic_write


def pyplot():
    """``matplotlib.pyplot`` on the non-interactive Agg backend, or a clear error."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise RuntimeError("drawing needs matplotlib: pip install 'dilated-attention[plot]'") from exc
    return plt


def save(fig, path: str, title: str, fontsize: int = 9, caption: str = "") -> None:
    """Title the figure, put ``caption`` (if any) under it, write it to ``path`` as
    PNG (atomically) and release it."""
    plt = pyplot()
    fig.suptitle(title, fontsize=fontsize)
    fig.tight_layout()
    if caption:
        fig.text(0.5, 0, caption, ha="center", va="top", fontsize=fontsize - 1, wrap=True)
    with atomic_write(path, binary=True) as f:
        fig.savefig(f, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
