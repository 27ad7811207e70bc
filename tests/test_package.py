"""The package: ``python -m build`` makes an sdist and a wheel that ``twine check``
accepts, the wheel installs into a fresh virtual environment and runs the README's
quickstart from outside the source tree, and no instruction names an install command
that does not work."""

import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import torch

from test_docs import ROOT, named_block

TIMEOUT_S = 400


def run(command, **kwargs):
    result = subprocess.run(
        [str(part) for part in command], capture_output=True, text=True, timeout=TIMEOUT_S, **kwargs
    )
    assert result.returncode == 0, f"{command} failed:\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    return result


def test_wheel_builds_checks_installs_and_runs_the_quickstart(tmp_path):
    dist = tmp_path / "dist"
    # The sdist first, then the wheel from the unpacked sdist (so the sdist is complete);
    # no isolation: setuptools comes from requirements-dev.txt, nothing is downloaded.
    run([sys.executable, "-m", "build", "--no-isolation", "--outdir", dist, ROOT])
    (sdist,), (wheel,) = sorted(dist.glob("*.tar.gz")), sorted(dist.glob("*.whl"))
    assert wheel.name == "dilated_attention-0.1.0-py3-none-any.whl"
    run([sys.executable, "-m", "twine", "check", "--strict", sdist, wheel])

    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        metadata = archive.read("dilated_attention-0.1.0.dist-info/METADATA").decode()
    assert "dilated_attention/py.typed" in names
    assert "dilated_attention-0.1.0.dist-info/licenses/LICENSE" in names
    assert "License-Expression: MIT" in metadata and "Provides-Extra: hf" in metadata
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    for name in ("LICENSE", "CITATION.cff", "CHANGELOG.md", "README.md", "src/dilated_attention/py.typed"):
        assert name in names, name

    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", venv])
    python = venv / "bin" / "python"
    torch_version = torch.__version__.split("+")[0]  # the installed torch, from the local wheel cache
    # --no-compile: byte-compiling torch's files would take most of the test's time.
    run(
        [
            python,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-compile",
            "--disable-pip-version-check",
            wheel,
            f"torch=={torch_version}",
        ]
    )

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    script = (
        named_block(ROOT / "README.md", "quickstart")
        + "\nimport dilated_attention\nprint(dilated_attention.__file__)\n"
    )
    env = {
        "PATH": f"{venv / 'bin'}:/usr/bin:/bin",
        "HOME": str(tmp_path),  # no PYTHONPATH, no source tree
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    result = run([python, "-c", script], cwd=elsewhere, env=env)
    printed = result.stdout.splitlines()
    assert "torch.Size([2, 1500, 256])" in printed
    assert Path(printed[-1]).resolve().is_relative_to(venv.resolve()), printed[-1]
    version = run([venv / "bin" / "dilated-attention", "--version"], cwd=elsewhere, env=env)
    assert version.stdout.startswith("dilated-attention 0.1.0 ")


def test_instructions_name_install_commands_that_work():
    """The package is on no index: nothing tells users to install it from one."""
    unserved = re.compile(r"pip install\s+['\"]?dilated[-_]attention\b(?!-)")
    paths = [
        ROOT / "README.md",
        *(ROOT / "docs").rglob("*.md"),
        *(ROOT / "src").rglob("*.py"),
        *(ROOT / "examples").rglob("*.py"),
    ]
    offenders = [str(path.relative_to(ROOT)) for path in paths if unserved.search(path.read_text())]
    assert not offenders, offenders
