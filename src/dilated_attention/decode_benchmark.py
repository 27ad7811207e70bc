"""Decoding speed and memory: :class:`DilatedKVCache` against a dense KV cache.

At each position ``P`` both caches hold the state after ``P`` tokens, then take one
token at a time. The dilated cache is started at the latest common segment boundary
at most ``lcm(segment_lengths)`` before ``P`` (it never needs anything earlier, so its
state is that of a cache fed from position 0) and timed over ``steps`` tokens: a
whole cycle of segment phases when ``steps = lcm(segment_lengths)``, so its mean is
the long-run cost per token. The dense cache (PyTorch SDPA of one query over every
cached key, the new key and value written into preallocated buffers) is timed over
``dense_steps`` tokens: its cost does not depend on the phase.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field
from typing import Sequence

import torch

from .benchmark import _seconds, _synchronize, machine_info
from .cache import DilatedKVCache
from .plotting import log_log, pyplot, save


@dataclass
class DecodeConfig:
    positions: Sequence[int] = (4096, 65536, 1048576)
    segment_lengths: Sequence[int] = (2048, 4096, 8192)
    dilation_rates: Sequence[int] = (1, 2, 4)
    heads: int = 8
    head_dim: int = 64
    dtype: str = "float32"
    device: str = "cpu"
    steps: int = 8192
    dense_steps: int = 16


@dataclass
class DecodeRow:
    impl: str
    position: int
    ms_per_token: float
    cache_bytes: int


@dataclass
class DecodeResult:
    config: DecodeConfig
    machine: dict
    rows: list[DecodeRow] = field(default_factory=list)


def _token(cfg: DecodeConfig, generator: torch.Generator) -> torch.Tensor:
    dtype = getattr(torch, cfg.dtype)
    return torch.randn(1, 1, cfg.heads, cfg.head_dim, generator=generator).to(cfg.device, dtype)


def dilated_step_time(cfg: DecodeConfig, position: int) -> DecodeRow:
    """Mean time per token of ``cfg.steps`` one-token steps from ``position`` on."""
    device, dtype = torch.device(cfg.device), getattr(torch, cfg.dtype)
    cycle = math.lcm(*cfg.segment_lengths)
    start = max(0, (position // cycle - 1) * cycle)
    cache = DilatedKVCache(1, cfg.heads, cfg.head_dim, cfg.segment_lengths, cfg.dilation_rates,
                           start=start, dtype=dtype, device=device)
    generator = torch.Generator().manual_seed(position)
    history = torch.randn(1, position - start, cfg.heads, cfg.head_dim, generator=generator).to(device, dtype)
    tokens = [_token(cfg, generator) for _ in range(min(cfg.steps, 64))]
    with torch.no_grad():
        cache.attend(history, history, history)
        _synchronize(device)
        times = []
        for step in range(cfg.steps):
            token = tokens[step % len(tokens)]
            times.append(_seconds(lambda: cache.attend(token, token, token), device))
    return DecodeRow("dilated", position, 1e3 * statistics.fmean(times), cache.nbytes)


def dense_step_time(cfg: DecodeConfig, position: int) -> DecodeRow:
    """Median time per token of a dense KV cache's one-token steps from ``position`` on."""
    device, dtype = torch.device(cfg.device), getattr(torch, cfg.dtype)
    generator = torch.Generator().manual_seed(position)
    size = (1, cfg.heads, position + cfg.dense_steps, cfg.head_dim)
    keys = torch.randn(size, generator=generator).to(device, dtype)
    values = torch.randn(size, generator=generator).to(device, dtype)
    token = _token(cfg, generator).transpose(1, 2)  # (1, H, 1, D)

    def step(at: int):
        keys[:, :, at : at + 1] = token
        values[:, :, at : at + 1] = token
        return torch.nn.functional.scaled_dot_product_attention(token, keys[:, :, : at + 1], values[:, :, : at + 1])

    with torch.no_grad():
        step(position)
        times = [_seconds(lambda: step(position + i), device) for i in range(cfg.dense_steps)]
    return DecodeRow("dense", position, 1e3 * statistics.median(times), keys.nbytes + values.nbytes)


def run(cfg: DecodeConfig, progress=print) -> DecodeResult:
    result = DecodeResult(cfg, machine_info(torch.device(cfg.device)))
    for position in cfg.positions:
        for measure in (dilated_step_time, dense_step_time):
            row = measure(cfg, position)
            result.rows.append(row)
            progress(f"{row.impl:8} position {row.position:>9,}: {row.ms_per_token:8.3f} ms/token, "
                     f"cache {row.cache_bytes / 2**20:10.1f} MiB")
    return result


def format_table(result: DecodeResult) -> str:
    cfg = result.config
    lines = [
        f"decode, one token per step: device {cfg.device} ({result.machine.get('gpu', result.machine['cpu'])}), "
        f"{result.machine['threads']} threads, {cfg.dtype}, B=1 H={cfg.heads} D={cfg.head_dim}, "
        f"segment_lengths={list(cfg.segment_lengths)} dilation_rates={list(cfg.dilation_rates)}",
        f"dilated: mean over {cfg.steps} steps; dense: median over {cfg.dense_steps} steps (SDPA over the whole cache)",
        "",
        f"{'position':>10} {'dilated ms':>11} {'dense ms':>9} {'dense/dilated':>13} "
        f"{'dilated MiB':>12} {'dense MiB':>10}",
    ]
    by_position: dict[int, dict[str, DecodeRow]] = {}
    for row in result.rows:
        by_position.setdefault(row.position, {})[row.impl] = row
    for position, rows in by_position.items():
        ours, dense = rows["dilated"], rows["dense"]
        lines.append(
            f"{position:>10,} {ours.ms_per_token:>11.3f} {dense.ms_per_token:>9.3f} "
            f"{dense.ms_per_token / ours.ms_per_token:>13.2f} {ours.cache_bytes / 2**20:>12.1f} "
            f"{dense.cache_bytes / 2**20:>10.1f}"
        )
    return "\n".join(lines)


def to_json(result: DecodeResult) -> dict:
    return {"config": asdict(result.config), "machine": result.machine, "rows": [asdict(r) for r in result.rows]}


def plot(result: DecodeResult, path: str) -> None:
    """Time per token and cache memory against the position, log-log."""
    plt = pyplot()
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4.2))
    for impl, style in (("dilated", "o-"), ("dense", "s--")):
        rows = [r for r in result.rows if r.impl == impl]
        positions = [r.position for r in rows]
        ax_t.plot(positions, [r.ms_per_token for r in rows], style, label=impl)
        ax_m.plot(positions, [r.cache_bytes / 2**20 for r in rows], style, label=impl)
    log_log([(ax_t, "time per token (ms)"), (ax_m, "KV cache (MiB)")], "position (tokens seen)", legend_size=8)
    cfg = result.config
    save(fig, path, f"decoding one token at a time, {cfg.device}, {cfg.dtype}, H={cfg.heads} D={cfg.head_dim}, "
                    f"w={list(cfg.segment_lengths)} r={list(cfg.dilation_rates)}")
