"""What the unusual configurations cost: tiny segments, and dropout.

    python3 benchmarks/edge_costs.py [--threads 2] [--skip-large-dropout]

1. Tiny segments (``w = 1``, ``N = 102400``, and ``w = [1, 2, 4]``): the time to
   plan, the forward's time, and the share of it spent inside PyTorch's fused
   attention op (from ``torch.profiler``).
2. Dropout (the unfused kernel, position-keyed masks) against the fused path
   without dropout: forward time and the peak memory the forward adds, at one
   8192-long segment and at ``N = 32768`` with ``w = 8192``; each time before any memory
   is measured, each memory in a fresh process after one call not measured.

float32, B = 1, H = 8, D = 64. Writes benchmarks/results/edge-costs-<device>.json
and .txt.
"""

import argparse
import json
import os
import sys
import time

import torch

from dilated_attention import dilated_attention
from dilated_attention.ops.plan import make_plan
from dilated_attention.tools.arguments import threads
from dilated_attention.tools.benchmark import (
    BenchConfig,
    forward_peak_added,
    json_from,
    machine_info,
    machine_words,
    time_by_op,
)
from dilated_attention.utils.files import write_results

HERE = os.path.dirname(os.path.abspath(__file__))
HEADS, HEAD_DIM = 8, 64


def inputs(seq_len: int):
    return [torch.randn(1, seq_len, HEADS, HEAD_DIM) for _ in range(3)]


def tiny_segments(seq_len: int, segs, rates) -> dict:
    """Plan time, forward time, and the fused op's share of the forward."""
    q, k, v = inputs(seq_len)
    start = time.perf_counter()
    make_plan(seq_len, HEADS, segs, rates, "mixture", False)
    plan_s = time.perf_counter() - start
    with torch.no_grad():
        dilated_attention(q, k, v, segs, rates)  # warm-up
        start = time.perf_counter()
        dilated_attention(q, k, v, segs, rates)
        forward_s = time.perf_counter() - start
    cfg = BenchConfig(seq_lens=[seq_len], segment_lengths=segs, dilation_rates=rates, heads=HEADS, head_dim=HEAD_DIM)
    by_op = time_by_op("mixture", seq_len, cfg, top=10**6)  # every operator
    return dict(
        seq_len=seq_len,
        segment_lengths=segs,
        dilation_rates=rates,
        plan_ms=1e3 * plan_s,
        forward_ms=1e3 * forward_s,
        kernel_share=sum(o["share"] for o in by_op if "flash_attention" in o["op"]),
    )


def dropout_time(seq_len: int, w: int, dropout_p: float) -> dict:
    """The forward's time (run before any memory is measured in this process: see
    :func:`dropout_memory`)."""
    q, k, v = inputs(seq_len)
    with torch.no_grad():
        start = time.perf_counter()
        dilated_attention(q, k, v, [w], [1], dropout_p=dropout_p)
        seconds = time.perf_counter() - start
    return dict(seq_len=seq_len, w=w, dropout_p=dropout_p, forward_s=seconds)


def dropout_memory(row: dict) -> dict:
    """``row`` with the peak memory its forward adds (output excluded), in a fresh
    process after one call not measured (as ``bench`` measures memory): glibc's state
    after the timings would change the figure, and :class:`PeakMemory` leaves glibc
    mapping every large block afresh, which would slow any forward timed after it."""
    command = [sys.executable, __file__, "--memory-of", str(row["seq_len"]), str(row["w"]), str(row["dropout_p"])]
    command += ["--threads", str(torch.get_num_threads())]
    return dict(row, **json_from(command, f"the memory of dropout_p={row['dropout_p']} at N={row['seq_len']}"))


def _memory_of(seq_len: int, w: int, dropout_p: float) -> dict:
    q, k, v = inputs(seq_len)
    added = forward_peak_added(lambda: dilated_attention(q, k, v, [w], [1], dropout_p=dropout_p), torch.device("cpu"))
    return dict(peak_added_mib=added / 2**20, qkv_mib=3 * q.numel() * q.element_size() / 2**20)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=threads, default=2, help="torch.set_num_threads (default: 2)")
    parser.add_argument(
        "--skip-large-dropout",
        action="store_true",
        help="skip the N = 32768 dropout run, about a minute (default: run it)",
    )
    parser.add_argument("--memory-of", nargs=3, metavar=("N", "W", "P"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.memory_of:
        n, w, p = args.memory_of
        print(json.dumps(_memory_of(int(n), int(w), float(p))))
        return 0
    lines = []

    def say(text=""):
        print(text, flush=True)
        lines.append(text)

    say(f"edge costs on cpu ({machine_words(machine_info(torch.device('cpu')))}), float32, B=1 H={HEADS} D={HEAD_DIM}")
    say("\ntiny segments: plan, forward, share of the forward inside the fused attention op")
    tiny = [tiny_segments(102400, [1], [1]), tiny_segments(102400, [1, 2, 4], [1, 1, 2])]
    for row in tiny:
        say(
            f"  N={row['seq_len']} w={row['segment_lengths']} r={row['dilation_rates']}: plan "
            f"{row['plan_ms']:.2f} ms, forward {row['forward_ms']:.0f} ms, fused op {row['kernel_share']:.0%}"
        )
    say("\ndropout: forward time and peak memory added (q, k, v for scale)")
    runs = [(8192, 8192)] + ([] if args.skip_large_dropout else [(32768, 8192)])
    timed = [dropout_time(n, w, p) for n, w in runs for p in (0.0, 0.1)]  # every timing first
    dropout = [dropout_memory(row) for row in timed]
    for row in dropout:
        say(
            f"  N={row['seq_len']} w={row['w']} dropout_p={row['dropout_p']}: forward {row['forward_s']:.1f} s, "
            f"added {row['peak_added_mib']:.0f} MiB (q, k, v: {row['qkv_mib']:.0f} MiB)"
        )
    stem = os.path.join(HERE, "results", "edge-costs-cpu")
    payload = {
        "machine": machine_info(torch.device("cpu")),
        "dtype": "float32",
        "tiny_segments": tiny,
        "dropout": dropout,
    }
    write_results(stem, payload, "\n".join(lines))
    print(f"wrote {stem}.json and {stem}.txt")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
