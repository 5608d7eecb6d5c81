"""The arena locked or not under memory pressure: which pages stay, and what pays instead.

    sudo python -m bench.tiers.pressure --json [--arena-mib 1024] [--hog-mib 1024]
                                        [--limit-mib 1536] [--swap-mib 2048]

Needs root: it makes a swap file (removed at the end; ``--swap-mib 0``: no
swap) and a memory cgroup (v1 ``memory`` or v2) limited to ``--limit-mib``.
For each of ``dram_lock = auto`` (locked as faulted in, the sidecar's
default) and ``off``, a child process joins the cgroup, makes an arena of
``--arena-mib`` on /dev/shm as the sidecar does (``Arena.create``, locked
with ``Arena.lock`` or not), writes it whole, and then allocates and
writes ``--hog-mib`` of anonymous memory: together over the limit, so the
kernel must take memory back from one of them. Then, per mode:

- ``arena_resident_bytes`` / ``arena_swapped_bytes``: the arena's mapping
  in the child (``/proc/self/smaps``: ``Rss``, ``Swap``), and the same for
  the hog (``hog_swapped_bytes``);
- ``arena_read_gbps``: one read of the whole arena right after, and
  ``arena_read_again_gbps`` the same read repeated (hot): what a load of
  the blocks that sat there meets;
- ``arena_intact``: every byte read back equals what was written;
- ``oom_killed``: the child was killed by the cgroup's OOM killer (what
  happens when neither can be taken back: no swap, or everything locked).

With swap, an unlocked arena is swapped out like any memory (its reads pay
the swap-in) and a locked one stays while the other processes of the cgroup
are swapped instead; without swap, neither can be taken back and the cgroup
OOM-kills. Whether locking is right is the operator's call: it moves the
cost of pressure from the store's loads to the host's other memory.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from bench.limits import GB, emit

MODES = ("auto", "off")
CHILD_TIMEOUT_S = 300
CHUNK_BYTES = 64 << 20  # the pattern is written and read back in pieces of this


@contextmanager
def swap_file(mib: int) -> Iterator[bool]:
    """A swap file of ``mib`` MiB in use for the block (False: none made)."""
    if mib <= 0:
        yield False
        return
    path = Path(tempfile.mkdtemp(prefix="tierstore-pressure-", dir=os.path.expanduser("~")))
    swap = path / "swap"
    try:
        subprocess.run(["fallocate", "-l", f"{mib}M", str(swap)], check=True)
        swap.chmod(0o600)
        subprocess.run(["mkswap", str(swap)], check=True, capture_output=True)
        subprocess.run(["swapon", str(swap)], check=True)
        try:
            yield True
        finally:
            subprocess.run(["swapoff", str(swap)], check=True, timeout=CHILD_TIMEOUT_S)
    finally:
        swap.unlink(missing_ok=True)
        path.rmdir()


@contextmanager
def memory_cgroup(limit_bytes: int) -> Iterator[Path]:
    """A new memory cgroup limited to ``limit_bytes``; yields its procs file."""
    v1 = Path("/sys/fs/cgroup/memory")
    v2 = Path("/sys/fs/cgroup")
    name = f"tierstore-pressure-{os.getpid()}"
    if v1.is_dir():
        group = v1 / name
        group.mkdir()
        (group / "memory.limit_in_bytes").write_text(str(limit_bytes))
    else:
        group = v2 / name
        group.mkdir()
        (group / "memory.max").write_text(str(limit_bytes))
    try:
        yield group / "cgroup.procs"
    finally:
        for _ in range(50):  # the child is gone; its cgroup empties as it is reaped
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def read_all(words: np.ndarray, out: np.ndarray) -> tuple[float, bool]:
    """Copy the arena out, ``out`` at a time (seconds, the copying alone),
    then check each piece against the pattern (not timed)."""
    seconds, intact = 0.0, True
    for lo in range(0, len(words), len(out)):
        n = min(len(out), len(words) - lo)
        t0 = time.perf_counter()
        np.copyto(out[:n], words[lo : lo + n])
        seconds += time.perf_counter() - t0
        intact &= bool(np.array_equal(out[:n], np.arange(lo, lo + n, dtype=np.uint64)))
    return seconds, intact


def child(mode: str, arena_bytes: int, hog_bytes: int, procs: str) -> dict[str, Any]:
    """One mode, in the cgroup: see the module docstring."""
    from tierstore.memory.arena import Arena, locked_bytes, smaps_bytes

    Path(procs).write_text(str(os.getpid()))
    arena = Arena.create(arena_bytes, upfront=False)
    try:
        if mode == "auto":
            why = arena.lock()
            if why:
                raise SystemExit(f"cannot lock the arena: {why}")
        words = arena.array.view(np.uint64)
        chunk = CHUNK_BYTES // 8
        for lo in range(0, len(words), chunk):  # a known pattern, no copy of it kept
            words[lo : lo + chunk] = np.arange(lo, min(lo + chunk, len(words)), dtype=np.uint64)
        hog = np.ones(hog_bytes, dtype=np.uint8)  # written whole: every page faulted in
        a0, h0 = arena.array.ctypes.data, hog.ctypes.data
        arena_pages = smaps_bytes(a0, a0 + arena_bytes, (b"Rss:", b"Swap:"))
        hog_pages = smaps_bytes(h0, h0 + hog_bytes, (b"Rss:", b"Swap:"))
        out = np.empty(chunk, dtype=np.uint64)
        first, intact = read_all(words, out)
        again, _ = read_all(words, out)
        return {
            "arena_resident_bytes": arena_pages[b"Rss:"],
            "arena_swapped_bytes": arena_pages[b"Swap:"],
            "hog_resident_bytes": hog_pages[b"Rss:"],
            "hog_swapped_bytes": hog_pages[b"Swap:"],
            "arena_read_gbps": round(arena_bytes / first / GB, 3),
            "arena_read_again_gbps": round(arena_bytes / again / GB, 3),
            "arena_intact": intact,
            "locked_bytes": locked_bytes(),
        }
    finally:
        arena.close()  # the creator's close removes the file


def run_mode(mode: str, args: argparse.Namespace, procs: Path) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "bench.tiers.pressure", "--child", mode, "--procs", str(procs),
           "--arena-mib", str(args.arena_mib), "--hog-mib", str(args.hog_mib)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    if proc.returncode == -9:  # SIGKILL: the cgroup's OOM killer
        return {"oom_killed": True}
    if proc.returncode != 0:
        raise RuntimeError(f"mode {mode}: child failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return {"oom_killed": False, **json.loads(proc.stdout.strip().splitlines()[-1])}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--arena-mib", type=int, default=1024)
    parser.add_argument("--hog-mib", type=int, default=1024)
    parser.add_argument("--limit-mib", type=int, default=1536)
    parser.add_argument("--swap-mib", type=int, default=2048)
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--procs", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.arena_mib << 20, args.hog_mib << 20, args.procs)))
        return
    if os.geteuid() != 0:
        raise SystemExit("bench.tiers.pressure needs root (a swap file and a memory cgroup)")
    result: dict[str, Any] = {
        "arena_bytes": args.arena_mib << 20,
        "hog_bytes": args.hog_mib << 20,
        "limit_bytes": args.limit_mib << 20,
        "swap_bytes": args.swap_mib << 20,
        "modes": {},
    }
    with swap_file(args.swap_mib), memory_cgroup(args.limit_mib << 20) as procs:
        for mode in MODES:
            result["modes"][mode] = run_mode(mode, args, procs)
    emit(result, args.json)


if __name__ == "__main__":
    main()
