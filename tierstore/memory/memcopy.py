"""Copies of whole blocks between private memory and the shared arena.

Provides ``copy_into(dst, src)``, the one CPU copy every hot path uses (a
put into the arena, a client's store and load on device='cpu', a benchmark's
get), and ``STREAMING``, whether it runs the C loop of
``tierstore/memory/_fastcopy.c`` (non-temporal stores, four pages at a time:
1.3-1.6x glibc's memcpy for runs of 320 KiB - 32 MiB in and out of the
arena, see that file) or numpy's memcpy (no compiler at install).

``copy_runs(dst, src, dst_offsets, src_offsets, nbytes, threads=1)``
copies many runs of one size between two buffers in one call (the engines'
page copies: one run per block and layer), with no Python per run, on
``threads`` threads. Its C loop for large runs depends on the CPU
(``RUNS_LOOP``, measured in ``_fastcopy.c``): on Intel with AVX-512 the
four-page loop with 64-byte non-temporal stores (1.3x the forward loop on
the 2-core Sapphire Rapids VM), elsewhere with AVX2 a forward loop with
32-byte ones (1.6x the four-page SSE loop on the 2-core AMD VM). One
thread does not reach a machine's memory bandwidth everywhere: two gave
1.9x one on the Sapphire Rapids VM, and nothing on the AMD one.

Runs in whichever process and thread calls it; the C loop releases the GIL.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

try:  # optional so that installs without a compiler work
    from tierstore.memory._fastcopy import STREAMING as _C_STREAMING
    from tierstore.memory._fastcopy import copy as _c_copy
except ImportError:  # pragma: no cover - exercised by the fallback test
    _c_copy = None
    _C_STREAMING = 0
try:  # apart: an extension built before copy_runs still serves copy_into
    from tierstore.memory._fastcopy import copy_runs as _c_copy_runs
except ImportError:  # pragma: no cover - exercised by the fallback test
    _c_copy_runs = None

try:
    from tierstore.memory._fastcopy import RUNS_LOOP as _C_RUNS_LOOP
    from tierstore.memory._fastcopy import set_runs_loop as _c_set_runs_loop
except ImportError:  # pragma: no cover - an extension built before the choice was exported
    _C_RUNS_LOOP = ""
    _c_set_runs_loop = None

STREAMING = bool(_c_copy is not None and _C_STREAMING)
"""True when large copies use non-temporal stores."""

RUNS_LOOP = _C_RUNS_LOOP if _c_copy_runs is not None else "numpy"
"""The loop ``copy_runs`` uses for runs of 256 KiB and more on this CPU:
``pages512`` (Intel with AVX-512), ``avx2``, ``pages`` (SSE2), ``memcpy``
(not x86-64), ``numpy`` (no C extension)."""

MAX_COPY_THREADS = 64
AUTO_COPY_THREADS = 4  # copy_threads 0: the cores this thread may run on, at most this many


def copy_thread_count(requested: int) -> int:
    """Threads for ``copy_runs`` from an engine setting ``copy_threads``:
    ``requested`` itself (1-64), or for 0 the cores the calling thread may
    run on, at most ``AUTO_COPY_THREADS`` (more streams than cores only
    take turns; two reached one VM's bandwidth, see the module docstring).
    Raises ValueError, naming the setting, for anything else."""
    if isinstance(requested, bool) or not isinstance(requested, int):
        raise ValueError(f"copy_threads must be a whole number, got {requested!r}")
    if not 0 <= requested <= MAX_COPY_THREADS:
        raise ValueError(f"copy_threads must be 0 (auto) to {MAX_COPY_THREADS}, got {requested}")
    if requested:
        return requested
    return max(1, min(AUTO_COPY_THREADS, len(os.sched_getaffinity(0))))


def set_runs_loop(name: str) -> str:
    """Make ``copy_runs`` and ``copy_into`` use the C loop ``name``
    (``pages512``, ``avx2``, ``pages``) for large runs; returns the loop used
    before. For tests and measurements of each loop; call it while no copy
    runs. Raises ValueError for a loop this CPU cannot run, RuntimeError
    without the C extension."""
    global RUNS_LOOP
    if _c_copy_runs is None or _c_set_runs_loop is None:
        raise RuntimeError("set_runs_loop: the C extension was not built")
    before: str = _c_set_runs_loop(name)
    RUNS_LOOP = name
    return before


def copy_into(dst: Any, src: Any) -> None:
    """Copy the bytes of ``src`` into ``dst``: C-contiguous buffers (numpy
    arrays, memoryviews, mmaps) of equal size in bytes that do not overlap;
    ``dst`` writable. Raises ValueError naming the sizes when they differ."""
    if _c_copy is not None:
        _c_copy(dst, src)
        return
    _numpy_copy(dst, src)


def _numpy_copy(dst: Any, src: Any) -> None:
    d = np.frombuffer(dst, dtype=np.uint8) if not isinstance(dst, np.ndarray) else dst
    s = np.frombuffer(src, dtype=np.uint8) if not isinstance(src, np.ndarray) else src
    d = d.reshape(-1).view(np.uint8)
    s = s.reshape(-1).view(np.uint8)
    if d.nbytes != s.nbytes:
        raise ValueError(f"copy: destination has {d.nbytes} bytes, source {s.nbytes}")
    np.copyto(d, s)


def copy_runs(
    dst: Any, src: Any, dst_offsets: Any, src_offsets: Any, nbytes: int, threads: int = 1
) -> None:
    """For every i, copy ``nbytes`` from ``src`` at byte ``src_offsets[i]``
    into ``dst`` at byte ``dst_offsets[i]``. ``dst`` and ``src``: C-contiguous
    buffers (``dst`` writable); the offsets: int64 arrays of one length.
    ``threads``: how many threads copy (the caller's and helpers started
    for the call; at most one per 4 MiB), 1-64; the fallback without the C
    extension copies on the caller's alone. Raises ValueError, before
    copying anything, for a run outside its buffer or overlapping its own
    source, or for a thread count out of range."""
    if not 1 <= threads <= MAX_COPY_THREADS:
        raise ValueError(f"copy_runs: threads is {threads}, not 1-{MAX_COPY_THREADS}")
    d_off = np.ascontiguousarray(dst_offsets, dtype=np.int64)
    s_off = np.ascontiguousarray(src_offsets, dtype=np.int64)
    if _c_copy_runs is not None:
        _c_copy_runs(dst, src, d_off, s_off, nbytes, threads)
        return
    _numpy_copy_runs(dst, src, d_off, s_off, nbytes)


def flat_bytes(buf: Any) -> np.ndarray:
    """``buf`` (a numpy array or any buffer) as a flat uint8 array, no copy."""
    a = buf if isinstance(buf, np.ndarray) else np.frombuffer(buf, dtype=np.uint8)
    return a.reshape(-1).view(np.uint8)


def _numpy_copy_runs(dst: Any, src: Any, d_off: np.ndarray, s_off: np.ndarray, nbytes: int) -> None:
    d, s = flat_bytes(dst), flat_bytes(src)
    if len(d_off) != len(s_off):
        raise ValueError(
            f"copy_runs: {len(d_off)} destination offsets, {len(s_off)} source offsets"
        )
    if nbytes < 0:
        raise ValueError(f"copy_runs: nbytes is {nbytes}")
    if len(d_off) and (
        d_off.min() < 0 or d_off.max() > d.nbytes - nbytes
        or s_off.min() < 0 or s_off.max() > s.nbytes - nbytes
    ):  # fmt: skip
        raise ValueError(
            f"copy_runs: a run of {nbytes} bytes lies outside the source ({s.nbytes} bytes) "
            f"or destination ({d.nbytes} bytes)"
        )
    for do, so in zip(d_off.tolist(), s_off.tolist()):
        if np.shares_memory(d[do : do + nbytes], s[so : so + nbytes]):
            raise ValueError("copy_runs: a run overlaps its source")
    for do, so in zip(d_off.tolist(), s_off.tolist()):
        d[do : do + nbytes] = s[so : so + nbytes]
