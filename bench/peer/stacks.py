"""Where the peer tier's threads spend a fetch: ``bench/peer/tier.py
--profile DIR`` samples the sender's and the receiver's sidecar with py-spy
(idle samples too: a thread parked on a lock or a socket shows where it
waits) and sums the stacks per tierstore thread kind.

Provides ``profile_fetch`` and ``summarize_stacks``. Runs in the
benchmark's process; py-spy runs as its children.
"""

from __future__ import annotations

import collections
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path


def profile_fetch(pids: dict[str, int], fetches: Callable[[], None], directory: Path) -> None:
    """py-spy (idle samples too) on each process of ``pids`` (side name ->
    pid) while ``fetches`` runs; raw stacks (``SIDE.txt``) and a per-thread
    summary (``profile.txt``) in ``directory``."""
    spy = shutil.which("py-spy")
    if spy is None:
        raise RuntimeError("--profile needs py-spy (pip install py-spy)")
    directory.mkdir(parents=True, exist_ok=True)
    spies = {}
    for side, pid in pids.items():
        cmd = [
            spy,
            "record",
            "--pid",
            str(pid),
            "--rate",
            "250",
            "--idle",
            "--threads",
        ]
        cmd += ["--nonblocking", "--format", "raw", "--output", str(directory / f"{side}.txt")]
        spies[side] = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)  # py-spy attaches
    try:
        fetches()
    finally:
        for p in spies.values():
            p.send_signal(signal.SIGINT)
        for p in spies.values():
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    lines = []
    for side in spies:
        lines += summarize_stacks(side, directory / f"{side}.txt")
    (directory / "profile.txt").write_text("\n".join(lines) + "\n")


PROFILED_THREADS = ("tierstore-data", "tierstore-rpc", "tierstore-peer", "tierstore-prefetch")


def summarize_stacks(side: str, path: Path, top: int = 6) -> list[str]:
    """Per tierstore thread kind: samples, and its innermost frames (self samples,
    idle included: a thread parked on a lock or a socket shows where it waits)."""
    if not path.exists():
        return [f"{side}: no samples ({path} missing)"]
    threads: collections.Counter[str] = collections.Counter()
    leaves: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        name = frames[0].partition(": ")[2].rstrip("_0123456789")
        if not count.isdigit() or not name.startswith(PROFILED_THREADS):
            continue
        threads[name] += int(count)
        leaves[name][frames[-1]] += int(count)
    out = [f"== {side}"]
    for name, total in threads.most_common():
        out.append(f"  {name}: {total} samples")
        out += [f"    {100 * n / total:5.1f}%  {f}" for f, n in leaves[name].most_common(top)]
    return out
