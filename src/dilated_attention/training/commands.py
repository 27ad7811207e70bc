"""``dilated-attention train`` and ``dilated-attention generate``."""

from __future__ import annotations

import argparse
import codecs
import dataclasses
import os
import shlex
import shutil
import signal
import sys
import time
import traceback

import torch

from ..models import PRESETS, LongNetConfig
from ..ops.validation import counted
from ..tools.arguments import number, seed
from ..tools.errors import exit_status
from ..utils.devices import device_type
from ..utils.files import check_output_folder
from . import checkpoint, parallel, run_folder, tasks
from .run_folder import read_log, read_run_config
from .settings import AUTOCAST_DTYPES, TrainSettings
from .trainer import load_model, train

RUNS = "runs"


# The settings the command line sets, by option: (field, type, help).
_SETTINGS = [
    ("--context", "context", number(int, 1), "tokens (bytes) per training sequence"),
    ("--batch-size", "batch_size", number(int, 1), "sequences per step, over all processes"),
    ("--steps", "steps", number(int, 1), "total optimizer steps, also when resuming (the schedule's length)"),
    (
        "--minutes",
        "minutes",
        number(float, 0, False),
        "stop after this much training time in this invocation (evaluation not counted); resume later",
    ),
    ("--lr", "lr", number(float, 0, False), "peak learning rate"),
    ("--warmup-steps", "warmup_steps", number(int, 0), "steps of linear warmup, then a cosine to lr/10"),
    ("--weight-decay", "weight_decay", number(float, 0), "AdamW weight decay on matrices"),
    ("--grad-clip", "grad_clip", number(float, 0, False), "clip the gradient norm to this"),
    ("--seed", "seed", seed, "seed of the initialisation, the batches and dropout, in [0, 2**63)"),
    ("--eval-interval", "eval_interval", number(int, 1), "steps between validation losses"),
    (
        "--eval-windows",
        "eval_windows",
        number(int, 1),
        "validation sequences per evaluation, at most every one the validation split holds",
    ),
    ("--checkpoint-interval", "checkpoint_interval", number(int, 1), "steps between checkpoints"),
    (
        "--task-fraction",
        "task_fraction",
        number(float, 0),
        "with --task: the fraction of training sequences that are task examples",
    ),
]


def add_train(sub, add_command) -> None:
    p = add_command(
        sub,
        "train",
        "Train a LongNet language model on bytes (resumable).",
        "Train a decoder-only LongNet (causal dilated attention) on UTF-8 text as bytes: by default on the "
        "Python standard library's own sources. Writes config.json, log.jsonl, loss.png and checkpoint.pt "
        "(the one before it kept as checkpoint.previous.pt) into the run folder, which one process holds at a "
        "time. Under torchrun the processes split each step (data parallel, or --sequence-parallel). Ctrl-C "
        "stops after the current step with a checkpoint.",
    )
    where = p.add_mutually_exclusive_group()
    where.add_argument("--out", type=folder, help=f"the run folder (default: a new folder {RUNS}/YYYYmmdd-HHMMSS-PID)")
    where.add_argument(
        "--resume",
        type=folder,
        metavar="RUN_DIR",
        help="continue this run exactly where its checkpoint left it (default: start a new run)",
    )
    model = p.add_mutually_exclusive_group()
    model.add_argument("--preset", choices=sorted(PRESETS), help="model preset (default: tiny)")
    model.add_argument(
        "--config", metavar="JSON", help="a LongNetConfig as a JSON file, instead of --preset (default: the preset)"
    )
    p.add_argument(
        "--data",
        type=file_or_folder,
        help="a UTF-8 text file or a folder of them (default: the standard library's sources)",
    )
    defaults = TrainSettings()
    for option, name, kind, text in _SETTINGS:
        shown = {"minutes": "no limit", "context": f"{defaults.context}, or the longest segment if longer"}.get(
            name, getattr(defaults, name)
        )
        p.add_argument(option, dest=name, type=kind, help=f"{text} (default: {shown})")
    p.add_argument(
        "--task",
        choices=tasks.TASKS,
        help="mix examples of this long-range retrieval task into the training text (see the evaluate "
        "command), at random distances up to the context (default: none)",
    )
    p.add_argument(
        "--dtype",
        choices=sorted(AUTOCAST_DTYPES),
        help=f"compute dtype; bfloat16 runs under autocast, on CPU too (default: {defaults.dtype})",
    )
    p.add_argument(
        "--grad-checkpointing",
        action="store_true",
        default=None,
        help="recompute each block's activations in backward: less memory (default: off)",
    )
    p.add_argument(
        "--sequence-parallel",
        action="store_true",
        default=None,
        help="under torchrun, split every sequence across the processes instead of the batch "
        "(default: off, data parallel)",
    )
    add_device_option(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bar (default: a progress bar)")
    p.set_defaults(run=_cmd_train)


def _given_settings(args) -> dict:
    names = [name for _, name, _, _ in _SETTINGS] + ["dtype", "grad_checkpointing", "sequence_parallel", "data", "task"]
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}


def _cmd_train(args) -> int:
    device_type(args.device)  # CUDA without a GPU, in the option's words
    given = _given_settings(args)
    if "task_fraction" in given and "task" not in given and not args.resume:
        raise ValueError("--task-fraction needs --task: name the task to mix in (passkey or recall)")
    if args.resume:
        if args.preset or args.config:
            raise ValueError("a resumed run keeps its model: drop --preset/--config")
        _, saved = read_run_config(args.resume)
        # A time limit is per invocation: the saved one does not carry over.
        run_dir, config, settings = args.resume, None, dataclasses.replace(saved, **{"minutes": None, **given})
    else:
        config = _model_config(args)
        given.setdefault("context", max(TrainSettings.context, config.max_segment))
        settings = TrainSettings(**given)
        # The process id keeps runs started in the same second apart.
        run_dir = args.out or os.path.join(RUNS, f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
    try:
        summary = train(
            run_dir, settings, config, resume=bool(args.resume), device=args.device, progress=not args.no_progress
        )
    except BaseException as exc:
        if not args.resume and not args.out:
            _remove_if_unused(run_dir)
        if isinstance(exc, KeyboardInterrupt) and _can_resume(run_dir):  # a second Ctrl-C: stopped at once
            if int(os.environ.get("RANK", "0")) == 0:
                print(
                    "\ninterrupted: continue from the last checkpoint with: dilated-attention train "
                    f"--resume {shlex.quote(run_dir)}",
                    file=sys.stderr,
                )
            return _ended(130)
        if parallel.launched_processes() > 1:  # said here, then ended here (see _ended), the error still held
            code = exit_status(exc)
            if code is None:
                traceback.print_exc()
            _ended(1 if code is None else code)
        raise
    if int(os.environ.get("RANK", "0")) == 0:
        _report(summary)
    # as a shell reports a process a signal ended: 128 + its number (130 for Ctrl-C, 143 for SIGTERM)
    code = 128 + signal.Signals[summary["signal"] or "SIGINT"] if summary["stopped"] == "interrupted" else 0
    return _ended(code)


def _ended(code: int) -> int:
    """``code``, which one process returns; one of several started by ``torchrun`` ends
    here instead, its output flushed. Its process group is gone and everything is
    written, but what Python frees at exit can hang or abort it: DDP's gradient
    reducer, freed with an error's traceback, can wait forever on gloo's worker
    thread (found after a failed write and after Ctrl-C), and torch 2.13's gloo can
    abort ("terminate called without an active exception"), which torchrun reports
    as a failure."""
    if parallel.launched_processes() == 1:
        return code
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def add_run_option(p) -> None:
    """``--run RUN_DIR`` (default: :func:`newest_run`), for the commands that read a run."""
    p.add_argument(
        "--run",
        dest="run_dir",
        type=folder,
        metavar="RUN_DIR",
        help=f"the run folder (default: the newest under {RUNS}/ that finished a step)",
    )


def add_device_option(p) -> None:
    p.add_argument("--device", choices=("cpu", "cuda"), help="device to run on (default: cuda if available, else cpu)")


def folder(text: str) -> str:
    """An argparse type: a folder's path, not empty, in UTF-8 (a run folder's checkpoint
    is read back through PyTorch, which takes no other)."""
    problem = run_folder.not_utf8(file_or_folder(text, "a folder"))
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return text


def file_or_folder(text: str, what: str = "a file or folder") -> str:
    """An argparse type: a file's or folder's path, not empty."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"must name {what}, got an empty string")
    return text


def _can_resume(run_dir: str) -> bool:
    """Whether ``run_dir`` holds a run that ``--resume`` continues (its ``config.json``
    is written before the first step)."""
    return os.path.isfile(os.path.join(run_dir, run_folder.CONFIG))


def _remove_if_unused(run_dir: str) -> None:
    """Delete the default run folder of a run that failed before writing anything."""
    if os.path.isdir(run_dir) and set(os.listdir(run_dir)) <= {run_folder.LOCK}:
        shutil.rmtree(run_dir, ignore_errors=True)


def _model_config(args) -> LongNetConfig:
    if args.config is None:
        return LongNetConfig.preset(args.preset or "tiny")
    try:
        with open(args.config, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise ValueError(f"--config {args.config}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"--config {args.config} is not UTF-8 text (byte {exc.start}): give a JSON file") from None
    try:
        return LongNetConfig.from_json(text)
    except TypeError as exc:
        raise TypeError(f"--config {args.config}: {exc}") from None
    except ValueError as exc:
        raise ValueError(f"--config {args.config}: {exc}") from None


def _report(summary: dict) -> None:
    records = read_log(summary["run_dir"])
    evaluated = [r for r in records if "val_bpb" in r]
    print(f"trained {summary['parameters']:,} parameters on {summary['corpus']}")
    losses = (
        f": training loss {records[0]['bpb']:.2f} -> {records[-1]['bpb']:.2f} bits per byte"
        if records
        else " (no steps logged)"
    )
    earlier = f", the sessions before step {summary['resumed_from']} included" if summary["resumed_from"] else ""
    print(
        f"step {summary['step']}/{summary['steps']} ({summary['stopped']}) after {summary['elapsed_s']:.0f} s of "
        f"training in all{earlier}{losses}" + (f", validation {evaluated[-1]['val_bpb']:.2f}" if evaluated else "")
    )
    print(f"run folder: {summary['run_dir']} (log.jsonl, loss.png, checkpoint.pt)")
    if summary["stopped"] != "done":
        print(f"continue with: dilated-attention train --resume {shlex.quote(summary['run_dir'])}")


def add_generate(sub, add_command) -> None:
    p = add_command(
        sub,
        "generate",
        "Sample text from a trained run, streaming it.",
        "Sample text from the latest checkpoint of a run folder through the model's cache (memory "
        "bounded by the longest segment, however long the text), print it as it comes, then the "
        "speed and the cache's size.",
    )
    add_run_option(p)
    p.add_argument(
        "--prompt", required=True, help="the text to continue, taken as the bytes the command line passes (required)"
    )
    p.add_argument("--max-new-tokens", type=number(int, 0), default=200, help="bytes to sample (default: 200)")
    p.add_argument(
        "--temperature",
        type=number(float, 0),
        default=0.8,
        help="sampling temperature; 0 always takes the likeliest byte (default: 0.8)",
    )
    p.add_argument("--top-k", type=number(int, 1), help="sample among the k likeliest bytes (default: all)")
    p.add_argument(
        "--top-p",
        type=number(float, 0, False),
        default=0.95,
        help="sample among the likeliest bytes whose probability reaches p (default: 0.95)",
    )
    p.add_argument("--seed", type=seed, default=0, help="seed of the sampling, in [0, 2**63) (default: 0)")
    add_device_option(p)
    p.set_defaults(run=_cmd_generate)


def add_evaluate(sub, add_command) -> None:
    p = add_command(
        sub,
        "evaluate",
        "Score a trained run on long-range retrieval, by distance.",
        "Score the latest checkpoint of a run folder on a synthetic retrieval task at distances between fact "
        "and question from the shortest up to the run's context, in powers of two: passkey (a five-digit key "
        "hidden once in text of the run's validation split, asked for at the end) or recall (key-value pairs, "
        "one key repeated at the end: its value must follow). An example counts as answered when greedy "
        "decoding writes the answer exactly. Prints a table and writes retrieval-TASK.json, .txt and .png "
        "(accuracy and answer loss against distance, each branch's reach marked) into the run folder.",
    )
    add_run_option(p)
    p.add_argument("--task", required=True, choices=tasks.TASKS, help="the task (required)")
    p.add_argument("--examples", type=number(int, 1), default=32, help="examples per distance (default: 32)")
    p.add_argument(
        "--max-distance",
        type=number(int, 1),
        help="the longest distance, never exceeded; beyond the context, examples grow longer than the "
        "training sequences (default: as far as the run's context allows, at least the task's shortest)",
    )
    p.add_argument("--batch-size", type=number(int, 1), default=8, help="examples per forward pass (default: 8)")
    p.add_argument("--seed", type=seed, default=0, help="seed of the examples, in [0, 2**63) (default: 0)")
    p.add_argument("--out", type=folder, help="folder for the results (default: the run folder)")
    p.add_argument(
        "--data",
        type=file_or_folder,
        help="passkey: the text the key hides in, from its validation split (default: the run's training data)",
    )
    add_device_option(p)
    p.set_defaults(run=_cmd_evaluate)


def _cmd_evaluate(args) -> int:
    from .retrieval import evaluate_run, format_table

    run_dir = args.run_dir or newest_run()
    if args.out is not None:
        check_output_folder(args.out, "--out")
    if args.max_distance is not None and args.max_distance < tasks.min_distance(args.task):
        raise ValueError(
            f"--max-distance must be at least {tasks.min_distance(args.task)} for {args.task}, got {args.max_distance}"
        )
    result = evaluate_run(
        run_dir,
        args.task,
        examples=args.examples,
        max_distance=args.max_distance,
        seed=args.seed,
        batch_size=args.batch_size,
        device=device_type(args.device),
        out=args.out,
        data=args.data,
    )
    print(format_table(result))
    print(f"wrote {os.path.join(args.out or run_dir, 'retrieval-' + args.task)}.json, .txt and .png", file=sys.stderr)
    return 0


def newest_run(root: str = RUNS) -> str:
    """The run folder under ``root`` whose checkpoint was written last, among those that
    finished a training step (a run stopped in its first step holds an untrained model)."""
    runs = [os.path.join(root, d) for d in os.listdir(root)] if os.path.isdir(root) else []
    runs = [d for d in runs if os.path.isfile(os.path.join(d, checkpoint.CHECKPOINT))]
    trained = [d for d in runs if _has_log_records(d)]
    if not trained:
        untrained = f" ({counted(len(runs), 'run')} stopped before a step ended)" if runs else ""
        raise ValueError(
            f"no trained run under {root}/{untrained}: train one first (dilated-attention train), or pass --run"
        )
    return max(trained, key=lambda d: os.path.getmtime(os.path.join(d, checkpoint.CHECKPOINT)))


def _has_log_records(run_dir: str) -> bool:
    """Whether ``run_dir``'s log holds a record: the run finished a step."""
    log = os.path.join(run_dir, run_folder.LOG)
    return os.path.isfile(log) and os.path.getsize(log) > 0


def _byte_writer(stream):
    """``write(data, final=False)``: ``data`` bytes onto the text stream ``stream`` as
    they are (the model writes bytes: its text is exact whatever the stream's encoding),
    through its binary buffer; a stream without one (an ``io.StringIO``) gets them
    decoded as UTF-8, invalid bytes replaced."""
    binary = getattr(stream, "buffer", None)
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    stream.flush()  # what was written as text comes first

    def write(data: bytes, final: bool = False) -> None:
        if binary is not None:
            binary.write(data)
            binary.flush()
        else:
            stream.write(decoder.decode(data, final=final))
            stream.flush()

    return write


def _cmd_generate(args) -> int:
    from ..models import stream

    if args.top_p is not None and args.top_p > 1:
        raise ValueError(f"--top-p must be in (0, 1], got {args.top_p}")
    if sys.stdout is None:  # started with stdout closed (>&-)
        raise ValueError("generate writes the text to stdout, which is closed: redirect it to a file or a pipe")
    device = device_type(args.device)
    run_dir = args.run_dir or newest_run()
    model = load_model(run_dir, device)
    if model.config.vocab_size != 256:
        raise ValueError(
            f"generate reads and writes text as bytes, but {run_dir}'s model has vocab_size "
            f"{model.config.vocab_size}, not 256"
        )
    # The bytes as passed, also where they are not UTF-8 (the model reads bytes).
    prompt_bytes = os.fsencode(args.prompt)
    prompt = torch.tensor(list(prompt_bytes), dtype=torch.long)
    if not len(prompt):
        raise ValueError("--prompt must not be empty: give at least one character to continue")
    cache = model.new_cache(1)
    generator = torch.Generator(device).manual_seed(args.seed)
    print(f"[{run_dir}]", file=sys.stderr)
    write = _byte_writer(sys.stdout)
    write(prompt_bytes)
    started, count = time.perf_counter(), 0
    for token in stream(
        model,
        prompt,
        args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        generator=generator,
        cache=cache,
    ):
        write(bytes([int(token)]))
        count += 1
    write(b"\n", final=True)
    seconds = time.perf_counter() - started
    print(
        f"{count} tokens in {seconds:.2f} s ({count / max(seconds, 1e-9):.1f} tokens/s, prompt included in the "
        f"time); cache {cache.nbytes / 2**10:.0f} KiB (stays below "
        f"{cache.max_nbytes() / 2**10:.0f} KiB after a token, however long the text)",
        file=sys.stderr,
    )
    return 0
