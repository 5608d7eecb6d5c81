"""Copies of whole blocks between private memory and the shared arena.

Provides ``copy_into(dst, src)``, the one CPU copy every hot path uses (a
put into the arena, a client's store and load on device='cpu', a benchmark's
get), and ``STREAMING``, whether it runs the C loop of
``tierstore/memory/_fastcopy.c`` (non-temporal stores, four pages at a time:
1.3-1.6x glibc's memcpy for runs of 320 KiB - 32 MiB in and out of the
arena, see that file) or numpy's memcpy (no compiler at install).

``copy_runs(dst, src, dst_offsets, src_offsets, nbytes)`` copies many runs
of one size between two buffers in one call (the engines' page copies: one
run per block and layer), with no Python per run; its C loop for large runs
is a forward one with 32-byte non-temporal stores on CPUs with AVX2 (1.6x
the four-page loop on the 2-core AMD VM, see ``_fastcopy.c``).

Runs in whichever process and thread calls it; the C loop releases the GIL.
"""

from __future__ import annotations

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

STREAMING = bool(_c_copy is not None and _C_STREAMING)
"""True when large copies use non-temporal stores."""


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


def copy_runs(dst: Any, src: Any, dst_offsets: Any, src_offsets: Any, nbytes: int) -> None:
    """For every i, copy ``nbytes`` from ``src`` at byte ``src_offsets[i]``
    into ``dst`` at byte ``dst_offsets[i]``. ``dst`` and ``src``: C-contiguous
    buffers (``dst`` writable); the offsets: int64 arrays of one length.
    Raises ValueError, before copying anything, for a run outside its buffer
    or overlapping its own source."""
    d_off = np.ascontiguousarray(dst_offsets, dtype=np.int64)
    s_off = np.ascontiguousarray(src_offsets, dtype=np.int64)
    if _c_copy_runs is not None:
        _c_copy_runs(dst, src, d_off, s_off, nbytes)
        return
    _numpy_copy_runs(dst, src, d_off, s_off, nbytes)


def _flat_bytes(buf: Any) -> np.ndarray:
    a = buf if isinstance(buf, np.ndarray) else np.frombuffer(buf, dtype=np.uint8)
    return a.reshape(-1).view(np.uint8)


def _numpy_copy_runs(dst: Any, src: Any, d_off: np.ndarray, s_off: np.ndarray, nbytes: int) -> None:
    d, s = _flat_bytes(dst), _flat_bytes(src)
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
