"""Helpers shared by the benchmarks: physical-limit measurements and output.

Every benchmark prints one JSON object. Each throughput sits next to the
physical limit measured in the same run, as a ratio, because timings on
shared machines are noisy and only ratios compare across runs.
"""

from __future__ import annotations

import ctypes
import glob
import json
import mmap
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
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


SIDECAR_START_S = 60.0
SIDECAR_STOP_S = 20.0
_PR_SET_PDEATHSIG = 1  # linux/prctl.h
_ROOT = Path(__file__).resolve().parent.parent


def _die_with_parent() -> None:
    """Run in the sidecar child before exec: SIGTERM it when the benchmark
    dies, even by SIGKILL, so that no sidecar outlives its benchmark."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def spawn_logged(cmd: list[str], log_path: Path) -> subprocess.Popen[bytes]:
    """Start ``cmd`` from the repository root with it on PYTHONPATH, its
    output appended to ``log_path``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_ROOT), env.get("PYTHONPATH")) if p)
    with open(log_path, "ab") as log:
        return subprocess.Popen(cmd, cwd=_ROOT, env=env, stdout=log, stderr=log)


def wait_for_socket(
    proc: subprocess.Popen[bytes], sock: Path, log_path: Path, timeout_s: float = SIDECAR_START_S
) -> None:
    """Return once a starting sidecar's socket exists; raise with the tail of
    its log if it exits or takes longer than ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not sock.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            tail = log_path.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"a sidecar did not start (exit {proc.poll()}):\n{tail}")
        time.sleep(0.05)


@contextmanager
def sidecar(tmp: Path, dram_bytes: int, *settings: str) -> Iterator[Path]:
    """A `tierstore serve` in ``tmp`` (1 GiB of NVMe, no metrics, DRAM never
    spilled by the watermarks) for the duration of the block; its socket is
    yielded. ``settings`` are extra ``name=value`` pairs. Stopped with
    SIGTERM (SIGKILL after a timeout) and its arena removed even on error."""
    sock, log_path = tmp / "s.sock", tmp / "sidecar.log"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_ROOT), env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "tierstore.cli", "serve", "--socket", str(sock)]
    cmd += ["--nvme-dir", str(tmp / "nvme"), "--dram-bytes", str(dram_bytes)]
    cmd += ["--nvme-bytes", "1GiB", "--metrics-port", "0"]
    defaults = ("dram_segment_bytes=64MiB", "dram_high_watermark=1.0", "dram_low_watermark=0.95",
                "log_level=warning")  # fmt: skip
    for setting in (*defaults, *settings):
        cmd += ["--set", setting]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd, cwd=_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
        )  # fmt: skip
    try:
        wait_for_socket(proc, sock, log_path)
        yield sock
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(SIDECAR_STOP_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for leftover in glob.glob(f"/dev/shm/tierstore-{proc.pid}-*"):
            os.unlink(leftover)
