"""Measure the library's CPU efficiency against the machine's matmul and say which goals are met.

    python3 benchmarks/targets.py [--device cpu] [--skip-1m]

Config (the issue's): float32, B=1, H=8, D=64, segment_lengths=[2048, 4096, 8192],
dilation_rates=[1, 2, 4]; 2 CPU threads on CPU. Every ratio is measured against a
4096 x 4096 matmul run alternately with the measured call (see
dilated_attention.tools.benchmark). Writes benchmarks/results/targets-<device>-float32-<machine>.json
and .txt (the machine: the CPU model, or the GPU's name).
"""

import argparse
import os
import sys

import torch

from dilated_attention.tools import benchmark
from dilated_attention.tools.arguments import positive_int, threads
from dilated_attention.utils.files import write_results

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--threads", type=threads, default=2)
    parser.add_argument("--repeats", type=positive_int, default=5)
    parser.add_argument("--skip-1m", action="store_true", help="skip the 1,048,576-token forward")
    args = parser.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(args.threads)

    lines = []

    def say(text=""):
        print(text, flush=True)
        lines.append(text)

    def rows(seq_lens, impls, **overrides):
        cfg = benchmark.BenchConfig(seq_lens=seq_lens, implementations=impls, device=args.device, **overrides)
        result = benchmark.run(cfg, progress=False)
        say(benchmark.format_table(result) + "\n")
        return result

    # every goal needs its row: no row is skipped for its predicted time
    speed = rows([32768], ["kernel", "mixture", "head_groups"], repeats=args.repeats, memory=False, max_seconds=1e9)
    # The engine against the kernel directly: the two alternate, the median of the pairs' GFLOP/s ratios.
    alongside = benchmark.BenchConfig(seq_lens=[32768], device=args.device, repeats=max(args.repeats, 7))
    fractions = {
        (impl, name): benchmark.kernel_fraction(impl, 32768, alongside, backward)
        for impl in ("head_groups", "mixture")
        for backward, name in ((False, "forward"), (True, "fwd+bwd"))
    }
    # Where the rest goes: one profiled forward of each mode, its time by operator.
    by_op = {impl: benchmark.time_by_op(impl, 32768, alongside) for impl in ("head_groups", "mixture")}
    say("one forward at N=32768 by PyTorch operator (torch.profiler, self time; page faults of fresh memory count")
    say("in the operator that touches it first):")
    for impl, ops in by_op.items():
        say(
            f"  {impl:12} "
            + ", ".join(f"{o['op'].removeprefix('aten::')} {100 * o['share']:.1f}% ({o['calls']})" for o in ops)
        )
    say()
    lengths = [16384] + ([] if args.skip_1m else [1048576])
    scaling = rows(lengths, ["mixture", "head_groups"], repeats=1, backward=False, memory=False, max_seconds=1e9)
    memory = rows([131072], ["mixture", "head_groups"], repeats=1, backward=False, max_seconds=1e9)

    def row(result, impl, n):
        return next(r for r in result.rows if r.impl == impl and r.seq_len == n)

    checks = []
    for impl, fwd_target, fb_target in (("head_groups", 0.9, 0.8), ("mixture", 0.8, 0.7)):
        r = row(speed, impl, 32768)
        checks.append((f"{impl} forward ratio at N=32768", r.fwd_ratio, ">=", fwd_target))
        checks.append((f"{impl} fwd+bwd ratio at N=32768", r.fwd_bwd_ratio, ">=", fb_target))
    kernel = row(speed, "kernel", 32768)
    checks.append(("fused kernel alone: forward ratio (the ceiling)", kernel.fwd_ratio, "info", None))
    checks.append(("fused kernel alone: fwd+bwd ratio (the ceiling)", kernel.fwd_bwd_ratio, "info", None))
    for (impl, name), fraction in fractions.items():
        checks.append((f"{impl} {name} GFLOP/s / the kernel's, alternating", fraction, ">=", 0.95))
    for impl, target in (("head_groups", 0.3), ("mixture", 0.6)):
        r = row(memory, impl, 131072)
        added = None if r.fwd_peak_added_bytes is None else r.fwd_peak_added_bytes / r.io_bytes
        checks.append((f"{impl} forward memory added / (q,k,v,out) at N=131072", added, "<=", target))
    if not args.skip_1m:
        for impl in ("mixture", "head_groups"):
            small, big = row(scaling, impl, 16384), row(scaling, impl, 1048576)
            per_token = (big.fwd_ms / big.seq_len) / (small.fwd_ms / small.seq_len)
            checks.append((f"{impl} forward time per token, N=1M / N=16K", per_token, "<=", 1.2))

    say(f"{'target':58} {'measured':>9} {'goal':>8}  met")
    report = []
    for name, value, op, goal in checks:
        goal_text = "" if goal is None else f"{op} {goal}"
        if value is None:  # a measurement that failed (its reason is printed above)
            say(f"{name:58} {'-':>9} {goal_text:>8}  not measured")
            report.append({"target": name, "measured": None, "goal": goal_text, "met": None})
            continue
        met = None if op == "info" else (value >= goal if op == ">=" else value <= goal)
        say(f"{name:58} {value:9.3f} {goal_text:>8}  {'' if met is None else ('yes' if met else 'NO')}")
        report.append({"target": name, "measured": value, "goal": goal_text, "met": met})

    # Each kind of CPU keeps its own results: the engine's share of the kernel differs between them.
    machine = benchmark.machine_slug(torch.device(args.device))
    stem = os.path.join(HERE, "results", f"targets-{args.device}-float32-{machine}")
    os.makedirs(os.path.dirname(stem), exist_ok=True)
    runs = {
        name: [vars(r) for r in res.rows] for name, res in (("speed", speed), ("memory", memory), ("scaling", scaling))
    }
    write_results(
        stem,
        {"machine": speed.machine, "dtype": "float32", "checks": report, "runs": runs, "forward_by_op": by_op},
        "\n".join(lines),
    )
    print(f"wrote {stem}.json and {stem}.txt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
