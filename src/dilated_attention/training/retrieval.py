"""Does a model use its long context? Accuracy on a synthetic retrieval task
(:mod:`dilated_attention.training.tasks`) by the distance between fact and question.

An example is scored in one forward pass (teacher forcing): it is answered when the
likeliest byte is right at every answer position, which is exactly when greedy
decoding would write the answer; the loss is the cross entropy of the answer bytes,
in bits per byte (8 for a model that knows nothing: uniform over 256 bytes).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch
from torch.nn import functional as F

from ..ops import validation
from ..utils.devices import device_type
from . import tasks

# tokens (B, N) int64 -> logits (B, N', 256) of the last N' positions (N' > the answer's bytes)
Model = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class DistanceScore:
    """The score of the examples at one distance (a row of :func:`format_table`)."""

    distance: int
    length: int  # bytes per example
    examples: int
    accuracy: float  # fraction answered exactly
    answer_bits: float  # mean cross entropy of the answer bytes, bits per byte


@dataclass
class RetrievalResult:
    """What :func:`score` returns: the task, its chance accuracy and one
    :class:`DistanceScore` per distance."""

    task: str
    chance: float  # the accuracy of guessing the answer's digits
    scores: list[DistanceScore] = field(default_factory=list)
    # what the plot marks: (label, distance), e.g. each branch's segment length
    reach: list[tuple[str, int]] = field(default_factory=list)
    about: dict = field(default_factory=dict)  # the run, model and settings evaluated


def distances(task: str, max_distance: int) -> list[int]:
    """The powers of two from the task's shortest distance up to ``max_distance``; where
    none lies between them, ``max_distance`` alone (never a distance beyond it)."""
    shortest = tasks.min_distance(task)
    max_distance = validation.check_int(max_distance, "max_distance", shortest)
    first = math.ceil(math.log2(shortest))
    powers = [2**k for k in range(first, max_distance.bit_length())]
    return powers or [max_distance]


def score(
    model: Model,
    task: str,
    context: int,
    at: Sequence[int],
    examples: int = 32,
    *,
    seed: int = 0,
    batch_size: int = 8,
    filler: torch.Tensor | None = None,
    device=None,
) -> RetrievalResult:
    """Score ``model`` on ``examples`` examples of ``task`` at each distance of ``at``.

    Examples are ``context`` bytes long, or as long as a distance needs beyond that.
    The examples depend only on ``seed`` (each distance has its own generator), so two
    models see the same ones. ``filler``: uint8 text around a passkey (default:
    spaces and newlines)."""
    tasks.check_task(task)
    context = validation.check_positive_int(context, "context")
    examples = validation.check_positive_int(examples, "examples")
    batch_size = validation.check_positive_int(batch_size, "batch_size")
    seed = validation.check_int(seed, "seed", 0, validation.SEED_LIMIT)
    if isinstance(at, (str, bytes)) or not isinstance(at, Sequence):
        raise TypeError(f"at must be a list of distances (ints), got {validation.type_name(at)}")
    if not at:
        raise ValueError("at must hold at least one distance, got none")
    at = [validation.check_int(d, "each distance of at", tasks.min_distance(task), 2**40) for d in at]
    result = RetrievalResult(task, tasks.chance(task))
    for distance in at:
        length = max(context, tasks.min_length(task, distance))
        # one generator per distance, within the range a torch generator's seed takes
        generator = torch.Generator().manual_seed((seed * 1_000_003 + distance) % validation.SEED_LIMIT)
        right, bits = 0, 0.0
        for first in range(0, examples, batch_size):  # made a batch at a time: memory bounded by the batch
            count = min(batch_size, examples - first)
            batch = [tasks.make_example(task, length, distance, generator, filler) for _ in range(count)]
            answer = batch[0].answer
            tokens = torch.stack([e.tokens for e in batch]).long().to(device)
            with torch.inference_mode():
                logits = model(tokens)[:, -answer - 1 : -1].float()
            truth = tokens[:, -answer:]
            right += int((logits.argmax(-1) == truth).all(1).sum())
            bits += float(F.cross_entropy(logits.flatten(0, 1), truth.flatten(), reduction="sum")) / math.log(2)
        result.scores.append(DistanceScore(distance, length, examples, right / examples, bits / (examples * answer)))
    return result


def format_table(result: RetrievalResult) -> str:
    """``result`` as a table: one line per distance, then how far each branch reaches."""
    about = ", ".join(f"{k} {v}" for k, v in result.about.items() if k in ("run", "context", "branches"))
    lines = [
        f"{result.task}: accuracy (answered exactly; chance {result.chance:g}) and answer loss by distance"
        + (f" ({about})" if about else ""),
        f"{'distance':>9} {'bytes':>7} {'examples':>8} {'accuracy':>9} {'answer bits/byte':>17}",
    ]
    lines += [
        f"{s.distance:>9} {s.length:>7} {s.examples:>8} {s.accuracy:>9.3f} {s.answer_bits:>17.3f}"
        for s in result.scores
    ]
    if result.reach:
        lines.append(
            "farthest each branch reaches back (its segment length): "
            + ", ".join(f"{label}: {distance}" for label, distance in result.reach)
        )
    return "\n".join(lines)


def to_json(result: RetrievalResult) -> dict:
    """``result`` as plain dicts and lists (what ``retrieval-TASK.json`` holds)."""
    return asdict(result)


def plot(results: Sequence[tuple[str, RetrievalResult]], path: str, title: str) -> None:
    """Accuracy and answer loss against distance, one line per ``(label, result)``,
    each result's reach marked by dotted vertical lines."""
    from ..utils.plotting import pyplot, save

    plt = pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6.5), sharex=True)
    for number, (label, result) in enumerate(results):
        x = [s.distance for s in result.scores]
        color = f"C{number}"
        top.plot(x, [s.accuracy for s in result.scores], "o-", color=color, label=label)
        bottom.plot(x, [s.answer_bits for s in result.scores], "o-", color=color, label=label)
        for mark, distance in result.reach:
            for ax in (top, bottom):
                ax.axvline(distance, color=color, linestyle=":", alpha=0.6)
            top.annotate(mark, (distance, 1.02 - 0.07 * number), fontsize=6, color=color, rotation=0, ha="right")
    chance = results[0][1].chance if results else 0.0
    top.axhline(chance, color="grey", linewidth=0.8)
    top.set_ylim(-0.03, 1.08)
    top.set_ylabel("accuracy (answered exactly)")
    bottom.axhline(8.0, color="grey", linewidth=0.8)
    bottom.set_ylabel("answer loss (bits per byte)")
    bottom.set_xlabel("distance from fact to question (bytes)")
    for ax in (top, bottom):
        ax.set_xscale("log", base=2)
        ax.grid(True, which="both", alpha=0.3)
    top.legend(fontsize=7)
    save(
        fig,
        path,
        title,
        caption="dotted: each branch's segment length (the farthest it reaches back); "
        "grey: chance (top), a uniform guess (bottom)",
    )


def activation_bytes(config) -> int:
    """About the bytes a forward pass without gradients holds per position of each
    sequence at its peak (a block's activations, the attention's buffers), for
    refusing lengths that cannot fit before any work."""
    return 4 * (8 * config.dim + config.ffn_dim)


def branch_reach(segment_lengths: Sequence[int], dilation_rates: Sequence[int]) -> list[tuple[str, int]]:
    """Each branch's segment length, labelled: no query attends further back."""
    return [(f"w={w}, r={r}", w) for w, r in zip(segment_lengths, dilation_rates, strict=True)]


def evaluate_run(
    run_dir: str,
    task: str,
    *,
    examples: int = 32,
    max_distance: int | None = None,
    seed: int = 0,
    batch_size: int = 8,
    device=None,
    out: str | None = None,
    data: str | None = None,
) -> RetrievalResult:
    """Score a run's latest checkpoint on ``task`` at distances up to ``max_distance``
    (default: the farthest an example of the run's training context holds, at least
    the task's shortest distance); write ``retrieval-<task>.json``, ``.txt``
    and ``.png`` into ``out`` (default: the run folder). A passkey hides in text of
    the validation split of ``data`` (default: the run's training data)."""
    from ..utils.files import check_output_file, check_output_folder, write_results
    from ..utils.memory import check_fits
    from .data import load_corpus
    from .run_folder import read_run_config
    from .trainer import load_model

    tasks.check_task(task)
    config, settings = read_run_config(run_dir)
    if max_distance is None:
        max_distance = max(settings.context - tasks.min_length(task, 0), tasks.min_distance(task))
    max_distance = validation.check_int(max_distance, "max_distance (--max-distance)", tasks.min_distance(task), 2**40)
    longest = max(settings.context, tasks.min_length(task, max(distances(task, max_distance))))
    if longest > settings.context:
        fix = "pass a smaller max_distance (--max-distance)"
    else:
        fix = f"examples are as long as the run's context ({settings.context} bytes) at least: evaluate passkey"
    tasks.check_length(task, longest, "the evaluation", fix)
    if task != "passkey" and data is not None:
        raise ValueError(f"data (--data) is the text a passkey hides in: {task} takes none, drop it")
    if task == "passkey" and data is None:
        data = settings.data
        if data is not None and not (os.path.isfile(data) or os.path.isdir(data)):
            raise ValueError(
                f"the run's training data {data} cannot be read again (a pipe, or a file since moved): "
                "pass the text for the passkey's filler as data (--data)"
            )
    examples = validation.check_positive_int(examples, "examples")
    batch_size = validation.check_positive_int(batch_size, "batch_size")
    folder, option = (run_dir, "the run folder") if out is None else (out, "out")
    check_output_folder(folder, option)
    stem = os.path.join(folder, f"retrieval-{task}")
    for extension in (".json", ".txt", ".png"):
        if os.path.isdir(stem + extension):
            raise ValueError(
                f"{stem + extension} is a folder where a result file goes: move it, or pass another out (--out)"
            )
        check_output_file(stem + extension, "the result file")
    device = torch.device(device_type("cpu" if device is None else device, "device"))
    check_fits(
        min(batch_size, examples) * longest * activation_bytes(config),
        device,
        f"a forward pass over {min(batch_size, examples)} examples of {longest} bytes",
        "pass a smaller max_distance (--max-distance) or batch_size (--batch-size)",
    )
    filler = None
    if task == "passkey":
        corpus = load_corpus(data)
        filler = corpus.validation
        if not len(filler):
            raise ValueError(
                f"the validation split of {corpus.source} is empty (its text is too short): give more text as data "
                "(--data)"
            )
    model = load_model(run_dir, device)
    keep = tasks.answer_length(task) + 1  # the logits scoring reads: the answer's, and the one before

    def last_logits(tokens: torch.Tensor) -> torch.Tensor:
        return model(tokens, logits_to_keep=keep)

    result = score(
        last_logits,
        task,
        settings.context,
        distances(task, max_distance),
        examples,
        seed=seed,
        batch_size=batch_size,
        filler=filler,
        device=next(model.parameters()).device,
    )
    result.reach = branch_reach(config.segment_lengths, config.dilation_rates)
    result.about = {
        "run": run_dir,
        "context": settings.context,
        "branches": f"w={list(config.segment_lengths)} r={list(config.dilation_rates)}",
        "model": config.to_dict(),
        "examples": examples,
        "seed": seed,
    }
    os.makedirs(folder, exist_ok=True)
    write_results(stem, to_json(result), format_table(result))
    plot(
        [(os.path.basename(os.path.normpath(run_dir)), result)],
        stem + ".png",
        f"{task} retrieval by distance: {run_dir} (context {settings.context})",
    )
    return result
