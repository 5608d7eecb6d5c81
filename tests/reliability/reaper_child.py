"""The harness process that tests/reliability/test_reaper.py SIGKILLs.

Makes what a test or benchmark makes: two network namespaces on a bridge
in the root namespace (with an address there, as the fleet's), a sidecar in
one of them (its arena in /dev/shm; started without the parent-death signal,
so only the reaper can stop it), a process group of two (a shell and its
child) holding a /dev/shm file open, as an engine holds its queues, and a
small tmpfs mounted (as the fault bench's full disk is).
Prints what it made as one JSON line, then sleeps until killed.

    python -m tests.reliability.reaper_child DIR
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from harness.netns import Network
from harness.reaper import watch_mount, watch_process
from harness.sidecar import SidecarProcess, arenas_of

LIFE_S = 300.0  # bounded: it is meant to be killed long before


def main() -> None:
    root = Path(sys.argv[1])
    net = Network(2, prefix="trp", subnet="10.209.0", root_addr="10.209.0.254")
    sidecar = SidecarProcess(root / "sidecar", netns=net.ns[0])
    sidecar.start()
    held = f"/dev/shm/tierstore-reaper-test-{os.getpid()}"
    group = subprocess.Popen(
        ["sh", "-c", f"exec 3<>{held}; echo held >&3; sleep {LIFE_S:.0f} & wait"],
        start_new_session=True,
    )
    watch_process(group.pid, group=True)
    deadline = time.monotonic() + 10.0
    while not os.path.exists(held) and time.monotonic() < deadline:
        time.sleep(0.02)
    mount = root / "disk"
    mount.mkdir()
    watch_mount(str(mount))
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], check=True)
    made = {
        "pids": [sidecar.pid, group.pid],
        "group": group.pid,
        "netns": net.ns,
        "links": [net.bridge],
        "shm": [f"/dev/shm/{name}" for name in arenas_of(sidecar.pid)] + [held],
        "mounts": [str(mount)],
    }
    print(json.dumps(made), flush=True)
    time.sleep(LIFE_S)


if __name__ == "__main__":
    main()
