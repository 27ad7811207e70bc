"""The project's habits, checked as CI runs the tests: ruff's lint and format check
(over src, tests, benchmarks and examples) and mypy (over src/dilated_attention) pass,
with their configuration in pyproject.toml; .pre-commit-config.yaml runs the same."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATHS = ["src", "tests", "benchmarks", "examples", "docs/hooks"]
TIMEOUT_S = 300

CHECKS = {
    "ruff check": ["ruff", "check", *PATHS],
    "ruff format --check": ["ruff", "format", "--check", *PATHS],
    "mypy": ["mypy"],  # the files and settings are in pyproject.toml
}


@pytest.mark.parametrize("name", CHECKS)
def test_check_passes(name):
    command = [sys.executable, "-m", *CHECKS[name]]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert result.returncode == 0, (
        f"{' '.join(CHECKS[name])} failed (exit status {result.returncode}; fix what it reports, or run "
        f"ruff format and ruff check --fix for what they fix):\n{result.stdout}{result.stderr}"
    )
