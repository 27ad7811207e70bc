"""The documentation: every Python block of the README and of docs/ runs as written, the
README keeps its two setup commands, and the site builds with ``mkdocs build --strict``.

A Python block may be preceded by an HTML comment of directives, separated by ``;``:
``torchrun N`` runs the block as a script under ``torchrun`` with ``N`` processes (each
must print the expected text), ``expect: TEXT`` asserts that the block prints ``TEXT``,
and a bare word names the block (``quickstart``, which tests/test_package.py runs from
an installed wheel).
"""

import html
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
BLOCK = re.compile(r"(?:<!--(?P<directives>[^>]*)-->\n)?```python\n(?P<code>.*?)^```", re.DOTALL | re.MULTILINE)
TIMEOUT_S = 300


def parse_directives(text):
    """``{"torchrun": N or None, "expect": [TEXT, ...], "names": [...]}`` from a comment."""
    found = {"torchrun": None, "expect": [], "names": []}
    for part in filter(None, (p.strip() for p in (text or "").split(";"))):
        if part.startswith("expect:"):
            found["expect"].append(part[len("expect:") :].strip())
        elif re.fullmatch(r"torchrun \d+", part):
            found["torchrun"] = int(part.split()[1])
        elif re.fullmatch(r"[\w-]+", part):
            found["names"].append(part)
        else:
            raise ValueError(f"unknown directive {part!r}")
    return found


def python_blocks(path):
    """``(line, directives, code)`` of every fenced Python block of a Markdown file."""
    text = path.read_text()
    for match in BLOCK.finditer(text):
        line = text.count("\n", 0, match.start("code")) + 1
        yield line, parse_directives(match["directives"]), match["code"]


def named_block(path, name):
    """The code of the block whose directives name it ``name``."""
    codes = [code for _, directives, code in python_blocks(path) if name in directives["names"]]
    assert len(codes) == 1, f"{path.name} has {len(codes)} python blocks named {name!r}"
    return codes[0]


BLOCKS = [
    pytest.param(path, line, directives, code, id=f"{path.relative_to(ROOT)}:{line}")
    for path in PAGES
    for line, directives, code in python_blocks(path)
]


def test_every_python_fence_is_found():
    for path in PAGES:
        fences = path.read_text().count("```python\n")
        assert fences == len(list(python_blocks(path))), f"{path.name}: a python block the tests would not run"
    assert len(BLOCKS) >= 15


@pytest.mark.parametrize(("path", "line", "directives", "code"), BLOCKS)
def test_python_block_runs_as_written(path, line, directives, code, tmp_path, monkeypatch, capsys):
    if "transformers" in code:
        pytest.importorskip("transformers")
    monkeypatch.chdir(tmp_path)  # blocks that write files write them here
    name = f"{path.relative_to(ROOT)}:{line}"
    if directives["torchrun"]:
        nproc = directives["torchrun"]
        script = tmp_path / "block.py"
        script.write_text(code)
        result = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", str(script)],
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )
        assert result.returncode == 0, f"{name} failed under torchrun:\n{result.stderr[-3000:]}"
        for expected in directives["expect"]:
            assert result.stdout.count(expected) == nproc, f"{name}: not every rank printed {expected!r}"
        return
    torch.manual_seed(0)
    exec(compile(code, name, "exec"), {"__name__": "__main__"})
    printed = capsys.readouterr().out
    for expected in directives["expect"]:
        assert expected in printed, f"{name} printed {printed!r}, without {expected!r}"


def test_readme_keeps_two_setup_commands_and_stays_short():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    setup = text.split("\n## Setup\n", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"```bash\n(.*?)```", setup, re.DOTALL)
    assert len(commands) == 2 and all(command.count("\n") == 1 for command in commands), commands
    assert commands[0].startswith("python3 -m pip install -r requirements.txt && ")
    assert "python3 -m dilated_attention train && python3 -m dilated_attention generate" in commands[0]
    assert f"<!-- test-command -->\n```bash\n{commands[1]}" in setup
    assert commands[1] == "python3 -m pip install -r requirements-dev.txt && python3 -m pytest\n"


def mkdocs_build(config_dir, site_dir):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # Material's notice about MkDocs 2.0, not a warning
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site_dir)],
        cwd=config_dir,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env=env,
    )


def test_site_builds_strict_with_the_api_reference_and_results(tmp_path):
    site = tmp_path / "site"
    result = mkdocs_build(ROOT, site)
    assert result.returncode == 0, result.stderr[-4000:]
    api = (site / "api" / "index.html").read_text()
    for name in (
        "dilated_attention.dilated_attention",
        "dilated_attention.DilatedKVCache",
        "dilated_attention.MultiheadDilatedAttention",
        "key_padding_mask",
    ):
        assert name in api, name
    assert ":class:" not in api and ":func:" not in api
    models = (site / "api-models" / "index.html").read_text()
    assert "dilated_attention.models.LongNetLM" in models
    assert "register" in (site / "api-transformers" / "index.html").read_text()
    performance = (site / "performance" / "index.html").read_text()
    # the results files, included as committed: the CPU table's heading lines and every row
    bench = (ROOT / "benchmarks" / "results" / "bench-cpu-float32-amd-epyc.txt").read_text().split("\n\n")
    for line in "\n".join(bench[:2]).splitlines():
        assert html.escape(line, quote=False) in performance, line
    assert (site / "results" / "bench-cpu-float32-amd-epyc.txt").is_file()
    assert (site / "results" / "decode-cpu-float32-amd-epyc.png").is_file()


def test_strict_build_fails_on_a_broken_link_or_anchor(tmp_path):
    copy = tmp_path / "repo"
    for name in ("mkdocs.yml", "CHANGELOG.md"):
        (copy / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, copy / name)
    for name in ("docs", "src", "benchmarks/results"):
        shutil.copytree(ROOT / name, copy / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    with open(copy / "docs" / "index.md", "a") as page:
        page.write("\nSee [a missing page](missing-page.md) and [a missing section](definition.md#no-such-section).\n")
    result = mkdocs_build(copy, tmp_path / "site")
    assert result.returncode != 0
    assert "missing-page.md" in result.stderr and "no-such-section" in result.stderr
