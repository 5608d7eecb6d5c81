"""`--no-skips` (what .ci/run passes) fails a run on any skip but the `cuda` marker's.

A skip in CI hides a part that was not installed (vLLM, etcd, iproute2), so the
gate itself is tested: a run with an ordinary skip must fail, one whose only
skip is a `cuda` test must pass.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"
REPO = CONFTEST.parents[1]  # the copied conftest imports harness from the checkout

TESTS = """
import pytest

def test_runs():
    pass

@pytest.mark.cuda
def test_on_a_gpu():
    pytest.skip("skips on a GPU host too, so the cuda exemption is what is tested")
"""


# One process, and CI's two workers (.ci/run): xdist hands the workers' reports to the
# process that decides the exit status.
WORKERS = pytest.mark.parametrize("workers", [(), ("-n", "2", "--dist", "loadgroup")],
                                  ids=["serial", "two-workers"])  # fmt: skip


def _run(tmp_path: Path, extra: str, workers: tuple[str, ...]) -> subprocess.CompletedProcess[str]:
    shutil.copy(CONFTEST, tmp_path / "conftest.py")
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    cuda: needs a GPU\n")
    (tmp_path / "test_sample.py").write_text(TESTS + extra)
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--no-skips", "-rs"]
    return subprocess.run(
        [*argv, *workers],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        },
    )


@WORKERS
def test_cuda_skip_alone_passes(tmp_path: Path, workers: tuple[str, ...]) -> None:
    run = _run(tmp_path, "", workers)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "skips that fail this run" not in run.stdout


@pytest.mark.parametrize(
    "extra",
    [
        "\ndef test_missing():\n    pytest.skip('etcd not found')\n",
        "\npytest.importorskip('a_module_that_is_not_installed')\n",
    ],
    ids=["in-test", "module-level"],
)
@WORKERS
def test_other_skip_fails_the_run(tmp_path: Path, extra: str, workers: tuple[str, ...]) -> None:
    run = _run(tmp_path, extra, workers)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "skips that fail this run" in run.stdout
