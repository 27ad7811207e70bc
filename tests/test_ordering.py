"""Patch orders on 2-D grids: exact permutations, the Hilbert curve where one is
defined, adjacency and locality on every grid, and moving tensors in and out."""

import math
import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dilated_attention.nn.ordering import MAX_PATCHES, ORDERS, apply, grid_order, invert, locality, shard

grids = st.tuples(st.integers(1, 70), st.integers(1, 70))


def cells(order, width):
    """``(row, col)`` of each token, ``(N, 2)``."""
    return torch.stack([order // width, order % width], 1)


def symmetries(points, side):
    """The 8 images of ``(row, col)`` points under the symmetries of a square of ``side``."""
    r, c = points.unbind(1)
    last = side - 1
    for a, b in ((r, c), (c, r)):
        for fa in (False, True):
            for fb in (False, True):
                yield torch.stack([last - a if fa else a, last - b if fb else b], 1)


@pytest.mark.parametrize("side", [2, 4, 8, 16, 32, 64])
def test_hilbert_on_power_of_two_squares_is_the_hilbert_curve(side):
    """Against an independent construction (the ``hilbertcurve`` package), up to a
    symmetry of the square: the same path, step for step."""
    hilbertcurve = pytest.importorskip("hilbertcurve.hilbertcurve")
    curve = hilbertcurve.HilbertCurve(int(math.log2(side)), 2)
    oracle = torch.tensor(curve.points_from_distances(list(range(side * side))))
    ours = cells(grid_order("hilbert", side, side), side)
    assert any(torch.equal(image, oracle) for image in symmetries(ours, side))


def test_zorder_interleaves_the_row_and_column_bits():
    """Against the definition: patches sorted by their Morton code, on grids whose
    sides are not powers of two."""
    for height, width in ((5, 7), (13, 32), (1, 9), (40, 3)):
        rows, cols = cells(torch.arange(height * width), width).unbind(1)
        codes = sum(((rows >> b) & 1) << (2 * b + 1) | ((cols >> b) & 1) << (2 * b) for b in range(7))
        assert torch.equal(grid_order("zorder", height, width), codes.argsort())


@given(grids, st.sampled_from(ORDERS))
def test_every_order_is_a_permutation(grid, kind):
    height, width = grid
    order = grid_order(kind, height, width)
    assert order.dtype == torch.int64 and torch.equal(order.sort().values, torch.arange(height * width))


@given(grids)
def test_hilbert_steps_to_a_neighbour_on_any_grid(grid):
    height, width = grid
    points = cells(grid_order("hilbert", height, width), width)
    assert points[0].tolist() == [0, 0]
    assert bool(((points[1:] - points[:-1]).abs().sum(1) == 1).all())


@given(st.integers(8, 90), st.integers(8, 90), st.sampled_from([16, 64]))
def test_curves_keep_segments_compact(height, width, segment):
    """On grids at least twice the segment's side wide and high: most neighbour pairs
    share a segment, and a segment's bounding box is about a square of its size;
    row-major segments are strips a row or two high."""
    side = math.isqrt(segment)
    if min(height, width) < 2 * side:
        return
    for kind, least_share in (("hilbert", 0.65 if segment == 16 else 0.8), ("zorder", 0.65)):
        result = locality(grid_order(kind, height, width), height, width, segment)
        assert result["neighbour_share"] >= least_share
        assert max(result["box_rows"], result["box_cols"]) <= 2 * side
    strips = locality(grid_order("row_major", height, width), height, width, segment)
    assert strips["box_rows"] <= -(-segment // width) + 1


def test_locality_on_a_64_grid_matches_the_counts():
    """48% / 76% of neighbour pairs within segments of 16, 50% / 89% within 64."""
    shares = {
        kind: [locality(grid_order(kind, 64, 64), 64, 64, w)["neighbour_share"] for w in (16, 64)] for kind in ORDERS
    }
    assert [round(s, 2) for s in shares["row_major"]] == [0.48, 0.5]
    assert [round(s, 2) for s in shares["hilbert"]] == [round(s, 2) for s in shares["zorder"]] == [0.76, 0.89]


@given(grids, st.sampled_from(ORDERS), st.integers(0, 2), st.integers(1, 5))
def test_apply_invert_and_shard(grid, kind, extra, world):
    height, width = grid
    order = grid_order(kind, height, width)
    gen = torch.Generator().manual_seed(height * 100 + width)
    x = torch.randn(2, extra + height * width, 3, generator=gen)
    ordered = apply(x, order, extra)
    assert torch.equal(ordered[:, :extra], x[:, :extra])
    assert torch.equal(ordered[:, extra:], x[:, extra:][:, order])
    assert torch.equal(invert(ordered, order, extra), x)
    pieces = [shard(x, order, rank, world, extra) for rank in range(world)]
    assert torch.equal(torch.cat(pieces, 1), ordered)
    assert [p.shape[1] for p in pieces] == [t.numel() for t in torch.arange(x.shape[1]).tensor_split(world)]


def test_orders_are_cached_per_grid_and_checked():
    assert grid_order("hilbert", 12, 7) is grid_order("hilbert", 12, 7)
    with pytest.raises(ValueError, match="kind must be one of"):
        grid_order("snake", 4, 4)
    with pytest.raises(ValueError, match="width must be >= 1"):
        grid_order("hilbert", 4, 0)
    order = grid_order("zorder", 3, 3)
    with pytest.raises(ValueError, match="extra_tokens \\+ height \\* width = 1 \\+ 9"):
        apply(torch.zeros(1, 9, 2), order, extra_tokens=1)
    with pytest.raises(ValueError, match=re.escape("rank must be in [0, 2), got 2")):
        shard(torch.zeros(1, 9, 2), order, 2, 2)
    with pytest.raises(TypeError, match="rank must be an int, got float"):
        shard(torch.zeros(1, 9, 2), order, 1.0, 2)
    with pytest.raises(TypeError, match="order must be a 1-D int64 tensor"):
        invert(torch.zeros(1, 9, 2), order.int())


@pytest.mark.parametrize("grid", [(8193, 8192), (1, MAX_PATCHES + 1)])
def test_grids_beyond_the_bound_are_refused_before_any_allocation(grid):
    """2**26 patches at most (8192 x 8192): a larger grid is a ValueError naming the
    bound, for the orders and for locality, at once."""
    for kind in ORDERS:
        with pytest.raises(ValueError, match=re.escape("height * width must be at most 2**26 = 67108864 patches")):
            grid_order(kind, *grid)
    with pytest.raises(ValueError, match=re.escape(f"got {grid[0]} x {grid[1]} = {grid[0] * grid[1]}")):
        locality(torch.randperm(12), *grid, 4)


def _not_permutations(size, gen):
    """Orders of ``size`` entries that are not permutations: a repeat, a value past
    the end, a negative value."""
    order = torch.randperm(size, generator=gen)
    repeated, past, negative = order.clone(), order.clone(), order.clone()
    i, j = torch.randperm(size, generator=gen)[:2].tolist()
    repeated[i] = repeated[j]
    past[i] = size + int(torch.randint(0, 5, (), generator=gen))
    negative[j] = -1 - int(torch.randint(0, 5, (), generator=gen))
    return repeated, past, negative


@pytest.mark.parametrize("extra", [0, 2])
def test_orders_that_are_not_permutations_are_refused(extra):
    """apply, invert, shard and locality refuse them (invert once returned
    uninitialised rows); any permutation, not only the library's, is accepted."""
    gen = torch.Generator().manual_seed(extra)
    height, width = 5, 7
    x = torch.randn(2, extra + height * width, 3, generator=gen)
    for bad in _not_permutations(height * width, gen):
        for move in (
            lambda o: apply(x, o, extra),
            lambda o: invert(x, o, extra),
            lambda o: shard(x, o, 1, 2, extra),
            lambda o: locality(o, height, width, 4),
        ):
            with pytest.raises(ValueError, match=re.escape("order must be a permutation of 0 .. 34 (each patch once)")):
                move(bad)
    order = torch.randperm(height * width, generator=gen)
    assert torch.equal(invert(apply(x, order, extra), order, extra), x)


def test_locality_checks_its_arguments():
    order = grid_order("hilbert", 4, 6)
    for args, exc, fragment in (
        ((4, 6, 0), ValueError, "segment_length must be >= 1, got 0"),
        ((4, 6, -3), ValueError, "segment_length must be >= 1, got -3"),
        ((4, 6, 2.0), TypeError, "segment_length must be an int"),
        ((0, 6, 4), ValueError, "height must be >= 1, got 0"),
        ((4, -6, 4), ValueError, "width must be >= 1, got -6"),
        ((6, 6, 4), ValueError, "order must have height * width = 6 x 6 = 36 entries, got 24"),
    ):
        with pytest.raises(exc, match=re.escape(fragment)):
            locality(order, *args)
    with pytest.raises(
        TypeError,
        match=re.escape("order must be a 1-D int64 tensor, as grid_order returns, got a 2-D torch.int64 tensor"),
    ):
        locality(order.view(4, 6), 4, 6, 4)


def _mha(**changes):
    from dilated_attention import MultiheadDilatedAttention

    torch.manual_seed(0)
    options = dict(embed_dim=12, num_heads=3, segment_lengths=[4, 16], dilation_rates=[1, 2], dtype=torch.float64)
    return MultiheadDilatedAttention(**{**options, **changes})


@pytest.mark.parametrize("batch_first", [True, False])
def test_grid_attention_runs_the_ordered_sequence_and_answers_in_the_callers_order(batch_first):
    """Output = the module on the ordered tokens, put back in row-major order (CLS
    token first throughout); gradients reach the inputs; the mask follows."""
    from dilated_attention import GridAttention

    mha = _mha(batch_first=batch_first)
    height, width = 5, 7
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 1 + height * width, 12, generator=gen, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(2, 1 + height * width, generator=gen) < 0.2
    order = grid_order("hilbert", height, width)
    seq = (lambda t: t) if batch_first else (lambda t: t.transpose(0, 1))
    out, weights = GridAttention(mha, "hilbert", extra_tokens=1)(seq(x), grid=(height, width), key_padding_mask=mask)
    expected, _ = mha(seq(apply(x, order, 1)), key_padding_mask=apply(mask, order, 1))
    assert weights is None
    assert torch.allclose(seq(out), invert(seq(expected), order, 1), rtol=1e-12, atol=1e-12)
    (grad,) = torch.autograd.grad(out.sum(), x)
    assert torch.isfinite(grad).all() and grad.abs().sum() > 0


def test_grid_attention_with_one_whole_segment_does_not_depend_on_the_order():
    """Full attention is the same in any order: a check that the tokens come back to
    their places (a wrong inverse would move rows)."""
    from dilated_attention import GridAttention

    mha = _mha(segment_lengths=[64], dilation_rates=[1])
    x = torch.randn(3, 2 + 6 * 9, 12, dtype=torch.float64)
    plain, _ = mha(x)
    for kind in ORDERS:
        out, _ = GridAttention(mha, kind, extra_tokens=2)(x, grid=(6, 9))
        assert torch.allclose(out, plain, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="grid must be \\(height, width\\)"):
        GridAttention(mha)(x, grid=56)
    with pytest.raises(
        ValueError, match=re.escape("for 2 leading tokens before the patches (a CLS token, ...) pass extra_tokens=2")
    ):
        GridAttention(mha)(x, grid=(6, 9))
    with pytest.raises(ValueError, match="GridAttention takes no attn_mask: the attention runs in the grid's order"):
        GridAttention(mha, extra_tokens=2)(x, grid=(6, 9), attn_mask=torch.ones(56, 56, dtype=torch.bool).triu(1))
    # a mask or positions of the patches alone, or an unbatched x: told what they must be, not extra_tokens=0
    patches_only = re.escape("one entry per token of x (56 along its last dim, the extra_tokens=2 included), got")
    with pytest.raises(ValueError, match="key_padding_mask must have " + patches_only):
        GridAttention(mha, extra_tokens=2)(x, grid=(6, 9), key_padding_mask=torch.zeros(3, 54, dtype=torch.bool))
    with pytest.raises(ValueError, match="positions must have " + patches_only):
        GridAttention(mha, extra_tokens=2)(x, grid=(6, 9), positions=torch.arange(54))
    with pytest.raises(ValueError, match=re.escape("x must have shape (batch, tokens, embed_dim) (batch_first=True)")):
        GridAttention(mha, extra_tokens=2)(x[0], grid=(6, 9))
    with pytest.raises(ValueError, match="order must be one of"):
        GridAttention(mha, "spiral")


def test_grid_attention_exports_and_an_export_leaves_the_orders_real():
    """``torch.export`` traces the orders' construction with placeholder tensors: kept,
    they would be every later call's orders (eager calls then failed). Exported on a
    grid whose orders are not yet made, the program gives eager's output, and so does
    a new module called eagerly after it."""
    from dilated_attention import GridAttention
    from dilated_attention.nn import ordering

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attention = GridAttention(_mha(), "hilbert", extra_tokens=1)

        def forward(self, x):
            return self.attention(x, (7, 5))[0]

    gen = torch.Generator().manual_seed(4)
    x, other = (torch.randn(2, 1 + 7 * 5, 12, generator=gen, dtype=torch.float64) for _ in range(2))
    block = Block().eval()
    ordering._made_permutations.cache_clear()
    exported = torch.export.export(block, (x,))
    assert type(grid_order("hilbert", 7, 5)) is torch.Tensor
    expected = block(other)
    assert torch.allclose(exported.module()(other), expected, rtol=1e-12, atol=1e-12)
    fresh = Block().eval()
    fresh.load_state_dict(block.state_dict())
    assert torch.equal(fresh(other), expected)
    with torch.device("meta"):  # orders made under a default device are not kept either
        assert grid_order("zorder", 3, 3).is_meta
    assert torch.equal(grid_order("zorder", 3, 3), torch.tensor([0, 1, 3, 4, 2, 5, 6, 7, 8]))


def test_grid_attention_lays_rotary_positions_out_with_the_tokens():
    """With one whole segment, rotary attention at positions given per token does not
    depend on the order the tokens run in, if each token keeps its position: ``(N,)`` and
    ``(B, N)`` positions, given in ``x``'s row-major order, move with the tokens."""
    from dilated_attention import GridAttention
    from dilated_attention.nn.rotary import RotaryEmbedding

    mha = _mha(segment_lengths=[64], dilation_rates=[1], rotary=RotaryEmbedding(4))
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 1 + 5 * 6, 12, generator=gen, dtype=torch.float64)
    for positions in (torch.randperm(31, generator=gen) * 3, torch.randint(0, 99, (2, 31), generator=gen)):
        plain, _ = mha(x, positions=positions)
        for kind in ORDERS:
            out, _ = GridAttention(mha, kind, extra_tokens=1)(x, grid=(5, 6), positions=positions)
            assert torch.allclose(out, plain, rtol=1e-12, atol=1e-12), kind


def _torchscale_longvit_attention(q, k, v, segment_lengths, dilation_rates):
    """LongViT's (torchscale's ``DilatedAttention``) computation, one process, in plain
    torch, for sequences a multiple of every segment and segments a multiple of every
    rate (torchscale pads other lengths with zero keys it then attends to): per branch,
    each segment keeps the rows ``offset, offset + r, ...`` where a head's offset is
    its group among ``r`` contiguous groups of ``ceil(H / r)`` heads (the diagonal of
    ``dense_to_sparse``); softmax attention among the kept rows; rows a branch does
    not keep get LSE ``-1e8``; the branches' outputs are averaged with weights
    ``softmax(lse)`` over the branches (``scattering``)."""
    batch, length, heads, dim = q.shape
    outs, lses = [], []
    for w, r in zip(segment_lengths, dilation_rates, strict=True):
        out = torch.zeros_like(q)
        lse = torch.full((batch, length, heads), -1e8, dtype=q.dtype)
        group = -(-heads // r)
        for head in range(heads):
            rows = torch.arange(length).view(-1, w)[:, head // group :: r]  # (segments, kept rows)
            qs, ks, vs = (t[:, rows, head] for t in (q, k, v))  # (B, segments, kept, D)
            scores = qs @ ks.transpose(-1, -2) * dim**-0.5
            out[:, rows, head] = scores.softmax(-1) @ vs
            lse[:, rows, head] = scores.logsumexp(-1)
        outs.append(out)
        lses.append(lse)
    weights = torch.stack(lses).softmax(0)
    return sum(o * w.unsqueeze(-1) for o, w in zip(outs, weights, strict=True))


def test_longvit_attention_is_reproduced_exactly():
    """LongViT's configuration for a 1024-patch (32 x 32) image, row-major order and
    contiguous head offsets: the library equals the reference and LongViT's algorithm."""
    from dilated_attention import dilated_attention, reference_dilated_attention

    segs, rates = [64, 128, 256, 512, 1024], [1, 2, 4, 8, 16]
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 32 * 32, 12, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    order = grid_order("row_major", 32, 32)
    assert torch.equal(apply(q, order), q)  # row-major is the patch embedding's own order
    out = dilated_attention(q, k, v, segs, rates, head_offsets="contiguous")
    ref, _ = reference_dilated_attention(q, k, v, segs, rates, head_offsets="contiguous")
    longvit = _torchscale_longvit_attention(q, k, v, segs, rates)
    assert torch.allclose(out, ref, rtol=1e-10, atol=1e-12)
    assert torch.allclose(out, longvit, rtol=1e-10, atol=1e-12)
    interleaved = dilated_attention(q, k, v, segs, rates)
    assert not torch.allclose(interleaved, longvit, atol=1e-3)  # the paper's offsets are another layer


@pytest.mark.parametrize("kind", ORDERS)
def test_the_drawn_patches_are_the_references_keys(kind):
    """What the grid picture shades for a query patch and a head: the keys the
    reference lets it attend to in that branch, on the ordered sequence."""
    from dilated_attention.reference import branch_offsets, branch_pattern
    from dilated_attention.tools.pattern import attended_cells

    height, width, heads = 5, 9, 3
    order = grid_order(kind, height, width)
    for w, r in ((4, 1), (8, 2), (45, 3), (7, 5)):
        offsets = branch_offsets(heads, [w], [r], "mixture")[0]
        allowed = branch_pattern(height * width, w, r, offsets)  # (H, N, N) over sequence positions
        for query in range(height * width):
            position = int((order == query).nonzero())
            for head in range(heads):
                cells, shown = attended_cells(order, query, w, r, offsets, head)
                assert shown == head
                assert sorted(cells.tolist()) == sorted(order[allowed[head, position]].tolist())
            cells, shown = attended_cells(order, query, w, r, offsets)
            keeps = [h for h in range(heads) if allowed[h, position].any()]
            assert shown == (keeps[0] if keeps else None)
