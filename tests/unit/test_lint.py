"""The code as ruff and mypy check it: tierstore, bench and harness type-check,
and every Python file lints and is laid out as ``ruff format`` lays it out.

Without this, CI ran neither: 25 mypy errors had built up in bench/, one of
them a variable that held a sidecar in one loop and a client in the next.
The versions are pinned in the ``test`` extra, so a new release of either
cannot fail a clean clone's CI with no change to the code. Each tool is
also run once on a file with a known fault, to show that its failure
reaches the test."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CODE = ["tierstore", "bench", "harness", "tests"]
TYPED = ["tierstore", "bench", "harness"]


def run(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=cwd, capture_output=True, text=True, timeout=600
    )


def test_ruff_finds_nothing() -> None:
    done = run("ruff", "check", *CODE)
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_python_file_is_laid_out_as_ruff_format_does() -> None:
    done = run("ruff", "format", "--check", *CODE)
    assert done.returncode == 0, done.stdout + done.stderr


def test_mypy_finds_nothing() -> None:
    done = run("mypy", *TYPED)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Success: no issues found" in done.stdout


@pytest.mark.parametrize(
    ("tool", "source", "named"),
    [
        (["ruff", "check"], "import os\n", "F401"),
        (["ruff", "format", "--check"], "x = {  'a':1}\n", "would be reformatted"),
        (["mypy"], "x: int = 'a'\n", "Incompatible types in assignment"),
    ],
)
def test_each_tool_fails_on_a_known_fault(
    tool: list[str], source: str, named: str, tmp_path: Path
) -> None:
    (tmp_path / "fault.py").write_text(source)
    done = run(*tool, "fault.py", cwd=tmp_path)
    assert done.returncode != 0
    assert named in done.stdout + done.stderr
