"""Long-range retrieval: the tasks' examples, the scoring, `evaluate`, and `train --task`."""

import json
import math
import os
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dilated_attention.tools.cli import main
from dilated_attention.training import TrainSettings, retrieval, tasks
from dilated_attention.training.data import Batches


@st.composite
def example_shapes(draw):
    task = draw(st.sampled_from(tasks.TASKS))
    distance = draw(st.integers(tasks.min_distance(task), 700))
    length = tasks.min_length(task, distance) + draw(st.integers(0, 300))
    return task, length, distance, draw(st.integers(0, 2**32))


@settings(max_examples=60, deadline=None)
@given(example_shapes())
def test_examples_place_the_fact_exactly_distance_before_the_answer(shape):
    task, length, distance, seed = shape
    example = tasks.make_example(task, length, distance, torch.Generator().manual_seed(seed))
    text = bytes(example.tokens.tolist())
    assert len(text) == length and example.distance == distance
    answer = text[-example.answer :]
    assert answer.isdigit() and len(answer) == example.answer
    fact = length - example.answer - distance  # the fact's first answer byte
    assert text[fact : fact + example.answer] == answer
    if task == "passkey":
        question = tasks.PASSKEY_QUESTION
        assert text.count(b"PASSKEY") == 2  # the fact and the question, nothing else
    else:
        question = text[-example.answer - 1 - tasks.RECALL_KEY - 1 : -example.answer]
        assert question[:1] == b" " and question[1:-1].isalpha() and question[-1:] == b"="
        keys = [pair.split(b"=")[0] for pair in text.replace(b";", b" ").split()]
        assert all(k.isalpha() and len(k) == tasks.RECALL_KEY for k in keys)
        assert text.count(question) == 2  # the queried key: its pair, and the question
    assert text[fact - len(question) : fact] == question
    assert text[: -example.answer].endswith(question)


def test_examples_refuse_impossible_shapes():
    generator = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match="task must be one of"):
        tasks.make_example("needle", 100, 20, generator)
    with pytest.raises(ValueError, match="distance must be at least 14"):
        tasks.make_example("passkey", 100, 13, generator)
    with pytest.raises(ValueError, match="length must be at least"):
        tasks.make_example("recall", 50, 45, generator)


class InductionCopier(torch.nn.Module):
    """Predicts, at each of the last ``rows`` positions, the byte that followed the
    latest earlier occurrence of the last ``k`` bytes (a perfect copier); other
    positions get zeros (the scoring reads only the answer's)."""

    def __init__(self, k: int, rows: int):
        super().__init__()
        self.k, self.rows = k, rows

    def forward(self, tokens):
        logits = torch.zeros(*tokens.shape, 256)
        for b, row in enumerate(tokens.tolist()):
            for i in range(len(row) - self.rows, len(row)):
                suffix = row[i - self.k + 1 : i + 1]
                for j in range(i - 1, self.k - 2, -1):
                    if row[j - self.k + 1 : j + 1] == suffix:
                        logits[b, i, row[j + 1]] = 1.0
                        break
        return logits


@pytest.mark.parametrize("task", tasks.TASKS)
def test_a_perfect_copier_answers_at_every_distance(task):
    at = retrieval.distances(task, 1000)
    assert at == [2**k for k in range(4, 10)]
    result = retrieval.score(InductionCopier(k=6, rows=6), task, 300, at, examples=5, seed=3, batch_size=2)
    assert [s.distance for s in result.scores] == at
    assert [s.length for s in result.scores] == [max(300, tasks.min_length(task, d)) for d in at]
    assert all(s.accuracy == 1.0 and s.examples == 5 for s in result.scores)
    assert all(s.answer_bits < 8.0 for s in result.scores)


@pytest.mark.parametrize("task", tasks.TASKS)
def test_a_constant_model_scores_chance(task):
    def constant(tokens):
        return torch.full((*tokens.shape, 256), 0.25)

    result = retrieval.score(constant, task, 128, [32, 64], examples=7, batch_size=3)
    assert result.chance == tasks.chance(task) == 10.0 ** -(5 if task == "passkey" else 4)
    for s in result.scores:
        assert s.accuracy == 0.0  # its answer is byte 0, never a digit: below chance, as a guess can be
        assert s.answer_bits == pytest.approx(8.0, abs=1e-5)  # uniform over 256 bytes


def test_scores_depend_on_the_seed_only():
    def model(tokens):  # "the same byte again": its loss depends on the examples' digits
        return torch.nn.functional.one_hot(tokens, 256).float() * 3

    first, again, other = (retrieval.score(model, "recall", 200, [16, 64], examples=6, seed=s) for s in (1, 1, 2))
    assert first.scores == again.scores
    assert [s.answer_bits for s in first.scores] != [s.answer_bits for s in other.scores]
    largest = retrieval.score(model, "recall", 200, [16, 64], examples=6, seed=2**63 - 1)  # the top of the range
    assert [s.examples for s in largest.scores] == [6, 6] and largest.scores != first.scores


def test_scoring_makes_each_batch_of_examples_when_it_runs_it(monkeypatch):
    """Memory is bounded by a batch, not by ``examples`` (long examples add up)."""
    made = []
    make_example = tasks.make_example
    monkeypatch.setattr(tasks, "make_example", lambda *args: made.append(1) or make_example(*args))
    seen = []

    def model(tokens):
        seen.append((len(made), tokens.shape[0]))
        return torch.zeros(*tokens.shape, 256)

    retrieval.score(model, "recall", 64, [16, 32], examples=7, batch_size=3)
    assert seen == [(3, 3), (6, 3), (7, 1), (10, 3), (13, 3), (14, 1)]


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 400), st.integers(1, 600), st.integers(0, 2**32))
def test_distinct_draws_are_distinct_and_in_range(count, high, seed):
    codes = tasks._distinct(count, high, torch.Generator().manual_seed(seed))
    assert len(codes) == len(set(codes)) == min(count, high)
    assert all(0 <= code < high for code in codes)


def test_training_batches_mix_task_examples_reproducibly():
    data = torch.tensor(list(b"def f(x):\n    return x + 1\n" * 200), dtype=torch.uint8)
    batches = Batches(data, 256, 8, seed=5, task="passkey", task_fraction=1.0)
    inputs, targets = batches.next()
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    for row in inputs.tolist():
        assert bytes(row).count(b"PASSKEY") == 2
    state = batches.state_dict()
    following = batches.next()
    batches.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(batches.next(), following, strict=True))
    none = Batches(data, 256, 8, seed=5, task="recall", task_fraction=0.0).next()[0]
    assert not any(b"=" in bytes(row) for row in none.tolist())


def test_train_settings_check_the_task():
    with pytest.raises(ValueError, match="task must be one of"):
        TrainSettings(task="copy")
    with pytest.raises(ValueError, match="task_fraction"):
        TrainSettings(task="recall", task_fraction=1.5)


def test_train_with_a_task_then_evaluate_the_run(tmp_path, capsys):
    run, text = str(tmp_path / "run"), tmp_path / "text.py"
    text.write_text("def f(x):\n    return x + 1\n" * 400)
    assert (
        main(
            [
                "train",
                "--out",
                run,
                "--data",
                str(text),
                "--steps",
                "2",
                "--context",
                "256",
                "--batch-size",
                "2",
                "--task",
                "passkey",
                "--task-fraction",
                "1",
                "--eval-windows",
                "2",
                "--no-progress",
            ]
        )
        == 0
    )
    with open(os.path.join(run, "config.json")) as f:
        saved = json.load(f)["training"]
    assert saved["task"] == "passkey" and saved["task_fraction"] == 1.0
    capsys.readouterr()
    assert main(["evaluate", "--run", run, "--task", "recall", "--examples", "3", "--max-distance", "100"]) == 0
    out = capsys.readouterr().out
    assert "recall: accuracy" in out and "w=256, r=4: 256" in out
    with open(os.path.join(run, "retrieval-recall.json")) as f:
        result = json.load(f)
    assert [s["distance"] for s in result["scores"]] == [16, 32, 64]
    for s in result["scores"]:
        assert s["examples"] == 3 and 0 <= s["accuracy"] <= 1 and math.isfinite(s["answer_bits"])
    assert os.path.getsize(os.path.join(run, "retrieval-recall.png")) > 10_000
    assert result["about"]["context"] == 256
    assert (
        main(
            [
                "evaluate",
                "--run",
                run,
                "--task",
                "passkey",
                "--examples",
                "2",
                "--max-distance",
                "40",
                "--out",
                str(tmp_path / "elsewhere"),
            ]
        )
        == 0
    )  # the passkey hides in the run's own text
    assert os.path.isfile(tmp_path / "elsewhere" / "retrieval-passkey.json")
    too_far = str(tasks.RECALL_MAX_LENGTH)
    refused = ["evaluate", "--run", run, "--task", "recall", "--max-distance", too_far, "--out", str(tmp_path / "x")]
    assert main(refused) == 2
    assert "pass a smaller max_distance (--max-distance)" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "x")  # refused before any work


def test_recall_examples_stop_where_their_distinct_keys_run_out(tmp_path, capsys):
    longest, generator = tasks.RECALL_MAX_LENGTH, torch.Generator().manual_seed(3)
    assert tasks.max_length("recall") == longest and tasks.max_length("passkey") is None
    with pytest.raises(ValueError, match=f"of {longest + 1} bytes, but they hold at most {longest}"):
        tasks.make_example("recall", longest + 1, 100, generator)
    with pytest.raises(ValueError, match="context asks for recall examples"):
        TrainSettings(task="recall", context=longest)  # each sequence comes with its next byte
    assert TrainSettings(task="recall", context=longest - 1).context == longest - 1
    assert TrainSettings(task="passkey", context=longest).context == longest
    assert main(["train", "--out", str(tmp_path / "r"), "--task", "recall", "--context", str(longest)]) != 0
    assert "context asks for recall examples" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "r")
    # the longest example has a distinct key for every pair it may need, and its answer follows its fact
    example = tasks.make_example("recall", longest, longest // 2, generator)
    text = bytes(example.tokens.tolist())
    pairs = text[:-4].split(b";")
    values = {}
    for pair in pairs[:-1]:
        key, value = pair.strip().split(b"=")
        assert values.setdefault(key, value) == value  # a repeated key keeps its value
    assert len(text) == longest and values[pairs[-1].strip().rstrip(b"=")] == text[-4:]


def test_evaluate_and_train_refuse_bad_task_options(tmp_path, capsys):
    assert main(["train", "--out", str(tmp_path / "r"), "--task-fraction", "0.3", "--steps", "1"]) != 0
    assert "--task-fraction needs --task" in capsys.readouterr().err
    assert main(["evaluate", "--run", str(tmp_path / "none"), "--task", "passkey", "--max-distance", "5"]) != 0
    assert "--max-distance must be at least 14" in capsys.readouterr().err


def test_distances_never_exceed_the_longest_asked_for():
    assert retrieval.distances("passkey", 14) == [14]  # no power of two in [14, 14]: 14 itself
    assert retrieval.distances("passkey", 15) == [15]
    assert retrieval.distances("passkey", 16) == [16]
    assert retrieval.distances("recall", 100) == [16, 32, 64]
    with pytest.raises(ValueError, match="max_distance must be >= 14, got 5"):
        retrieval.distances("passkey", 5)  # below the task's shortest: [5] before, which score then refused


def test_score_takes_numpy_distances_and_refuses_others_by_name():
    import numpy as np

    def constant(tokens):
        return torch.zeros((*tokens.shape, 256))

    numpy_ints = list(np.array([16, 32]))  # np.geomspace(...).astype(int): an OverflowError in the seed before
    assert [s.distance for s in retrieval.score(constant, "recall", 64, numpy_ints, examples=1).scores] == [16, 32]
    for at, error, fragment in (
        ([16.0], TypeError, "each distance of at must be an int, got float"),
        ([16, 3], ValueError, "each distance of at must be in [11, 2**40), got 3"),  # recall's shortest: 11
        (16, TypeError, "at must be a list of distances (ints), got int"),
        ([], ValueError, "at must hold at least one distance, got none"),
    ):
        with pytest.raises(error, match=re.escape(fragment)):
            retrieval.score(constant, "recall", 64, at, examples=1)


def test_evaluate_by_default_works_for_a_context_shorter_than_an_example(tmp_path, capsys):
    from dilated_attention.models import LongNetConfig
    from dilated_attention.training import train

    run, text = str(tmp_path / "run"), tmp_path / "text.py"
    text.write_text("def f(x):\n    return x + 1\n" * 400)
    config = LongNetConfig(dim=32, depth=1, heads=2, ffn_dim=64, segment_lengths=(8, 16), dilation_rates=(1, 2))
    settings = TrainSettings(context=16, batch_size=2, steps=1, eval_windows=2, data=str(text))
    train(run, settings, config, progress=False)
    assert main(["evaluate", "--run", run, "--task", "passkey", "--examples", "2"]) == 0
    with open(os.path.join(run, "retrieval-passkey.json")) as f:
        scores = json.load(f)["scores"]
    assert [(s["distance"], s["length"]) for s in scores] == [(14, 28)]  # the shortest, beyond the context
    # before any work: an output file that cannot be written, a length that cannot fit
    os.makedirs(tmp_path / "out" / "retrieval-recall.png")
    assert main(["evaluate", "--run", run, "--task", "recall", "--out", str(tmp_path / "out")]) == 2
    assert "retrieval-recall.png is a folder where a result file goes: move it, or pass another out" in (
        capsys.readouterr().err
    )
    assert os.listdir(tmp_path / "out") == ["retrieval-recall.png"]
    assert main(["evaluate", "--run", run, "--task", "passkey", "--max-distance", str(2**39)]) == 2
    err = capsys.readouterr().err
    assert f"a forward pass over 8 examples of {2**39 + 14} bytes take" in err and "--max-distance" in err
    assert main(["evaluate", "--run", run, "--task", "recall", "--max-distance", str(2**40)]) == 2
    assert "max_distance (--max-distance) must be in [11, 2**40)" in capsys.readouterr().err
    # a run trained on text that is gone (or came through a pipe, --data <(zcat ...)): --data gives it
    os.rename(text, tmp_path / "moved.py")
    assert main(["evaluate", "--run", run, "--task", "passkey", "--examples", "1"]) == 2
    assert f"the run's training data {text} cannot be read again" in capsys.readouterr().err
    moved = ["--data", str(tmp_path / "moved.py"), "--out", str(tmp_path / "again")]
    assert main(["evaluate", "--run", run, "--task", "passkey", "--examples", "2", *moved]) == 0
    with open(tmp_path / "again" / "retrieval-passkey.json") as f:
        assert json.load(f)["scores"] == scores  # the same text, the same examples
    (tmp_path / "tiny.txt").write_text("hi")
    for task, data, fragment in (
        ("passkey", "tiny.txt", "tiny.txt is empty (its text is too short): give more text"),
        ("recall", "moved.py", "data (--data) is the text a passkey hides in: recall takes none"),
    ):
        assert main(["evaluate", "--run", run, "--task", task, "--data", str(tmp_path / data)]) == 2
        assert fragment in capsys.readouterr().err


def test_evaluate_refuses_an_output_that_is_a_file_before_any_work(tmp_path, capsys):
    a_file = tmp_path / "results"
    a_file.write_text("x")
    assert main(["evaluate", "--run", str(tmp_path / "none"), "--task", "recall", "--out", str(a_file)]) == 2
    assert f"--out {a_file}: {a_file} is not a folder" in capsys.readouterr().err
