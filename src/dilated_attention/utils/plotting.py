"""Matplotlib access shared by the pictures the command line draws (optional extra)."""

from __future__ import annotations

import os

from .extras import require
from .files import atomic_write


def pyplot():
    """``matplotlib.pyplot`` on the non-interactive Agg backend, or a clear
    :class:`dilated_attention.utils.extras.MissingExtra`."""
    require("plot", "drawing")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def log_log(axes_and_labels, xlabel: str, legend_size: int = 7) -> None:
    """Log-log axes (base 2 along x) with a grid, a legend and the given y labels:
    ``axes_and_labels`` is ``[(ax, ylabel), ...]``."""
    for ax, label in axes_and_labels:
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # an empty panel (memory not measured) has none
            ax.legend(fontsize=legend_size)


def save(fig, path: str, title: str, fontsize: int = 9, caption: str = "") -> None:
    """Title the figure, put ``caption`` (if any) under it, write it to ``path`` as
    PNG (atomically; its folder is made when the picture is ready) and release it."""
    plt = pyplot()
    try:
        fig.suptitle(title, fontsize=fontsize)
        fig.tight_layout()
        if caption:
            fig.text(0.5, 0, caption, ha="center", va="top", fontsize=fontsize - 1, wrap=True)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with atomic_write(path, binary=True) as f:
            fig.savefig(f, format="png", dpi=110, bbox_inches="tight")
    finally:
        plt.close(fig)
