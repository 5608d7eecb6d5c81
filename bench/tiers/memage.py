"""How fast memory that sat idle is copied the first time: the limit every
load and backup of old blocks meets on this machine.

    python -m bench.tiers.memage [--json] [--mib 256] [--ages 0,30,60,120,240]
                                 [--huge-dir DIR]

On this machine (a Firecracker VM) memory nobody touched for a while is
copied up to two or three times slower the first time than right after,
by how much changing from hour to hour, with no page fault in the guest.
The guest runs DAMON with a pageout scheme for memory idle 60 s, but its
filters exempt anonymous memory, which slows as much: the slow first touch
comes from below the guest. A store's blocks are such memory: a prefix stored
minutes before its returning turn sits idle in the arena until the load,
and so do pages of a pool allocated at start. A ``memcpy`` between two
buffers touched just before (``common.memcpy_gbps``) never pays this, so it
overstates the limit of such a copy.

For each age, buffers of ``--mib`` MiB are written at the start, left idle
for that many seconds and then copied once:

- ``read_anon`` / ``read_shm``: out of the idle buffer (anonymous memory,
  or a file on /dev/shm mapped shared, as the sidecar's arena) into one
  touched just before;
- ``write_anon`` / ``write_shm``: from a touched buffer into the idle one;
- ``*_locked``: the same on a sidecar's arena (``Arena.create``) locked in
  memory as the sidecar locks it (``dram_lock``, mlock2 MLOCK_ONFAULT):
  whether locking keeps idle memory ready on this machine;
- ``*_huge``: with ``--huge-dir``, the same on a file of that mount (a
  hugetlbfs or ``huge=always`` tmpfs, as ``shm_dir`` may put the arena):
  whether memory mapped with huge pages stays ready;
- ``*_again``: the same copy repeated right after (the hot figure).

``kept_warm``: a buffer of the longest age of which one byte a page was
read every ``--touch-s`` seconds while it waited, copied first after the
last wait (before the idle buffers of that age, so that nothing before it
warms the CPU more): if idle memory is taken back by its accessed bits,
this one reads at the hot speed. Every timed copy follows a write of its
touched side, so no copy starts on an idle CPU. Ages run together (one
clock), so the bench takes about the longest age.
"""

from __future__ import annotations

import argparse
import mmap
import time
from typing import Any

import numpy as np

from bench.limits import GB, emit, shm_buffer
from tierstore.memory.arena import Arena

KINDS = ("anon", "shm", "locked")


_ARENAS: list[Arena] = []  # kept open (and locked) while the bench runs


def _buffer(kind: str, nbytes: int, huge_dir: str = "") -> np.ndarray:
    if kind == "locked":
        arena = Arena.create(nbytes, upfront=False)
        why = arena.lock()
        if why:
            raise SystemExit(f"cannot lock the arena: {why}")
        _ARENAS.append(arena)
        arr = arena.array
        arr[:] = 0x5A
        return arr
    if kind == "anon":
        buf = mmap.mmap(-1, nbytes)
    else:
        buf = shm_buffer(nbytes, huge_dir if kind == "huge" else "/dev/shm")
    arr = np.frombuffer(buf, dtype=np.uint8)
    arr[:] = 0x5A  # written: every page is present in the guest
    return arr


def _copy_gbps(dst: np.ndarray, src: np.ndarray) -> float:
    t0 = time.perf_counter()
    np.copyto(dst, src)
    return dst.nbytes / (time.perf_counter() - t0) / GB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--ages", default="0,30,60,120,240")
    parser.add_argument("--touch-s", type=float, default=10.0)
    parser.add_argument(
        "--huge-dir",
        default="",
        help="also measure a file on this mount (hugetlbfs, or a tmpfs mounted huge=always)",
    )
    args = parser.parse_args()
    kinds = (*KINDS, "huge") if args.huge_dir else KINDS
    nbytes = args.mib << 20
    ages = sorted(int(a) for a in args.ages.split(","))
    hot = np.ones(nbytes, dtype=np.uint8)
    idle = {
        (age, op, kind): _buffer(kind, nbytes, args.huge_dir)
        for age in ages
        for op in ("read", "write")
        for kind in kinds
    }
    warm = _buffer("shm", nbytes)
    start = time.monotonic()
    last_touch = start
    rows: list[dict[str, Any]] = []
    kept: dict[str, Any] = {}
    for age in ages:
        while (left := start + age - time.monotonic()) > 0:
            time.sleep(min(left, 0.5))
            if time.monotonic() - last_touch >= args.touch_s:
                int(warm[:: mmap.PAGESIZE].sum())  # one byte a page
                last_touch = time.monotonic()
        row: dict[str, Any] = {"idle_s": round(time.monotonic() - start, 1)}
        if age == ages[-1]:  # first after the wait, as the idle buffers are below
            hot[:] = 1
            kept = {
                "idle_s": row["idle_s"],
                "touch_s": args.touch_s,
                "read_gbps": round(_copy_gbps(hot, warm), 2),
                "read_again_gbps": round(_copy_gbps(hot, warm), 2),
            }
        for kind in kinds:
            src = idle[(age, "read", kind)]
            hot[:] = 1  # the destination touched just before
            row[f"read_{kind}_gbps"] = round(_copy_gbps(hot, src), 2)
            row[f"read_{kind}_again_gbps"] = round(_copy_gbps(hot, src), 2)
            dst = idle[(age, "write", kind)]
            row[f"write_{kind}_gbps"] = round(_copy_gbps(dst, hot), 2)
            row[f"write_{kind}_again_gbps"] = round(_copy_gbps(dst, hot), 2)
        rows.append(row)
    oldest = rows[-1]
    emit(
        {
            "bytes": nbytes,
            "ages": rows,
            "kept_warm": kept,
            "oldest_read_shm_vs_hot": round(
                oldest["read_shm_gbps"] / oldest["read_shm_again_gbps"], 3
            ),
            "oldest_write_shm_vs_hot": round(
                oldest["write_shm_gbps"] / oldest["write_shm_again_gbps"], 3
            ),
            **{
                f"oldest_read_{kind}_vs_hot": round(
                    oldest[f"read_{kind}_gbps"] / oldest[f"read_{kind}_again_gbps"], 3
                )
                for kind in kinds
                if kind in ("locked", "huge")
            },
            "huge_dir": args.huge_dir or None,
        },
        args.json,
    )


if __name__ == "__main__":
    main()
