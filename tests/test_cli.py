"""The command line: check's exit code, pattern's picture, the help and the version."""

import os
import re
import subprocess
import sys

import pytest
import torch

import dilated_attention
import dilated_attention.tools.check as check
import dilated_attention.tools.cli as cli
import dilated_attention.tools.pattern as pattern
from dilated_attention.tools.cli import main
from helpers import option_help


def test_check_passes_and_prints_a_table(capsys):
    assert main(["check", "--dtype", "float64", "float32", "--seed", "3"]) == 0
    out = capsys.readouterr().out
    assert "float64 on cpu" in out and "float32 on cpu" in out
    assert "all passed: 0 failing case(s)" in out
    assert out.count(" yes") == 2 * len(check.default_cases())


def test_check_fails_when_a_case_exceeds_its_tolerance(capsys, monkeypatch):
    monkeypatch.setitem(check.TOLERANCES, torch.float32, 1e-12)
    assert main(["check", "--dtype", "float32"]) == 1
    assert "FAILED" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available, so there is nothing to refuse")
def test_check_refuses_missing_cuda(capsys):
    assert main(["check", "--device", "cuda"]) == 2
    assert "torch.cuda.is_available() is False" in capsys.readouterr().err


def test_pattern_writes_a_png(tmp_path, capsys):
    path = tmp_path / "new folder" / "pattern.png"  # created if missing
    args = ["pattern", "--segment-lengths", "8", "16", "--dilation-rates", "1", "2"]
    assert main([*args, "--length", "32", "--heads", "4", "--causal", "--out", str(path)]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines[:4]] == ["head 0", "head 1", "head 2", "head 3"]
    # head 1: offsets [0, 1]; causal, so query 0 sees only itself
    assert lines[1].startswith("head 1: offsets per branch [0, 1], keys per query min 1")


def test_pattern_on_a_grid_draws_each_order_and_prints_the_locality(tmp_path, capsys):
    path = tmp_path / "grid.png"
    args = ["pattern", "--grid", "16", "16", "--segment-lengths", "16", "64", "--dilation-rates", "1", "2"]
    assert main([*args, "--order", "row_major", "hilbert", "--query", "3", "9", "--out", str(path)]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("16 x 16 grid: neighbour pairs inside one segment")
    assert [line.split()[0] for line in lines[2:4]] == ["row_major", "hilbert"]
    assert lines[2].split()[1:5] == ["50.0%", "1.0", "x", "16.0"]  # a segment of 16 is one row
    assert lines[3].split()[1:5] == ["80.0%", "4.0", "x", "4.0"]  # 4 x 4 squares: 24 of 30 pairs each
    for bad, message in (
        (["--query", "16", "0"], "--query 16 0 must be a patch"),
        (["--causal"], "without --causal"),
        (["--head", "2"], "--head 2 must be in [0, 2) (a head of --heads 2)"),
        (["--head", "-1"], "--head -1 must be in [0, 2)"),
        (["--length", "256"], "--length applies without --grid only: drop it (an image's length is H * W)"),
    ):
        assert main(args + bad + ["--out", str(path)]) == 2
        assert message in capsys.readouterr().err
    sequence = [args[0], *args[4:], "--length", "16", "--heads", "2", "--out", str(tmp_path / "never.png")]
    assert main([*sequence, "--head", "1", "--order", "hilbert"]) == 2  # flags a sequence would ignore
    assert "error: --order, --head apply with --grid only: drop them" in capsys.readouterr().err
    assert not (tmp_path / "never.png").exists()
    assert main(["pattern", "--segment-lengths", "4", "--dilation-rates", "1"]) == 2
    assert "needs --length and --heads (or --grid H W" in capsys.readouterr().err


def test_pattern_has_a_colour_bar_per_head_and_a_caption(tmp_path, monkeypatch):
    figures = []

    def save(fig, *args, **kwargs):
        figures.append(fig)
        return original(fig, *args, **kwargs)

    original = pattern.save
    monkeypatch.setattr(pattern, "save", save)
    path = tmp_path / "pattern.png"
    pattern.draw_pattern(str(path), 24, 3, [8, 16], [1, 2])
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (fig,) = figures
    images = [image for ax in fig.axes for image in ax.images]
    assert len(images) == 3 and all(image.colorbar is not None for image in images)
    caption = " ".join(text.get_text() for text in fig.texts)
    assert "scores are equal" in caption and "counts twice" in caption and "not attended" in caption


def test_pattern_makes_its_folder_only_for_a_picture(tmp_path, monkeypatch):
    args = ["pattern", "--segment-lengths", "4", "--dilation-rates", "1", "--length", "8", "--heads", "1"]
    out = tmp_path / "new" / "folder" / "p.png"

    def fails(*args, **kwargs):
        raise RuntimeError("drawing failed")

    with monkeypatch.context() as patched:
        patched.setattr(pattern, "attention_weights_uniform", fails)
        with pytest.raises(RuntimeError, match="drawing failed"):
            main([*args, "--out", str(out)])
    assert not (tmp_path / "new").exists()  # nothing left behind
    assert main([*args, "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_pattern_draws_contiguous_head_offsets(tmp_path, capsys):
    args = ["pattern", "--segment-lengths", "8", "16", "--dilation-rates", "1", "2", "--length", "16", "--heads", "4"]
    summaries = {}
    for offsets in ("interleaved", "contiguous"):
        path = tmp_path / f"{offsets}.png"
        assert main([*args, "--head-offsets", offsets, "--out", str(path)]) == 0
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        summaries[offsets] = [line for line in capsys.readouterr().out.splitlines() if line.startswith("head ")]
    # branch (16, 2): head j's offset is j % 2 interleaved, j // 2 contiguous
    assert [line.split("]")[0] for line in summaries["interleaved"]] == [
        f"head {j}: offsets per branch [0, {j % 2}" for j in range(4)
    ]
    assert [line.split("]")[0] for line in summaries["contiguous"]] == [
        f"head {j}: offsets per branch [0, {j // 2}" for j in range(4)
    ]


def test_pattern_replaces_its_png_atomically(tmp_path):
    path, other_name = tmp_path / "pattern.png", tmp_path / "other-name.png"
    other_name.write_bytes(b"old")
    os.link(other_name, path)  # writing into the file in place would change other_name too
    args = ["pattern", "--segment-lengths", "8", "--dilation-rates", "1", "--length", "8", "--heads", "1"]
    assert main([*args, "--out", str(path)]) == 0
    assert path.read_bytes()[:4] == b"\x89PNG" and other_name.read_bytes() == b"old"
    assert sorted(os.listdir(tmp_path)) == ["other-name.png", "pattern.png"]


def test_pattern_rejects_bad_configuration(tmp_path, capsys):
    args = ["pattern", "--segment-lengths", "8", "--dilation-rates", "1", "2", "--length", "8", "--heads", "2"]
    assert main([*args, "--out", str(tmp_path / "p.png")]) == 2
    assert "same length" in capsys.readouterr().err


def test_module_entry_point_runs():
    result = subprocess.run(
        [sys.executable, "-m", "dilated_attention", "check", "--dtype", "float64"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "all passed" in result.stdout


def test_version_names_the_package_and_torch(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    expected = f"dilated-attention {dilated_attention.__version__} (torch {torch.__version__})"
    assert capsys.readouterr().out.strip() == expected


def _help(argv, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--help"])
    assert exit_info.value.code == 0
    return capsys.readouterr().out


def test_top_level_help_has_one_sentence_per_command_and_no_markup(capsys, monkeypatch):
    text = _help([], capsys, monkeypatch)
    assert "``" not in text
    for command in ("check", "pattern", "bench", "decode-bench", "train", "generate"):
        (line,) = [line for line in text.splitlines() if line.startswith(f"    {command} ")]
        sentence = line.split(None, 1)[1]
        assert sentence[0].isupper() and sentence.endswith("."), line
    assert "--version" in option_help(text)


@pytest.mark.parametrize("command", ["check", "pattern", "bench", "decode-bench", "train", "generate"])
def test_every_option_says_what_it_does_and_its_default(command, capsys, monkeypatch):
    text = _help([command], capsys, monkeypatch)
    assert "``" not in text
    options = option_help(text)
    del options["-h, --help"]
    assert options
    for invocation, help_text in options.items():
        what, default = re.fullmatch(r"(.*?) ?(\(default: .+\)|\(required\))?", help_text).groups()
        assert what and default, f"{command} {invocation}: {help_text!r}"


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["bench", "--heads", "0"], "argument --heads: must be >= 1, got 0"),
        (["bench", "--seq-lens", "4096", "0"], "argument --seq-lens: must be >= 1, got 0"),
        (["bench", "--max-seconds", "-1"], "argument --max-seconds: must be a number > 0"),
        (["bench", "--threads", "100000"], "argument --threads: must be at most"),
        (["decode-bench", "--threads", "100000"], "argument --threads: must be at most"),
        (["decode-bench", "--positions", "64", str(10**20)], "argument --positions: must be at most 2**62"),
        (["decode-bench", "--dense-steps", str(10**20)], "argument --dense-steps: must be at most 65536"),
        (
            ["pattern", "--segment-lengths", "8", "--dilation-rates", "1", "--length", "-5", "--heads", "2"],
            "argument --length: must be >= 1, got -5",
        ),
    ],
)
def test_out_of_range_numbers_are_usage_errors(argv, fragment, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert fragment in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (
            ["bench", "--segment-lengths", "8,16"],
            "argument --segment-lengths: must be an int >= 1, got '8,16' (separate several values with spaces: 8 16)",
        ),
        (
            ["decode-bench", "--positions", "4k"],
            "argument --positions: must be an int >= 1, got '4k' (several values are separated by spaces)",
        ),
        (["bench", "--heads", "two"], "argument --heads: must be an int >= 1, got 'two'"),
        (["bench", "--max-seconds", "soon"], "argument --max-seconds: must be a number > 0, got 'soon'"),
    ],
)
def test_unreadable_numbers_say_what_is_expected(argv, fragment, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert fragment in err and "invalid" not in err


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--verison"], "error: unrecognized option --verison: did you mean --version?"),
        (["--verison", "check"], "error: unrecognized option --verison: did you mean --version?"),
        (
            ["bnech", "--heads", "2"],
            (
                "error: unknown command 'bnech': did you mean bench? (commands: check, pattern, "
                "bench, decode-bench, train, generate, evaluate)"
            ),
        ),
        (
            ["pattern", "--segmnet-lengths", "8", "--dilation-rates", "1"],
            "error: unrecognized option --segmnet-lengths: did you mean --segment-lengths?",
        ),
        (["bench", "--sed-lens=64"], "error: unrecognized option --sed-lens: did you mean --seq-lens?"),
    ],
)
def test_unknown_options_and_commands_come_first_with_the_closest_name(argv, fragment, capsys):
    """Reported before a missing command or required option, which argparse alone
    reports first."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert fragment in err and "required" not in err


def test_abbreviations_negative_numbers_and_values_are_not_unknown_options(tmp_path, capsys):
    path = tmp_path / "p.png"
    assert (
        main(["pattern", "--segment-l", "8", "--dilation-rates=1", "--length", "8", "--heads", "1", "--out", str(path)])
        == 0
    )
    with pytest.raises(SystemExit):
        main(["pattern", "--grid", "4", "4", "--segment-lengths", "4", "--dilation-rates", "1", "--query", "-1", "0"])
    assert "argument --query: must be >= 0, got -1" in capsys.readouterr().err


def test_pattern_refuses_a_picture_too_large_to_draw(tmp_path, capsys):
    args = ["pattern", "--segment-lengths", "8", "--dilation-rates", "1", "--length", "100000", "--heads", "2"]
    assert main([*args, "--out", str(tmp_path / "p.png")]) == 2
    assert "too large to draw" in capsys.readouterr().err
    assert not (tmp_path / "p.png").exists()
    assert main([*args[:-4], "--length", "8", "--heads", "1", "--out", str(tmp_path / "p.jpg")]) == 2
    assert "pattern writes a PNG image, name a .png file" in capsys.readouterr().err
    grid = ["pattern", "--segment-lengths", "8", "--dilation-rates", "1", "--grid", "4", "4", "--heads", str(10**20)]
    assert main([*grid, "--out", str(tmp_path / "p.png")]) == 2
    assert "--heads 100000000000000000000 must be at most 65,536 with --grid" in capsys.readouterr().err


PATTERN = ["pattern", "--segment-lengths", "8", "--dilation-rates", "1", "--length", "8", "--heads", "1"]
SMALL_BENCH = ["--segment-lengths", "8", "--dilation-rates", "1", "--no-plot"]


def _refused(argv, capsys) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    return err


def test_unwritable_outputs_are_refused_before_any_work(tmp_path, capsys, monkeypatch):
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    monkeypatch.chdir(tmp_path)
    assert "--out . is a folder: name a file" in _refused([*PATTERN, "--out", "."], capsys)
    assert f"--out file.txt/p.png: {a_file} is not a folder" in _refused([*PATTERN, "--out", "file.txt/p.png"], capsys)
    assert "--out must name a file, got ''" in _refused([*PATTERN, "--out", ""], capsys)
    assert sorted(os.listdir(tmp_path)) == ["file.txt"]
    assert not [name for name in os.listdir(tmp_path.parent) if name.endswith(".tmp")]  # --out "": none beside
    monkeypatch.setattr(cli.benchmark, "run", None)  # never reached
    assert "--out-dir file.txt: " in _refused(["bench", *SMALL_BENCH, "--out-dir", "file.txt"], capsys)
    assert "--name must be a file name without a folder, got 'a/b'" in _refused(
        ["bench", *SMALL_BENCH, "--name", "a/b"], capsys
    )
    writable = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: path != str(tmp_path) and writable(path, mode))
    assert "cannot be written into" in _refused(["bench", *SMALL_BENCH, "--out-dir", "new/results"], capsys)
    assert "cannot be written into" in _refused([*PATTERN, "--out", "p.png"], capsys)
    assert sorted(os.listdir(tmp_path)) == ["file.txt"]


def test_sizes_beyond_the_memory_are_refused_before_measuring(capsys, monkeypatch):
    from dilated_attention.tools import decode_benchmark

    monkeypatch.setattr(cli.benchmark, "run", None)  # never reached
    monkeypatch.setattr(decode_benchmark, "run", None)
    assert "at --seq-lens 4611686018427387904 take" in _refused(
        ["bench", *SMALL_BENCH, "--seq-lens", str(2**62)], capsys
    )
    assert "the reference matmul's operands and product at --matmul-size 1000000 take" in _refused(
        ["bench", *SMALL_BENCH, "--matmul-size", str(10**6)], capsys
    )
    assert "the dilated caches of --batch 100000000000 sequences take" in _refused(
        ["decode-bench", *SMALL_BENCH, "--batch", str(10**11)], capsys
    )


@pytest.mark.parametrize(
    ("error", "code", "expected"),
    [
        (MemoryError(), 2, "error: out of memory (MemoryError): use smaller sizes"),
        (RuntimeError("std::bad_alloc"), 2, "error: out of memory (std::bad_alloc)"),
        (PermissionError(13, "Permission denied", "/results/p.png"), 1, "error: /results/p.png: Permission denied"),
        (IsADirectoryError(21, "Is a directory", "/r/.x.json.0f.tmp", None, "/r/x.json"), 1, "error: /r/x.json: Is"),
        # another pipe than stdout's (stdout's own: test_training's closed pipe, status 141)
        (BrokenPipeError(32, "Broken pipe"), 1, "error: Broken pipe (BrokenPipeError)"),
    ],
)
def test_failures_of_the_machine_are_one_line_errors(error, code, expected, capsys, monkeypatch):
    def fail(args):
        raise error

    monkeypatch.setattr(cli, "_cmd_check", fail)
    assert main(["check"]) == code
    err = capsys.readouterr().err.strip()
    assert err.startswith(expected) and len(err.splitlines()) <= 1 and (expected or not err)


@pytest.mark.parametrize(
    ("arguments", "fix"),
    [
        (["bench", "--heads", "1", "--impl", "head_groups"], "or leave head_groups out of --impl"),
        (["pattern", "--heads", "1", "--mode", "head_groups", "--length", "8"], "or --mode mixture"),
    ],
)
def test_head_groups_refusals_name_the_commands_options(tmp_path, capsys, arguments, fix):
    """The command line has no mode= argument: its refusal names its own options."""
    branches = ["--segment-lengths", "4", "8", "--dilation-rates", "1", "2"]
    out = ["--out-dir", str(tmp_path / "out")] if arguments[0] == "bench" else ["--out", str(tmp_path / "p.png")]
    assert cli.main([*arguments, *branches, *out]) == 2
    assert f"1 heads < 2 branches; use more --heads, fewer --segment-lengths, {fix}" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []
