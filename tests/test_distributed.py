"""Sequence parallelism on the gloo backend: several processes on this machine.

Each worker computes the single-process result on the whole sequence (same seed on
every rank), runs its shard through ``process_group=``, and compares its shard of
the output, LSE and gradients; it also checks the bytes it moved against the
analytic minimum counted from the reference patterns.
"""

import json
import math
import os
import random
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dilated_attention import dilated_attention
from dilated_attention.ops.distributed import Communicator
from dilated_attention.reference import branch_offsets, branch_pattern
from dilated_attention.tools.check import ONE_PROCESS_TOLERANCES, lse_error, max_relative_error
from helpers import with_memory_layout

TIMEOUT_S = 300


def shard_bounds(lengths):
    starts = [sum(lengths[:k]) for k in range(len(lengths))]
    return [(s, s + n) for s, n in zip(starts, lengths, strict=True)]


def minimum_bytes(case, lengths, sender, receiver, itemsize):
    """Bytes ``receiver``'s queries need from ``sender``: the key and value rows of
    the (head, key) cells of the sender's shard that some query of the receiver
    attends to in some branch (the patterns include causality), each once, and with
    a padding mask one mask value per distinct key row."""
    n, h = sum(lengths), case["heads"]
    (s0, s1), (r0, r1) = shard_bounds(lengths)[sender], shard_bounds(lengths)[receiver]
    needed = torch.zeros(h, s1 - s0, dtype=torch.bool)  # (head, key) cells, over all branches
    segs, rates = case["segment_lengths"], case["dilation_rates"]
    for w, r, offs in zip(segs, rates, branch_offsets(h, segs, rates, case["mode"]), strict=True):
        needed |= branch_pattern(n, w, r, offs, case["is_causal"])[:, r0:r1, s0:s1].any(dim=1)
    mask_rows = int(needed.any(dim=0).sum()) if case["masked"] else 0
    return case["batch"] * itemsize * (2 * int(needed.sum()) * case["head_dim"] + mask_rows)


def run_case(case, rank, world, group):
    gen = torch.Generator().manual_seed(case["seed"])
    n = sum(case["lengths"])
    shape = (case["batch"], n, case["heads"], case["head_dim"])
    dtype = getattr(torch, case.get("dtype", "float64"))
    q, k, v, grad = (torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype) for _ in range(4))
    grad_lse = torch.randn(shape[:3], generator=gen)
    mask = (torch.rand(case["batch"], n, generator=gen) < 0.3) if case["masked"] else None
    for _ in range(case.get("nonfinite", 0)):  # NaN or infinity at random places of q, k, v
        which, value = (int(torch.randint(3, (), generator=gen)) for _ in range(2))
        index = tuple(int(torch.randint(size, (), generator=gen)) for size in shape)
        (q, k, v)[which][index] = (math.nan, math.inf, -math.inf)[value]
    kwargs = dict(mode=case["mode"], is_causal=case["is_causal"], dropout_p=case.get("dropout_p", 0.0), return_lse=True)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.manual_seed(case["seed"])  # the same dropout seed on every rank and in the one-process run
    out, lse = dilated_attention(
        *full, case["segment_lengths"], case["dilation_rates"], key_padding_mask=mask, **kwargs
    )
    full_grads = torch.autograd.grad((out, lse), full, (grad, grad_lse.to(lse.dtype)))

    lo, hi = shard_bounds(case["lengths"])[rank]
    # Strided shards too: a head dim that is not unit-stride.
    local = [with_memory_layout(t[:, lo:hi], case.get("memory", "contiguous")).requires_grad_() for t in (q, k, v)]
    local_mask = None if mask is None else mask[:, lo:hi]
    torch.manual_seed(case["seed"])
    communicator = Communicator(group)
    dout, dlse = dilated_attention(
        *local,
        case["segment_lengths"],
        case["dilation_rates"],
        key_padding_mask=local_mask,
        process_group=communicator,
        **kwargs,
    )
    grads = torch.autograd.grad((dout, dlse), local, (grad[:, lo:hi], grad_lse[:, lo:hi].to(dlse.dtype)))
    errors = {
        "out": max_relative_error(dout, out[:, lo:hi]),
        "lse": lse_error(dlse, lse[:, lo:hi]),
        "grads": max_relative_error(grads, [g[:, lo:hi] for g in full_grads]),
    }
    moved = vars(communicator.traffic)
    itemsize = q.element_size()
    sent = sum(minimum_bytes(case, case["lengths"], rank, b, itemsize) for b in range(world) if b != rank)
    received = sum(minimum_bytes(case, case["lengths"], b, rank, itemsize) for b in range(world) if b != rank)
    unmasked = dict(case, masked=False)
    grads_sent = sum(minimum_bytes(unmasked, case["lengths"], b, rank, itemsize) for b in range(world) if b != rank)
    grads_received = sum(minimum_bytes(unmasked, case["lengths"], rank, b, itemsize) for b in range(world) if b != rank)
    errors["traffic"] = moved != {
        "forward_sent": sent,
        "forward_received": received,
        "backward_sent": grads_sent,
        "backward_received": grads_received,
    }
    return errors, moved


def run_module(rank, world, group):
    """MultiheadDilatedAttention on shards: the output shard and the parameter
    gradients summed over ranks equal the single-process ones."""
    from dilated_attention import MultiheadDilatedAttention

    torch.manual_seed(0)
    mha = MultiheadDilatedAttention(12, 3, [4, 10], [1, 2], dtype=torch.float64)
    lengths = [5, 9, 2, 7][:world] if world <= 4 else [3] * world
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, sum(lengths), 12, generator=gen, dtype=torch.float64)
    weight = torch.randn(2, sum(lengths), 12, generator=gen, dtype=torch.float64)
    out, _ = mha(x, is_causal=True)
    full_grads = torch.autograd.grad((out * weight).sum(), list(mha.parameters()))
    lo, hi = shard_bounds(lengths)[rank]
    local_out, _ = mha(x[:, lo:hi], is_causal=True, process_group=group)
    grads = torch.autograd.grad((local_out * weight[:, lo:hi]).sum(), list(mha.parameters()))
    for g in grads:
        dist.all_reduce(g, group=group)
    return {"out": max_relative_error(local_out, out[:, lo:hi]), "grads": max_relative_error(grads, full_grads)}


def run_grid_module(rank, world, group):
    """GridAttention on each rank's piece of the Hilbert-ordered patches (with a CLS
    token): the pieces of the output are the single-process output in that order."""
    from dilated_attention import GridAttention, MultiheadDilatedAttention
    from dilated_attention.nn.ordering import apply, grid_order, shard

    torch.manual_seed(0)
    grid_attention = GridAttention(
        MultiheadDilatedAttention(12, 3, [8, 16], [1, 2], dtype=torch.float64), "hilbert", extra_tokens=1
    )
    x = torch.randn(2, 1 + 6 * 5, 12, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    whole, _ = grid_attention(x, grid=(6, 5))
    order = grid_order("hilbert", 6, 5)
    piece, _ = grid_attention(shard(x, order, rank, world, 1), grid=(6, 5), process_group=group)
    return max_relative_error(piece, apply(whole, order, 1).tensor_split(world, dim=1)[rank])


def shared_communicator_traffic(rank, group):
    """Two calls (two layers) through one communicator, then one backward through both:
    each call's record holds its own forward and backward, equal to the call alone."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1, 20, 2, 4, generator=gen, dtype=torch.float64)[:, 10 * rank : 10 * rank + 10]
    x.requires_grad_()
    layers = (([20], [1]), ([20], [2]))  # segments across both shards: traffic in each
    communicator = Communicator(group)
    records, outs = [], []
    for segs, rates in layers:
        outs.append(dilated_attention(x, x, x, segs, rates, process_group=communicator))
        records.append(communicator.traffic)
    torch.autograd.grad(sum(out.sum() for out in outs), x)
    alone = []
    for segs, rates in layers:
        out = dilated_attention(x, x, x, segs, rates, process_group=communicator)
        torch.autograd.grad(out.sum(), x)
        alone.append(vars(communicator.traffic))
    return [vars(record) for record in records], alone


def _error_of(fn) -> dict:
    """``fn()``'s error (type and message) and how long it took to come."""
    start = time.monotonic()
    try:
        fn()
        error = None
    except (ValueError, TypeError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    return {"error": error, "seconds": time.monotonic() - start}


def shared_errors(rank, group):
    """Bad input on rank 1 only, in each layer that checks its own input before its
    collective calls, and in settings that the ranks must share: every rank raises."""
    from dilated_attention import GridAttention, MultiheadDilatedAttention
    from dilated_attention.models import LongNetConfig, LongNetLM
    from dilated_attention.nn.rotary import RotaryEmbedding

    torch.manual_seed(0)
    report = {}
    x = torch.randn(1, 8, 2, 4, dtype=torch.float64)
    # the backward exchanges gradients: a rank without a graph would leave the others waiting
    grad_x = x.clone().requires_grad_(rank == 0)
    report["graph"] = _error_of(lambda: dilated_attention(grad_x, grad_x, grad_x, [16], [1], process_group=group))
    for rotary in (None, RotaryEmbedding(4)):  # with rotary, the first collective is the shard's start
        module = MultiheadDilatedAttention(8, 2, [8], [1], rotary=rotary)
        mask = torch.zeros(1, 5 if rank == 0 else 4, dtype=torch.bool)
        report[f"module rotary={rotary is not None}"] = _error_of(
            lambda module=module, mask=mask: module(torch.randn(1, 5, 8), key_padding_mask=mask, process_group=group)
        )
    # a rotary layer given positions on one rank only: that rank skips the shard's collective
    module = MultiheadDilatedAttention(8, 2, [8], [1], rotary=RotaryEmbedding(4))
    positions = torch.arange(4, 8) if rank == 1 else None
    report["positions on one rank"] = _error_of(
        lambda: module(torch.randn(1, 4, 8), is_causal=True, positions=positions, process_group=group)
    )
    model = LongNetLM(LongNetConfig(vocab_size=11, dim=8, depth=1, heads=2, segment_lengths=(4,), dilation_rates=(1,)))
    tokens = torch.randint(0, 11, (1, 4)) + (20 if rank == 1 else 0)
    report["model"] = _error_of(lambda: model(tokens, process_group=group))
    # models that differ between ranks: the one with more layers would wait in a collective the other never makes
    config = LongNetConfig(vocab_size=11, dim=8, depth=1, heads=2, segment_lengths=(4,), dilation_rates=(1,))
    tokens = torch.randint(0, 11, (1, 4))
    for name, change in (("depth", {"depth": 1 + rank}), ("positions", {"positions": ("rotary", "none")[rank]})):
        other = LongNetLM(config.replace(**change))
        report[f"model {name}"] = _error_of(lambda other=other: other(tokens, process_group=group))
    given = torch.arange(4 * rank, 4 * rank + 4) if rank == 1 else None
    report["model positions on one rank"] = _error_of(lambda: model(tokens, positions=given, process_group=group))
    model.train().gradient_checkpointing = rank == 0  # recomputed in backward on one rank only
    report["model checkpointing"] = _error_of(lambda: model(tokens, process_group=group))
    grid_attention = GridAttention(MultiheadDilatedAttention(8, 2, [8], [1]), extra_tokens=1)
    grid = (2, 2) if rank == 0 else "2x2"
    report["grid"] = _error_of(lambda: grid_attention(torch.randn(1, 3, 8), grid=grid, process_group=group))
    # a call that raises leaves the random generator as it was (the dropout seed is drawn first)
    state = torch.get_rng_state()
    mask = torch.zeros(1, 8, dtype=torch.bool if rank == 0 else torch.int64)
    report["dropout"] = _error_of(
        lambda: dilated_attention(x, x, x, [4], [1], dropout_p=0.5, key_padding_mask=mask, process_group=group)
    )
    report["generator kept"] = torch.equal(state, torch.get_rng_state())
    report["type"] = _error_of(lambda: dilated_attention(x, x, x, [4], [1], process_group="world"))
    outsider = dist.new_group([0])  # every rank calls new_group; rank 1 is not in it
    if rank == 1:
        report["outsider"] = _error_of(lambda: dilated_attention(x, x, x, [4], [1], process_group=outsider))
    return report


def compiled_call(rank, world, group):
    """``torch.compile`` of a function calling with a process group (the exchange runs
    eagerly) gives the one-process shard, gradients included; ``None`` or the error."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 12, 2, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    whole = dilated_attention(x, x, x, [12], [2], is_causal=True) * 2
    (expected,) = torch.autograd.grad(whole.square().sum(), x)
    lo, hi = (0, 5) if rank == 0 else (5, 12)
    shard = x.detach()[:, lo:hi].clone().requires_grad_()
    compiled = torch.compile(lambda t: dilated_attention(t, t, t, [12], [2], is_causal=True, process_group=group) * 2)
    out = compiled(shard)
    (grad,) = torch.autograd.grad(out.square().sum(), shard)
    errors = max_relative_error(out, whole[:, lo:hi]), max_relative_error(grad, expected[:, lo:hi])
    return None if max(errors) <= 1e-12 else f"errors {errors}"


def worker(rank, world, init_file, cases, result_dir, scenario):
    torch.set_num_threads(1)
    # Generous, since 8 processes on 2 cores start slowly; short where a peer dies on purpose.
    timeout = timedelta(seconds=20 if scenario == "dead_peer" else 120)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timeout)
    report = {}
    try:
        if scenario == "cases":
            report["cases"] = [run_case(case, rank, world, dist.group.WORLD) for case in cases]
            report["module"] = run_module(rank, world, dist.group.WORLD)
            report["grid"] = run_grid_module(rank, world, dist.group.WORLD)
        elif scenario == "head_offsets":
            x = torch.randn(1, 8, 4, 2, dtype=torch.float64)
            try:
                dilated_attention(
                    x, x, x, [8], [2], head_offsets=("interleaved", "contiguous")[rank], process_group=dist.group.WORLD
                )
                report["error"] = None
            except ValueError as exc:
                report["error"] = str(exc)
        elif scenario == "shared_communicator":
            report["traffic"] = shared_communicator_traffic(rank, dist.group.WORLD)
        elif scenario in ("mismatch", "bad_input"):
            x = torch.randn(1, 8, 2, 4, dtype=torch.float64)
            mask = torch.zeros(1, 8, dtype=torch.bool if rank == 0 or scenario == "mismatch" else torch.int64)
            start = time.monotonic()
            try:
                dilated_attention(
                    x,
                    x,
                    x,
                    [4 + 4 * rank if scenario == "mismatch" else 4],
                    [1],
                    key_padding_mask=mask,
                    process_group=dist.group.WORLD,
                )
                report["error"] = None
            except (ValueError, TypeError) as exc:
                report["error"] = f"{type(exc).__name__}: {exc}"
            report["seconds"] = time.monotonic() - start
        elif scenario == "shared_errors":
            report.update(shared_errors(rank, dist.group.WORLD))
        elif scenario == "compiled":
            report["error"] = compiled_call(rank, world, dist.group.WORLD)
        elif scenario == "dead_peer":
            # The peer dies only once rank 0 is past the group's set-up: dying during
            # gloo's connection of the ranks fails init_process_group instead (a torch
            # error outside the library, seen in CI about once in many runs).
            dist.barrier()
            ready = os.path.join(result_dir, "connected")
            if rank == 1:
                deadline = time.monotonic() + 60
                while not os.path.exists(ready) and time.monotonic() < deadline:
                    time.sleep(0.01)
                os._exit(0)  # dies without taking part
            open(ready, "w").close()
            x = torch.randn(1, 8, 2, 4, dtype=torch.float64)
            start = time.monotonic()
            try:
                dilated_attention(x, x, x, [16], [1], process_group=dist.group.WORLD)
                report["error"] = None
            except Exception as exc:  # noqa: BLE001 - any error is the point; a hang is not
                report["error"] = f"{type(exc).__name__}: {exc}"[:300]
            report["seconds"] = time.monotonic() - start
    finally:
        with open(os.path.join(result_dir, f"{rank}.json"), "w") as f:
            json.dump(report, f)
    if scenario != "dead_peer":
        dist.barrier()  # no rank tears down its connections while a peer still uses them
        dist.destroy_process_group()
        # Skip the interpreter's teardown: after an error was raised on both ranks, torch
        # 2.13's gloo sometimes aborts there ("terminate called without an active
        # exception", about 1 exit in 25 under load), with every result already written.
        os._exit(0)


def launch(world, tmp_path, cases=(), scenario="cases"):
    """Start ``world`` gloo processes; fail (never hang) if they take too long."""
    ctx = mp.start_processes(
        worker,
        args=(world, str(tmp_path / "init"), list(cases), str(tmp_path), scenario),
        nprocs=world,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                pytest.fail(f"{world} processes still running after {TIMEOUT_S} s")
    except mp.ProcessExitedException:
        if scenario != "dead_peer":
            raise
    reports = {}
    for rank in range(world):
        path = tmp_path / f"{rank}.json"
        if path.exists():
            reports[rank] = json.loads(path.read_text())
    return reports


def make_cases(world, count, seed):
    """Random configurations on ``world`` shards: equal or unequal lengths (some
    shorter than a segment, so segments span several shards), both modes, causal,
    masks, ``w > N``, ``w % r != 0``, dropout (masks must be the one-process ones),
    shards whose head dim is not unit-stride, NaN and infinities in the inputs."""
    rng = random.Random(seed)
    cases = []
    for index in range(count):
        lengths = [rng.randint(1, 14) for _ in range(world)] if index % 2 else [rng.randint(3, 10)] * world
        branches = rng.randint(1, 3)
        mode = rng.choice(["mixture", "head_groups"])
        huge = index % 5 == 4  # a last branch with w and r beyond any tensor index
        cases.append(
            dict(
                lengths=lengths,
                segment_lengths=[rng.randint(1, 2 * sum(lengths)) for _ in range(branches - huge)] + [2**64] * huge,
                dilation_rates=[rng.randint(1, 4) for _ in range(branches - huge)] + [2**63] * huge,
                mode=mode,
                is_causal=rng.random() < 0.5,
                masked=rng.random() < 0.3,
                batch=rng.randint(1, 2),
                heads=rng.randint(branches if mode == "head_groups" else 1, 4),
                head_dim=rng.choice([2, 4]),
                seed=rng.randrange(2**31),
                dtype="float32" if index % 4 == 3 else "float64",
                dropout_p=0.3 if index % 3 == 1 else 0.0,
                nonfinite=rng.choice([0, 0, 1, 3]),
                memory="head_dim_strided" if index % 4 == 2 else "contiguous",
            )
        )
    return cases


def aligned_case(world):
    """Every segment inside one shard: no attention data may cross processes."""
    return dict(
        lengths=[8] * world,
        segment_lengths=[4, 8],
        dilation_rates=[1, 2],
        mode="mixture",
        is_causal=False,
        masked=False,
        batch=1,
        heads=2,
        head_dim=4,
        seed=7,
    )


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_every_world_size_matches_one_process(world, tmp_path):
    cases = [aligned_case(world), *make_cases(world, 12 if world < 8 else 6, seed=world)]
    reports = launch(world, tmp_path, cases)
    assert sorted(reports) == list(range(world))
    for rank, report in reports.items():
        for case, (errors, moved) in zip(cases, report["cases"], strict=True):
            tolerance = ONE_PROCESS_TOLERANCES[getattr(torch, case.get("dtype", "float64"))]
            assert errors["out"] <= tolerance, (rank, case, errors)
            assert errors["lse"] <= tolerance, (rank, case, errors)
            assert errors["grads"] <= tolerance, (rank, case, errors)
            assert not errors["traffic"], (rank, case, moved)
        assert report["module"]["out"] <= 1e-12 and report["module"]["grads"] <= 1e-12, report["module"]
        assert report["grid"] <= 1e-12, report["grid"]
        aligned_moved = report["cases"][0][1]
        assert aligned_moved == dict(forward_sent=0, forward_received=0, backward_sent=0, backward_received=0)


def test_ranks_with_different_configurations_fail_loudly(tmp_path):
    reports = launch(2, tmp_path, scenario="mismatch")
    for rank in (0, 1):
        assert (
            "ValueError: process_group ranks disagree on segment_lengths (per rank: [[4], [8]])"
            in (reports[rank]["error"])
        )


def test_ranks_with_different_head_offsets_fail_loudly(tmp_path):
    reports = launch(2, tmp_path, scenario="head_offsets")
    for rank in (0, 1):
        assert "disagree on head_offsets (per rank: ['interleaved', 'contiguous'])" in reports[rank]["error"]


def test_each_call_keeps_its_own_traffic_record(tmp_path):
    reports = launch(2, tmp_path, scenario="shared_communicator")
    for rank in (0, 1):
        together, alone = reports[rank]["traffic"]
        assert together == alone
        assert alone[0] != alone[1] and alone[0]["backward_sent"] > 0


def test_bad_input_on_one_rank_raises_the_same_error_on_every_rank_at_once(tmp_path):
    reports = launch(2, tmp_path, scenario="bad_input")
    for rank in (0, 1):
        assert reports[rank]["error"] == reports[1]["error"]
        assert reports[rank]["error"].startswith("ValueError: key_padding_mask must be a bool tensor")
        assert "bad input on rank 1 of process_group" in reports[rank]["error"]
        assert reports[rank]["seconds"] < 10  # not the group's 120 s timeout


def test_a_layers_own_bad_input_on_one_rank_raises_on_every_rank(tmp_path):
    reports = launch(2, tmp_path, scenario="shared_errors")
    expected = {
        "graph": "ValueError: process_group ranks disagree on whether the call records a graph for backward",
        "module rotary=False": "ValueError: key_padding_mask must have shape (batch, seq_len) = (1, 5), got (1, 4)",
        "module rotary=True": "ValueError: key_padding_mask must have shape (batch, seq_len) = (1, 5), got (1, 4)",
        "positions on one rank": "ValueError: process_group ranks made different calls (per rank: [\"the shard's",
        "model": "ValueError: token ids must lie in [0, vocab_size=11)",
        "model depth": "ValueError: process_group ranks disagree on depth (per rank: [1, 2]); every rank must run "
        "the same model (the same config)",
        "model positions": "ValueError: process_group ranks disagree on positions (per rank: ['rotary', 'none'])",
        "model positions on one rank": "ValueError: process_group ranks disagree on positions= (given or None) "
        "(per rank: [False, True])",
        "model checkpointing": "ValueError: process_group ranks disagree on gradient checkpointing",
        "grid": "ValueError: grid must be (height, width) in patches, got '2x2'",
        "dropout": "ValueError: key_padding_mask must be a bool tensor",
        "type": "TypeError: process_group must be a torch.distributed process group",
    }
    for rank in (0, 1):
        for name, start in expected.items():
            found = reports[rank][name]
            assert found["error"].startswith(start), (rank, name, found)
            assert found["error"] == reports[1][name]["error"]  # one message on every rank
            assert found["seconds"] < 10  # not the group's 120 s timeout
        shared = "(bad input on rank 1 of process_group; every rank raises this error)"
        for name in ("module rotary=False", "model", "dropout"):
            assert shared in reports[rank][name]["error"]
        assert reports[rank]["generator kept"]
    assert reports[1]["outsider"]["error"].startswith("ValueError: this process (global rank 1) is not a member")


def test_a_compiled_call_across_processes_gives_the_one_process_shard(tmp_path):
    reports = launch(2, tmp_path, scenario="compiled")
    assert reports[0]["error"] is None and reports[1]["error"] is None, reports


def test_a_dead_peer_ends_the_others_with_an_error(tmp_path):
    reports = launch(2, tmp_path, scenario="dead_peer")
    assert reports[0]["error"] is not None
    assert reports[0]["seconds"] < 60


def test_torchrun_example_runs_and_checks_itself(tmp_path):
    import subprocess
    import sys

    example = os.path.join(os.path.dirname(__file__), "..", "examples", "distributed.py")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=3",
            example,
            "--seq-len",
            "301",
            "--segment-lengths",
            "32",
            "64",
            "--dilation-rates",
            "1",
            "2",
            "--heads",
            "4",
            "--head-dim",
            "8",
            "--causal",
            "--json",
            str(tmp_path / "run.json"),
        ],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    ranks = json.loads((tmp_path / "run.json").read_text())["ranks"]
    assert [r["shard"] for r in ranks] == [101, 100, 100]
    assert all(r["out_error"] <= 1e-5 and r["grad_error"] <= 1e-5 for r in ranks)
    assert ranks[0]["forward_received"] == 0 and ranks[0]["forward_sent"] > 0  # causal: rank 0 needs no keys


def test_a_communicator_made_before_init_process_group_uses_the_group_it_makes(tmp_path):
    communicator = Communicator()
    with pytest.raises(ValueError, match=r"torch\.distributed is not initialized"):
        communicator.group  # noqa: B018 - the property's refusal is under test
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        assert communicator.group is dist.group.WORLD
        x = torch.randn(1, 8, 2, 4, dtype=torch.float64)
        out = dilated_attention(x, x, x, [4], [1], process_group=communicator)
        assert torch.allclose(out, dilated_attention(x, x, x, [4], [1]))
    finally:
        dist.destroy_process_group()
