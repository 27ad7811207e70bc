"""Synthetic long-range tasks on bytes: a fact, then, ``distance`` bytes later, a
question whose answer only the fact gives.

- ``passkey``: a five-digit key stated once inside filler text
  (``PASSKEY\xff48213``), asked for at the end (``PASSKEY\xff`` -> ``48213``); the byte
  ``0xFF`` (never in UTF-8 text) marks both.
- ``recall``: a stream of key-value pairs (`` qmzv=3071;``), some of them repeated
  later; at the end one key is repeated and its value must follow
  (`` qmzv=`` -> ``3071``). Keys are four lowercase letters, distinct within an
  example (so an example is at most :func:`max_length` bytes, about 5 MB); values
  four digits.

The ``distance`` is the number of positions from the fact's first answer byte to
the question's first answer byte: a model that attends back that far can copy the
answer. Each example is ``length`` bytes and ends with its answer, so a batch is
one forward pass. Examples depend only on the generator's state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..ops import validation

TASKS = ("passkey", "recall")
DIGITS = b"0123456789"
LETTERS = b"abcdefghijklmnopqrstuvwxyz"
# The key follows the byte 0xFF, which UTF-8 text never holds: in any filler text the
# fact and the question are the only places it occurs.
MARK = b"\xff"
PASSKEY_FACT, PASSKEY_QUESTION = b"\nPASSKEY" + MARK, b"\nPASSKEY" + MARK
PASSKEY_DIGITS = 5
RECALL_KEY, RECALL_VALUE = 4, 4
_PAIR = 1 + RECALL_KEY + 1 + RECALL_VALUE + 1  # " qmzv=3071;"
# A recall example draws length // _PAIR + 2 distinct keys, of 26**RECALL_KEY there are.
RECALL_MAX_LENGTH = (26**RECALL_KEY - 1) * _PAIR - 1


@dataclass(frozen=True)
class Example:
    """``tokens``: uint8 ``(length,)``, ending with the answer; ``answer``: the
    number of answer bytes at the end; ``distance``: from the fact's first answer
    byte to the question's."""

    tokens: torch.Tensor
    answer: int
    distance: int


def check_task(task: str) -> str:
    """``task`` as a plain ``str`` if it is one of ``TASKS``; else a ``ValueError`` (``TypeError`` if not a str)."""
    return validation.check_choice(task, "task", TASKS)


def min_distance(task: str) -> int:
    """The shortest distance an example of ``task`` can have: the fact must end
    before the question starts."""
    if check_task(task) == "passkey":
        return PASSKEY_DIGITS + len(PASSKEY_QUESTION)
    return _PAIR


def answer_length(task: str) -> int:
    """The bytes of an answer (digits): the last bytes of every example of ``task``."""
    return PASSKEY_DIGITS if check_task(task) == "passkey" else RECALL_VALUE


def min_length(task: str, distance: int) -> int:
    """The shortest example with the fact ``distance`` bytes before the answer."""
    fact = len(PASSKEY_FACT) if check_task(task) == "passkey" else 1 + RECALL_KEY + 1
    return fact + distance + answer_length(task)


def max_length(task: str) -> int | None:
    """The longest example of ``task`` (``None``: any length): a ``recall`` example's
    keys are distinct four-letter words, and there are ``26**4`` of them."""
    return None if check_task(task) == "passkey" else RECALL_MAX_LENGTH


def check_length(task: str, length: int, name: str, fix: str) -> None:
    """Refuse a ``length`` (named ``name``) beyond :func:`max_length`, saying ``fix``."""
    longest = max_length(task)
    if longest is not None and length > longest:
        raise ValueError(
            f"{name} asks for {task} examples of {length} bytes, but they hold at most {longest} "
            f"(their keys are distinct four-letter words): {fix}"
        )


def chance(task: str) -> float:
    """The accuracy of guessing the answer: uniform digits."""
    return 10.0 ** -answer_length(task)


def make_example(
    task: str, length: int, distance: int, generator: torch.Generator, filler: torch.Tensor | None = None
) -> Example:
    """One example of ``task``, ``length`` bytes, its fact ``distance`` bytes before
    its answer. ``filler`` (uint8 text, ``passkey`` only; default: spaces and
    newlines at random) fills the rest around the fact."""
    check_task(task)
    if distance < min_distance(task):
        raise ValueError(f"distance must be at least {min_distance(task)} for {task}, got {distance}")
    if length < min_length(task, distance):
        raise ValueError(
            f"length must be at least {min_length(task, distance)} for a {task} example at distance "
            f"{distance}, got {length}"
        )
    check_length(task, length, "length", "pass a shorter length")
    if task == "passkey":
        return _passkey(length, distance, generator, filler)
    return _recall(length, distance, generator)


def _digits(count: int, generator: torch.Generator) -> bytes:
    return bytes(DIGITS[i] for i in torch.randint(0, 10, (count,), generator=generator).tolist())


def _text(data: torch.Tensor, count: int, generator: torch.Generator) -> bytes:
    """``count`` bytes of ``data`` from a random place (repeated if it is short)."""
    if count <= 0:
        return b""
    if len(data) < count:
        data = data.repeat(math.ceil(count / max(len(data), 1)) + 1)
    start = int(torch.randint(0, len(data) - count + 1, (1,), generator=generator))
    return bytes(data[start : start + count].tolist())


def _passkey(length: int, distance: int, generator: torch.Generator, filler: torch.Tensor | None) -> Example:
    key = _digits(PASSKEY_DIGITS, generator)
    if filler is None:
        filler = torch.tensor(list(b" \n"), dtype=torch.uint8)[torch.randint(0, 2, (4096,), generator=generator)]
    answer_at = length - PASSKEY_DIGITS
    fact_at = answer_at - distance  # the fact's first digit
    before = fact_at - len(PASSKEY_FACT)
    between = distance - PASSKEY_DIGITS - len(PASSKEY_QUESTION)  # after the fact's key
    text = (
        _text(filler, before, generator)
        + PASSKEY_FACT
        + key
        + _text(filler, between, generator)
        + PASSKEY_QUESTION
        + key
    )
    return Example(_bytes(text, length), PASSKEY_DIGITS, distance)


def _recall(length: int, distance: int, generator: torch.Generator) -> Example:
    """Pairs and repeats of earlier pairs (one item in four, from a log-uniform number
    of items back), spaces padding the gaps
    to exact lengths; the queried key occurs once before the question, ``distance``
    bytes back."""
    items = length // _PAIR + 2
    codes = _distinct(items, 26**RECALL_KEY, generator)
    keys = [bytes(LETTERS[code // 26**i % 26] for i in range(RECALL_KEY)) for code in codes]
    values = [_digits(RECALL_VALUE, generator) for _ in keys]
    target, others = 0, iter(range(1, items))  # the queried key, and the others in order of first use

    def stream(count: int) -> bytes:
        """``count`` bytes of pairs (new ones, or repeats of this stream's earlier
        ones; never the queried key), then spaces to the exact length."""
        out: list[bytes] = []
        seen: list[int] = []
        for _ in range(count // _PAIR):
            repeat = seen and float(torch.rand((), generator=generator)) < 0.25
            # a repeat of the pair `back` items ago, log-uniform: near ones as often as far ones
            back = int(math.exp(float(torch.rand((), generator=generator)) * math.log(len(seen) + 1))) if repeat else 0
            index = seen[-min(max(back, 1), len(seen))] if repeat else next(others)
            seen.append(index)
            out.append(b" " + keys[index] + b"=" + values[index] + b";")
        return b"".join(out) + b" " * (count % _PAIR)

    answer_at = length - RECALL_VALUE
    fact_at = answer_at - distance  # the fact's value
    question = b" " + keys[target] + b"="
    before = stream(fact_at - len(question))
    between = stream(distance - RECALL_VALUE - 1 - len(question))
    text = before + question + values[target] + b";" + between + question + values[target]
    return Example(_bytes(text, length), RECALL_VALUE, distance)


def _distinct(count: int, high: int, generator: torch.Generator) -> list[int]:
    """``min(count, high)`` distinct ints drawn uniformly from ``[0, high)``, in the
    order drawn. Where they are a small share of ``high``, draws that repeat an
    earlier one are drawn again (a permutation costs ``O(high)`` time and memory per
    call); else the first of a random permutation."""
    if 4 * count > high:
        return torch.randperm(high, generator=generator)[:count].tolist()
    codes: list[int] = []
    seen: set[int] = set()
    while len(codes) < count:
        for code in torch.randint(0, high, (count - len(codes),), generator=generator).tolist():
            if code not in seen:
                seen.add(code)
                codes.append(code)
    return codes


def _bytes(text: bytes, length: int) -> torch.Tensor:
    assert len(text) == length, (len(text), length)  # the arithmetic above places every part exactly
    return torch.tensor(list(text), dtype=torch.uint8)


def sample_distance(task: str, length: int, generator: torch.Generator) -> int:
    """A distance for a training example: log-uniform from the shortest to the
    longest the length allows."""
    low, high = min_distance(task), length - min_length(task, 0)
    return round(math.exp(math.log(low) + float(torch.rand((), generator=generator)) * math.log(high / low)))


def mix_into(
    inputs: torch.Tensor,
    targets: torch.Tensor,
    task: str,
    fraction: float,
    generator: torch.Generator,
    filler: torch.Tensor | None = None,
) -> None:
    """Replace about ``fraction`` of the rows of a training batch (``inputs, targets``
    int64 ``(B, N)``, next-byte pairs) by examples of ``task``, in place, each at a
    random distance (:func:`sample_distance`)."""
    batch, context = inputs.shape
    chosen = torch.rand(batch, generator=generator) < fraction
    for row in chosen.nonzero().flatten().tolist():
        distance = sample_distance(task, context + 1, generator)
        tokens = make_example(task, context + 1, distance, generator, filler).tokens.long()
        inputs[row], targets[row] = tokens[:-1], tokens[1:]
