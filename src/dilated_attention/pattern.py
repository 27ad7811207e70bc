"""Draw which keys each query attends to, per head, as a PNG (needs matplotlib)."""

from __future__ import annotations

import math
from typing import Sequence

import torch

from .plotting import pyplot, save
from .reference import attention_weights_uniform, branch_offsets


def summarize_heads(weights: torch.Tensor, offsets: list[torch.Tensor]) -> list[str]:
    """One line per head: its offset in each branch and how many keys its queries see.

    ``weights``: ``(H, N, N)`` from :func:`attention_weights_uniform`."""
    lines = []
    for head in range(weights.shape[0]):
        keys = (weights[head] > 0).sum(-1)
        branch_offs = ["-" if int(o[head]) < 0 else str(int(o[head])) for o in offsets]
        lines.append(
            f"head {head}: offsets per branch [{', '.join(branch_offs)}], keys per query "
            f"min {int(keys.min())} mean {keys.double().mean().item():.1f} max {int(keys.max())}, "
            f"queries attending to nothing: {int((keys == 0).sum())}"
        )
    return lines


def caption(mode: str, branches: int) -> str:
    """What the shades of a pattern drawn in ``mode`` with ``branches`` branches mean."""
    share = (
        "a key seen by two branches counts twice"
        if mode == "mixture"
        else f"each head has only its group's branch, its weights scaled by 1/{branches}"
    )
    return (
        "Shade: the weight a key gets in the query's softmax when all scores are equal\n"
        f"({mode}: {share}). White: not attended."
    )


def draw_pattern(
    path: str,
    seq_len: int,
    num_heads: int,
    segment_lengths: Sequence[int],
    dilation_rates: Sequence[int],
    *,
    mode: str = "mixture",
    is_causal: bool = False,
) -> list[str]:
    """Write the per-head ``(query, key)`` pattern to ``path`` and return the summary lines.

    Each panel is one head, with its colour bar; a cell's shade is the weight the key
    gets when all scores are equal (see :func:`caption`)."""
    plt = pyplot()
    weights = attention_weights_uniform(
        seq_len, num_heads, segment_lengths, dilation_rates, mode=mode, is_causal=is_causal
    )
    cols = min(num_heads, 4)
    rows = math.ceil(num_heads / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.8 * cols, 3.2 * rows + 0.6), squeeze=False)
    for head, ax in enumerate(axes.flat):
        if head >= num_heads:
            ax.axis("off")
            continue
        shades = weights[head].masked_fill(weights[head] == 0, math.nan)  # NaN: drawn white
        image = ax.imshow(shades.numpy(), cmap="Blues", vmin=0, interpolation="nearest")
        fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04).ax.tick_params(labelsize=7)
        ax.set_title(f"head {head}", fontsize=10)
        ax.set_xlabel("key position", fontsize=8)
        ax.set_ylabel("query position", fontsize=8)
        ax.tick_params(labelsize=7)
    title = f"{mode}: segment_lengths={list(segment_lengths)}, dilation_rates={list(dilation_rates)}"
    title += ", causal" if is_causal else ""
    save(fig, path, title, fontsize=10, caption=caption(mode, len(segment_lengths)))
    offsets = branch_offsets(num_heads, segment_lengths, dilation_rates, mode)
    return summarize_heads(weights, offsets)
