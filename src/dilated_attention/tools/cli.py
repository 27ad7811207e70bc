"""Command line: ``dilated-attention check | pattern | bench | decode-bench | train | generate``
(also ``python -m dilated_attention``)."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence

import torch

from .. import __version__
from ..ops import fused, validation
from ..ops.plan import MODES
from ..training.commands import add_evaluate, add_generate, add_train
from ..utils.devices import device_type
from ..utils.extras import require
from ..utils.files import check_output_file, check_output_folder, fresh_folder, write_results
from ..utils.memory import check_fits
from . import benchmark
from .arguments import (
    Parser,
    dense_steps,
    number,
    position,
    positive_float,
    positive_int,
    positive_ints,
    seed,
    threads,
)
from .errors import exit_status

DTYPES = validation.FLOAT_DTYPES


# The pattern draws an (N, N) picture per head, through the dense reference.
MAX_PATTERN_CELLS = 2**24
# Heads a grid pattern takes (it draws one; the offsets of all are made).
MAX_GRID_HEADS = 2**16


def _cmd_check(args) -> int:
    from .check import default_cases, format_table, run_case

    device_type(args.device)
    generator = torch.Generator().manual_seed(args.seed)
    device = torch.device(args.device)
    kernel = fused.requested(args.kernel)  # a bad choice (or $DILATED_ATTENTION_KERNEL) raises here
    paths = {}
    for name in args.dtype:  # every dtype's kernels before any case runs
        sample = torch.empty(1, 1, 1, 16, dtype=DTYPES[name], device=device)
        reason = fused.why_not_triton(sample, 0.0, False) if kernel == "triton" else None
        if reason is not None:
            fix = "" if DTYPES[name] in fused.TRITON_DTYPES else "pass --dtype with those only, "
            given = "--kernel triton" if args.kernel else f"{fused.KERNEL_ENV}=triton"
            raise ValueError(f"{given} cannot check {name}: {reason}; {fix}or use --kernel auto or torch")
        paths[name] = fused.describe(sample, kernel=kernel)
    failed = 0
    for name, path in paths.items():
        dtype = DTYPES[name]
        results = [run_case(c, device, dtype, generator, args.kernel) for c in default_cases()]
        failed += sum(not r.ok for r in results)
        print(f"\n{name} on {args.device}: library vs float64 reference (seed {args.seed}); kernels: {path}")
        print(format_table(results))
    print(f"\n{'FAILED' if failed else 'all passed'}: {failed} failing case(s)")
    return 1 if failed else 0


def _cmd_pattern(args) -> int:
    require("plot", "pattern")
    check_output_file(args.out, "--out", "pattern.png")
    if not args.out.lower().endswith(".png"):
        raise ValueError(f"--out {args.out}: pattern writes a PNG image, name a .png file")
    segs, rates = validation.check_branches(args.segment_lengths, args.dilation_rates)
    grid_only = {"--order": args.order, "--query": args.query, "--head": args.head}
    misplaced = ["--length"] if args.grid and args.length is not None else []
    misplaced += [] if args.grid else [flag for flag, value in grid_only.items() if value is not None]
    if misplaced:
        print(
            f"error: {', '.join(misplaced)} {'apply' if len(misplaced) > 1 else 'applies'} "
            f"{'without' if args.grid else 'with'} --grid only: drop {'them' if len(misplaced) > 1 else 'it'}"
            + (" (an image's length is H * W)" if args.grid else ""),
            file=sys.stderr,
        )
        return 2
    if args.grid:
        return _grid_pattern(args, segs, rates)
    from .pattern import draw_pattern

    if args.length is None or args.heads is None:
        print("error: pattern needs --length and --heads (or --grid H W for an image)", file=sys.stderr)
        return 2
    if args.heads * args.length**2 > MAX_PATTERN_CELLS:
        longest = int((MAX_PATTERN_CELLS / args.heads) ** 0.5)
        print(
            f"error: --length {args.length} with --heads {args.heads} is too large to draw "
            f"({args.heads} pictures of {args.length}^2 cells): use --length <= {longest}",
            file=sys.stderr,
        )
        return 2
    if args.mode == "head_groups":
        validation.check_head_groups(args.heads, len(segs), PATTERN_HEAD_GROUPS_FIX)
    lines = draw_pattern(
        args.out,
        args.length,
        args.heads,
        segs,
        rates,
        mode=args.mode,
        head_offsets=args.head_offsets or "interleaved",
        is_causal=args.causal,
    )
    print("\n".join(lines))
    print(f"wrote {args.out}")
    return 0


def _grid_pattern(args, segs, rates) -> int:
    from ..nn.ordering import ORDERS
    from .pattern import draw_grid_pattern

    height, width = args.grid
    heads = args.heads if args.heads is not None else max(rates)
    query = tuple(args.query) if args.query else (height // 2, width // 2)
    problems = []
    if not (0 <= query[0] < height and 0 <= query[1] < width):
        problems.append(f"--query {query[0]} {query[1]} must be a patch of the {height} x {width} grid")
    if args.head is not None and not 0 <= args.head < heads:
        problems.append(f"--head {args.head} must be in [0, {heads}) (a head of --heads {heads})")
    if height * width > MAX_PATTERN_CELLS or args.causal:
        problems.append("--grid draws images of at most 2**24 patches, without --causal (images attend both ways)")
    if heads > MAX_GRID_HEADS:
        problems.append(f"--heads {heads} must be at most {MAX_GRID_HEADS:,} with --grid (one head is drawn)")
    if problems:
        print("error: " + "; ".join(problems), file=sys.stderr)
        return 2
    if args.mode == "head_groups":
        validation.check_head_groups(heads, len(segs), PATTERN_HEAD_GROUPS_FIX)
    table = draw_grid_pattern(
        args.out,
        height,
        width,
        segs,
        rates,
        args.order or list(ORDERS),
        query,
        num_heads=heads,
        head=args.head,
        mode=args.mode,
        head_offsets=args.head_offsets or "interleaved",
    )
    print(table)
    print(f"wrote {args.out}")
    return 0


PATTERN_HEAD_GROUPS_FIX = "use more --heads, fewer --segment-lengths, or --mode mixture"


def _bench_setup(args, kind: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Check the device, the plot's extra and where the results go; the branches of a
    benchmark command."""
    device_type(args.device)
    if not args.no_plot:
        require("plot", "the plot of the results (or pass --no-plot)")
    _check_destination(args, kind)
    return validation.check_branches(args.segment_lengths, args.dilation_rates)


def _set_threads(args) -> None:
    """``--threads``, once every check has passed (a process-wide setting)."""
    if args.threads:
        torch.set_num_threads(args.threads)


def _check_destination(args, kind: str) -> None:
    """``--out-dir`` (by default the current directory, where a new folder goes) and
    ``--name``: where a benchmark's results can be written, before it measures."""
    check_output_folder("." if args.out_dir is None else args.out_dir, "--out-dir")
    if args.name is not None and (os.path.basename(args.name) != args.name or args.name in ("", ".", "..")):
        raise ValueError(
            f"--name must be a file name without a folder, got {args.name!r}: give the folder as --out-dir"
        )
    if args.out_dir is not None:  # a folder given may hold files (or folders) of these names already
        for extension in (".json", ".txt") + (() if args.no_plot else (".png",)):
            check_output_file(_results_stem(args, kind, args.out_dir) + extension, "--out-dir/--name")


def _results_stem(args, kind: str, out_dir: str) -> str:
    """Where a benchmark's results go, less the extension: ``<--name or
    kind-device-dtype-machine>`` (a run on another machine keeps its own files)."""
    machine = benchmark.machine_slug(torch.device(args.device))
    return os.path.join(out_dir, args.name or f"{kind}-{args.device}-{args.dtype}-{machine}")


def _cmd_bench(args) -> int:
    segs, rates = _bench_setup(args, "bench")
    if "head_groups" in args.impl:
        validation.check_head_groups(
            args.heads, len(segs), "use more --heads, fewer --segment-lengths, or leave head_groups out of --impl"
        )
    default_lens = [2**p for p in range(12, 18)] if args.device == "cpu" else [2**p for p in range(12, 21)]
    element = torch.empty((), dtype=DTYPES[args.dtype]).element_size()
    longest = max(args.seq_lens or default_lens)
    check_fits(
        4 * args.batch * longest * args.heads * args.head_dim * element,
        args.device,
        f"q, k, v and the output at --seq-lens {longest}",
        "use shorter --seq-lens (or a smaller --batch, --heads or --head-dim)",
    )
    check_fits(
        3 * args.matmul_size**2 * element,
        args.device,
        f"the reference matmul's operands and product at --matmul-size {args.matmul_size}",
        "use a smaller --matmul-size (the default, 4096, suits every device)",
    )
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
    _set_threads(args)
    result = benchmark.run(cfg, progress=not args.quiet)
    return _save_results(
        args,
        "bench",
        benchmark.to_json(result),
        benchmark.format_table(result),
        lambda path: benchmark.plot(result, path),
    )


def _cmd_decode_bench(args) -> int:
    from . import decode_benchmark

    segs, rates = _bench_setup(args, "decode")
    cfg = decode_benchmark.DecodeConfig(
        positions=args.positions,
        segment_lengths=segs,
        dilation_rates=rates,
        heads=args.heads,
        head_dim=args.head_dim,
        dtype=args.dtype,
        device=args.device,
        steps=args.steps,
        dense_steps=args.dense_steps,
        batch=args.batch,
    )
    check_fits(
        args.batch * decode_benchmark.row_bytes(cfg),
        args.device,
        f"the dilated caches of --batch {args.batch} sequences",
        "use a smaller --batch (or shorter --segment-lengths, fewer --heads or a smaller --head-dim)",
    )
    _set_threads(args)
    result = decode_benchmark.run(cfg, progress=None if args.quiet else decode_benchmark.say)
    return _save_results(
        args,
        "decode",
        decode_benchmark.to_json(result),
        decode_benchmark.format_table(result),
        lambda path: decode_benchmark.plot(result, path),
    )


def _save_results(args, kind: str, payload: dict, table: str, plot) -> int:
    """Write ``table``, ``payload`` (JSON) and, unless ``--no-plot``, ``plot(path)`` (PNG)
    into the results folder as ``<--name or kind-device-dtype-machine>.*``, then print
    ``table`` and say where (the files first: a reader gone from stdout loses nothing)."""
    out_dir = _bench_folder(args.out_dir)
    stem = _results_stem(args, kind, out_dir)
    # the options as parsed, so that the run can be repeated from its file
    arguments = {name: value for name, value in vars(args).items() if name != "run"}
    earlier_plot = os.path.isfile(stem + ".png")
    if earlier_plot:  # removed first: it would pass for this run's, with --no-plot or if drawing is interrupted
        os.remove(stem + ".png")
    write_results(stem, {**payload, "arguments": arguments}, table)
    files = f"{os.path.basename(stem)}.json, .txt"
    if not args.no_plot:
        plot(stem + ".png")
        files += ", .png"
    elif earlier_plot:
        files += " (the earlier run's .png removed)"
    print(table)
    print(f"results in {os.path.abspath(out_dir)}: {files}")
    return 0


def _bench_folder(out_dir: str | None) -> str:
    """``out_dir`` (created if missing), or by default a new folder in the current
    directory named after the time: a run never writes over an earlier one's results."""
    if out_dir is None:
        return fresh_folder(time.strftime("dilated-attention-bench-%Y%m%d-%H%M%S"))
    os.makedirs(out_dir, exist_ok=True)
    return out_dir


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="dilated-attention",
        description="Exact LongNet dilated attention: check it against its float64 reference, "
        "draw its attention pattern, benchmark it against dense attention, train a LongNet language "
        "model and sample from it.",
    )
    parser.add_argument(
        "--version",
        action="version",
        version=f"%(prog)s {__version__} (torch {torch.__version__})",
        help="print the versions of dilated-attention and torch and exit",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _add_check(sub)
    _add_pattern(sub)
    _add_bench(sub)
    _add_decode_bench(sub)
    add_train(sub, _add_command)
    add_generate(sub, _add_command)
    add_evaluate(sub, _add_command)
    return parser


def _add_command(sub, name: str, sentence: str, description: str) -> argparse.ArgumentParser:
    """A subcommand: ``sentence`` in the list of commands, ``description`` atop its own help."""
    return sub.add_parser(name, help=sentence, description=description)


def _add_check(sub) -> None:
    check = _add_command(
        sub,
        "check",
        "Compare the library with its float64 reference.",
        "Compare the library with its float64 reference on 24 configurations per dtype (both modes, "
        "causal or not, padding masks, odd and tiny lengths), print each case's errors and tolerance, "
        "and exit 1 if any case fails.",
    )
    check.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="device to run on (default: cpu)")
    check.add_argument(
        "--dtype",
        nargs="+",
        choices=list(DTYPES),
        default=["float64", "float32"],
        help="dtypes to check, each against its tolerance (default: float64 float32)",
    )
    check.add_argument("--seed", type=seed, default=0, help="seed of the random inputs, in [0, 2**63) (default: 0)")
    check.add_argument(
        "--kernel",
        choices=fused.CHOICES,
        help="which kernels to check: auto (Triton on CUDA for float16/bfloat16, else PyTorch's), "
        "triton or torch (default: $DILATED_ATTENTION_KERNEL, else auto)",
    )
    check.set_defaults(run=_cmd_check)


def _add_pattern(sub) -> None:
    from ..nn.ordering import ORDERS
    from ..ops.plan import HEAD_OFFSETS

    pattern = _add_command(
        sub,
        "pattern",
        "Draw each head's attention pattern as a PNG.",
        "Draw which keys each query attends to, one panel per head, as a PNG, and print one "
        "summary line per head. With --grid H W: for one patch of an H x W image, the patches it "
        "attends to in each branch, one row of panels per patch order, and print per order how "
        "compact the segments are on the image.",
    )
    pattern.add_argument(
        "--segment-lengths",
        type=positive_ints,
        nargs="+",
        metavar="W",
        required=True,
        help="segment length w of each branch, separated by spaces: 8 16 (required)",
    )
    pattern.add_argument(
        "--dilation-rates",
        type=positive_ints,
        nargs="+",
        metavar="R",
        required=True,
        help="dilation rate r of each branch, as many as --segment-lengths, separated by spaces (required)",
    )
    pattern.add_argument(
        "--length", type=positive_int, metavar="N", help="sequence length N, required without --grid (default: none)"
    )
    pattern.add_argument(
        "--heads",
        type=positive_int,
        metavar="H",
        help="number of heads H, required without --grid (default: none; with --grid, the largest rate)",
    )
    pattern.add_argument(
        "--mode", choices=MODES, default="mixture", help="how the branches share the heads (default: mixture)"
    )
    pattern.add_argument(
        "--causal", action="store_true", help="queries attend only to keys at or before them (default: off)"
    )
    pattern.add_argument(
        "--grid",
        type=positive_ints,
        nargs=2,
        metavar=("H", "W"),
        help="draw an image of H x W patches instead of a sequence (default: off)",
    )
    pattern.add_argument(
        "--order",
        nargs="+",
        choices=ORDERS,
        help="with --grid: the patch orders to compare (default: all three)",
    )
    pattern.add_argument(
        "--query",
        type=number(int, 0, several=True),
        nargs=2,
        metavar=("ROW", "COL"),
        help="with --grid: the query patch (default: the centre)",
    )
    pattern.add_argument(
        "--head", type=int, help="with --grid: the head to draw (default: per branch, a head that keeps the query)"
    )
    pattern.add_argument(
        "--head-offsets",
        choices=HEAD_OFFSETS,
        help="which offset a head uses in a branch of mixture (default: interleaved)",
    )
    pattern.add_argument(
        "--out",
        default="pattern.png",
        help="PNG file to write; its folder is created if missing (default: pattern.png)",
    )
    pattern.set_defaults(run=_cmd_pattern)


def _add_run_options(bench, tensors: str, stem: str) -> None:
    """The options both benchmark commands share: device, dtype of ``tensors``, the
    attention's shape, threads, and where the results go (files named ``stem-...``)."""
    bench.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="device to run on (default: cpu)")
    bench.add_argument(
        "--dtype", choices=list(DTYPES), default="float32", help=f"dtype of {tensors} (default: float32)"
    )
    bench.add_argument(
        "--segment-lengths",
        type=positive_ints,
        nargs="+",
        metavar="W",
        default=[2048, 4096, 8192],
        help="segment length w of each branch, separated by spaces (default: 2048 4096 8192)",
    )
    bench.add_argument(
        "--dilation-rates",
        type=positive_ints,
        nargs="+",
        metavar="R",
        default=[1, 2, 4],
        help="dilation rate r of each branch, separated by spaces (default: 1 2 4)",
    )
    bench.add_argument("--heads", type=positive_int, metavar="H", default=8, help="number of heads H (default: 8)")
    bench.add_argument(
        "--head-dim", type=positive_int, metavar="D", default=64, help="size D of each head (default: 64)"
    )
    bench.add_argument(
        "--threads",
        type=threads,
        help="CPU threads, for torch.set_num_threads, at most 4096 (default: torch's own)",
    )
    bench.add_argument("--no-plot", action="store_true", help="write no PNG plot (default: off)")
    bench.add_argument(
        "--out-dir",
        help="folder to write the results into, created if missing (default: a new "
        "folder dilated-attention-bench-YYYYmmdd-HHMMSS in the current directory)",
    )
    bench.add_argument(
        "--name",
        help=f"file name stem of the JSON, text and PNG files (default: {stem}-DEVICE-DTYPE-MACHINE, the "
        "machine as the CPU model or the GPU's name)",
    )


def _add_bench(sub) -> None:
    bench = _add_command(
        sub,
        "bench",
        "Time dense vs dilated attention; measure their memory.",
        "Time dense and dilated attention (forward, and forward+backward), measure the peak memory "
        "a call adds, compare their speed with a square matmul's, and write a JSON file, a text "
        "table and a plot into a new folder (or --out-dir).",
    )
    _add_run_options(bench, "q, k, v", "bench")
    bench.add_argument(
        "--seq-lens",
        type=positive_ints,
        nargs="+",
        metavar="N",
        help="sequence lengths N to measure, "
        "separated by spaces (default: powers of 2 from 4096 to 131072 on CPU, to 1048576 on CUDA)",
    )
    bench.add_argument("--batch", type=positive_int, metavar="B", default=1, help="batch size B (default: 1)")
    bench.add_argument(
        "--causal", action="store_true", help="queries attend only to keys at or before them (default: off)"
    )
    impls = benchmark.IMPLEMENTATIONS
    bench.add_argument(
        "--impl",
        nargs="+",
        choices=benchmark.ALL_IMPLEMENTATIONS,
        default=list(impls),
        help="implementations to measure: dense is PyTorch SDPA, kernel the fused kernel alone, "
        "mixture and head_groups the library (the fused Triton kernels where they apply), "
        "mixture-torch the library on PyTorch's kernels, flex PyTorch's FlexAttention computing the "
        f"same mixture (default: {' '.join(impls)})",
    )
    bench.add_argument(
        "--repeats",
        type=positive_int,
        default=3,
        help="timed runs per measurement, of which the median counts (default: 3)",
    )
    bench.add_argument(
        "--max-seconds",
        type=positive_float,
        default=60.0,
        help="skip a measurement predicted to take longer, such as dense at large N (default: 60)",
    )
    bench.add_argument(
        "--matmul-size",
        type=positive_int,
        default=4096,
        help="side of the square matmul the speed ratios refer to (default: 4096)",
    )
    bench.add_argument("--no-backward", action="store_true", help="time the forward only (default: off)")
    bench.add_argument("--no-memory", action="store_true", help="do not measure peak memory (default: off)")
    bench.add_argument(
        "--quiet",
        action="store_true",
        help="no progress on stderr (default: off, so a bar on a terminal, else a line per measurement)",
    )
    bench.set_defaults(run=_cmd_bench)


def _add_decode_bench(sub) -> None:
    bench = _add_command(
        sub,
        "decode-bench",
        "Time one-token decode steps: DilatedKVCache vs a dense KV cache.",
        "Time one-token steps of DilatedKVCache and of a preallocated dense KV cache (SDPA over every "
        "cached key, PyTorch's fastest backend for it; on CUDA also both captured in CUDA graphs) at several "
        "positions, for one sequence, a batch at one position and a left-padded batch; measure the caches' "
        "memory, and write a JSON file, a text table and a plot into a new folder (or --out-dir).",
    )
    bench.add_argument(
        "--positions",
        type=position,
        nargs="+",
        metavar="P",
        default=[1, 1024, 4096, 8192, 65536, 2**20],
        help="positions (tokens already seen) to measure at, separated by spaces "
        "(default: 1 1024 4096 8192 65536 1048576)",
    )
    bench.add_argument(
        "--batch",
        type=positive_int,
        default=8,
        help="sequences of the two batched runs, one at a single position and one left-padded (default: 8)",
    )
    _add_run_options(bench, "the caches", "decode")
    bench.add_argument(
        "--steps",
        type=positive_int,
        default=8192,
        help="one-token steps timed per position for the dilated cache, spread evenly over a whole "
        "cycle of segment phases (lcm of the segment lengths, at most 65536 positions; fewer before the "
        "position reaches it): a step's cost depends on its place in its segments (default: 8192)",
    )
    bench.add_argument(
        "--dense-steps",
        type=dense_steps,
        default=16,
        help="one-token steps timed per position for the dense cache, spread over the same span as the "
        "dilated cache's, at most 65536 (default: 16)",
    )
    bench.add_argument("--quiet", action="store_true", help="no progress on stderr (default: off)")
    bench.set_defaults(run=_cmd_decode_bench)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except BaseException as exc:
        code = exit_status(exc)
        if code is None:
            raise
        return code
