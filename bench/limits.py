"""Physical-limit measurements and output, shared by every benchmark group.

Provides ``memcpy_gbps``, ``raw_disk_gbps`` / ``raw_disk_once`` (O_DIRECT
sequential disk), ``raw_read_best`` (the fastest O_DIRECT read of an
existing file among a few request sizes and depths), ``shm_buffer`` and
``aligned_buffer`` (the memory kinds they use), ``best_of``, ``ratio`` and
``emit`` (one JSON object, or aligned text). Every benchmark prints one
JSON object. Each throughput sits next to the physical limit measured in
the same run, as a ratio, because timings on shared machines are noisy and
only ratios compare across runs. Runs in the benchmark's process and
thread. The sidecars the benchmarks start come from ``harness.sidecar``.
"""

from __future__ import annotations

import json
import mmap
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent import futures
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


def shm_buffer(nbytes: int, directory: str = "/dev/shm") -> mmap.mmap:
    """A shared mapping of an unlinked file on /dev/shm: the memory kind of
    the sidecar's arena (tmpfs, base pages), not yet touched; or on another
    mount the arena may use (``shm_dir``: hugetlbfs, a ``huge=`` tmpfs)."""
    fd, path = tempfile.mkstemp(prefix="bench-shm-", dir=directory)
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


def raw_read_best(
    path: str | os.PathLike[str],
    nbytes: int,
    depths: Sequence[int] = (1, 4),
    chunks: Sequence[int] = (4 << 20,),
    rounds: int = 2,
) -> tuple[float, str]:
    """The fastest O_DIRECT read of the first ``nbytes`` of ``path`` among the
    ways tried, in GB/s, and which way won: ``chunk`` bytes a request,
    ``depth`` requests in flight (request i on thread i % depth, each thread
    in file order), every way ``rounds`` times. A store that reads with
    several requests in flight is measured against a disk read that may do
    the same; one request at a time is not the device's limit. ``nbytes`` is
    rounded down to whole requests of each size."""
    best, how = 0.0, ""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    try:
        size = os.fstat(fd).st_size
        if size < nbytes:
            raise ValueError(f"{path} holds {size} bytes, fewer than the {nbytes} to read")
        for _ in range(rounds):
            for chunk in chunks:
                total = nbytes - nbytes % chunk
                if total <= 0:
                    raise ValueError(f"{nbytes} bytes hold no whole request of {chunk}")
                for depth in depths:
                    gbps = total / _read_with(fd, total, chunk, depth) / GB
                    if gbps > best:
                        best, how = gbps, f"{chunk >> 20} MiB requests, {depth} in flight"
    finally:
        os.close(fd)
    return best, how


def _read_with(fd: int, total: int, chunk: int, depth: int) -> float:
    """Seconds to read ``[0, total)`` of ``fd`` in ``chunk`` requests on ``depth`` threads."""
    offsets = list(range(0, total, chunk))
    buffers = [mmap.mmap(-1, chunk) for _ in range(depth)]

    def reader(k: int) -> None:
        view = memoryview(buffers[k])
        try:
            for off in offsets[k::depth]:
                if os.preadv(fd, [view], off) != chunk:
                    raise OSError(f"short read at offset {off}")
        finally:
            view.release()

    try:
        with futures.ThreadPoolExecutor(depth) as pool:
            t0 = time.perf_counter()
            for done in [pool.submit(reader, k) for k in range(depth)]:
                done.result()
            return time.perf_counter() - t0
    finally:
        for buf in buffers:
            buf.close()


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
