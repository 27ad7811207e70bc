"""Draw which keys each query attends to, per head, as a PNG (needs matplotlib)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..reference import attention_weights_uniform, branch_offsets
from ..utils.plotting import pyplot, save


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
    head_offsets: str = "interleaved",
    is_causal: bool = False,
) -> list[str]:
    """Write the per-head ``(query, key)`` pattern to ``path`` and return the summary lines.

    Each panel is one head, with its colour bar; a cell's shade is the weight the key
    gets when all scores are equal (see :func:`caption`)."""
    plt = pyplot()
    weights = attention_weights_uniform(
        seq_len, num_heads, segment_lengths, dilation_rates, mode=mode, head_offsets=head_offsets, is_causal=is_causal
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
    title += ", contiguous head offsets" if head_offsets == "contiguous" and mode == "mixture" else ""
    save(fig, path, title, fontsize=10, caption=caption(mode, len(segment_lengths)))
    offsets = branch_offsets(num_heads, segment_lengths, dilation_rates, mode, head_offsets)
    return summarize_heads(weights, offsets)


def attended_cells(
    order: torch.Tensor,
    query: int,
    segment_length: int,
    dilation_rate: int,
    offsets: torch.Tensor,
    head: int | None = None,
) -> tuple[torch.Tensor, int | None]:
    """The row-major indices of the patches that the patch ``query`` (a row-major
    index) attends to in a branch ``(w, r)`` whose heads use ``offsets`` (``-1``: not
    in the branch), with the patches laid out in ``order``, and the head: ``head``, or
    if ``None`` the first head that keeps the query's row. Empty if that head does not."""
    position = int((order == query).nonzero())
    start = position // segment_length * segment_length
    row = (position - start) % dilation_rate
    if head is None:
        keeping = (offsets == row).nonzero()
        head = int(keeping[0]) if len(keeping) else None
    if head is None or int(offsets[head]) != row:
        return order.new_empty(0), head
    stop = min(start + segment_length, order.numel())
    return order[start + row : stop : dilation_rate], head


def grid_locality_table(height: int, width: int, segment_lengths: Sequence[int], orders: Sequence[str]) -> str:
    """Per order and segment length: the share of 4-neighbour patch pairs inside one
    segment and the mean bounding box of a segment, as a text table."""
    from ..nn.ordering import grid_order, locality

    lines = [
        f"{height} x {width} grid: neighbour pairs inside one segment, mean segment bounding box (rows x cols)",
        f"{'order':<10}" + "".join(f"{f'w={w}':>22}" for w in segment_lengths),
    ]
    for kind in orders:
        cells = []
        for w in segment_lengths:
            result = locality(grid_order(kind, height, width), height, width, w)
            cells.append(f"{result['neighbour_share']:6.1%} {result['box_rows']:5.1f} x {result['box_cols']:<5.1f}")
        lines.append(f"{kind:<10}" + "".join(f"{cell:>22}" for cell in cells))
    return "\n".join(lines)


def draw_grid_pattern(
    path: str,
    height: int,
    width: int,
    segment_lengths: Sequence[int],
    dilation_rates: Sequence[int],
    orders: Sequence[str],
    query: tuple[int, int],
    *,
    num_heads: int = 1,
    head: int | None = None,
    mode: str = "mixture",
    head_offsets: str = "interleaved",
) -> str:
    """Write, for the patch ``query`` ``(row, col)`` of a ``height x width`` image, the
    patches it attends to in each branch (columns) for each order (rows), with a last
    column counting the branches per patch; return the :func:`grid_locality_table`.
    ``head``: the head drawn; ``None``: in each branch, the first head that keeps the
    query's row (in ``mixture`` with ``num_heads >= r`` there always is one)."""
    from ..nn.ordering import grid_order

    plt = pyplot()
    offsets = branch_offsets(num_heads, segment_lengths, dilation_rates, mode, head_offsets)
    columns = len(segment_lengths) + 1
    scale = 2.6 * min(1.0, max(width / height, 0.5))
    fig, axes = plt.subplots(len(orders), columns, figsize=(scale * columns, 2.6 * len(orders) + 0.4), squeeze=False)
    index = query[0] * width + query[1]
    for row, kind in enumerate(orders):
        order = grid_order(kind, height, width)
        count = torch.zeros(height * width)
        for branch, (w, r) in enumerate(zip(segment_lengths, dilation_rates, strict=True)):
            image = torch.zeros(height * width)
            cells, shown = attended_cells(order, index, w, r, offsets[branch], head)
            image[cells] = 1.0
            count += image
            label = "no head keeps it" if shown is None else f"head {shown}: {len(cells)} patches"
            _grid_panel(axes[row][branch], image, height, width, query, f"{kind}: w={w}, r={r}\n{label}")
        _grid_panel(axes[row][-1], count, height, width, query, f"{kind}: all branches\n(shade: branches)")
    title = (
        f"patch (row {query[0]}, col {query[1]}) of a {height} x {width} grid, {num_heads} heads "
        f"({mode}, {head_offsets} offsets)"
    )
    save(fig, path, title, fontsize=10, caption="Shaded: the patches the query patch (red) attends to.")
    return grid_locality_table(height, width, segment_lengths, orders)


def _grid_panel(ax, values: torch.Tensor, height: int, width: int, query: tuple[int, int], title: str) -> None:
    shades = values.view(height, width).masked_fill(values.view(height, width) == 0, math.nan)
    ax.imshow(shades.numpy(), cmap="Blues", vmin=0, vmax=max(float(values.max()), 1.0), interpolation="nearest")
    ax.plot([query[1]], [query[0]], marker="s", color="red", markersize=3)
    ax.set_title(title, fontsize=8)
    ax.set_xticks([])
    ax.set_yticks([])
