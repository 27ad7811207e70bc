"""LongNet training with dilated vs dense causal attention, measured side by side.

    python3 benchmarks/longnet_training.py speed   [--contexts 4096 16384 65536] [--max-seconds 400]
    python3 benchmarks/longnet_training.py quality [--minutes 6] [--context 16384]

Both use the ``small`` preset (256 dims, 4 layers, 8 heads, about 3.2 M parameters);
"dense" is the same model with one branch ``w = context, r = 1``, which the library
runs as one causal call of PyTorch's fused attention (SDPA) per layer and head group.

- ``speed``: one training step (forward, backward, AdamW) on one sequence of each
  context: tokens per second (median of the timed steps, after one warm-up step) in
  one fresh process per model and context, and the peak memory a step adds (after a
  warm-up step) in another (measuring memory makes glibc map every large block afresh
  for the rest of a process). A dense step predicted (from the previous context,
  quadratically) to take longer than ``--max-seconds`` is skipped and marked so.
- ``quality``: both models trained for the same training-time budget on the default
  corpus at one context (batch 1, learning rate 2e-3 after 10 warm-up steps,
  constant, so a budget's end cuts neither schedule short), validation bits per byte
  against training seconds on one plot.

Writes benchmarks/results/longnet-<speed|quality>-<device>.json, .txt and .png.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
from torch.nn import functional as F

from dilated_attention.models import LongNetConfig, LongNetLM
from dilated_attention.tools.arguments import positive_float, positive_int, positive_ints, threads
from dilated_attention.tools.benchmark import PeakMemory, json_from, machine_info, machine_words
from dilated_attention.training import TrainSettings, read_log, train
from dilated_attention.utils.files import write_results
from dilated_attention.utils.plotting import pyplot, save

HERE = os.path.dirname(os.path.abspath(__file__))
PRESET = "small"


def variants(context: int) -> dict:
    dilated = LongNetConfig.preset(PRESET)
    return {"dilated": dilated, "dense": dilated.replace(segment_lengths=(context,), dilation_rates=(1,))}


def step_cost(config: LongNetConfig, context: int, device: torch.device, repeats: int) -> dict:
    """Seconds per training step, batch 1: the median of ``repeats``, or with
    ``repeats = 0`` the peak bytes one step adds instead. Each after one step not
    counted (the optimizer's state is allocated there)."""
    torch.manual_seed(0)
    model = LongNetLM(config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, config.vocab_size, (1, context + 1), device=device)

    def step():
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    if not repeats:
        with PeakMemory(device) as memory:
            step()
        return {"peak_mib": memory.added / 2**20}
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    return {"seconds": seconds, "tokens_per_s": context / seconds}


def step_cost_apart(args, name: str, context: int) -> dict:
    """:func:`step_cost` of the model ``name`` at ``context``: its time in one fresh
    process, its memory in another (measuring memory slows what a process times after
    it, and what it measures after timings inherits their heap)."""
    cost = {}
    for repeats in (args.repeats, 0):
        command = [sys.executable, __file__, "row", name, str(context), "--device", args.device]
        command += ["--repeats", str(repeats)] + (["--threads", str(args.threads)] if args.threads else [])
        cost.update(json_from(command, f"the {name} row at {context}"))
    return cost


def speed(args, device) -> tuple[dict, str]:
    rows, predicted = [], {}
    for context in args.contexts:
        for name in variants(context):
            guess = predicted.get(name)
            if guess is not None and guess > args.max_seconds:
                rows.append({"context": context, "attention": name, "skipped_predicted_s": guess})
                print(f"{name:8} {context:6}: skipped, predicted {guess:.0f} s per step", flush=True)
                continue
            cost = step_cost_apart(args, name, context)
            rows.append({"context": context, "attention": name, **cost})
            # Predict the next context's step: quadratic for dense, linear for dilated.
            predicted[name] = cost["seconds"] * (4 if name == "dense" else 1) * 4  # contexts grow 4x
            print(
                f"{name:8} {context:6}: {cost['tokens_per_s']:8.0f} tokens/s, {cost['peak_mib']:7.0f} MiB", flush=True
            )
    lines = [
        (f"LongNet '{PRESET}' training step, batch 1, float32, {device.type} ({machine_words(machine_info(device))})"),
        (
            f"{'context':>8} {'dilated tok/s':>14} {'dense tok/s':>12} {'speed-up':>9} "
            f"{'dilated MiB':>12} {'dense MiB':>10}"
        ),
    ]
    for context in args.contexts:
        d, s = (next(r for r in rows if r["context"] == context and r["attention"] == a) for a in ("dilated", "dense"))
        if "seconds" in s:
            lines.append(
                f"{context:8} {d['tokens_per_s']:14.0f} {s['tokens_per_s']:12.0f} "
                f"{s['seconds'] / d['seconds']:8.1f}x {d['peak_mib']:12.0f} {s['peak_mib']:10.0f}"
            )
        else:
            lines.append(
                f"{context:8} {d['tokens_per_s']:14.0f} {'skipped':>12} {'':>9} {d['peak_mib']:12.0f} "
                f"{'':>10}  (dense predicted {s['skipped_predicted_s']:.0f} s/step)"
            )
    return {"rows": rows}, "\n".join(lines)


def quality(args, device) -> tuple[dict, str]:
    curves = {}
    with tempfile.TemporaryDirectory() as folder:
        for name, config in variants(args.context).items():
            settings = TrainSettings(
                context=args.context,
                batch_size=1,
                steps=10**6,
                minutes=args.minutes,
                lr=2e-3,
                warmup_steps=10,
                min_lr_ratio=1.0,
                eval_interval=args.eval_interval[name],
                eval_windows=2,
                checkpoint_interval=10**6,
                seed=0,
            )
            print(f"training {name} for {args.minutes} min of training time", flush=True)
            run = os.path.join(folder, name)
            train(run, settings, config, device=device.type, progress=True)
            curves[name] = [
                {k: r[k] for k in ("step", "elapsed_s", "loss", "bpb", "val_bpb") if k in r} for r in read_log(run)
            ]
    lines = [
        (
            f"LongNet '{PRESET}', context {args.context}, batch 1, {args.minutes} min of training time each, "
            f"{device.type} ({machine_words(machine_info(device))})"
        ),
        f"{'attention':>10} {'steps':>6} {'tokens':>10} {'val bits/byte':>14}",
    ]
    for name, records in curves.items():
        evaluated = [r for r in records if "val_bpb" in r]
        lines.append(
            f"{name:>10} {records[-1]['step']:6} {records[-1]['step'] * args.context:10} "
            f"{evaluated[-1]['val_bpb']:14.3f}"
        )
    return {"curves": curves}, "\n".join(lines)


def plot_quality(payload: dict, path: str, title: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for (name, records), color in zip(payload["curves"].items(), ("C0", "C3"), strict=True):
        ax.plot([r["elapsed_s"] for r in records], [r["bpb"] for r in records], color=color, lw=0.6, alpha=0.4)
        evaluated = [r for r in records if "val_bpb" in r]
        ax.plot(
            [r["elapsed_s"] for r in evaluated],
            [r["val_bpb"] for r in evaluated],
            "o-",
            color=color,
            ms=3,
            label=f"{name}: validation",
        )
    ax.set_xlabel("training time (s)")
    ax.set_ylabel("bits per byte (thin: training batches)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    save(fig, path, title)


def plot_speed(payload: dict, path: str, title: str) -> None:
    plt = pyplot()
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(8, 3.4))
    for name, color in (("dilated", "C0"), ("dense", "C3")):
        rows = [r for r in payload["rows"] if r["attention"] == name and "seconds" in r]
        ax_t.plot([r["context"] for r in rows], [r["tokens_per_s"] for r in rows], "o-", color=color, label=name)
        ax_m.plot([r["context"] for r in rows], [r["peak_mib"] for r in rows], "o-", color=color, label=name)
    for ax, label in ((ax_t, "training tokens / s"), (ax_m, "peak memory added (MiB)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    save(fig, path, title)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="part", required=True, metavar="{speed,quality}")
    s = sub.add_parser("speed", help="tokens/s and peak memory of a training step")
    s.add_argument("--contexts", type=positive_ints, nargs="+", default=[4096, 16384, 65536])
    s.add_argument("--repeats", type=positive_int, default=2, help="timed steps per measurement (default: 2)")
    s.add_argument("--max-seconds", type=positive_float, default=400.0, help="skip a step predicted to take longer")
    q = sub.add_parser("quality", help="validation bits per byte after the same training time")
    q.add_argument("--minutes", type=positive_float, default=6.0, help="training time per model (default: 6)")
    q.add_argument("--context", type=positive_int, default=16384)
    one = sub.add_parser("row")  # one speed row, in the process speed starts for it
    one.add_argument("name", choices=("dilated", "dense"))
    one.add_argument("context", type=int)
    one.add_argument("--repeats", type=int, default=2, help="timed steps; 0: the memory of one step")
    for p in (s, q, one):
        p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
        p.add_argument("--threads", type=threads, help="torch.set_num_threads (default: torch's own)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if args.part == "row":
        print(json.dumps(step_cost(variants(args.context)[args.name], args.context, device, args.repeats)))
        return 0
    if args.part == "speed":
        payload, table = speed(args, device)
        plot = plot_speed
    else:
        args.eval_interval = {"dilated": 10, "dense": 3}
        payload, table = quality(args, device)
        plot = plot_quality
    print(table)
    stem = os.path.join(HERE, "results", f"longnet-{args.part}-{args.device}")
    payload = {"machine": machine_info(device), "dtype": "float32", "command": " ".join(sys.argv), **payload}
    write_results(stem, payload, table)
    plot(payload, stem + ".png", table.splitlines()[0])
    print(f"wrote {stem}.json, .txt and .png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
