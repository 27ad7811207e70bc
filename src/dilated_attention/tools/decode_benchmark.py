"""Decoding speed and memory: dilated attention's caches against the fastest dense
decoding PyTorch offers on the device.

At each position ``P`` every cache holds the state after ``P`` tokens, then takes
one token per sequence per step. Three batches: one sequence; ``B`` sequences at one
position; ``B`` sequences left-padded to different lengths (each row ``p_b`` tokens
of padding before its first token, so its positions are ``P - p_b``).

Both are timed over the same span of positions from ``P`` (:func:`span_of`): a whole
cycle of segment phases, ``lcm(segment_lengths)`` positions, once ``P`` reaches it (the
long-run cost per token: a step's cost depends on its place in its segments), else
``P`` positions (at least 64) around ``P`` for short texts. ``steps`` steps spread
evenly over the span are timed, the positions between them fed untimed as chunks.

- ``dilated``: :class:`DilatedKVCache` (its lean decode path), the mean over the
  timed steps of the span, the median of three such rounds, each from a copy of one state.
  It is started at the latest common segment boundary at most
  ``lcm(segment_lengths)`` before ``P`` (it never needs anything earlier, so its state
  is that of a cache fed from position 0); a padded batch is fed from its start (up
  to :data:`MAX_PADDED_POSITION`).
- ``dense``: keys and values preallocated for every position to come (static
  shapes), each step writes its row and runs PyTorch's SDPA over the cache's filled
  part; left-padded rows add a boolean key mask (SDPA's fastest masked path). On
  CUDA the FlashAttention backend is forced where there is no mask. The median of
  ``dense_steps`` steps per round spread evenly over the span.
- The two alternate round by round, so that a slow spell of the machine touches
  both columns alike; each runs its round alone (a dense step timed right after a
  dilated one finds the processor's caches holding the other's data, which slows
  it).
- On CUDA also ``dilated-graph`` and ``dense-graph``: one step captured in a CUDA
  graph and replayed: :class:`StaticKVCache` (a fixed ring of ``max(w) - 1``
  positions) and a dense cache of a fixed length with a length mask.

Times are per token (a step's time over the batch).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch

from ..nn.cache import DilatedKVCache
from ..nn.static_cache import StaticKVCache
from ..utils.plotting import log_log, pyplot, save
from .benchmark import _seconds, _synchronize, machine_info

# Dense caches larger than this are not measured on a CPU (they would not fit such a
# machine); on a GPU the limit is a quarter of its memory.
MAX_DENSE_BYTES = 8 * 2**30
# A graph-captured step is replayed this many times between two device events.
GRAPH_REPLAYS = 32
# Left-padded batches are measured up to this position (each is fed from its start).
MAX_PADDED_POSITION = 65536
# Untimed steps before each timed one that follows positions fed as a chunk.
SETTLING_STEPS = 8
# The span a position's steps are timed over is at most this many positions (a
# whole cycle of segment phases where ``lcm(segment_lengths)`` is no longer).
MAX_SPAN = 65536


@dataclass
class DecodeConfig:
    positions: Sequence[int] = (1, 1024, 4096, 8192, 65536, 1048576)
    segment_lengths: Sequence[int] = (2048, 4096, 8192)
    dilation_rates: Sequence[int] = (1, 2, 4)
    heads: int = 8
    head_dim: int = 64
    dtype: str = "float32"
    device: str = "cpu"
    steps: int = 8192
    dense_steps: int = 16
    batch: int = 8  # the size of the two batched runs (the third is one sequence)
    rounds: int = 3  # the dilated span is timed this many times, from copies of one state


@dataclass
class DecodeRow:
    impl: str
    batch: str  # "1", "B equal", "B padded"
    position: int
    ms_per_token: float | None
    cache_bytes: int
    note: str = ""


@dataclass
class DecodeResult:
    config: DecodeConfig
    machine: dict
    rows: list[DecodeRow] = field(default_factory=list)
    padded: list[dict] = field(default_factory=list)  # padded_against_equal, per position


def _tokens(cfg: DecodeConfig, batch: int, count: int, generator: torch.Generator) -> list[torch.Tensor]:
    dtype = getattr(torch, cfg.dtype)
    return [
        torch.randn(batch, 1, cfg.heads, cfg.head_dim, generator=generator).to(cfg.device, dtype) for _ in range(count)
    ]


def row_bytes(cfg: DecodeConfig) -> int:
    """The fewest bytes one sequence of a batch takes at the longest position: its
    dilated cache's keys and values, at least the positions it keeps there (fewer than
    ``max(segment_lengths)``; up to 4 times a window while its buffers move:
    :meth:`DilatedKVCache.max_nbytes`). A lower bound, for refusing batches that cannot fit."""
    element = torch.empty((), dtype=getattr(torch, cfg.dtype)).element_size()
    positions = 2 * min(max(cfg.positions), max(cfg.segment_lengths) - 1)  # keys and values
    return positions * cfg.heads * cfg.head_dim * element


def padding_of(cfg: DecodeConfig, batch: int, position: int) -> list[int]:
    """The left padding of each row of a padded batch at ``position``: spread over up
    to an eighth of the position (0 for the first row)."""
    return [row * (position // 8) // max(batch - 1, 1) for row in range(batch)]


def cycle_of(cfg: DecodeConfig) -> int:
    """``lcm(segment_lengths)``: positions this far apart have one place in every segment."""
    return math.lcm(*cfg.segment_lengths)


def _fed_cache(cfg: DecodeConfig, position: int, pads: Sequence[int]) -> tuple[DilatedKVCache, list[torch.Tensor]]:
    """A :class:`DilatedKVCache` of ``len(pads)`` sequences (row ``b`` left-padded by
    ``pads[b]``) up to :data:`SETTLING_STEPS` positions before ``position`` (the
    positions :func:`_timed_steps` takes as steps before its first timed one), and the
    tokens its steps take."""
    device, dtype = torch.device(cfg.device), getattr(torch, cfg.dtype)
    cycle = cycle_of(cfg)
    # A left-padded batch is fed every position from its padding on (positive starts
    # must be segment boundaries, which a padded row's state is not at); the others
    # from the latest common boundary a cycle before, which gives the same state.
    start = 0 if any(pads) else max(0, (position // cycle - 1) * cycle)
    settling = min(SETTLING_STEPS, position - start)
    batch = len(pads)
    cache = DilatedKVCache(
        batch,
        cfg.heads,
        cfg.head_dim,
        cfg.segment_lengths,
        cfg.dilation_rates,
        start=torch.tensor([start - p for p in pads]),
        dtype=dtype,
        device=device,
    )
    generator = torch.Generator().manual_seed(position)
    tokens = _tokens(cfg, batch, min(cfg.steps, 64), generator)
    with torch.inference_mode():  # as a generation loop runs
        _feed(cache, position - start - settling, cfg, generator)
    _synchronize(device)
    return cache, tokens


def _feed(cache: DilatedKVCache, count: int, cfg: DecodeConfig, generator: torch.Generator) -> None:
    """Feed ``count`` positions of random keys (also the queries and values) to every
    sequence of ``cache``, in chunks of at most ``max(segment_lengths)``."""
    chunk = max(cfg.segment_lengths)
    for at in range(0, count, chunk):
        size = (cache.shape[0], min(chunk, count - at), cfg.heads, cfg.head_dim)
        history = torch.randn(size, generator=generator).to(cfg.device, getattr(torch, cfg.dtype))
        cache.attend(history, history, history)


def _timed_steps(cache: DilatedKVCache, tokens: Sequence[torch.Tensor], cfg: DecodeConfig, position: int):
    """Seconds of each timed step of the span from ``position`` (:func:`timed_offsets`),
    one by one as a generator, ``cache`` (its first row unpadded) at most
    :data:`SETTLING_STEPS` positions before it. The positions between two timed steps
    are fed untimed, the last :data:`SETTLING_STEPS` of them as steps: the steps right
    after a chunk or a copy of the cache find its buffers to move and the processor's
    caches holding other data, which a generation loop's steps do not (measured on a
    2-core Xeon at 65,536: 64 steps spread over a cycle took 1.25 times the whole
    cycle's mean with one such step, 1.03 with eight)."""
    device, done = torch.device(cfg.device), int(cache.position.max()) - position
    generator = torch.Generator().manual_seed(position + 1)
    for i, offset in enumerate(timed_offsets(cfg, position)):
        settling = min(SETTLING_STEPS, offset - done)
        _feed(cache, offset - done - settling, cfg, generator)
        for _ in range(settling):
            _step_seconds(cache, tokens, i, device)
        yield _step_seconds(cache, tokens, i, device)
        done = offset + 1


def step_times(cfg: DecodeConfig, position: int, pads: Sequence[int]) -> list[DecodeRow]:
    """Time per token of a :class:`DilatedKVCache` and of a dense cache over the span
    from ``position`` on, rows left-padded by ``pads``, in ``cfg.rounds`` rounds that
    alternate the two (a slow spell of the machine touches both alike): in each, the
    dilated cache (a copy of one state) takes the timed steps of the span, then the
    dense cache ``cfg.dense_steps`` steps spread evenly over it, after one untimed step
    (each side runs with its own data in the processor's caches, as it would alone).
    Dilated: the mean over the timed steps, the median of the rounds; dense: the
    median of all its steps."""
    cache, tokens = _fed_cache(cfg, position, pads)
    dense_step, dense_bytes = _dense_cache(cfg, position, pads)
    device, span = torch.device(cfg.device), span_of(cfg, position)
    dense_at = [position + i * span // cfg.dense_steps for i in range(cfg.dense_steps)]
    means, dense_times = [], []
    with torch.inference_mode():
        for _ in range(cfg.rounds):
            fed = copy.deepcopy(cache)
            means.append(statistics.fmean(_timed_steps(fed, tokens, cfg, position)))
            if dense_step is not None:
                dense_step(dense_at[0])
                dense_times += [_seconds(functools.partial(dense_step, at), device) for at in dense_at]
    batch, name = len(pads), _batch_name(pads)
    dilated = DecodeRow("dilated", name, position, 1e3 * statistics.median(means) / batch, fed.nbytes)
    if dense_step is None:
        return [dilated, DecodeRow("dense", name, position, None, dense_bytes, "skipped: the cache would not fit")]
    dense_ms = 1e3 * statistics.median(dense_times) / batch
    return [dilated, DecodeRow("dense", name, position, dense_ms, dense_bytes, _dense_backend(device, any(pads)))]


def padded_against_equal(cfg: DecodeConfig, position: int, pads: Sequence[int]) -> dict:
    """The left-padded batch's time per token over the equal batch's, their timed
    steps alternating over the span (a slow spell of the machine touches both alike)."""
    caches = [_fed_cache(cfg, position, pads), _fed_cache(cfg, position, [0] * len(pads))]
    totals = [0.0, 0.0]
    with torch.inference_mode():
        for seconds in zip(*(_timed_steps(cache, tokens, cfg, position) for cache, tokens in caches), strict=True):
            totals = [total + s for total, s in zip(totals, seconds, strict=True)]
    steps = len(timed_offsets(cfg, position)) * len(pads)
    padded, equal = (1e3 * total / steps for total in totals)
    return {"position": position, "padded_ms": padded, "equal_ms": equal, "ratio": padded / equal}


def _dense_cache(cfg: DecodeConfig, position: int, pads: Sequence[int]) -> tuple[Callable[[int], object] | None, int]:
    """``(step, bytes)``: a dense cache preallocated for every position of the span from
    ``position`` on, ``step(at)`` writing the row at ``at`` and attending over the
    filled part (``None`` where the cache would not fit such a machine)."""
    device = torch.device(cfg.device)
    batch, length = len(pads), position + span_of(cfg, position)
    drawn, nbytes = _dense_keys(cfg, batch, length, position)
    if drawn is None:
        return None, nbytes
    keys, values = drawn
    token = _tokens(cfg, batch, 1, torch.Generator().manual_seed(position))[0].transpose(1, 2)  # (B, H, 1, D)
    padded = torch.arange(length, device=device)[None, :] < torch.tensor(pads, device=device)[:, None]
    mask = None if not any(pads) else ~padded[:, None, None, :]  # True: attend

    def step(at: int):
        keys[:, :, at : at + 1] = token
        values[:, :, at : at + 1] = token
        return _sdpa(token, keys[:, :, : at + 1], values[:, :, : at + 1], None if mask is None else mask[..., : at + 1])

    return step, nbytes


def dense_limit(device: torch.device) -> int:
    """The largest dense cache measured on ``device``, in bytes."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory // 4
    return MAX_DENSE_BYTES


def _dense_keys(
    cfg: DecodeConfig, batch: int, length: int, seed: int
) -> tuple[tuple[torch.Tensor, torch.Tensor] | None, int]:
    """``((keys, values), bytes)`` of a dense cache of ``length`` positions, ``(B, H,
    length, D)`` each, standard normal, drawn on the device; ``None`` for the tensors
    where the cache is larger than :func:`dense_limit`."""
    device, dtype = torch.device(cfg.device), getattr(torch, cfg.dtype)
    size = (batch, cfg.heads, length, cfg.head_dim)
    nbytes = 2 * math.prod(size) * torch.empty((), dtype=dtype).element_size()
    if nbytes > dense_limit(device):
        return None, nbytes
    generator = torch.Generator(device).manual_seed(seed)
    keys, values = (torch.randn(size, generator=generator, device=device, dtype=dtype) for _ in range(2))
    return (keys, values), nbytes


def _step_seconds(cache: DilatedKVCache, tokens: Sequence[torch.Tensor], i: int, device: torch.device) -> float:
    """Seconds of the cache's ``i``-th step of a span (its token ``tokens[i % len(tokens)]``
    as query, key and value)."""
    token = tokens[i % len(tokens)]
    return _seconds(functools.partial(cache.attend, token, token, token), device)


def span_of(cfg: DecodeConfig, position: int) -> int:
    """How many positions from ``position`` on both caches are timed over: a whole
    cycle of segment phases (``lcm(segment_lengths)``, at most :data:`MAX_SPAN`; as
    many whole cycles as make 64 positions where it is shorter) once ``position``
    reaches it, else ``position`` (at least 64)."""
    cycle = cycle_of(cfg)
    if cycle <= position and cycle < 64:
        return cycle * math.ceil(64 / cycle)  # every phase timed equally often
    return max(64, min(cycle, MAX_SPAN, position))


def timed_offsets(cfg: DecodeConfig, position: int) -> list[int]:
    """The steps timed, as offsets from ``position``: ``cfg.steps`` of the span spread
    evenly over it (every step where the span is no longer), step ``i`` moved on to the
    first position of phase ``i mod lcm(dilation_rates)`` before the next one's place
    where there is one: a step's cost depends on its position modulo each rate (which
    heads' rows it is in), and evenly spread steps would all share one such phase where
    their spacing is a multiple of the rates."""
    span = span_of(cfg, position)
    count = min(cfg.steps, span)
    phases = math.lcm(*cfg.dilation_rates)
    places = [i * span // count for i in range(count)] + [span]
    offsets = []
    for i in range(count):
        moved = places[i] + (i - position - places[i]) % phases
        offsets.append(moved if moved < places[i + 1] else places[i])
    return offsets


def _sdpa(q, k, v, mask):
    """SDPA with PyTorch's fastest backend for the case: FlashAttention forced on CUDA
    without a mask, its own choice otherwise."""
    if q.device.type == "cuda" and mask is None:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _dense_backend(device: torch.device, masked: bool) -> str:
    if device.type == "cuda":
        return "SDPA, boolean key mask" if masked else "SDPA, FlashAttention forced"
    return "SDPA (CPU flash), boolean key mask" if masked else "SDPA (CPU flash)"


def graph_step_times(cfg: DecodeConfig, position: int, pads: Sequence[int], impl: str) -> list[DecodeRow]:
    """CUDA only: time per token of one step captured in a CUDA graph and replayed:
    ``dilated-graph`` (:class:`StaticKVCache`, brought to ``position`` by replays of
    the graph from the latest common segment boundary at least a ring before it, or
    from its padding) or ``dense-graph`` (a dense cache of a fixed length filled up to
    ``position``, attending through a length mask updated in place)."""
    device, dtype = torch.device(cfg.device), getattr(torch, cfg.dtype)
    batch = len(pads)
    generator = torch.Generator().manual_seed(position)
    inputs = _tokens(cfg, batch, 3, generator)
    feed = 0  # replays that bring the cache to the position, untimed
    if impl == "dilated-graph":
        cycle, ring = cycle_of(cfg), max(cfg.segment_lengths)
        base = 0 if any(pads) else max(0, (position - ring) // cycle * cycle)
        start = torch.tensor([base - p for p in pads])
        shape = (batch, cfg.heads, cfg.head_dim, cfg.segment_lengths, cfg.dilation_rates)
        cache = StaticKVCache(*shape, start=start, dtype=dtype, device=device)
        step: Callable[[], object] = lambda: cache.attend(*inputs)  # noqa: E731
        reset: Callable[[], object] = functools.partial(cache.reset, start)
        feed, nbytes = position - base, cache.nbytes
    else:
        # Filled up to the position; the warm-up steps, the capture's and every replay
        # each write one more row.
        length = position + 2 + GRAPH_REPLAYS * cfg.dense_steps
        drawn, nbytes = _dense_keys(cfg, batch, length, position)
        if drawn is None:
            return [DecodeRow(impl, _batch_name(pads), position, None, nbytes, "skipped: the cache would not fit")]
        keys, values = drawn
        at = torch.tensor([position], device=device)
        columns = torch.arange(length, device=device)
        first = torch.tensor(pads, device=device)[:, None, None, None]
        token = inputs[0].transpose(1, 2)

        def reset():
            at.fill_(position)

        def step():
            keys.index_copy_(2, at, token)
            values.index_copy_(2, at, token)
            mask = (columns >= first) & (columns <= at)  # (B, 1, 1, length): the filled, unpadded keys
            out = torch.nn.functional.scaled_dot_product_attention(token, keys, values, attn_mask=mask)
            at.add_(1)
            return out

    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                step()
        torch.cuda.current_stream().wait_stream(side)
        reset()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        for _ in range(feed + 1):
            graph.replay()
        times = [_replay_seconds(graph) for _ in range(cfg.dense_steps)]
    return [
        DecodeRow(
            impl,
            _batch_name(pads),
            position,
            1e3 * statistics.median(times) / batch,
            nbytes,
            "CUDA graph" + ("" if impl == "dilated-graph" else ", SDPA over a fixed length, length mask"),
        )
    ]


def _replay_seconds(graph: torch.cuda.CUDAGraph) -> float:
    """Seconds per replay of ``graph``: :data:`GRAPH_REPLAYS` replays back to back
    between two device events (one replay is shorter than a host clock's round trip)."""
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(GRAPH_REPLAYS):
        graph.replay()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / 1e3 / GRAPH_REPLAYS


def _batch_name(pads: Sequence[int]) -> str:
    return "1" if len(pads) == 1 else f"{len(pads)} {'padded' if any(pads) else 'equal'}"


def say(line: str) -> None:
    """One line of progress, on stderr."""
    print(line, file=sys.stderr, flush=True)


def run(cfg: DecodeConfig, progress: Callable[[str], object] | None = say) -> DecodeResult:
    """Every row of the table, in order; a line per row to ``progress`` (by default on
    stderr; ``None``: quiet)."""
    progress = progress or (lambda line: None)
    result = DecodeResult(cfg, machine_info(torch.device(cfg.device)))
    measures: list[Callable[[DecodeConfig, int, Sequence[int]], list[DecodeRow]]] = [step_times]
    if cfg.device == "cuda":
        measures += [functools.partial(graph_step_times, impl=impl) for impl in ("dilated-graph", "dense-graph")]
    for measure in measures:  # the first steps of a process pay for its warm-up: not recorded
        measure(dataclasses.replace(cfg, steps=64, rounds=1, dense_steps=4), min(cfg.positions), [0])
    for position in sorted(set(cfg.positions)):
        padded = padding_of(cfg, cfg.batch, position)
        fed = any(padded) and position <= MAX_PADDED_POSITION  # a padded batch is fed from its start
        batches = [[0]] + ([[0] * cfg.batch] if cfg.batch > 1 else []) + ([padded] if fed else [])
        for pads in batches:
            for measure in measures:
                for row in measure(cfg, position, pads):
                    result.rows.append(row)
                    shown = "-" if row.ms_per_token is None else f"{row.ms_per_token:8.4f}"
                    progress(
                        f"{row.impl:13} B={row.batch:9} position {row.position:>9,}: {shown} ms/token, "
                        f"cache {row.cache_bytes / 2**20:10.1f} MiB {row.note}"
                    )
        if fed:
            result.padded.append(padded_against_equal(cfg, position, padded))
            progress(f"padded / equal, alternating, position {position:>9,}: {result.padded[-1]['ratio']:.2f}")
    return result


def format_table(result: DecodeResult) -> str:
    cfg = result.config
    lines = [
        (
            f"decode, one token per sequence per step: device {cfg.device} "
            f"({result.machine.get('gpu', result.machine['cpu'])}), {result.machine['threads']} threads, "
            f"torch {result.machine['torch']}, {cfg.dtype}, H={cfg.heads} D={cfg.head_dim}, "
            f"segment_lengths={list(cfg.segment_lengths)} dilation_rates={list(cfg.dilation_rates)}"
        ),
        (
            f"ms per token (a step's time over its batch) over a span of positions from the position on: a whole "
            f"cycle of segment phases (lcm(segment_lengths) = {cycle_of(cfg):,}"
            f"{f', at most {MAX_SPAN:,}' if cycle_of(cfg) > MAX_SPAN else ''}"
            f"{'; whole cycles to at least 64 positions' if cycle_of(cfg) < 64 else ''}) once the position "
            f"reaches it, else as many as the position (at least 64); dilated: the mean of up to {cfg.steps} steps "
            f"spread evenly over the span (median of {cfg.rounds} rounds), dense: the median of {cfg.dense_steps} "
            "per round spread over it, the rounds alternating; padded: row b left-padded by b/(B-1) of an eighth "
            "of the position"
        ),
        "",
    ]
    impls = list(dict.fromkeys(r.impl for r in result.rows))
    lines.append(f"{'batch':>10} {'position':>10} " + " ".join(f"{i:>13}" for i in impls) + f" {'dense/dilated':>13}")
    table: dict[tuple[str, int], dict[str, DecodeRow]] = {}
    for row in result.rows:
        table.setdefault((row.batch, row.position), {})[row.impl] = row
    for (batch, position), rows in table.items():
        cells = [rows.get(i) for i in impls]
        shown = [f"{'-':>13}" if r is None or r.ms_per_token is None else f"{r.ms_per_token:>13.4f}" for r in cells]
        ours, dense = rows.get("dilated"), rows.get("dense")
        ratio = (
            dense.ms_per_token / ours.ms_per_token
            if ours and dense and ours.ms_per_token and dense.ms_per_token
            else None
        )
        lines.append(f"{batch:>10} {position:>10,} " + " ".join(shown) + (f" {ratio:>13.2f}" if ratio else ""))
    backends = sorted({f"{r.impl}: {r.note}" for r in result.rows if r.note and not r.note.startswith("skipped")})
    memory = sorted({(r.impl, r.position, r.cache_bytes) for r in result.rows if r.batch == "1"})
    lines += ["", "dense backends: " + "; ".join(backends) if backends else ""]
    lines += ["cache MiB at B=1: " + ", ".join(f"{i} {p:,}: {b / 2**20:.1f}" for i, p, b in memory)]
    if result.padded:
        lines += [
            "",
            f"dilated, B={cfg.batch} left-padded over B={cfg.batch} at equal positions, their steps alternating:",
        ]
        lines += [
            f"{'position':>10} {'padded ms':>10} {'equal ms':>10} {'ratio':>6}",
            *(
                f"{r['position']:>10,} {r['padded_ms']:>10.4f} {r['equal_ms']:>10.4f} {r['ratio']:>6.2f}"
                for r in result.padded
            ),
        ]
    return "\n".join(lines)


def to_json(result: DecodeResult) -> dict:
    return {
        "config": asdict(result.config),
        "machine": result.machine,
        "rows": [asdict(r) for r in result.rows],
        "padded_against_equal": result.padded,
    }


def plot(result: DecodeResult, path: str) -> None:
    """Time per token (one sequence) and cache memory against the position, log-log."""
    plt = pyplot()
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4.2))
    for impl, style in (("dilated", "o-"), ("dense", "s--"), ("dilated-graph", "^-"), ("dense-graph", "v--")):
        rows = [r for r in result.rows if r.impl == impl and r.batch == "1" and r.ms_per_token is not None]
        if rows:
            positions = [max(r.position, 1) for r in rows]
            ax_t.plot(positions, [r.ms_per_token for r in rows], style, label=impl)
            ax_m.plot(positions, [r.cache_bytes / 2**20 for r in rows], style, label=impl)
    log_log([(ax_t, "time per token (ms)"), (ax_m, "KV cache (MiB)")], "position (tokens seen)", legend_size=8)
    cfg = result.config
    save(
        fig,
        path,
        f"decoding one token at a time, {cfg.device}, {cfg.dtype}, H={cfg.heads} D={cfg.head_dim}, "
        f"w={list(cfg.segment_lengths)} r={list(cfg.dilation_rates)}",
    )
