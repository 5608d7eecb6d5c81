"""Nothing a harness starts outlives it when it is SIGKILLed (the OOM case):
``harness.reaper``.

A harness process (tests/reliability/reaper_child.py) makes two network
namespaces on a bridge in the root namespace, a sidecar in one (its arena
in /dev/shm), a process group holding a /dev/shm file and a tmpfs mount,
then is SIGKILLed. Proved: within a bounded wait no process it started is
alive, neither namespace nor the bridge exists, no /dev/shm file of theirs
is left and the tmpfs is unmounted. The control runs the same child with
the reaper off and finds all five kinds left behind (then removes them
itself), so the check fails when nothing cleans up.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from harness import REPO, child_env
from harness.netns import Network, delete_namespace
from harness.reaper import start_time

READY_S = 60.0
REAPED_S = 30.0  # the reaper's grace and kill waits are 5 s each

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="makes network namespaces: needs root")


def start_child(tmp_path: Path, reaper: bool) -> tuple[subprocess.Popen[bytes], dict[str, Any]]:
    env = dict(child_env(), HARNESS_REAPER="1" if reaper else "0")
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.reliability.reaper_child", str(tmp_path)],
        cwd=REPO, env=env, stdout=subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], READY_S)
    line = proc.stdout.readline() if ready else b""
    if not line:
        proc.kill()
        proc.wait(10)
        raise AssertionError(f"the harness child made nothing in {READY_S} s (exit {proc.poll()})")
    made = json.loads(line)
    made["starts"] = {pid: start_time(pid) for pid in made["pids"]}
    return proc, made


def left(made: dict[str, Any]) -> dict[str, list[Any]]:
    """What the child made that still exists, by kind."""
    return {
        "processes": [p for p, t in made["starts"].items() if t and start_time(p) == t],
        "netns": [n for n in made["netns"] if os.path.exists(f"/run/netns/{n}")],
        "links": [n for n in made["links"] if os.path.exists(f"/sys/class/net/{n}")],
        "shm": [f for f in made["shm"] if os.path.exists(f)],
        "mounts": [m for m in made["mounts"] if mounted(m)],
    }


def mounted(path: str) -> bool:
    with open("/proc/self/mounts") as f:
        return any(line.split()[1] == path for line in f)


def kill_harness(proc: subprocess.Popen[bytes]) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)


def test_nothing_outlives_a_sigkilled_harness(tmp_path: Path) -> None:
    proc, made = start_child(tmp_path, reaper=True)
    before = left(made)
    assert all(before.values()), f"the child did not make all five kinds: {before}"
    assert len(made["shm"]) >= 2  # the sidecar's arena and the group's file
    kill_harness(proc)
    deadline = time.monotonic() + REAPED_S
    while any((now := left(made)).values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(now.values()), f"left behind {REAPED_S} s after the kill: {now}"


def test_the_control_without_the_reaper_leaves_them(tmp_path: Path) -> None:
    proc, made = start_child(tmp_path, reaper=False)
    try:
        kill_harness(proc)
        time.sleep(2.0)
        now = left(made)
        assert all(now[kind] for kind in ("processes", "netns", "links", "shm", "mounts")), now
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(made["group"], signal.SIGKILL)
        for pid in left(made)["processes"]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10.0
        while left(made)["processes"] and time.monotonic() < deadline:
            time.sleep(0.05)
        for name in made["netns"]:
            delete_namespace(name)
        for name in made["links"]:
            subprocess.run(["ip", "link", "del", name], check=False, timeout=30)
        for path in made["shm"]:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        for mount in made["mounts"]:
            subprocess.run(["umount", "-l", mount], check=False, timeout=30)


def test_a_network_refuses_a_subnet_another_run_left_routed() -> None:
    """What the reaper prevents, caught if it ever happens: a bridge left with
    an address on the subnet takes the new hosts' packets, so a network on
    that subnet refuses to start, says why, and leaves nothing behind."""
    stale = f"trs{os.getpid() % 100000}x"
    subprocess.run(["ip", "link", "add", stale, "type", "bridge"], check=True, timeout=30)
    try:
        subprocess.run(
            ["ip", "addr", "add", "10.208.0.250/24", "dev", stale], check=True, timeout=30
        )
        subprocess.run(["ip", "link", "set", stale, "up"], check=True, timeout=30)
        before = set(os.listdir("/run/netns")) if os.path.isdir("/run/netns") else set()
        with pytest.raises(RuntimeError, match=rf"10\.208\.0\.0/24 is already routed.*{stale}"):
            Network(2, prefix="trs", subnet="10.208.0", root_addr="10.208.0.254")
        after = set(os.listdir("/run/netns")) if os.path.isdir("/run/netns") else set()
        assert after == before, f"namespaces left: {after - before}"
    finally:
        subprocess.run(["ip", "link", "del", stale], check=False, timeout=30)
