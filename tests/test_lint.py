"""The linter CI runs: `ruff check` over every Python file of the repository, as configured in pyproject.toml."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_ruff_check_is_clean():
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format=concise", "."],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        pytest.fail(f"ruff check found problems (`ruff check --fix` repairs the [*] ones):\n{proc.stdout}{proc.stderr}",
                    pytrace=False)
