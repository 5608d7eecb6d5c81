"""What a sidecar knows of its host's load and speeds, for routers.

Provides:
- ``EngineLoad`` and ``LoadBoard``: the engines of a host report their slots,
  queue and prefill speed (``StoreClient.report_load``); the board sums the
  reports that are fresh (younger than a TTL, from attached clients), which
  peers and routers read with every lookup;
- ``RateMeter``: a running estimate of a read path's bytes per second
  (exponentially weighted, over samples large enough to mean something).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

RATE_MIN_BYTES = 1 << 20  # reads smaller than this are dominated by fixed costs
RATE_WEIGHT = 0.2  # weight of the newest sample in the running estimate


@dataclass(frozen=True, slots=True)
class EngineLoad:
    busy_slots: int
    slots: int
    queue_len: int
    wait_s: float = 0.0
    prefill_tokens_per_s: float = 0.0


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


class LoadBoard:
    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._reports: dict[int, tuple[float, EngineLoad]] = {}
        self._lock = threading.Lock()

    def report(self, client_id: int, load: EngineLoad) -> None:
        if load.busy_slots > load.slots and load.slots:
            raise ValueError(f"busy_slots {load.busy_slots} exceeds slots {load.slots}")
        if load.wait_s < 0 or load.prefill_tokens_per_s < 0:
            raise ValueError("wait_s and prefill_tokens_per_s must be >= 0")
        with self._lock:
            self._reports[client_id] = (time.monotonic(), load)

    def forget(self, client_id: int) -> None:
        with self._lock:
            self._reports.pop(client_id, None)

    def host(self) -> HostLoadView:
        now = time.monotonic()
        with self._lock:
            for cid in [c for c, (t, _) in self._reports.items() if now - t > self.ttl_s]:
                del self._reports[cid]
            fresh = list(self._reports.values())
        if not fresh:
            return HostLoadView()
        loads = [load for _, load in fresh]
        speeds = [x.prefill_tokens_per_s for x in loads if x.prefill_tokens_per_s > 0]
        waits = [x.wait_s for x in loads if x.wait_s > 0]
        return HostLoadView(
            reported=True,
            busy_slots=sum(x.busy_slots for x in loads),
            slots=sum(x.slots for x in loads),
            queue_len=sum(x.queue_len for x in loads),
            # Engines of one host serve one queue's worth of requests: the
            # first slot to free up is the shortest of their waits.
            wait_s=min(waits) if waits else 0.0,
            # Each engine prefills a request alone: speeds do not add up.
            prefill_tokens_per_s=sum(speeds) / len(speeds) if speeds else 0.0,
            age_s=now - min(t for t, _ in fresh),
        )


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
