"""Nothing a test or benchmark starts outlives it, even when it is SIGKILLed
(the OOM killer), which runs no ``finally`` block.

Provides ``watch_process`` (a child, or its whole process group),
``watch_netns`` (a network namespace), ``watch_link`` (a device in the
root namespace: a bridge the hosts' namespaces hang on), ``watch_mount`` (a filesystem the
harness mounted, e.g. a small tmpfs for a full disk), ``forget_*`` (stopped
or removed by their owner: nothing left to do), and the reaper itself
(``main``, run as ``python -m harness.reaper``).

The first watch starts the reaper: a child in a session of its own whose
stdin is a pipe from this process, which writes one line per watch and per
forget. The kernel closes that pipe when this process exits, however it
exits, and the reaper then cleans up what is still watched, in order:

1. the processes: each watched pid whose start time is still the one
   recorded (a pid reused since is never touched), and every member of each
   watched process group (engines, SeaweedFS and the gateway are started as
   group leaders: an engine's core and workers go with it). Before any
   signal it notes the /dev/shm files they hold open or mapped. SIGTERM,
   ``GRACE_S`` to exit, then SIGKILL;
2. the namespaces still there (``ip netns del``), the root namespace's
   devices (``ip link del``: a bridge left there keeps its address and its
   route to the hosts' subnet, and the next run's hosts on that subnet are
   unreachable), and the mounts (``umount -l``: a tmpfs gives its memory
   back);
3. the /dev/shm files those processes held (a sidecar's arena, an engine's
   queues and semaphores), once no live process holds them.

What it did, if anything, goes to ``tierstore-reaper-<harness pid>.log`` in
the temporary directory (the harness's stderr may be gone with it).
``HARNESS_REAPER=0`` (not ``TIERSTORE_``: those are the sidecar's settings)
turns watching off: the control that shows what is left without it
(tests/reliability/test_reaper.py). The harness side is thread-safe; a
forked child that watches something starts a reaper of its own.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from . import REPO, child_env

SHM = Path("/dev/shm")
GRACE_S = 5.0  # SIGTERM to SIGKILL
KILL_WAIT_S = 5.0  # SIGKILL to gone
POLL_S = 0.05

_lock = threading.Lock()
_reaper: subprocess.Popen[bytes] | None = None
_reaper_owner = -1  # the pid that started _reaper (a forked child needs its own)


# -- the harness's side ---------------------------------------------------------------


def _enabled() -> bool:
    return os.environ.get("HARNESS_REAPER", "1") != "0"


def _send(line: str) -> None:
    global _reaper, _reaper_owner
    if not _enabled():
        return
    with _lock:
        if _reaper is None or _reaper_owner != os.getpid():
            log = Path(tempfile.gettempdir()) / f"tierstore-reaper-{os.getpid()}.log"
            _reaper = subprocess.Popen(
                [sys.executable, "-m", "harness.reaper", str(log)], cwd=REPO, env=child_env(),
                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True,
            )  # fmt: skip
            _reaper_owner = os.getpid()
        assert _reaper.stdin is not None
        try:
            _reaper.stdin.write(f"{line}\n".encode())
            _reaper.stdin.flush()
        except BrokenPipeError:
            raise RuntimeError(
                f"the harness's reaper (pid {_reaper.pid}) exited {_reaper.poll()}: what this "
                "process starts would outlive it"
            ) from None


def start_time(pid: int) -> int:
    """The process's start time in clock ticks since boot (0: no such process,
    or a zombie: it has exited and holds nothing)."""
    fields = _stat_fields(pid)
    return 0 if fields is None or fields[0] == "Z" else int(fields[19])


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/PID/stat after the command's name: state, ppid, pgrp, ..."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None


def watch_process(pid: int, group: bool = False) -> None:
    """Reap ``pid`` (with ``group``: every process of the group it leads)."""
    _send(f"proc {pid} {start_time(pid)} {int(group)}")


def forget_process(pid: int) -> None:
    _send(f"forget-proc {pid}")


def watch_netns(name: str) -> None:
    _send(f"netns {name}")


def forget_netns(name: str) -> None:
    _send(f"forget-netns {name}")


def watch_link(name: str) -> None:
    _send(f"link {name}")


def forget_link(name: str) -> None:
    _send(f"forget-link {name}")


def watch_mount(path: str) -> None:
    if any(c.isspace() for c in path):
        raise ValueError(f"a watched mount's path cannot hold whitespace: {path!r}")
    _send(f"mount {path}")


def forget_mount(path: str) -> None:
    _send(f"forget-mount {path}")


# -- the reaper -------------------------------------------------------------------


def _all_pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def _members(procs: dict[int, tuple[int, bool]]) -> set[int]:
    """The live processes watched: pids with their recorded start time, and
    every member of the watched groups."""
    groups = {pid for pid, (_, group) in procs.items() if group}
    found = {pid for pid, (start, _) in procs.items() if start and start_time(pid) == start}
    if groups:
        for pid in _all_pids():
            fields = _stat_fields(pid)
            if fields is not None and fields[0] != "Z" and int(fields[2]) in groups:
                found.add(pid)
    return found


def _shm_held(pids: set[int] | None) -> set[Path]:
    """The /dev/shm files open or mapped by ``pids`` (None: by any process)."""
    held: set[Path] = set()
    prefix = f"{SHM}/"
    for pid in _all_pids() if pids is None else pids:
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if target.startswith(prefix):
                        held.add(Path(target))
        with contextlib.suppress(OSError), open(f"/proc/{pid}/maps") as maps:
            for line in maps:
                at = line.find(prefix)
                if at >= 0:
                    held.add(Path(line[at:].rstrip("\n").removesuffix(" (deleted)")))
    return held


def group_shm(pgid: int) -> set[Path]:
    """The /dev/shm files the live members of process group ``pgid`` hold."""
    return _shm_held(_members({pgid: (0, True)}))


def remove_unheld(paths: set[Path]) -> list[Path]:
    """Unlink those of ``paths`` no live process holds; returns them."""
    removed = []
    for path in sorted(paths - _shm_held(None)):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed.append(path)
    return removed


def _signal(procs: dict[int, tuple[int, bool]], members: set[int], sig: int) -> None:
    """``sig`` to each watched group, and to each watched pid still in ``members``."""
    for pid, (_, group) in procs.items():
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if group:
                os.killpg(pid, sig)
            elif pid in members:
                os.kill(pid, sig)


def _wait_gone(procs: dict[int, tuple[int, bool]], timeout_s: float) -> set[int]:
    deadline = time.monotonic() + timeout_s
    while (left := _members(procs)) and time.monotonic() < deadline:
        time.sleep(POLL_S)
    return left


def _mounted(path: str) -> bool:
    with open("/proc/self/mounts") as f:
        return any(line.split()[1] == path for line in f)


def reap(
    procs: dict[int, tuple[int, bool]],
    netns: set[str],
    mounts: set[str] | None = None,
    links: set[str] | None = None,
) -> list[str]:
    """Stop what is watched and remove what it leaves; returns what was done."""
    done: list[str] = []
    members = _members(procs)
    shm = _shm_held(members)
    if members:
        _signal(procs, members, signal.SIGTERM)
        left = _wait_gone(procs, GRACE_S)
        if left:
            _signal(procs, left, signal.SIGKILL)
            left = _wait_gone(procs, KILL_WAIT_S)
        done.append(f"stopped {sorted(members)}" + (f"; alive still: {sorted(left)}" * bool(left)))
    for name in sorted(netns):
        if Path(f"/run/netns/{name}").exists():
            out = subprocess.run(
                ["ip", "netns", "del", name], capture_output=True, text=True, timeout=20
            )
            failed = f" failed: {out.stderr.strip()}" if out.returncode else ""
            done.append(f"netns {name} deleted{failed}")
    for name in sorted(links or ()):
        if Path(f"/sys/class/net/{name}").exists():
            out = subprocess.run(
                ["ip", "link", "del", name], capture_output=True, text=True, timeout=20
            )
            failed = f" failed: {out.stderr.strip()}" if out.returncode else ""
            done.append(f"link {name} deleted{failed}")
    for mount in sorted(mounts or ()):
        if _mounted(mount):
            out = subprocess.run(
                ["umount", "-l", mount], capture_output=True, text=True, timeout=20
            )
            failed = f" failed: {out.stderr.strip()}" if out.returncode else ""
            done.append(f"unmounted {mount}{failed}")
    done.extend(f"removed {path}" for path in remove_unheld(shm))
    return done


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # only the pipe's end stops it
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    procs: dict[int, tuple[int, bool]] = {}
    netns: set[str] = set()
    mounts: set[str] = set()
    links: set[str] = set()
    for line in sys.stdin:
        verb, *args = line.split()
        if verb == "proc":
            procs[int(args[0])] = (int(args[1]), args[2] == "1")
        elif verb == "forget-proc":
            procs.pop(int(args[0]), None)
        elif verb == "netns":
            netns.add(args[0])
        elif verb == "forget-netns":
            netns.discard(args[0])
        elif verb == "link":
            links.add(args[0])
        elif verb == "forget-link":
            links.discard(args[0])
        elif verb == "mount":
            mounts.add(args[0])
        elif verb == "forget-mount":
            mounts.discard(args[0])
    done = reap(procs, netns, mounts, links) if procs or netns or mounts or links else []
    if done:
        with open(sys.argv[1], "a") as log:
            for entry in done:
                log.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {entry}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
