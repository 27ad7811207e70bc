"""The training loop of ``dilated-attention train``: a LongNet on bytes, with resumable runs.

A run folder holds ``config.json`` (the model and these settings), ``log.jsonl`` (one
record per step), ``loss.png`` and ``checkpoint.pt`` (model, optimizer, schedule,
data position and random states). A resumed run computes the same losses, step for
step, as one that was never interrupted.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch.nn import functional as F

from ..files import atomic_write
from ..models import LongNetConfig, LongNetLM
from . import checkpoint, parallel
from .data import Batches, check_long_enough, evaluation_windows, load_corpus

CONFIG = "config.json"
LOG = "log.jsonl"
PLOT = "loss.png"
AUTOCAST_DTYPES = {"float32": None, "bfloat16": torch.bfloat16}


@dataclass
class TrainSettings:
    """How to train (the model's shape is a :class:`LongNetConfig`).

    ``steps``: the run's total optimizer steps (the schedule's length), also when
    resuming; ``minutes``: stop earlier once this much training time has passed
    (the run can be resumed). ``batch_size``: sequences per step over all processes.
    ``lr``: the peak learning rate, reached linearly over ``warmup_steps``, then a
    cosine down to ``lr * min_lr_ratio``. AdamW (``weight_decay`` on matrices only),
    gradients clipped to norm ``grad_clip``. ``dtype``: ``"bfloat16"`` runs under
    autocast (CPU too). ``data``: a UTF-8 file or folder (default: the standard
    library's sources).
    """

    context: int = 512
    batch_size: int = 8
    steps: int = 600
    minutes: Optional[float] = None
    lr: float = 3e-3
    warmup_steps: int = 30
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    dtype: str = "float32"
    grad_checkpointing: bool = False
    seed: int = 0
    data: Optional[str] = None
    eval_interval: int = 50
    eval_windows: int = 16
    checkpoint_interval: int = 100
    sequence_parallel: bool = False

    def __post_init__(self):
        for name in ("context", "batch_size", "steps", "eval_interval", "eval_windows", "checkpoint_interval"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be an int >= 0, got {self.warmup_steps!r}")
        for name, low, high in (("lr", 0, math.inf), ("min_lr_ratio", 0, 1), ("weight_decay", 0, math.inf),
                                ("grad_clip", 0, math.inf)):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not low <= value <= high:
                raise ValueError(f"{name} must be a number in [{low}, {high}], got {value!r}")
        if self.minutes is not None and not 0 < self.minutes < math.inf:
            raise ValueError(f"minutes must be a number > 0, got {self.minutes!r}")
        if self.dtype not in AUTOCAST_DTYPES:
            raise ValueError(f"dtype must be one of {sorted(AUTOCAST_DTYPES)}, got {self.dtype!r}")

    def learning_rate(self, step: int) -> float:
        """The learning rate of step ``step`` (0-based)."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        progress = (step - self.warmup_steps) / max(1, self.steps - self.warmup_steps)
        cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * cosine)


def read_run_config(run_dir: str) -> tuple[LongNetConfig, TrainSettings]:
    """The model configuration and settings a run folder was started with."""
    path = os.path.join(run_dir, CONFIG)
    if not os.path.isfile(path):
        raise ValueError(f"{run_dir} is not a training run folder: {path} is missing")
    try:
        with open(path, encoding="utf-8") as f:
            saved = json.load(f)
        return LongNetConfig.from_dict(saved["model"]), TrainSettings(**saved["training"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{path} is not a valid run configuration: {exc}") from None


def load_model(run_dir: str, device="cpu") -> LongNetLM:
    """The model of a run's latest checkpoint, in eval mode."""
    config, _ = read_run_config(run_dir)
    state = checkpoint.load_checkpoint(run_dir, map_location=device)
    model = LongNetLM(_matching_config(run_dir, config, state)).to(device)
    model.load_state_dict(state["model"])
    return model.eval()


def _matching_config(run_dir: str, config: LongNetConfig, state: dict) -> LongNetConfig:
    saved = LongNetConfig.from_dict(state["model_config"])
    if saved != config:
        raise ValueError(
            f"{os.path.join(run_dir, CONFIG)} describes a different model than {run_dir}'s checkpoint "
            f"({config} vs {saved}): restore config.json, or train a new run"
        )
    return config


def _parameter_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices (linear weights, embeddings); none on biases and norms."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


class _StopRequest:
    """Ctrl-C during training: the first finishes the current step, checkpoints and
    stops; a second one interrupts at once (the previous checkpoint stays whole)."""

    def __init__(self):
        self.requested = False
        self._previous = None

    def __enter__(self):
        try:
            self._previous = signal.signal(signal.SIGINT, self._handle)
        except ValueError:  # not the main thread: Ctrl-C keeps its usual meaning
            self._previous = None
        return self

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        print("\nCtrl-C: stopping after this step and writing a checkpoint (press again to stop at once)")

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


def train(
    run_dir: str,
    settings: Optional[TrainSettings] = None,
    model_config: Optional[LongNetConfig] = None,
    *,
    resume: bool = False,
    device: Optional[str] = None,
    callback: Optional[Callable[[dict], None]] = None,
    progress: bool = True,
) -> dict:
    """Train (or with ``resume=True`` continue) the run in ``run_dir``; return a summary.

    A new run needs ``settings`` and ``model_config`` and an empty or missing
    ``run_dir``; a resumed one reads them from ``run_dir`` (``settings``, if given,
    may change only ``steps`` and ``minutes``). ``callback(record)`` is called after
    every step with the step's log record (on rank 0). Launched by ``torchrun``, the
    processes share each step (see :mod:`dilated_attention.training.parallel`).
    """
    if resume:
        model_config, saved = read_run_config(run_dir)
        settings = _resumed_settings(saved, settings)
    elif settings is None or model_config is None:
        raise ValueError("a new run needs settings and model_config")
    place = parallel.setup(settings.sequence_parallel, device)
    if settings.context < model_config.max_segment:
        raise ValueError(
            f"--context {settings.context} is shorter than the longest segment ({model_config.max_segment}): the "
            "model would never see that branch's segments whole in training, yet use them when generating. "
            f"Use --context >= {model_config.max_segment}, or a model with shorter segments"
        )
    if place.mode == "data" and settings.batch_size % place.world:
        raise ValueError(f"--batch-size {settings.batch_size} must be divisible by the {place.world} processes")
    if place.mode == "sequence" and settings.context < place.world:
        raise ValueError(f"--context {settings.context} is shorter than the {place.world} sequence shards")
    corpus = load_corpus(settings.data)
    check_long_enough(corpus, settings.context)

    torch.manual_seed(settings.seed)
    model = LongNetLM(model_config).to(place.device)
    model.gradient_checkpointing = settings.grad_checkpointing
    optimizer = torch.optim.AdamW(
        _parameter_groups(model, settings.weight_decay), lr=settings.lr, betas=(0.9, 0.95),
        fused=place.device.type == "cuda",
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: settings.learning_rate(step) / settings.lr)
    batches = Batches(corpus.train, settings.context, settings.batch_size, settings.seed)
    step, elapsed = 0, 0.0
    if resume:
        state = checkpoint.load_checkpoint(run_dir, map_location=place.device)
        _matching_config(run_dir, model_config, state)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        batches.load_state_dict(state["data"])
        torch.set_rng_state(state["rng"]["torch"])
        if place.device.type == "cuda" and "cuda" in state["rng"]:
            torch.cuda.set_rng_state(state["rng"]["cuda"], place.device)
        step, elapsed = state["step"], state["elapsed_s"]
        if place.is_main:
            _truncate_log(run_dir, step)
    elif place.is_main:
        _start_run_folder(run_dir, model_config, settings)
    trained = place.wrap(model)
    autocast = AUTOCAST_DTYPES[settings.dtype]
    evaluation = evaluation_windows(corpus.validation, settings.context, settings.eval_windows)

    def loss_sum(module, inputs, targets) -> torch.Tensor:
        """Summed cross entropy (nats) of this rank's part of ``inputs, targets``."""
        inputs, targets = place.part(inputs, targets)
        with torch.autocast(place.device.type, dtype=autocast, enabled=autocast is not None):
            logits = module(inputs, process_group=place.group)
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum")

    def evaluate() -> float:
        """Validation loss in bits per byte."""
        model.eval()
        with torch.no_grad():
            total = place.sum(loss_sum(model, *evaluation))
        model.train()
        return float(total) / evaluation[1].numel() / math.log(2)

    def save():
        if place.is_main:
            checkpoint.save_checkpoint(run_dir, {
                "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(), "data": batches.state_dict(), "step": step,
                "elapsed_s": elapsed, "model_config": model_config.to_dict(), "rng": _rng_states(place.device),
            })

    bar = _progress_bar(settings.steps, step, enabled=progress and place.is_main)
    model.train()
    stop_reason = "done"
    started = time.perf_counter() - elapsed
    with _StopRequest() as stop:
        while step < settings.steps:
            tick = time.perf_counter()
            inputs, targets = batches.next()
            count = targets.numel()
            summed = loss_sum(trained, inputs, targets)
            (summed * place.loss_weight(count)).backward()
            place.finish_gradients(model)
            torch.nn.utils.clip_grad_norm_(model.parameters(), settings.grad_clip)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            loss = float(place.sum(summed.detach())) / count
            elapsed = time.perf_counter() - started
            record = {"step": step, "loss": loss, "bpb": loss / math.log(2), "lr": scheduler.get_last_lr()[0],
                      "tokens_per_s": count / (time.perf_counter() - tick), "elapsed_s": elapsed}
            last = step == settings.steps
            if step % settings.eval_interval == 0 or last:
                record["val_bpb"] = evaluate()
            out_of_time = settings.minutes is not None and elapsed >= 60 * settings.minutes
            if place.is_main:
                _append_log(run_dir, record)
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{record['tokens_per_s']:.0f}")
                if callback is not None:
                    callback(record)
            stop_now = _agree(place, stop.requested or out_of_time)
            if step % settings.checkpoint_interval == 0 or last or stop_now:
                save()
            if "val_bpb" in record or last or stop_now:
                if place.is_main:
                    _plot(run_dir)
            if stop_now:
                stop_reason = "interrupted" if stop.requested else "out of time"
                break
    bar.close()
    return {"run_dir": run_dir, "step": step, "steps": settings.steps, "stopped": stop_reason,
            "elapsed_s": elapsed, "corpus": corpus.source, "parameters": model.num_parameters()}


def _resumed_settings(saved: TrainSettings, given: Optional[TrainSettings]) -> TrainSettings:
    if given is None:
        return saved
    changed = {f.name for f in dataclasses.fields(TrainSettings)
               if getattr(given, f.name) != getattr(saved, f.name) and f.name not in ("steps", "minutes")}
    if changed:
        raise ValueError(f"a resumed run keeps its settings; only steps and minutes may change, not {sorted(changed)}")
    return dataclasses.replace(saved, steps=given.steps, minutes=given.minutes)


def _agree(place, flag: bool) -> bool:
    """``flag`` on any rank, so that every rank stops after the same step."""
    return bool(place.sum(torch.tensor([float(flag)], device=place.device)) > 0)


def _rng_states(device: torch.device) -> dict:
    states = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    return states


def _start_run_folder(run_dir: str, model_config: LongNetConfig, settings: TrainSettings) -> None:
    if os.path.exists(os.path.join(run_dir, checkpoint.CHECKPOINT)) or os.path.exists(os.path.join(run_dir, CONFIG)):
        raise ValueError(f"{run_dir} already holds a run: continue it with --resume {run_dir}, or pick another --out")
    os.makedirs(run_dir, exist_ok=True)
    with atomic_write(os.path.join(run_dir, CONFIG)) as f:
        json.dump({"model": model_config.to_dict(), "training": dataclasses.asdict(settings)}, f, indent=1)
    with atomic_write(os.path.join(run_dir, LOG)) as f:
        f.write("")


def read_log(run_dir: str) -> list[dict]:
    """The run's log records, oldest first (a last line cut short by a crash is left out)."""
    path = os.path.join(run_dir, LOG)
    if not os.path.isfile(path):
        return []
    with open(path, encoding="utf-8") as f:
        lines = [line for line in f if line.strip()]
    if lines and not lines[-1].endswith("\n"):
        lines.pop()
    return [json.loads(line) for line in lines]


def _truncate_log(run_dir: str, step: int) -> None:
    """Drop the records of steps after the checkpoint (a resumed run redoes them)."""
    kept = [r for r in read_log(run_dir) if r["step"] <= step]
    with atomic_write(os.path.join(run_dir, LOG)) as f:
        f.writelines(json.dumps(r) + "\n" for r in kept)


def _append_log(run_dir: str, record: dict) -> None:
    with open(os.path.join(run_dir, LOG), "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def _progress_bar(total: int, initial: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, disable=not enabled, unit="step", dynamic_ncols=True)


def _plot(run_dir: str) -> None:
    """``loss.png``: training and validation bits per byte against the step."""
    from ..plotting import pyplot, save

    records = read_log(run_dir)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.plot([r["step"] for r in records], [r["bpb"] for r in records], lw=0.8, label="training (batch)")
    evaluated = [r for r in records if "val_bpb" in r]
    ax.plot([r["step"] for r in evaluated], [r["val_bpb"] for r in evaluated], "o-", ms=3, label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("bits per byte")
    ax.grid(True, alpha=0.3)
    ax.legend()
    save(fig, os.path.join(run_dir, PLOT), f"{os.path.basename(os.path.abspath(run_dir))}: loss")
