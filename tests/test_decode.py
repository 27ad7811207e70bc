"""The lean path of decode steps (``dilated_attention.ops.decode``): a few query rows
against a window of keys, in one attention call with a log-multiplicity bias or
branch by branch, against the float64 reference."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dilated_attention import reference_dilated_attention
from dilated_attention.ops import decode
from dilated_attention.tools.check import TOLERANCES, lse_error, max_relative_error
from helpers import cache_from_config, configs, random_inputs, split_config, windows


def tables_of(attn, heads):
    return decode.decode_tables(
        heads,
        tuple(attn["segment_lengths"]),
        tuple(attn["dilation_rates"]),
        attn["mode"],
        attn["head_offsets"],
        torch.device("cpu"),
    )


def rows_of(call, batch):
    """The batch rows of a :class:`decode.BranchCall`, in its order."""
    return call.rows if isinstance(call.rows, tuple) else range(*call.rows.indices(batch))


def step_case(case, data, max_rows):
    """A window case with at most ``max_rows`` queries, each batch row shifted by its
    own multiple of lcm(w): the inputs, the expected rows, the key positions."""
    cfg, queries, start = case
    queries = min(queries, max_rows)
    start = min(start, cfg["seq_len"] - queries)
    inputs, attn = split_config(dict(cfg, masked=False))
    (q, k, v), _, _ = random_inputs(**inputs)
    q, k, v = (t.detach() for t in (q, k, v))
    total = cfg["seq_len"]
    whole, whole_lse = reference_dilated_attention(q, k, v, **attn)
    period = math.lcm(*cfg["segment_lengths"])
    positions = [start + data.draw(st.integers(0, 2)) * period for _ in range(cfg["batch"])]
    window = [t[:, start:total].transpose(1, 2) for t in (k, v)]  # key-head-major, as the cache keeps them
    expected = whole[:, total - queries :], whole_lse[:, total - queries :]
    scale = attn["softmax_scale"] if attn["softmax_scale"] is not None else cfg["head_dim"] ** -0.5
    return q[:, total - queries :], window, positions, expected, tables_of(attn, cfg["heads"]), scale


@given(windows(max_len=40), st.data())
def test_one_call_over_the_window_is_the_definition(case, data):
    q, (k, v), positions, (ref, ref_lse), tables, scale = step_case(case, data, decode.MAX_ROWS)
    out, lse = decode.window_attention(q, k, v, positions, tables, scale)
    assert max_relative_error(out, ref) <= 1e-10 and lse_error(lse, ref_lse) <= 1e-10


@given(windows(max_len=40), st.data())
def test_branch_by_branch_is_the_definition(case, data):
    """Rows at different positions (each its own multiple of lcm(w) later) in one
    call per branch and phase."""
    q, (k, v), positions, (ref, ref_lse), tables, scale = step_case(case, data, 1)
    result = decode.branch_attention(q, k, v, [p + k.shape[2] - 1 for p in positions], tables, scale)
    if result is None:  # grouped-query heads no view expresses: the window serves
        return
    out, lse = result
    assert max_relative_error(out, ref) <= 1e-10 and lse_error(lse, ref_lse) <= 1e-10


@pytest.mark.parametrize("cost", [None, -(10**12)], ids=["cheaper-way", "branch-by-branch"])
@settings(max_examples=40)
@given(windows(max_len=32), st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), st.data())
def test_low_precision_steps(cost, case, dtype, data):
    """Steps in low precision, each the cheaper way, or branch by branch where views
    serve (the calls merged in float32, in place where one covers every head)."""
    case = (dict(case[0], softmax_scale=None), *case[1:])  # scales above 1 amplify rounding past the tolerances
    q, (k, v), positions, (ref, _), tables, scale = step_case(case, data, 4)
    q, k, v = (t.to(dtype) for t in (q, k, v))
    with pytest.MonkeyPatch.context() as patch:
        if cost is not None:
            patch.setattr(decode, "BRANCH_CALLS_COST", cost)
        out = decode.attend_step(q, k, v, positions, tables, scale)[0]
    assert out.dtype == dtype and max_relative_error(out, ref) <= TOLERANCES[dtype]


def test_the_layers_of_a_step_share_its_choice_and_another_step_chooses_anew(monkeypatch):
    """A step at the positions, keys and width of the one before (the next layer's) reuses
    its choice of way; other positions, another key count, or another batch size choose
    anew, each exact."""
    (q, k, v), _, _ = random_inputs(5, 2, 63, 4, 8)
    q, k, v = (t.detach() for t in (q, k, v))
    attn = dict(segment_lengths=[8, 32], dilation_rates=[1, 4], mode="mixture", head_offsets="interleaved")
    tables = tables_of(attn, 4)
    chosen = []
    original = decode.branch_calls
    monkeypatch.setattr(decode, "branch_calls", lambda *a, **kw: chosen.append(a[1]) or original(*a, **kw))
    reference = reference_dilated_attention(q, k, v, is_causal=True, **attn)[0]
    keys, values = k.transpose(1, 2), v.transpose(1, 2)
    for query, rows, expected in [(62, 2, 1), (62, 2, 0), (62, 1, 1), (61, 2, 1), (61, 2, 0), (62, 2, 1)]:
        window = slice(query - 40, query + 1)  # 41 keys, enough for any query's segments
        chosen.clear()
        out, _ = decode.attend_step(
            q[:rows, query : query + 1],
            keys[:rows, :, window],
            values[:rows, :, window],
            [query - 40] * rows,
            tables,
            8**-0.5,
        )
        assert len(chosen) == expected
        assert max_relative_error(out, reference[:rows, query : query + 1]) <= 1e-10
    chosen.clear()
    decode.attend_step(q[:2, 62:], keys[:2, :, 21:], values[:2, :, 21:], [21, 21], tables, 8**-0.5)  # another key count
    assert len(chosen) == 1


def test_padding_and_rows_at_negative_positions():
    """Padded keys have no effect; a query at a negative position (left padding)
    outputs 0 and -inf, and so does one no branch selects for a head."""
    (q, k, v), _, mask = random_inputs(3, 2, 20, 4, 8, masked=True)
    q, k, v = (t.detach() for t in (q, k, v))
    attn = dict(segment_lengths=[4, 8], dilation_rates=[2, 4], mode="mixture", head_offsets="interleaved")
    tables = tables_of(attn, 4)
    ref, ref_lse = reference_dilated_attention(q, k, v, is_causal=True, key_padding_mask=mask, **attn)
    out, lse = decode.window_attention(
        q[:, 16:], k[:, 8:].transpose(1, 2), v[:, 8:].transpose(1, 2), [8, 8], tables, 8**-0.5, padding=mask[:, 8:]
    )
    assert max_relative_error(out, ref[:, 16:]) <= 1e-10 and lse_error(lse, ref_lse[:, 16:]) <= 1e-10
    assert torch.isneginf(lse).any()  # rate 2 and 4 without a rate-1 branch: some heads see nothing
    out, lse = decode.window_attention(
        q[:, 19:], k[:, 3:].transpose(1, 2), v[:, 3:].transpose(1, 2), [-20, 3], tables, 8**-0.5
    )
    assert torch.all(out[0] == 0) and torch.all(torch.isneginf(lse[0]))  # row 0's query is at position -4
    assert (
        max_relative_error(out[1:], reference_dilated_attention(q[1:], k[1:], v[1:], is_causal=True, **attn)[0][:, 19:])
        <= 1e-10
    )


@pytest.mark.parametrize(("cost", "expected"), [(-(10**12), "branch_attention"), (10**12, "window_attention")])
def test_the_step_takes_the_cheaper_way(cost, expected, monkeypatch):
    (q, k, v), _, _ = random_inputs(4, 1, 63, 4, 8)
    q, k, v = (t.detach() for t in (q, k, v))
    attn = dict(segment_lengths=[8, 32], dilation_rates=[1, 4], mode="mixture", head_offsets="interleaved")
    ran = []
    for name in ("branch_attention", "window_attention"):
        original = getattr(decode, name)
        monkeypatch.setattr(decode, name, lambda *a, _f=original, _n=name, **kw: ran.append(_n) or _f(*a, **kw))
    monkeypatch.setattr(decode, "BRANCH_CALLS_COST", cost)
    out, _ = decode.attend_step(q[:, 62:], k.transpose(1, 2), v.transpose(1, 2), [0], tables_of(attn, 4), 8**-0.5)
    assert ran == [expected]  # position 62: a window of 31 keys, of which the heads attend 7 or 8
    assert max_relative_error(out, reference_dilated_attention(q, k, v, is_causal=True, **attn)[0][:, 62:]) <= 1e-10


@pytest.mark.parametrize("cost", [-(10**12), 10**12])  # every step branch by branch, or over one window
@given(cfg=configs(max_len=30), data=st.data())
def test_left_padded_decoding_either_way_is_the_definition(cost, cfg, data):
    """Sequences left-padded to different lengths decode one token a step: their
    queries sit at different phases of their segments, yet share each call."""
    from dilated_attention import DilatedKVCache

    cfg = dict(cfg, is_causal=True, masked=False)
    inputs, attn = split_config(cfg)
    tensors = [t.detach() for t in random_inputs(**inputs)[0]]
    pads = [data.draw(st.integers(0, cfg["seq_len"] - 1)) for _ in range(cfg["batch"])]
    cache = cache_from_config(DilatedKVCache, cfg, attn, pads, dtype=torch.float64)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(decode, "BRANCH_CALLS_COST", cost)
        out = torch.cat([cache.attend(*(t[:, i : i + 1] for t in tensors)) for i in range(cfg["seq_len"])], 1)
    for row, pad in enumerate(pads):
        ref, _ = reference_dilated_attention(*(t[row : row + 1, pad:] for t in tensors), **attn)
        assert max_relative_error(out[row : row + 1, pad:], ref) <= 1e-10
        assert torch.all(out[row, :pad] == 0)


@pytest.mark.parametrize("row_call", [-(10**12), 10**12], ids=["a-call-per-row", "rows-of-a-phase-together"])
@given(configs(max_len=8), st.data())
def test_rows_at_any_positions_share_branch_and_window_calls(row_call, cfg, data):
    """One query per row, every row at its own position (a window at least the longest
    segment long is valid anywhere): both ways against the reference, row by row, the
    branch-by-branch way with a call per row or with the rows of each phase together
    (gathered where other rows lie between them)."""
    cfg = dict(cfg, is_causal=True, masked=False, batch=data.draw(st.integers(1, 5)))
    inputs, attn = split_config(cfg)
    longest = max(cfg["segment_lengths"])
    inputs["seq_len"] = longest + data.draw(st.integers(0, 5))
    q, k, v = (t.detach() for t in random_inputs(**inputs)[0])
    starts = [data.draw(st.integers(0, 3 * math.lcm(*cfg["segment_lengths"]))) for _ in range(cfg["batch"])]
    tables = tables_of(attn, cfg["heads"])
    scale = attn["softmax_scale"] if attn["softmax_scale"] is not None else cfg["head_dim"] ** -0.5
    last = [s + inputs["seq_len"] - 1 for s in starts]
    window = decode.window_attention(q[:, -1:], k.transpose(1, 2), v.transpose(1, 2), starts, tables, scale)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(decode, "ROW_CALL_COST", row_call)
        branch = decode.branch_attention(q[:, -1:], k.transpose(1, 2), v.transpose(1, 2), last, tables, scale)
    for row, start in enumerate(starts):
        ref, ref_lse = reference_dilated_attention(
            q[row : row + 1, -1:], k[row : row + 1], v[row : row + 1], key_offset=start, **attn
        )
        for out, lse in [window] + ([branch] if branch is not None else []):
            assert max_relative_error(out[row : row + 1], ref) <= 1e-10
            assert lse_error(lse[row : row + 1], ref_lse) <= 1e-10


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize(("starts", "shared"), [([0, 1, 0, 1, 0], slice(0, 5, 2)), ([0, 0, 1, 0, 1], (0, 1, 3))])
def test_rows_of_a_phase_share_a_call_as_a_view_or_gathered(starts, shared, dtype, monkeypatch):
    """Rows of one phase evenly spaced in the batch are one strided view of it; others
    are gathered. Either way each row's output is the reference's, in low precision too."""
    attn = dict(segment_lengths=[8, 16], dilation_rates=[1, 2], mode="mixture", head_offsets="interleaved")
    (q, k, v), _, _ = random_inputs(len(starts), 5, 21, 4, 8)
    q, k, v = (t.detach() for t in (q, k, v))
    tables = tables_of(attn, 4)
    monkeypatch.setattr(decode, "ROW_CALL_COST", 10**12)  # every phase's rows in one call
    last = [s + 20 for s in starts]
    calls = decode.branch_calls(tables, last)[1]
    assert calls is not None and shared in [call.rows for call in calls.plan.calls if call.r == 2]
    low = [t.to(dtype) for t in (q[:, -1:], k.transpose(1, 2), v.transpose(1, 2))]
    out, lse = decode.branch_attention(*low, last, tables, 8**-0.5, calls)
    assert out.dtype == dtype
    tolerance = 1e-10 if dtype == torch.float64 else TOLERANCES[dtype]
    for row, start in enumerate(starts):
        ref, ref_lse = reference_dilated_attention(
            q[row : row + 1, -1:], k[row : row + 1], v[row : row + 1], key_offset=start, is_causal=True, **attn
        )
        assert max_relative_error(out[row : row + 1], ref) <= tolerance
        assert lse_error(lse[row : row + 1], ref_lse) <= tolerance


@pytest.mark.parametrize(
    ("mode", "rates", "kv_heads", "in_place"),
    [
        ("mixture", [1, 2, 3], 6, True),  # the r = 1 branch's call covers every (row, head): the others merge into it
        ("mixture", [1, 2, 3], 3, True),  # grouped-query heads, each key head a slice of every call's
        ("mixture", [2, 3, 1], 6, True),  # whatever the order of the branches
        ("mixture", [2, 3], 6, False),  # no call covers every head: one indexed copy, then the merge
        ("head_groups", [1, 2, 3], 6, False),
    ],
)
@pytest.mark.parametrize("scale", [0.3, 9.0])  # 9: one branch's scores dwarf another's
def test_a_step_merges_its_calls_in_place_where_one_covers_every_head(mode, rates, kv_heads, in_place, scale):
    attn = dict(segment_lengths=[8, 16, 24][: len(rates)], dilation_rates=rates, mode=mode, head_offsets="interleaved")
    starts = [0, 48, 5]  # three rows, at three places in their segments
    (q, k, v), _, _ = random_inputs(11, len(starts), 29, 6, 8, kv_heads=kv_heads)
    q, k, v = (t.detach() for t in (q, k, v))
    tables = tables_of(attn, 6)
    last = [s + 28 for s in starts]
    calls = decode.branch_calls(tables, last)[1]
    assert calls is not None and calls.plan.merges_in_place == in_place
    out, lse = decode.branch_attention(q[:, -1:], k.transpose(1, 2), v.transpose(1, 2), last, tables, scale, calls)
    for row, start in enumerate(starts):
        ref, ref_lse = reference_dilated_attention(
            q[row : row + 1, -1:],
            k[row : row + 1],
            v[row : row + 1],
            key_offset=start,
            is_causal=True,
            softmax_scale=scale,
            **attn,
        )
        assert max_relative_error(out[row : row + 1], ref) <= 1e-10
        assert lse_error(lse[row : row + 1], ref_lse) <= 1e-10


def test_rows_near_each_other_share_a_call_and_rows_far_apart_do_not(monkeypatch):
    """Rows of one phase whose queries are near each other in their segments share a
    call (a mask for the keys before a row's own), those far from them take their own:
    the runs the cost model picks, and each row's output is the reference's."""
    attn = dict(segment_lengths=[16], dilation_rates=[1], mode="mixture", head_offsets="interleaved")
    starts = [11, 10, 9, 15, 14]  # the last queries 15, 14, 13, 3 and 2 keys into their segments
    (q, k, v), _, _ = random_inputs(len(starts), 5, 21, 4, 8)
    q, k, v = (t.detach() for t in (q, k, v))
    tables = tables_of(attn, 4)
    monkeypatch.setattr(decode, "ROW_CALL_COST", 40)  # pairs: shared 3 x 4 x 16 x 1.125 < alone 4 x 45 + 2 x 40
    monkeypatch.setattr(decode, "MASKED_FACTOR", 1.125)
    last = [s + 20 for s in starts]
    calls = decode.branch_calls(tables, last)[1]
    assert calls is not None
    runs = [(call.rows, longest, call.deficits) for call, longest in zip(calls.plan.calls, calls.longest, strict=True)]
    assert runs == [(slice(0, 3, 1), 16, (0, 1, 2)), (slice(3, 5, 1), 4, (0, 1))]
    out, lse = decode.branch_attention(q[:, -1:], k.transpose(1, 2), v.transpose(1, 2), last, tables, 8**-0.5, calls)
    for row, start in enumerate(starts):
        ref, ref_lse = reference_dilated_attention(
            q[row : row + 1, -1:], k[row : row + 1], v[row : row + 1], key_offset=start, is_causal=True, **attn
        )
        assert max_relative_error(out[row : row + 1], ref) <= 1e-10
        assert lse_error(lse[row : row + 1], ref_lse) <= 1e-10


def test_a_row_cost_kept_follows_the_cost_model(monkeypatch):
    """:meth:`DecodeTables.row_cost` keeps its answer per place in the cycle of segments,
    and per cost model: a changed constant gives the cost it implies, not the kept one."""
    attn = dict(segment_lengths=[64, 128], dilation_rates=[1, 2], mode="mixture", head_offsets="interleaved")
    tables = tables_of(attn, 4)
    position = 3 * 128 + 100

    def expected():
        window = tables.window_cost([position], 4)
        return min(window, decode.branch_calls(tables, [position], window)[0])

    first = tables.row_cost(position, 4)
    assert first == expected()
    monkeypatch.setattr(decode, "BRANCH_CALLS_COST", 1)  # branch by branch much cheaper than the window
    assert tables.row_cost(position, 4) == expected() < first
    assert tables.row_cost(position + 128, 4) == expected()  # the same place one cycle on


@pytest.mark.parametrize(("rates", "in_place"), [([2, 4], False), ([1, 2], True)])
def test_a_merge_keeps_float32_precision_whatever_the_log_sum_exps(rates, in_place):
    """Two branches whose best key is the same, at a score near 1,600: the merged
    output is a convex combination of the branches' outputs whatever the rounding of
    their log-sum-exps (an ulp of 1,600 in float32 is about 1e-4), within float32's
    tolerance of the float64 reference."""
    attn = dict(segment_lengths=[16, 32], dilation_rates=rates, mode="mixture", head_offsets="interleaved")
    generator = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 32, 4, 16, generator=generator, dtype=torch.float64) for _ in range(3))
    k[:, 23] = q[:, 31]  # eight keys back: in both branches' keys of the heads of phase 1 and 3
    tables = tables_of(attn, 4)
    calls = decode.branch_calls(tables, [31, 31])[1]
    assert calls is not None and calls.plan.merges_in_place == in_place
    single = (t.float() for t in (q[:, -1:], k.transpose(1, 2), v.transpose(1, 2)))
    out, lse = decode.branch_attention(*single, [31, 31], tables, 64.0, calls)
    ref, ref_lse = reference_dilated_attention(q[:, -1:], k, v, is_causal=True, softmax_scale=64.0, **attn)
    assert ref_lse.abs().max() > 1000
    assert max_relative_error(out, ref) <= TOLERANCES[torch.float32]
    assert lse_error(lse, ref_lse) <= TOLERANCES[torch.float32]


@settings(max_examples=80)
@given(
    configs(max_len=8),
    st.lists(st.integers(-60, 200), min_size=1, max_size=9),
    st.integers(1, 200),
    st.sampled_from([-(10**6), 0, 40, 2048, 10**6]),
    st.sampled_from([1, 60, decode.MAX_PLAN_ELEMENTS]),
)
def test_kept_plans_give_each_row_its_own_keys(cfg, starts, steps, row_call, kept):
    """Steps of rows at any positions (padding, segment starts, places far apart),
    their calls taken from plans kept since earlier steps of these tables: each call's
    rows and heads are exactly those whose query's phase counts the head in its
    branch, each once, with the row's own number of keys."""
    tables = tables_of(cfg, cfg["heads"])
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(decode, "ROW_CALL_COST", row_call)  # calls per row, of runs, or of a whole phase
        patch.setattr(decode, "MAX_PLAN_ELEMENTS", kept)  # the kept plans dropped often, or seldom
        for step in range(steps):
            positions = [start + step for start in starts]
            _, calls = decode.branch_calls(tables, positions)
            assert calls is not None  # without a limit
            expected = {}
            for branch, (w, r, _, chosen) in enumerate(tables.branches):
                for row, position in enumerate(positions):
                    into = position % w
                    if position >= 0 and into % r < len(chosen):
                        for head in range(cfg["heads"]):
                            if chosen[into % r] >> head & 1:
                                expected[branch, row, head] = into // r + 1
            found = {}
            for call, longest in zip(calls.plan.calls, calls.longest, strict=True):
                assert call.r == tables.branches[call.branch][1]
                rows = rows_of(call, len(positions))
                for row, deficit in zip(rows, call.deficits or [0] * len(rows), strict=True):
                    for head in range(*call.heads.indices(cfg["heads"])):
                        assert (call.branch, row, head) not in found
                        found[call.branch, row, head] = longest - deficit
            assert found == expected


def test_kept_plans_stay_within_their_bound(monkeypatch):
    """Plans of batches of every size, the largest first (each one smaller than those
    kept): what the tables keep never exceeds MAX_PLAN_ELEMENTS, and a plan larger than
    that is used once, not kept."""
    monkeypatch.setattr(decode, "MAX_PLAN_ELEMENTS", 300)
    tables = tables_of(dict(segment_lengths=[2**20], dilation_rates=[1], mode="mixture", head_offsets="interleaved"), 2)
    tables.plans.clear()
    for batch in range(200, 0, -1):
        positions = [1000 + 7 * row for row in range(batch)]  # rows 7 keys apart: calls of runs of them
        _, calls = decode.branch_calls(tables, positions)
        assert calls is not None
        assert any(plan is calls.plan for plan in tables.plans.values()) == (calls.plan.size <= 300)
        assert sum(plan.size for plan in tables.plans.values()) <= 300


def test_a_row_whose_padding_ends_gets_a_plan_of_its_own():
    """A row at position -1, then at 0, the other row one place further in the same
    range of places: the second step's calls cover the row that starts."""
    tables = tables_of(dict(segment_lengths=[32], dilation_rates=[1], mode="mixture", head_offsets="interleaved"), 2)
    tables.plans.clear()
    for positions, rows in [([20, -1], {0}), ([21, 0], {0, 1})]:
        calls = decode.branch_calls(tables, positions)[1]
        assert calls is not None
        covered = set()
        for call in calls.plan.calls:
            covered.update(rows_of(call, 2))
        assert covered == rows


@pytest.mark.parametrize("starts", [[1000, 990, 900], [-5, 990, 900]])
def test_a_left_padded_batch_meets_its_plans_again(starts):
    """Steps of rows at different places of their segments (the first one padded, or
    not): after lcm(r) steps they take kept plans, and a step's cost is what its calls
    read at its own numbers of keys (a gather reading twice, a mask costing
    MASKED_FACTOR a pair, each call beyond one per branch and phase ROW_CALL_COST)."""
    attn = dict(segment_lengths=[2048, 4096], dilation_rates=[1, 2], mode="mixture", head_offsets="interleaved")
    tables = tables_of(attn, 4)
    tables.plans.clear()
    made = 0
    for step in range(64):
        before = len(tables.plans)
        cost, calls = decode.branch_calls(tables, [start + step for start in starts])
        made += len(tables.plans) > before
        assert calls is not None
        expected = decode.BRANCH_CALLS_COST
        for call, longest in zip(calls.plan.calls, calls.longest, strict=True):
            factor = (2 if isinstance(call.rows, tuple) else 1) * (1 if call.deficits is None else decode.MASKED_FACTOR)
            expected += factor * len(rows_of(call, len(starts))) * len(range(*call.heads.indices(4))) * longest
        phases = {(call.branch, call.heads.start) for call in calls.plan.calls}
        expected += decode.ROW_CALL_COST * (len(calls.plan.calls) - len(phases))
        assert abs(cost - expected) <= 1
    assert made <= 2 * 2 * 2  # lcm(r) phases in each of at most two ranges of places


def test_a_late_keys_mask_is_as_wide_as_its_call():
    """A branch as long as any sequence (one global segment, w = 2**40): rows at
    different positions share a call whose mask spans their keys only, not the
    branch's length (which no memory could hold)."""
    from dilated_attention import DilatedKVCache

    (q, k, v), _, _ = random_inputs(7, 2, 3001, 2, 4)
    q, k, v = (t.detach() for t in (q, k, v))
    cache = DilatedKVCache(2, 2, 4, [2**40], [2], start=torch.tensor([0, -2]), dtype=torch.float64)
    cache.attend(q[:, :3000], k[:, :3000], v[:, :3000])
    out = cache.attend(q[:, 3000:], k[:, 3000:], v[:, 3000:])  # positions 3000 and 2998: one call, counts differ
    for row, pad in enumerate([0, 2]):
        ref, _ = reference_dilated_attention(*(t[row : row + 1, pad:] for t in (q, k, v)), [2**40], [2], is_causal=True)
        assert max_relative_error(out[row : row + 1], ref[:, -1:]) <= 1e-10


@settings(max_examples=60)
@given(configs(max_len=8), st.integers(1, 40), st.sampled_from([torch.float32, torch.float64]))
def test_early_steps_read_the_bias_from_a_table(cfg, longer, dtype):
    """Queries in the first segment of every branch: the bias is a view of a table made
    once, equal to the one filled for the step, at every first position and row count."""
    lengths = [w + longer for w in cfg["segment_lengths"]]  # first segments longer than MAX_ROWS, sometimes
    attn = dict(segment_lengths=lengths, dilation_rates=cfg["dilation_rates"], mode=cfg["mode"])
    tables = tables_of(dict(attn, head_offsets=cfg["head_offsets"]), cfg["heads"])
    for rows in {1, 3, min(decode.MAX_ROWS, min(lengths))}:
        for first in range(min(lengths) - rows + 1):
            early = tables.early_bias(first, rows, dtype)
            assert early is not None
            filled = decode.filled_bias(tables, [first], rows, first + rows, cfg["heads"], "cpu", dtype)
            assert early[0].shape == filled[0].shape and early[1] == filled[1]
            assert torch.equal(torch.isneginf(early[0]), torch.isneginf(filled[0]))
            torch.testing.assert_close(early[0], filled[0], rtol=1e-6 if dtype == torch.float32 else 1e-12, atol=0)
    assert tables.early_bias(min(lengths) - 1, 2, dtype) is None and tables.early_bias(-1, 1, dtype) is None


def test_early_steps_of_a_cache_are_the_definition():
    """A cache decoding from position 0 through the first segments (the table's view)
    and past them (the filled bias), against the reference."""
    from dilated_attention import DilatedKVCache

    attn = dict(segment_lengths=[24, 40], dilation_rates=[1, 3], mode="mixture", head_offsets="contiguous")
    (q, k, v), _, _ = random_inputs(2, 1, 70, 4, 8)
    q, k, v = (t.detach().double() for t in (q, k, v))
    cache = DilatedKVCache(1, 4, 8, **attn, dtype=torch.float64)
    out = torch.cat([cache.attend(q[:, i : i + 1], k[:, i : i + 1], v[:, i : i + 1]) for i in range(70)], 1)
    assert max_relative_error(out, reference_dilated_attention(q, k, v, is_causal=True, **attn)[0]) <= 1e-10
