"""The harness's sidecars die with the process that started them, and a
frozen one answers nothing until it is thawed.

A benchmark or test that is SIGKILLed must not leave a ``tierstore serve``
behind (it holds gigabytes of /dev/shm and its ports): ``die_with_parent``
has the kernel SIGTERM the sidecar when its parent dies. The child is
started without a ``preexec_fn``, so subprocess does not fork() the
parent (whose gRPC atfork handlers can block a fork for good); this test
proves the death signal still reaches the sidecar that way, and, as the
control, that a sidecar started without it outlives its parent (the
harness's reaper, the other guard, is off in both).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from harness import REPO, child_env
from harness.reaper import start_time
from harness.sidecar import start_sidecar, threads_not_stopped

PARENT = """
import sys, time
from pathlib import Path
from harness.sidecar import start_sidecar
s = start_sidecar(Path(sys.argv[1]), die_with_parent=sys.argv[2] == "1")
print(s.pid, flush=True)
time.sleep(120)
"""
WAIT_S = 30.0


def _alive(pid: int) -> bool:
    return start_time(pid) != 0  # 0: gone, or a zombie not yet reaped by init


def _sidecar_of_killed_parent(tmp_path: Path, die_with_parent: bool) -> int:
    """Start a parent that starts a sidecar, SIGKILL the parent; the sidecar's pid.
    The parent's reaper (``harness.reaper``, which would also stop the sidecar)
    is off, so that only the death signal is tested."""
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(tmp_path / "s"), "1" if die_with_parent else "0"],
        cwd=REPO, env={**child_env(), "HARNESS_REAPER": "0"}, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert parent.stdout is not None
        line = parent.stdout.readline()  # the parent's own start wait bounds this
        assert line.strip().isdigit(), f"the parent printed no sidecar pid: {line!r}"
        pid = int(line)
        assert _alive(pid)
    finally:
        parent.kill()
        parent.wait(timeout=WAIT_S)
    return pid


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.1)
    return False


def test_a_sidecar_dies_with_its_killed_parent(tmp_path: Path) -> None:
    pid = _sidecar_of_killed_parent(tmp_path, die_with_parent=True)
    assert _gone_within(pid, WAIT_S), f"sidecar {pid} outlived its SIGKILLed parent"


def test_without_it_the_sidecar_outlives_its_parent(tmp_path: Path) -> None:
    """The control: the test above can fail."""
    pid = _sidecar_of_killed_parent(tmp_path, die_with_parent=False)
    try:
        assert not _gone_within(pid, 2.0), "the sidecar died without die_with_parent"
    finally:
        os.kill(pid, signal.SIGTERM)
        assert _gone_within(pid, WAIT_S)


def test_a_frozen_sidecar_answers_nothing_until_thawed(tmp_path: Path) -> None:
    """``freeze`` returns with every thread stopped (the tests of a stalled
    peer rely on it: a thread still running once answered a lookup after
    SIGSTOP); ``thaw`` lets it serve again."""
    s = start_sidecar(tmp_path / "s")
    try:
        # The control: a serving sidecar's threads (sleeping or running) are
        # not stopped, so the check below can fail.
        assert len(threads_not_stopped(s.pid)) > 1
        s.freeze()
        assert threads_not_stopped(s.pid) == []
        with pytest.raises(grpc.RpcError) as stalled:
            s.stat(timeout_s=0.5)
        assert stalled.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        s.thaw()
        assert s.stat(timeout_s=10.0).counters is not None
        assert len(threads_not_stopped(s.pid)) > 1
    finally:
        s.thaw()
        s.stop()
