"""What a sidecar knows of its host's engines' load, for peers and routers.

``EngineLoad`` and ``LoadBoard``: the engines of a host report their slots,
queue and prefill speed (``StoreClient.report_load``); the board sums the
reports that are fresh (younger than a TTL, from attached clients) into a
``tierstore.load.HostLoadView``, which peers and routers read with every
lookup. Runs in the sidecar; thread-safe.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from tierstore.load import HostLoadView


@dataclass(frozen=True, slots=True)
class EngineLoad:
    busy_slots: int
    slots: int
    queue_len: int
    wait_s: float = 0.0
    prefill_tokens_per_s: float = 0.0


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
