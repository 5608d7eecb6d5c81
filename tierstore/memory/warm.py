"""Memory kept warm: one byte of every page read again, every period.

Provides ``KeepWarm(period_s)``: a daemon thread in the calling process
that reads one byte of every 4 KiB page of the buffers added to it, once a
period, and ``touch(buf)``, one such pass.

Why: on a VM whose host takes back guest memory left idle (the 2-core
Firecracker VMs here, ``bench/tiers/memage.py``), the first copy into or out of
memory nobody touched for a minute runs at half the speed of the next or
less, and a read of one byte a page every 10 s keeps it at 0.92 of hot. A
GPU host pins its host KV pools and tierstore's arena (and a VM with a GPU
passed through has all its memory pinned), so it never meets this. The
benches use ``KeepWarm`` to measure the copies as such a host would
(``bench/engines/sglang_hicache.py --keep-warm-s``); a pass over 5 GiB is about 1.3 M
reads.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from tierstore.memory.memcopy import flat_bytes

PAGE_BYTES = 4096


def touch(buf: Any, page_bytes: int = PAGE_BYTES) -> int:
    """Read one byte of every page of ``buf`` (a buffer); returns their sum,
    so that the reads cannot be left out."""
    return int(flat_bytes(buf)[::page_bytes].sum(dtype=np.uint64))


class KeepWarm:
    """See the module docstring. ``add`` buffers at any time; ``close``
    stops the thread. A pass that fails (a buffer gone) ends the thread and
    is kept in ``error``, and ``passes`` stops counting: never silent."""

    def __init__(self, period_s: float) -> None:
        if not period_s > 0:
            raise ValueError(f"KeepWarm: period_s must be > 0, got {period_s!r}")
        self.period_s = period_s
        self.passes = 0
        self.error: BaseException | None = None
        self._buffers: list[Any] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="keep-warm", daemon=True)
        self._thread.start()

    def add(self, buf: Any) -> None:
        with self._lock:
            self._buffers.append(buf)

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            with self._lock:
                buffers = list(self._buffers)
            try:
                for buf in buffers:
                    touch(buf)
            except (ValueError, TypeError, BufferError) as e:
                self.error = e
                return
            self.passes += 1

    def close(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)
        with self._lock:
            self._buffers.clear()
