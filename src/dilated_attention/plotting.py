"""Matplotlib access shared by the pictures the command line draws (optional extra)."""

from __future__ import annotations


def pyplot():
    """``matplotlib.pyplot`` on the non-interactive Agg backend, or a clear error."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise RuntimeError("drawing needs matplotlib: pip install 'dilated-attention[plot]'") from exc
    return plt


def save(fig, path: str, title: str, fontsize: int = 9) -> None:
    """Title the figure, write it to ``path`` as PNG and release it."""
    plt = pyplot()
    fig.suptitle(title, fontsize=fontsize)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
