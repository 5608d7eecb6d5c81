"""Load and speed figures that sidecars, peers and routers all speak of.

Provides:
- ``HostLoadView``: the sum of a host's fresh engine reports, as peers and
  routers see it (``tierstore.sidecar.loadboard`` computes it);
- ``RateMeter``: a running estimate of a read path's bytes per second
  (exponentially weighted, over samples large enough to mean something).

Pure data and arithmetic; thread-safe where noted. Any process imports it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

RATE_MIN_BYTES = 1 << 20  # reads smaller than this are dominated by fixed costs
RATE_WEIGHT = 0.2  # weight of the newest sample in the running estimate


@dataclass(frozen=True, slots=True)
class HostLoadView:
    """The sum over a host's fresh engine reports (``reported`` False: none)."""

    reported: bool = False
    busy_slots: int = 0
    slots: int = 0
    queue_len: int = 0
    wait_s: float = 0.0
    prefill_tokens_per_s: float = 0.0
    age_s: float = 0.0


class RateMeter:
    """Bytes per second of one read path. Small reads are pooled until they
    make a sample of at least RATE_MIN_BYTES; concurrent reads each count
    their own time, so the estimate errs low (a cost model then errs toward
    recomputing, the safe side)."""

    def __init__(self) -> None:
        self._rate = 0.0
        self._bytes = 0
        self._seconds = 0.0
        self._lock = threading.Lock()

    def add(self, nbytes: int, seconds: float) -> None:
        with self._lock:
            self._bytes += nbytes
            self._seconds += max(seconds, 0.0)
            if self._bytes < RATE_MIN_BYTES or self._seconds <= 0:
                return
            sample = self._bytes / self._seconds
            self._bytes, self._seconds = 0, 0.0
            w = 1.0 if self._rate == 0 else RATE_WEIGHT
            self._rate = (1 - w) * self._rate + w * sample

    @property
    def bytes_per_s(self) -> float:
        with self._lock:
            return self._rate
