"""Orders in which the patches of a 2-D grid are laid into a sequence.

Dilated attention only sees keys inside a segment of consecutive tokens, so the
order of the patches decides which patches share a segment. For a grid of
``height x width`` patches, numbered row by row (``index = row * width + col``,
the order of ``x.flatten(2).transpose(1, 2)`` on a patch embedding), an *order* is
a permutation ``order`` (a 1-D int64 tensor of ``height * width`` entries):
``order[i]`` is the row-major index of the patch that comes ``i``-th.

- ``row_major``: row by row (LongViT's order): a segment of ``w < width`` patches
  is a thin strip of one row.
- ``zorder``: the Morton (Z) order: patches sorted by their row and column bits
  interleaved; on a grid whose sides are not powers of two, the cells outside the
  grid are skipped. Consecutive patches are close but not always adjacent.
- ``hilbert``: a generalised Hilbert curve ("gilbert"), for any ``height x width``:
  on a power-of-two square it is the Hilbert curve; on every grid consecutive
  patches are 4-neighbours. It starts at the top-left corner and runs along the
  longer side, or along the even side when one side is odd and the other even
  (then both ends allow unit steps all the way).

:func:`apply` and :func:`invert` move ``(B, N, ...)`` tensors between row-major order
and an order, with ``extra_tokens`` leading tokens (a CLS token) kept first;
:func:`shard` cuts the ordered sequence into the contiguous pieces of the ranks of a
process group. Orders are computed once per grid shape, vectorised (a 4096 x 4096
grid in well under a second on a CPU), and cached. A grid has at most
:data:`MAX_PATCHES` patches.
"""

from __future__ import annotations

import functools

import torch

from ..ops import validation
from ..ops.intmath import ceil_div

ORDERS = ("row_major", "zorder", "hilbert")

# The most patches a grid may have: 8192 x 8192, a slide of 131072 x 131072 pixels
# in 16-pixel patches (LongViT's gigapixel images, 32768 pixels square in 32-pixel
# patches, are 1024 x 1024). An order takes 8 bytes a patch (512 MiB here) and
# building one about 5 times that.
MAX_PATCHES = 2**26


def grid_order(kind: str, height: int, width: int) -> torch.Tensor:
    """The permutation ``(height * width,)`` int64 (CPU) of order ``kind`` (one of
    :data:`ORDERS`) for a ``height x width`` grid of at most :data:`MAX_PATCHES`
    (``2**26``) patches. Cached: do not modify it."""
    return grid_permutations(kind, height, width)[0]


def grid_permutations(kind: str, height: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(order, inverse)``: :func:`grid_order` and its inverse (:func:`positions`),
    made once per grid and kept only as real CPU tensors: placeholders of a tracer
    (which ``torch.export`` runs this under) and tensors made under a default device
    (``with torch.device("meta")``) are not kept for later calls."""
    kind = validation.check_choice(kind, "kind", ORDERS)
    height, width = _check_grid(height, width)
    made = _made_permutations(kind, height, width)
    if type(made[0]) is not torch.Tensor or made[0].device.type != "cpu":  # a tracer's placeholder, or elsewhere
        _made_permutations.cache_clear()
    return made


def _check_grid(height: int, width: int) -> tuple[int, int]:
    """``height, width``: positive ints with a product of at most :data:`MAX_PATCHES`."""
    height, width = validation.check_positive_int(height, "height"), validation.check_positive_int(width, "width")
    if height * width > MAX_PATCHES:
        raise ValueError(
            f"height * width must be at most 2**26 = {MAX_PATCHES} patches (8192 x 8192; an order takes 8 bytes "
            f"a patch), got {height} x {width} = {height * width}: use larger patches"
        )
    return height, width


@functools.lru_cache(maxsize=16)
def _made_permutations(kind: str, height: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    order = {"row_major": _row_major, "zorder": _zorder, "hilbert": _hilbert}[kind](height, width)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel())
    return order, inverse


def _index(order: torch.Tensor, extra_tokens: int, device) -> torch.Tensor:
    """``order`` shifted past ``extra_tokens`` leading tokens, which come first."""
    extra = validation.check_non_negative_int(extra_tokens, "extra_tokens")
    return torch.cat([torch.arange(extra, device=order.device), order + extra]).to(device)


def _check_order(order) -> torch.Tensor:
    """``order``'s inverse permutation (see :func:`positions`), if ``order`` is a 1-D
    int64 tensor holding each of ``0 .. N-1`` once."""
    if not isinstance(order, torch.Tensor) or order.dim() != 1 or order.dtype != torch.int64:
        raise TypeError(f"order must be a 1-D int64 tensor, as grid_order returns, got {_describe(order)}")
    return positions(order)


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dim()}-D {value.dtype} tensor"
    return validation.type_name(value)


def _check_length(x, patches: int, extra_tokens: int, dim: int, name: str) -> None:
    """``x`` (called ``name``): a tensor of ``extra_tokens + patches`` tokens along ``dim``."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {validation.type_name(x)}")
    if x.dim() <= dim or x.shape[dim] != extra_tokens + patches:
        leading = x.shape[dim] - patches if x.dim() > dim else -1
        hint = (
            f": for {leading} leading tokens before the patches (a CLS token, ...) pass extra_tokens={leading}"
            if leading >= 0
            else ""
        )
        raise ValueError(
            f"{name} must have extra_tokens + height * width = {extra_tokens} + {patches} tokens along dim "
            f"{dim}, got shape {tuple(x.shape)}{hint}"
        )


def permute(x: torch.Tensor, order: torch.Tensor, extra_tokens: int = 0, dim: int = 1, *, name: str = "x"):
    """:func:`apply` for an ``order`` known to be a permutation (:func:`grid_permutations`
    makes them): only ``x``'s length is checked. :func:`invert` is ``permute`` by the
    inverse permutation."""
    _check_length(x, order.numel(), extra_tokens, dim, name)
    return x.index_select(dim, _index(order, extra_tokens, x.device))


def apply(
    x: torch.Tensor, order: torch.Tensor, extra_tokens: int = 0, dim: int = 1, *, name: str = "x"
) -> torch.Tensor:
    """``x`` ``(B, extra_tokens + H*W, ...)`` with its patches in row-major order ->
    the same tokens in ``order`` (the extra tokens stay first): a copy. ``name``: what
    messages call ``x``."""
    _check_order(order)
    return permute(x, order, extra_tokens, dim, name=name)


def invert(y: torch.Tensor, order: torch.Tensor, extra_tokens: int = 0, dim: int = 1) -> torch.Tensor:
    """The inverse of :func:`apply`: ``y`` in ``order`` -> row-major order."""
    return permute(y, _check_order(order), extra_tokens, dim, name="y")


def positions(order: torch.Tensor) -> torch.Tensor:
    """The inverse permutation: the place in the sequence of each patch (row-major).
    A ``ValueError`` if ``order`` is not a permutation of ``0 .. N-1`` (checked in O(N))."""
    size = order.numel()
    low, high = (int(value) for value in torch.aminmax(order)) if size else (0, -1)
    inverse = torch.full_like(order, -1)
    if low >= 0 and high < size:
        inverse[order] = torch.arange(size, device=order.device)
    if size and int(inverse.min()) < 0:  # a value out of range, or one repeated (so another missing)
        raise ValueError(
            f"order must be a permutation of 0 .. {size - 1} (each patch once), as grid_order returns, got "
            f"{size} values from {low} to {high}{', some repeated' if low >= 0 and high < size else ''}"
        )
    return inverse


def shard(
    x: torch.Tensor, order: torch.Tensor, rank: int, world_size: int, extra_tokens: int = 0, dim: int = 1
) -> torch.Tensor:
    """Rank ``rank``'s contiguous piece of ``apply(x, order, extra_tokens)`` when the
    ordered sequence is cut into ``world_size`` pieces (as ``torch.tensor_split``
    cuts it: the first ``N % world_size`` pieces one token longer), without forming
    the rest: what each rank of a ``process_group`` passes to the attention."""
    _check_order(order)
    _check_length(x, order.numel(), extra_tokens, dim, "x")
    world_size = validation.check_positive_int(world_size, "world_size")
    rank = validation.check_int(rank, "rank", 0, world_size)
    piece = torch.tensor_split(_index(order, extra_tokens, order.device), world_size)[rank]
    return x.index_select(dim, piece.to(x.device))


def locality(order: torch.Tensor, height: int, width: int, segment_length: int) -> dict:
    """How compact the segments of ``segment_length`` consecutive tokens of ``order``
    are on the ``height x width`` grid: ``neighbour_share``, the fraction of pairs of
    4-neighbour patches that fall in one segment; ``box_rows`` and ``box_cols``, the
    mean height and width of a segment's bounding box (in patches)."""
    height, width = _check_grid(height, width)
    segment_length = validation.check_positive_int(segment_length, "segment_length")
    inverse = _check_order(order)
    if order.numel() != height * width:
        raise ValueError(
            f"order must have height * width = {height} x {width} = {height * width} entries, got {order.numel()}: "
            "pass the height and width of the grid it orders"
        )
    segment = (inverse // segment_length).view(height, width)
    same = [segment[:, 1:] == segment[:, :-1], segment[1:] == segment[:-1]]
    pairs = sum(t.numel() for t in same)
    count = ceil_div(order.numel(), segment_length)
    ids = torch.arange(order.numel()) // segment_length  # the segment of each token
    boxes = []
    for coordinate in (order // width, order % width):
        low = torch.full((count,), height * width).scatter_reduce(0, ids, coordinate, "amin")
        high = torch.full((count,), -1).scatter_reduce(0, ids, coordinate, "amax")
        boxes.append(float((high - low + 1).double().mean()))
    return {
        "neighbour_share": sum(int(t.sum()) for t in same) / pairs if pairs else 1.0,
        "box_rows": boxes[0],
        "box_cols": boxes[1],
    }


def _row_major(height: int, width: int) -> torch.Tensor:
    return torch.arange(height * width)


def _zorder(height: int, width: int) -> torch.Tensor:
    """The Z curve of the power-of-two square around the grid, without the cells
    outside it: each square's walk is its four quadrants' walks (top left, top right,
    bottom left, bottom right) one after the other, so it is built, like
    :func:`_hilbert`, once per distinct (square, clipped part) as row-major offsets."""
    walks: dict[tuple[int, int, int], torch.Tensor] = {}

    def walk(side: int, rows: int, cols: int) -> torch.Tensor:
        """Offsets from its corner of the first ``rows x cols`` cells of a square of ``side``."""
        key = (side, rows, cols)
        if key not in walks:
            if side == 1:
                walks[key] = torch.zeros(1, dtype=torch.int64)
            else:
                half = side // 2
                quadrants = [(r, c) for r in (0, half) for c in (0, half) if r < rows and c < cols]
                walks[key] = torch.cat(
                    [walk(half, min(half, rows - r), min(half, cols - c)) + (r * width + c) for r, c in quadrants]
                )
        return walks[key]

    return walk(1 << max(height - 1, width - 1).bit_length(), height, width)


def _hilbert(height: int, width: int) -> torch.Tensor:
    """The generalised Hilbert curve ("gilbert"): a rectangle is cut in two halves
    along its main axis when it is much longer than wide, else into three parts (a
    bottom part turned a quarter, the top part, a bottom part turned back), the cuts
    placed so that the parts have even sides where possible; a rectangle one cell
    thick is walked straight. The walk of a rectangle depends only on its axes, so
    it is built once per distinct ``(ax, ay, bx, by)`` as row-major index offsets
    from its corner (``dy * width + dx``, linear in the step) and placed by adding
    the corner's index: a few hundred tensor concatenations for any grid."""
    along_width = width >= height
    if (width + height) % 2 and (width if along_width else height) % 2:
        along_width = not along_width  # run along the even side: both ends then allow unit steps
    walks: dict[tuple[int, int, int, int], torch.Tensor] = {}

    def walk(ax: int, ay: int, bx: int, by: int) -> torch.Tensor:
        """Offsets of the cells of the rectangle with main axis ``(ax, ay)`` and other
        axis ``(bx, by)`` from its corner, in curve order."""
        key = (ax, ay, bx, by)
        if key in walks:
            return walks[key]
        w, h = abs(ax + ay), abs(bx + by)
        dax, day, dbx, dby = _sign(ax), _sign(ay), _sign(bx), _sign(by)
        if h == 1 or w == 1:  # one cell thick: straight along its length
            step = day * width + dax if h == 1 else dby * width + dbx
            walks[key] = torch.arange(max(w, h), dtype=torch.int64) * step
            return walks[key]
        ax2, ay2, bx2, by2 = ax // 2, ay // 2, bx // 2, by // 2
        if 2 * w > 3 * h:  # much longer than wide: two halves
            if abs(ax2 + ay2) % 2 and w > 2:  # prefer even steps
                ax2, ay2 = ax2 + dax, ay2 + day
            parts = [((0, 0), (ax2, ay2, bx, by)), ((ax2, ay2), (ax - ax2, ay - ay2, bx, by))]
        else:  # up along the other axis, across, back down
            if abs(bx2 + by2) % 2 and h > 2:
                bx2, by2 = bx2 + dbx, by2 + dby
            parts = [
                ((0, 0), (bx2, by2, ax2, ay2)),
                ((bx2, by2), (ax, ay, bx - bx2, by - by2)),
                (((ax - dax) + (bx2 - dbx), (ay - day) + (by2 - dby)), (-bx2, -by2, -(ax - ax2), -(ay - ay2))),
            ]
        walks[key] = torch.cat([walk(*axes) + (dy * width + dx) for (dx, dy), axes in parts])
        return walks[key]

    return walk(width, 0, 0, height) if along_width else walk(0, height, width, 0)


def _sign(value: int) -> int:
    return (value > 0) - (value < 0)
