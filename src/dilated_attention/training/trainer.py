"""The training loop of ``dilated-attention train``: a LongNet on bytes, with resumable runs.

A run folder (:mod:`.run_folder`) holds ``config.json``, ``log.jsonl``, ``loss.png`` and
``checkpoint.pt`` (model, optimizer, schedule, data position and random states). A
resumed run computes the same losses, step for step, as one that was never interrupted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import math
import os
import shlex
import signal
import sys
import time
from collections.abc import Callable

import torch
from torch.nn import functional as F

from ..models import LongNetConfig, LongNetLM
from ..ops import fused, validation
from ..tools.errors import describe
from ..utils.devices import device_type
from ..utils.extras import require
from ..utils.memory import OutOfMemory, check_fits, first_line, is_out_of_memory
from . import checkpoint, parallel, run_folder, tasks
from .data import Batches, check_long_enough, evaluation_count, evaluation_starts, load_corpus, windows
from .settings import AUTOCAST_DTYPES, TrainSettings


def load_model(run_dir: str, device="cpu") -> LongNetLM:
    """The model of a run's latest checkpoint, in eval mode, on ``device``."""
    device = device_type(device, "device")
    config, _ = run_folder.read_run_config(run_dir)
    state = checkpoint.load_checkpoint(run_dir)
    model = LongNetLM(_matching_config(run_dir, config, state)).to(device)
    model.load_state_dict(state["model"])
    return model.eval()


def _matching_config(run_dir: str, config: LongNetConfig, state: dict) -> LongNetConfig:
    saved = LongNetConfig.from_dict(state["model_config"])
    if saved != config:
        raise ValueError(
            f"{os.path.join(run_dir, run_folder.CONFIG)} describes a different model than {run_dir}'s checkpoint "
            f"({_differences(config, saved)}): restore config.json, or train a new run"
        )
    return config


def _differences(ours: LongNetConfig, theirs: LongNetConfig) -> str:
    """``depth 4 vs 1, dim 64 vs 32``: the fields where two configs differ."""
    other = theirs.to_dict()
    return ", ".join(
        f"{name} {value!r} vs {other[name]!r}" for name, value in ours.to_dict().items() if value != other[name]
    )


def _parameter_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices (linear weights, embeddings); none on biases and norms."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


class _StopRequest:
    """Ctrl-C (SIGINT) or SIGTERM during training: the first finishes the current step,
    checkpoints and stops (``signal``: its name); a second Ctrl-C interrupts at once (the
    previous checkpoint stays whole). A signal the process was started ignoring (a run
    in the background of a script) stays ignored. Under ``torchrun`` a Ctrl-C in its
    terminal reaches each process twice or more within milliseconds (from the terminal,
    then forwarded by ``torchrun``, which may add a SIGTERM as it shuts down): signals
    within :attr:`ECHO_S` seconds of the first are that one request."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)
    ECHO_S = 2.0

    def __init__(self):
        self.requested = False
        self.signal: str | None = None
        self._previous = {}
        self._first_at = 0.0
        self._echoes = "TORCHELASTIC_RUN_ID" in os.environ  # a process torchrun started

    def __enter__(self):
        for sig in self.SIGNALS:
            if signal.getsignal(sig) is signal.SIG_IGN:
                continue
            with contextlib.suppress(ValueError):  # not the main thread: the signals keep their usual meaning
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        now = time.monotonic()
        if self.requested:
            if self._echoes and now - self._first_at < self.ECHO_S:
                return
            raise KeyboardInterrupt
        self.requested, self.signal, self._first_at = True, signal.Signals(signum).name, now
        print(
            f"\n{signal.Signals(signum).name}: stopping after this step and writing a checkpoint (Ctrl-C again "
            "stops at once)",
            file=sys.stderr,
        )

    def __exit__(self, *exc):
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)


def train(
    run_dir: str,
    settings: TrainSettings | None = None,
    model_config: LongNetConfig | None = None,
    *,
    resume: bool = False,
    device: str | None = None,
    callback: Callable[[dict], None] | None = None,
    progress: bool = True,
) -> dict:
    """Train (or with ``resume=True`` continue) the run in ``run_dir``; return a summary.

    A new run needs ``settings`` and ``model_config`` and an empty or missing
    ``run_dir``; a resumed one reads them from ``run_dir`` (``model_config``, if given,
    must be the run's own; ``settings``, if given, may change only ``steps``,
    ``minutes`` and ``data``; ``minutes`` limits each invocation).
    ``callback(record)`` is called after every step with the step's log record (on
    rank 0). Launched by ``torchrun``, the processes share each step (see
    :mod:`dilated_attention.training.parallel`); every check that can fail runs on
    every rank, or on rank 0 with its outcome shared, so that all ranks fail alike.

    The run holds its folder's :class:`~dilated_attention.training.run_folder.RunLock`
    (rank 0 does, under ``torchrun``) from start to end: a second process on the
    same folder gets an error, not a share of it. A run stopped before its first step
    ended (interrupted, or out of memory) starts again from step 0 with ``resume=True``,
    or as a new run in the same folder, with other settings too.
    """
    require("train", "training")
    try:
        return _train_or_resume(run_dir, settings, model_config, resume, device, callback, progress)
    except OSError as exc:  # a write into the run folder failed: say so, no traceback
        raise ValueError(_write_failure(exc, run_dir)) from None


def _write_failure(exc: OSError, run_dir: str) -> str:
    """The message for a failed write into ``run_dir``."""
    where = exc.filename or run_dir
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return (
            f"no space left on the device writing {where}; the latest checkpoint in {run_dir} is intact: free "
            f"some space, then continue the run with --resume {shlex.quote(run_dir)}"
        )
    return f"cannot write {where} ({exc.strerror}); the latest checkpoint in {run_dir} is intact"


def _train_or_resume(run_dir, settings, model_config, resume, device, callback, progress) -> dict:
    """:func:`train` after its extra is checked."""
    run_dir = run_folder.run_dir_path(run_dir)
    problem = run_folder.not_utf8(run_dir)
    if problem is not None:
        raise ValueError(f"run_dir {problem}")
    _check_type(settings, TrainSettings, "settings")
    _check_type(model_config, LongNetConfig, "model_config")
    if model_config is not None and type(model_config) is not LongNetConfig:  # a subclass: the fields a run keeps
        model_config = _base_fields(model_config, LongNetConfig)
    resume = validation.check_flag(resume, "resume")
    if callback is not None and not callable(callback):
        raise TypeError(
            f"callback must be a function of the step's log record (a dict), or None, got "
            f"{validation.type_name(callback)}"
        )
    if settings is not None:
        settings = _checked_settings(settings)
    if resume:
        saved_config, saved = run_folder.read_run_config(run_dir)
        if model_config is not None and model_config != saved_config:
            _refuse_other_model(run_dir, model_config, saved_config)
        model_config, settings = saved_config, _resumed_settings(saved, settings)
    elif settings is None or model_config is None:
        raise ValueError("a new run needs settings and model_config")
    else:
        _check_model(model_config, settings)
    asked_by = (
        f"{run_dir} was trained with --sequence-parallel, which its resumed runs keep (the processes' dropout "
        "masks depend on how they split a step); it"
        if resume
        else "--sequence-parallel"
    )
    place = parallel.setup(settings.sequence_parallel, device, asked_by)
    try:

        def check():
            _check_split(settings, place, resume, model_config.dropout)
            _check_fits(model_config, place.device)
            _check_kernel(model_config, settings, place)
            _check_data(settings, run_dir, resume)

        place.agree(check)  # a rank's failure is every rank's
        corpus = _read_text(settings.data, place)
        check_long_enough(corpus, settings.context)
        if place.is_main:
            _note_evaluation_windows(corpus, settings)
            _note_long_warmup(settings)
        lock = place.on_main(lambda: _claim_run_folder(run_dir, resume))
        try:
            return _train(run_dir, settings, model_config, corpus, resume, place, callback, progress)
        finally:
            if lock is not None:
                lock.release()
    finally:
        place.close()


def _claim_run_folder(run_dir: str, resume: bool) -> run_folder.RunLock:
    """Lock the run folder (a new run's created first), delete what writers killed
    mid-write left in it, and refuse a new run's folder if it holds anything but an
    earlier start of a run that never finished a step."""
    if not resume:
        run_folder.make_run_folder(run_dir)
        _check_new_run_folder(run_dir)  # before the lock file goes in: a refused folder stays as it was
    lock = run_folder.RunLock(run_dir)
    try:
        if not resume:
            _check_new_run_folder(run_dir)  # again, now that no other process can start a run in it
        run_folder.remove_stale_temporaries(run_dir)
    except BaseException:
        lock.release()
        raise
    return lock


def _check_new_run_folder(run_dir: str) -> None:
    if run_folder.never_started(run_dir):
        return
    if os.path.isfile(os.path.join(run_dir, checkpoint.CHECKPOINT)):
        raise ValueError(
            f"{run_dir} already holds a run: continue it with --resume {shlex.quote(run_dir)} (from Python: "
            "resume=True), or pick another --out (run_dir)"
        )
    raise ValueError(f"--out {run_dir} is a folder with files in it: pick an empty or new folder for the run")


def _train(run_dir, settings, model_config, corpus, resume, place, callback, progress) -> dict:
    """:func:`train` once the settings and the text are known, this process has its
    place and the run its folder."""
    state = _checked_state(run_dir, model_config, settings, place) if resume else None

    torch.manual_seed(settings.seed)
    model = LongNetLM(model_config).to(place.device)
    model.gradient_checkpointing = settings.grad_checkpointing
    if place.rank:  # the same initialisation everywhere, then each rank's own dropout masks
        torch.manual_seed(settings.seed + 1_000_003 * place.rank)
    optimizer = torch.optim.AdamW(
        _parameter_groups(model, settings.weight_decay),
        lr=settings.lr,
        betas=(0.9, 0.95),
        fused=place.device.type == "cuda",
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: settings.learning_rate(step) / settings.lr)
    batches = Batches(
        corpus.train, settings.context, settings.batch_size, settings.seed, settings.task, settings.task_fraction
    )
    step, elapsed = 0, 0.0
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        # The optimizer's state holds the rate of the saved schedule; the next step takes this one's.
        for group, base, rate in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas, strict=True):
            group["lr"] = base * rate(scheduler.last_epoch)
        batches.load_state_dict(state["data"])
        _restore_rng(state["rng"], place, settings.seed + 1_000_003 * place.rank + state["step"])
        step, elapsed = state["step"], state["elapsed_s"]

        def resumed():
            run_folder.truncate_log(run_dir, step)
            _note_changed_text(state.get("corpus"), corpus, run_dir)
            _note_new_schedule(run_folder.read_run_config(run_dir)[1], settings, step)
            run_folder.write_run_config(run_dir, model_config, settings)  # the total steps may have changed

        place.on_main(resumed)
    else:
        place.on_main(lambda: run_folder.start_run_folder(run_dir, model_config, settings))
    first_step = step
    trained = place.wrap(model)
    autocast = AUTOCAST_DTYPES[settings.dtype]
    evaluation = evaluation_starts(corpus.validation, settings.context, settings.eval_windows)

    def loss_sum(module, inputs, targets) -> torch.Tensor:
        """Summed cross entropy (nats) of this rank's part of ``inputs, targets``."""
        inputs, targets = place.part(inputs, targets)
        if not inputs.numel():  # more ranks than evaluation windows
            return torch.zeros((), device=place.device)
        with torch.autocast(place.device.type, dtype=autocast, enabled=autocast is not None):
            logits = module(inputs, process_group=place.group)
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum")

    def evaluate() -> float:
        """Validation loss in bits per byte, over the evaluation windows in batches of
        at most ``batch_size`` (so that memory does not grow with their number)."""
        model.eval()
        with torch.no_grad():
            total = place.sum(
                sum(
                    loss_sum(model, *windows(corpus.validation, starts, settings.context))
                    for starts in evaluation.split(settings.batch_size)
                )
            )
        model.train()
        return float(total) / (len(evaluation) * settings.context) / math.log(2)

    def save():
        rng = place.gather(_rng_state(place.device))  # a collective: every rank calls save
        place.on_main(
            lambda: checkpoint.save_checkpoint(
                run_dir,
                {
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(),
                    "data": batches.state_dict(),
                    "step": step,
                    "elapsed_s": elapsed,
                    "model_config": model_config.to_dict(),
                    "rng": rng,
                    "settings": _fixed_settings(settings),
                    "corpus": corpus.fingerprint,
                },
            )
        )

    bar = _progress_bar(settings.steps, step, enabled=progress and place.is_main)
    model.train()
    stop_reason, session = "done", 0.0
    speed = _Speed()
    with _StopRequest() as stop:  # a Ctrl-C while the first checkpoint is written stops after the first step
        if state is None:
            save()  # step 0: a run is resumable from its start
        while step < settings.steps:
            tick = time.perf_counter()
            lr = optimizer.param_groups[0]["lr"]  # this step's (the scheduler moves it after the step)
            try:
                inputs, targets = batches.next()
                count = targets.numel()
                summed = loss_sum(trained, inputs, targets)
                (summed * place.loss_weight(count)).backward()
                place.finish_gradients(model)
                torch.nn.utils.clip_grad_norm_(model.parameters(), settings.grad_clip)
                optimizer.step()
            except (RuntimeError, MemoryError) as exc:
                if step == 0 and is_out_of_memory(exc):
                    raise _first_step_out_of_memory(exc, run_dir) from None
                raise
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            loss = float(place.sum(summed.detach())) / count
            seconds = time.perf_counter() - tick
            elapsed, session = elapsed + seconds, session + seconds
            record = {
                "step": step,
                "loss": loss,
                "bpb": loss / math.log(2),
                "lr": lr,
                "tokens_per_s": count / seconds,
                "elapsed_s": elapsed,
            }
            speed.add(count, seconds)
            last = step == settings.steps
            out_of_time = _agree(place, settings.minutes is not None and session >= 60 * settings.minutes)
            if step % settings.eval_interval == 0 or last or out_of_time:
                record["val_bpb"] = evaluate()
            # what fails there stops every rank
            place.on_main(functools.partial(_logged, run_dir, record, bar, speed, progress, settings.steps, callback))
            if "val_bpb" in record:
                speed = _Speed()
            interrupted = _agree(place, stop.requested)
            stop_now = out_of_time or interrupted
            if step % settings.checkpoint_interval == 0 or last or stop_now:
                save()
            if "val_bpb" in record or last or stop_now:
                place.on_main(lambda: run_folder.plot(run_dir))
            if stop_now and not last:  # a run whose last step ends as time runs out is done
                stop_reason = "interrupted" if interrupted else "out of time"
                break
    bar.close()
    return {
        "run_dir": run_dir,
        "step": step,
        "steps": settings.steps,
        "stopped": stop_reason,
        "signal": stop.signal,  # the signal that stopped the run on this rank, if one did
        "elapsed_s": elapsed,
        "corpus": corpus.source,
        "parameters": model.num_parameters(),
        "resumed_from": first_step,
    }


def _logged(run_dir: str, record: dict, bar, speed, progress: bool, steps: int, callback) -> None:
    """Rank 0's part of a step: the log line, the progress bar, the callback."""
    run_folder.append_log(run_dir, record)
    bar.update(1)
    bar.set_postfix(bpb=f"{record['bpb']:.3f}", tokens_per_s=f"{speed.mean():.0f}")
    if progress and bar.disable and "val_bpb" in record:
        _print_evaluation(record, steps, speed.mean())
    if callback is not None:
        callback(record)


class _Speed:
    """Tokens per second of training over the steps since the last evaluation (the
    mean, not one step's figure)."""

    def __init__(self):
        self.tokens, self.seconds = 0, 0.0

    def add(self, tokens: int, seconds: float) -> None:
        self.tokens, self.seconds = self.tokens + tokens, self.seconds + seconds

    def mean(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)


# The settings a resumed run may change: its length, its time limit, and where its
# text is read from (a moved file, a pipe again; a changed text is noted).
RESUMABLE_CHANGES = ("steps", "minutes", "data")


def _resumed_settings(saved: TrainSettings, given: TrainSettings | None) -> TrainSettings:
    """The saved settings with ``given``'s ``steps``, ``minutes`` and ``data`` (a time
    limit is per invocation: a resumed run has none unless given one)."""
    if given is None:
        return dataclasses.replace(saved, minutes=None)
    changed = {
        f.name
        for f in dataclasses.fields(TrainSettings)
        if getattr(given, f.name) != getattr(saved, f.name) and f.name not in RESUMABLE_CHANGES
    }
    if changed:
        raise ValueError(
            f"a resumed run keeps its settings; only steps, minutes and data may change, not {sorted(changed)}"
        )
    return dataclasses.replace(saved, steps=given.steps, minutes=given.minutes, data=given.data)


def _fixed_settings(settings: TrainSettings) -> dict:
    """The settings a resumed run must share with its checkpoint."""
    return {k: v for k, v in dataclasses.asdict(settings).items() if k not in RESUMABLE_CHANGES}


def _check_model(model_config: LongNetConfig, settings: TrainSettings) -> None:
    if model_config.vocab_size != 256:
        raise ValueError(
            f"train reads text as bytes: the model's vocab_size must be 256, got {model_config.vocab_size}"
        )
    if settings.task is not None and settings.context + 1 < tasks.min_length(
        settings.task, tasks.min_distance(settings.task)
    ):
        raise ValueError(
            f"--context {settings.context} is too short for {settings.task} examples: use --context >= "
            f"{tasks.min_length(settings.task, tasks.min_distance(settings.task)) - 1}"
        )
    if settings.context < model_config.max_segment:
        raise ValueError(
            f"--context {settings.context} is shorter than the longest segment ({model_config.max_segment}): the "
            "model would never see that branch's segments whole in training, yet use them when generating. "
            f"Use --context >= {model_config.max_segment}, or a model with shorter segments"
        )


def _check_kernel(model_config: LongNetConfig, settings: TrainSettings, place) -> None:
    """``$DILATED_ATTENTION_KERNEL`` checked before the run folder is written: one of its
    values, and ``triton`` only where the run's attention calls can take the Triton kernels."""
    if fused.requested(None) != "triton":
        return
    dtype = AUTOCAST_DTYPES[settings.dtype] or torch.float32
    sample = torch.empty(1, 1, 1, model_config.head_dim, dtype=dtype, device=place.device)
    reason = fused.why_not_triton(sample, model_config.dropout, place.group is not None)
    if reason is not None:
        raise ValueError(
            f"{fused.KERNEL_ENV}=triton cannot run this training ({reason}): unset it, or set it to auto or torch"
        )


def _check_data(settings: TrainSettings, run_dir: str, resume: bool) -> None:
    """The run's text exists, and a data folder does not hold the run folder (whose
    checkpoints and logs would become part of the text)."""
    if settings.data is None:
        return
    if not os.path.exists(settings.data):
        if resume:
            raise ValueError(
                f"{run_dir}'s text {settings.data} (its config.json's data) is not there any more: pass "
                "--data with where the text is now (a changed text is noted), or restore it"
            )
        return  # load_corpus says so
    data, run = (os.path.realpath(path) for path in (settings.data, run_dir))
    if os.path.isdir(data) and os.path.commonpath([data, run]) == data:
        raise ValueError(
            f"the run folder {run_dir} lies inside the data folder {settings.data}, so the run's own checkpoints "
            "and logs would be read as text: pass --out (or --resume) a folder outside it, or --data a folder "
            "that does not hold it"
        )


def _check_type(value, kind: type, name: str) -> None:
    """A ``TypeError`` unless ``value`` is a ``kind`` or ``None``."""
    if value is not None and not isinstance(value, kind):
        hint = f": build one, {kind.__name__}(**{name})" if isinstance(value, dict) else ""
        raise TypeError(f"{name} must be a {kind.__name__} or None, got {validation.type_name(value)}{hint}")


def _checked_settings(settings: TrainSettings) -> TrainSettings:
    """A ``TrainSettings`` of ``settings``' fields (a subclass's own are not kept: the run
    folder records these), checked again (a field set after they were made is checked
    as the constructor checks it), with the data path made absolute, as a run records
    it, so that a resumed run reads the same files wherever it is started from."""
    checked = _base_fields(settings, TrainSettings)
    return checked if checked.data is None else dataclasses.replace(checked, data=os.path.abspath(checked.data))


def _base_fields(value, kind: type):
    """A new ``kind`` (a dataclass, checked as its constructor checks) of ``value``'s
    fields of ``kind`` (``value``: a ``kind``, or a subclass whose own fields are left out)."""
    return kind(**{f.name: getattr(value, f.name) for f in dataclasses.fields(kind)})


def _refuse_other_model(run_dir: str, given: LongNetConfig, saved: LongNetConfig) -> None:
    """The ``ValueError`` for a ``model_config`` that is not the resumed run's."""
    raise ValueError(
        f"a resumed run keeps its model, and model_config differs from {run_dir}'s ({_differences(given, saved)}): "
        "pass model_config=None"
    )


def _check_fits(model_config: LongNetConfig, device: torch.device) -> None:
    """Refuse a model whose training state (float32 weights, gradients and AdamW's two
    moments: 16 bytes a parameter) exceeds the device's memory, before anything is
    written. The parameters are counted from the sizes, without allocating: the
    matrices alone (embedding, once if tied; attention; feed-forward), a lower bound."""
    c = model_config
    embeddings = c.vocab_size * c.dim * (1 if c.tie_embeddings else 2)
    parameters = embeddings + c.depth * (4 * c.dim**2 + 2 * c.dim * c.ffn_dim)
    check_fits(
        16 * parameters,
        device,
        f"the model's parameters (at least {parameters:.3g}), with their gradients and AdamW's two moments,",
        "use a smaller dim, ffn_dim, depth or vocab_size",
    )


def _note_new_schedule(saved: TrainSettings, settings: TrainSettings, step: int) -> None:
    """Say so where a resumed run's new ``steps`` moves its learning rate: the cosine
    schedule spans the steps, so from ``step`` on the rate follows the new span's."""
    before, now = saved.learning_rate(step), settings.learning_rate(step)
    if saved.steps != settings.steps and step < settings.steps and not math.isclose(before, now, rel_tol=0.01):
        print(
            f"note: the learning rate's cosine schedule now spans {settings.steps:,} steps, not "
            f"{saved.steps:,}: at step {step:,} it is {now:.3g}, where it was {before:.3g}",
            file=sys.stderr,
        )


def _note_changed_text(saved: dict | None, corpus, run_dir: str) -> None:
    """Say so where the text a run resumes on is not the text its checkpoint was
    trained on (``saved``: the checkpoint's fingerprint; older checkpoints have none)."""
    if saved is not None and saved != corpus.fingerprint:
        sizes = f"{saved['bytes']:,} bytes then, {corpus.fingerprint['bytes']:,} now"
        print(
            f"note: the text of {corpus.source} changed since {run_dir}'s checkpoint ({sizes}): the run goes on "
            "with the text as it is now, so its batches and validation losses are not those of an "
            "uninterrupted run",
            file=sys.stderr,
        )


def _note_long_warmup(settings: TrainSettings) -> None:
    """Say so where the warmup lasts the whole run: the rate never reaches ``lr``."""
    if settings.warmup_steps >= settings.steps:
        print(
            f"note: warmup_steps {settings.warmup_steps} is not below steps {settings.steps}: the learning "
            f"rate rises for the whole run and never reaches lr {settings.lr:g}",
            file=sys.stderr,
        )


def _note_evaluation_windows(corpus, settings: TrainSettings) -> None:
    """Say so where the validation split holds fewer windows than ``eval_windows``:
    each evaluation uses every window it holds (:func:`.data.evaluation_starts`)."""
    count = evaluation_count(corpus.validation, settings.context, settings.eval_windows)
    if count < settings.eval_windows:
        print(
            f"note: the validation split of {corpus.source} holds {count:,} windows of context + 1 = "
            f"{settings.context + 1} bytes: each evaluation uses those {count:,}, not eval_windows "
            f"{settings.eval_windows:,}",
            file=sys.stderr,
        )


def _check_split(settings: TrainSettings, place, resume: bool, dropout: float) -> None:
    if place.mode == "data" and settings.batch_size % place.world:
        if resume and dropout > 0:  # see _checked_state
            fix = "resume it on as many processes as trained it"
        else:
            counts = [str(n) for n in range(1, min(settings.batch_size, 64) + 1) if settings.batch_size % n == 0]
            counts += ["..."] if settings.batch_size > 64 else []
            fix = f"launch a number of processes that divides it ({', '.join(counts)})"
            fix += "" if resume else ", or a --batch-size they divide"
        whose = " (the run's)" if resume else ""
        raise ValueError(
            f"--batch-size {settings.batch_size}{whose} must be divisible by the {place.world} processes: {fix}"
        )
    if place.mode == "sequence" and settings.context < place.world:
        raise ValueError(f"--context {settings.context} is shorter than the {place.world} sequence shards")


def _read_text(data: str | None, place):
    """:func:`load_corpus` of ``data`` on every rank, which must read the same text (a
    pipe would give each process part of its stream): what it raises where every rank
    fails alike (a missing ``/dev/fd`` path with why), else a ``ValueError`` naming what
    each rank read."""
    try:
        corpus = load_corpus(data)
    except (ValueError, TypeError, OSError) as exc:
        if place.world == 1:
            raise
        read = place.gather(describe(exc))
        if all(r == read[0] for r in read):
            if isinstance(data, str) and data.startswith(("/dev/fd/", "/proc/self/fd/")) and not os.path.exists(data):
                raise ValueError(
                    f"{exc} (a shell's <(...) reaches only the process the shell starts, not those torchrun "
                    "starts: write the text to a file)"
                ) from None
            raise
    else:
        read = place.gather(corpus.fingerprint)
        if all(r == read[0] for r in read):
            return corpus
    sizes = "; ".join(
        f"process {rank}: {r['bytes']:,} bytes" if isinstance(r, dict) else f"process {rank}: {r}"
        for rank, r in enumerate(read)
    )
    raise ValueError(
        f"the {place.world} processes read different texts from {'the default text' if data is None else data} "
        f"({sizes}): a pipe given as --data gives each process part of its stream; write the text to a file, "
        "which every process reads whole"
    )


def _checked_state(run_dir: str, model_config: LongNetConfig, settings: TrainSettings, place) -> dict | None:
    """The checkpoint to resume, checked against the run's configuration and log;
    ``None`` for a run stopped before its first step ended (it starts from step 0:
    rank 0 tells, as it then deletes that start's checkpoint, which the others must
    not be reading)."""
    if place.gather(run_folder.never_started(run_dir) if place.is_main else None)[0]:
        _check_model(model_config, settings)
        return None
    state = checkpoint.load_checkpoint(run_dir)
    _matching_config(run_dir, model_config, state)
    _check_model(model_config, settings)
    trained_by = len(state["rng"])  # a random state per process
    if model_config.dropout > 0 and trained_by != place.world:
        launch = f"torchrun --nproc_per_node {trained_by}" if trained_by > 1 else "one process"
        raise ValueError(
            f"{run_dir} was trained by {trained_by} process{'es' if trained_by > 1 else ''} with dropout "
            f"{model_config.dropout:g}, and its resumed runs keep that number: the dropout masks depend on how the "
            f"processes split a step (without dropout, any number resumes a run exactly): run it with {launch}"
        )
    # settings that checkpoints of earlier versions lack have their defaults (and those kept the data path)
    saved = {**_fixed_settings(TrainSettings()), **state["settings"]}
    if {k: v for k, v in saved.items() if k not in RESUMABLE_CHANGES} != _fixed_settings(settings):
        raise ValueError(
            f"{os.path.join(run_dir, run_folder.CONFIG)}'s training settings differ from those of "
            f"{run_dir}'s "
            "checkpoint: restore config.json"
        )
    if settings.steps < state["step"]:
        raise ValueError(f"{run_dir} has done {state['step']} steps already: --steps (the total) must be at least that")
    run_folder.read_log(run_dir)  # a damaged log fails here, on every rank
    return state


def _first_step_out_of_memory(exc: BaseException, run_dir: str) -> OutOfMemory:
    """The error for a run's first training step out of memory: what to change, and
    that the run folder, which holds no trained step, can take the run again."""
    return OutOfMemory(
        f"out of memory in the run's first training step ({first_line(exc)}): use a smaller --batch-size or --context, "
        f"--grad-checkpointing, or a smaller model. {run_dir} holds no trained step, so the run can start again "
        f"there with other settings: --out {shlex.quote(run_dir)}"
    )


def _agree(place, flag: bool) -> bool:
    """``flag`` on any rank, so that every rank stops after the same step."""
    return bool(place.sum(torch.tensor([float(flag)], device=place.device)) > 0)


def _rng_state(device: torch.device) -> dict:
    states = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    return states


def _restore_rng(states: list, place, fresh_seed: int) -> None:
    """This rank's random state; a rank the checkpoint did not have (a resume on more
    processes) is seeded with ``fresh_seed`` instead, so that no two ranks draw the
    same dropout masks."""
    if place.rank >= len(states):
        torch.manual_seed(fresh_seed)
        return
    mine = states[place.rank]
    torch.set_rng_state(mine["torch"])
    if place.device.type == "cuda" and "cuda" in mine:
        torch.cuda.set_rng_state(mine["cuda"], place.device)


def _progress_bar(total: int, initial: int, enabled: bool):
    """A tqdm bar on a terminal; elsewhere (output to a file) none: the evaluations
    print one line each instead (see :func:`_print_evaluation`)."""
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, disable=None if enabled else True, unit="step", dynamic_ncols=True)


def _print_evaluation(record: dict, steps: int, tokens_per_s: float) -> None:
    print(
        f"step {record['step']}/{steps}: loss {record['bpb']:.3f} bits per byte, validation "
        f"{record['val_bpb']:.3f}, {tokens_per_s:.0f} tokens/s since the last evaluation",
        file=sys.stderr,
        flush=True,
    )
