"""Physical-limit measurements and output, shared by every benchmark group.

Provides ``memcpy_gbps``, ``raw_disk_gbps`` / ``raw_disk_once`` (O_DIRECT
sequential disk), ``shm_buffer`` and ``aligned_buffer`` (the memory kinds
they use), ``best_of``, ``ratio`` and ``emit`` (one JSON object, or aligned
text). Every benchmark prints one JSON object. Each throughput sits next to
the physical limit measured in the same run, as a ratio, because timings on
shared machines are noisy and only ratios compare across runs. Runs in the
benchmark's process and thread. The sidecars the benchmarks start come from
``harness.sidecar``.
"""

from __future__ import annotations

import json
import mmap
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

GB = 1e9


def best_of(repeats: int, fn: Callable[[], Any]) -> float:
    """Shortest wall time of ``repeats`` calls of ``fn`` (seconds)."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def memcpy_gbps(nbytes: int, repeats: int = 3) -> float:
    """numpy copyto between two preallocated, touched buffers."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    return nbytes / best_of(repeats, lambda: np.copyto(dst, src)) / GB


def shm_buffer(nbytes: int) -> mmap.mmap:
    """A shared mapping of an unlinked file on /dev/shm: the memory kind of
    the sidecar's arena (tmpfs, base pages), not yet touched."""
    fd, path = tempfile.mkstemp(prefix="bench-shm-", dir="/dev/shm")
    try:
        os.ftruncate(fd, nbytes)
        return mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)
        os.unlink(path)


def aligned_buffer(nbytes: int) -> mmap.mmap:
    """Page-aligned anonymous memory (O_DIRECT needs aligned buffers)."""
    buf = mmap.mmap(-1, nbytes)
    buf.write(np.random.default_rng(0).bytes(min(nbytes, 1 << 20)) * (nbytes // (1 << 20) or 1))
    return buf


def raw_disk_gbps(
    directory: str, nbytes: int, chunk_bytes: int = 4 << 20, repeats: int = 2
) -> tuple[float, float]:
    """Best of ``repeats`` runs of ``raw_disk_once`` (the disk of a VM drifts)."""
    runs = [raw_disk_once(directory, nbytes, chunk_bytes) for _ in range(repeats)]
    return max(w for w, _ in runs), max(r for _, r in runs)


def raw_disk_once(directory: str, nbytes: int, chunk_bytes: int = 4 << 20) -> tuple[float, float]:
    """Sequential O_DIRECT write (with fdatasync) and read of ``nbytes`` in
    ``chunk_bytes`` requests, like ``dd oflag=direct``; buffered I/O if the
    filesystem refuses O_DIRECT. Returns (write_gbps, read_gbps)."""
    path = os.path.join(directory, f".rawdisk-{os.getpid()}")
    buf = aligned_buffer(chunk_bytes)
    view = memoryview(buf)
    flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC
    try:
        fd = os.open(path, flags | getattr(os, "O_DIRECT", 0), 0o600)
    except OSError:
        fd = os.open(path, flags, 0o600)
    try:
        t0 = time.perf_counter()
        for off in range(0, nbytes, chunk_bytes):
            os.pwrite(fd, view, off)
        os.fdatasync(fd)
        write_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        for off in range(0, nbytes, chunk_bytes):
            os.preadv(fd, [view], off)
        read_s = time.perf_counter() - t0
    finally:
        os.close(fd)
        os.unlink(path)
        view.release()
        buf.close()
    return nbytes / write_s / GB, nbytes / read_s / GB


def emit(result: dict[str, Any], as_json: bool) -> None:
    result.setdefault("machine", {"cpus": os.cpu_count(), "python": platform.python_version()})
    if as_json:
        json.dump(result, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return
    width = max(len(k) for k in result)
    for key, value in result.items():
        if isinstance(value, float):
            value = f"{value:.3f}"
        print(f"{key:<{width}}  {value}")


def ratio(value: float, limit: float) -> float:
    return round(value / limit, 3) if limit > 0 else 0.0
