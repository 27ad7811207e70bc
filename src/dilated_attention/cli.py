"""Command line: ``dilated-attention check | pattern | bench`` (also ``python -m dilated_attention``)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

import torch

from . import benchmark, validation
from .plan import MODES

DTYPES = {
    "float64": torch.float64,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def _cmd_check(args) -> int:
    from .check import default_cases, format_table, run_case

    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda, but torch.cuda.is_available() is False", file=sys.stderr)
        return 2
    generator = torch.Generator().manual_seed(args.seed)
    failed = 0
    for name in args.dtype:
        results = [run_case(c, torch.device(args.device), DTYPES[name], generator) for c in default_cases()]
        failed += sum(not r.ok for r in results)
        print(f"\n{name} on {args.device}: library vs float64 reference (seed {args.seed})")
        print(format_table(results))
    print(f"\n{'FAILED' if failed else 'all passed'}: {failed} failing case(s)")
    return 1 if failed else 0


def _cmd_pattern(args) -> int:
    from .pattern import draw_pattern

    segs, rates = validation.check_branches(args.segment_lengths, args.dilation_rates)
    if args.length < 1 or args.heads < 1:
        print("error: --length and --heads must be >= 1", file=sys.stderr)
        return 2
    if args.mode == "head_groups":
        validation.check_head_groups(args.heads, len(segs))
    lines = draw_pattern(
        args.out, args.length, args.heads, segs, rates, mode=args.mode, is_causal=args.causal
    )
    print("\n".join(lines))
    print(f"wrote {args.out}")
    return 0


def _cmd_bench(args) -> int:
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda, but torch.cuda.is_available() is False", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    segs, rates = validation.check_branches(args.segment_lengths, args.dilation_rates)
    default_lens = [2**p for p in range(12, 18)] if args.device == "cpu" else [2**p for p in range(12, 21)]
    cfg = benchmark.BenchConfig(
        seq_lens=args.seq_lens or default_lens,
        segment_lengths=segs,
        dilation_rates=rates,
        batch=args.batch,
        heads=args.heads,
        head_dim=args.head_dim,
        dtype=args.dtype,
        device=args.device,
        is_causal=args.causal,
        implementations=args.impl,
        repeats=args.repeats,
        backward=not args.no_backward,
        memory=not args.no_memory,
        max_seconds=args.max_seconds,
        matmul_size=args.matmul_size,
    )
    result = benchmark.run(cfg, progress=not args.quiet)
    table = benchmark.format_table(result)
    print(table)
    stem = os.path.join(args.out_dir, args.name or f"bench-{args.device}-{args.dtype}")
    benchmark.write_json(result, stem + ".json")
    with open(stem + ".txt", "w") as f:
        f.write(table + "\n")
    print(f"wrote {stem}.json and {stem}.txt")
    if not args.no_plot:
        benchmark.plot(result, stem + ".png")
        print(f"wrote {stem}.png")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dilated-attention", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    check = sub.add_parser("check", help="compare the library with the float64 reference")
    check.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    check.add_argument("--dtype", nargs="+", choices=list(DTYPES), default=["float64", "float32"])
    check.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    check.set_defaults(run=_cmd_check)

    pattern = sub.add_parser("pattern", help="draw the attention pattern of each head as a PNG")
    pattern.add_argument("--segment-lengths", type=int, nargs="+", required=True)
    pattern.add_argument("--dilation-rates", type=int, nargs="+", required=True)
    pattern.add_argument("--length", type=int, required=True, help="sequence length N")
    pattern.add_argument("--heads", type=int, required=True)
    pattern.add_argument("--mode", choices=MODES, default="mixture")
    pattern.add_argument("--causal", action="store_true")
    pattern.add_argument("--out", default="pattern.png", help="PNG file to write")
    pattern.set_defaults(run=_cmd_pattern)

    bench = sub.add_parser("bench", help="time and memory: dense vs dilated attention")
    bench.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    bench.add_argument("--dtype", choices=list(DTYPES), default="float32")
    bench.add_argument("--seq-lens", type=int, nargs="+", help="default: 4K..128K on CPU, 4K..1M on CUDA")
    bench.add_argument("--segment-lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    bench.add_argument("--dilation-rates", type=int, nargs="+", default=[1, 2, 4])
    bench.add_argument("--batch", type=int, default=1)
    bench.add_argument("--heads", type=int, default=8)
    bench.add_argument("--head-dim", type=int, default=64)
    bench.add_argument("--causal", action="store_true")
    bench.add_argument("--impl", nargs="+", choices=benchmark.IMPLEMENTATIONS,
                       default=list(benchmark.IMPLEMENTATIONS))
    bench.add_argument("--repeats", type=int, default=3, help="timed runs per measurement (median)")
    bench.add_argument("--threads", type=int, help="torch.set_num_threads")
    bench.add_argument("--max-seconds", type=float, default=60.0,
                       help="skip a measurement predicted to take longer (dense at large N)")
    bench.add_argument("--matmul-size", type=int, default=4096, help="side of the reference square matmul")
    bench.add_argument("--no-backward", action="store_true")
    bench.add_argument("--no-memory", action="store_true")
    bench.add_argument("--no-plot", action="store_true")
    bench.add_argument("--quiet", action="store_true", help="no progress bar")
    bench.add_argument("--out-dir", default=os.path.join("benchmarks", "results"))
    bench.add_argument("--name", help="file name stem of the JSON and PNG")
    bench.set_defaults(run=_cmd_bench)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, TypeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
