"""Does dilated attention retrieve from far away? The same small LongNet trained three
ways for the same time on this machine, then scored by distance between fact and question.

    python3 benchmarks/long_range.py [--minutes 8] [--context 4096] [--task passkey]

- ``dilated``: branches whose segments reach the whole context
  (``w = [256, 1024, 4096], r = [1, 4, 16]`` at context 4096: every branch attends to
  256 selected positions per segment);
- ``local``: the shortest branch alone (``w = [256], r = [1]``): a sliding segment;
- ``dense``: one segment of the whole context (``w = [4096], r = [1]``): full causal attention.

Each trains ``--minutes`` of training time (evaluation excluded) on the standard
library's sources with ``--task-fraction`` of the sequences replaced by task examples
at random distances (``train --task``), then is scored on the same ``--examples``
examples per distance (``dilated-attention evaluate``). The model: 4 layers, 128
dims, 8 heads, float32, batch 4. Writes benchmarks/results/long-range-<task>-cpu.json,
.txt and .png; the runs go to a temporary folder (``--keep`` keeps them).
"""

import argparse
import dataclasses
import os
import shutil
import sys
import tempfile

import torch

from dilated_attention.models import LongNetConfig
from dilated_attention.tools.arguments import positive_float, positive_int
from dilated_attention.tools.benchmark import machine_info
from dilated_attention.training import TrainSettings, evaluate_run, read_log, retrieval, tasks, train
from dilated_attention.utils.files import write_results

HERE = os.path.dirname(os.path.abspath(__file__))


def setups(context: int) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """Branches ``(segment_lengths, dilation_rates)`` of each set-up at ``context``."""
    short = context // 16
    return {
        "dilated": ((short, context // 4, context), (1, 4, 16)),
        "local": ((short,), (1,)),
        "dense": ((context,), (1,)),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=positive_float, default=8.0, help="training time per set-up (default: 8)")
    parser.add_argument(
        "--context", type=positive_int, default=4096, help="training context, a multiple of 16 (default: 4096)"
    )
    parser.add_argument("--task", choices=tasks.TASKS, default="passkey", help="the task (default: passkey)")
    parser.add_argument(
        "--task-fraction",
        type=float,
        default=0.5,
        help="share of training sequences that are task examples (default: 0.5)",
    )
    parser.add_argument("--examples", type=positive_int, default=32, help="examples per distance (default: 32)")
    parser.add_argument(
        "--only",
        nargs="+",
        choices=("dilated", "local", "dense"),
        help="run only these set-ups (their files named after them: long-range-TASK-cpu-local.*)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the run folders")
    args = parser.parse_args()
    torch.set_num_threads(min(torch.get_num_threads(), 2))
    folder = tempfile.mkdtemp(prefix="long-range-")
    results, runs = [], {}
    try:
        for name, (segment_lengths, dilation_rates) in setups(args.context).items():
            if args.only and name not in args.only:
                continue
            config = LongNetConfig(
                dim=128, depth=4, heads=8, ffn_dim=512, segment_lengths=segment_lengths, dilation_rates=dilation_rates
            )
            # A constant learning rate after warmup: the run stops on time, not at the end of a schedule.
            settings = TrainSettings(
                context=args.context,
                batch_size=4,
                steps=10**6,
                minutes=args.minutes,
                warmup_steps=30,
                min_lr_ratio=1.0,
                eval_interval=10**6,
                eval_windows=4,
                checkpoint_interval=10**6,
                task=args.task,
                task_fraction=args.task_fraction,
            )
            run_dir = os.path.join(folder, name)
            print(
                f"training {name} (w={list(segment_lengths)}, r={list(dilation_rates)}) for {args.minutes} min",
                file=sys.stderr,
                flush=True,
            )
            summary = train(run_dir, settings, config, progress=False)
            log = read_log(run_dir)
            result = evaluate_run(run_dir, args.task, examples=args.examples)  # also into the run folder
            result.about = {
                "setup": name,
                "branches": f"w={list(segment_lengths)} r={list(dilation_rates)}",
                "steps": summary["step"],
                "train_s": summary["elapsed_s"],
                "tokens_per_s": summary["step"] * settings.batch_size * settings.context / summary["elapsed_s"],
                "final_train_bpb": log[-1]["bpb"],
                "val_bpb": log[-1].get("val_bpb"),
            }
            print(retrieval.format_table(result), file=sys.stderr, flush=True)
            results.append((name, result))
            runs[name] = {"model": config.to_dict(), "settings": dataclasses.asdict(settings)}
    finally:
        if args.keep:
            print(f"runs kept in {folder}", file=sys.stderr)
        else:
            shutil.rmtree(folder, ignore_errors=True)
    machine = machine_info(torch.device("cpu"))
    text = table(results, args, machine)
    print(text)
    # a run of some set-ups only keeps its own files beside the whole comparison's
    only = "".join(f"-{name}" for name in ("dilated", "local", "dense") if args.only and name in args.only)
    stem = os.path.join(HERE, "results", f"long-range-{args.task}-cpu{only}")
    write_results(
        stem,
        {
            "machine": machine,
            "dtype": "float32",
            "task": args.task,
            "minutes": args.minutes,
            "context": args.context,
            "task_fraction": args.task_fraction,
            "runs": runs,
            "results": {name: retrieval.to_json(r) for name, r in results},
        },
        text,
    )
    retrieval.plot(
        results,
        stem + ".png",
        f"{args.task} retrieval by distance after {args.minutes:g} min of "
        f"training each, context {args.context} ({machine['cpu']}, float32)",
    )
    return 0


def table(results, args, machine) -> str:
    lines = [
        (
            f"{args.task} retrieval by distance: the same LongNet (4 layers, 128 dims, 8 heads) trained "
            f"{args.minutes:g} min each at context {args.context}, {args.task_fraction:g} of the sequences task "
            f"examples; {machine['cpu']}, {machine.get('threads', 2)} threads, float32, torch {torch.__version__}"
        ),
        "",
        f"{'set-up':8} {'branches':32} {'steps':>6} {'tokens/s':>9} {'train bpb':>10}",
    ]
    for name, r in results:
        a = r.about
        lines.append(
            f"{name:8} {a['branches']:32} {a['steps']:>6} {a['tokens_per_s']:>9.0f} {a['final_train_bpb']:>10.3f}"
        )
    chance = results[0][1].chance if results else 0.0
    lines += [
        "",
        (
            f"accuracy (answered exactly, {args.examples} examples per distance; chance {chance:g}) / answer loss "
            "in bits per byte"
        ),
    ]
    lines.append(f"{'distance':>9} " + " ".join(f"{name:>16}" for name, _ in results))
    for i, score in enumerate(results[0][1].scores if results else []):
        cells = [f"{r.scores[i].accuracy:>7.3f} / {r.scores[i].answer_bits:>6.2f}" for _, r in results]
        lines.append(f"{score.distance:>9} " + " ".join(f"{c:>16}" for c in cells))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
