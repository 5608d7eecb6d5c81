"""Copies of whole blocks between private memory and the shared arena.

Provides ``copy_into(dst, src)``, the one CPU copy every hot path uses (a
put into the arena, a client's store and load on device='cpu', a benchmark's
get), and ``STREAMING``, whether it runs the C loop of
``tierstore/memory/_fastcopy.c`` (non-temporal stores, four pages at a time:
1.3-1.6x glibc's memcpy for runs of 320 KiB - 32 MiB in and out of the
arena, see that file) or numpy's memcpy (no compiler at install).

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
