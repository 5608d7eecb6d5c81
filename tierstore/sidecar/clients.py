"""The engine clients attached to a sidecar: ``AttachedClients``.

Provides ``ClientSession`` (one attached client: its id, name, pid and when
it attached) and ``AttachedClients``, the table of them, bounded by
``max_clients``, with the tiers each client's engine last reported
(``ReportTiers``: its HBM pool), summed over the clients for Stat. Ids are
random, not sequential: another process on the socket cannot guess a live
client's id to release or commit in its name.

Runs in the sidecar: the local service's handlers (``tierstore.sidecar.service``)
call it from gRPC's threads, Stat reads it; thread-safe behind one lock.
What a detached client held in the store is released by the service.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from tierstore.tiers import TierName
from tierstore.v1 import common_pb2

ENGINE_TIERS = (str(TierName.HBM),)  # tiers engines may report (ReportTiers), in display order
U64_MAX = (1 << 64) - 1
TIER_STAT_FIELDS = tuple(f for f in common_pb2.TierStat.DESCRIPTOR.fields_by_name if f != "name")


@dataclass
class ClientSession:
    client_id: int
    name: str
    pid: int
    connected_at: float


class AttachedClients:
    """client id -> session, and the engine tiers it reported. Thread-safe."""

    def __init__(self, max_clients: int) -> None:
        self.max_clients = max_clients
        self._lock = threading.Lock()
        self._sessions: dict[int, ClientSession] = {}
        # Tiers that live in the engines (their HBM pools), as each client last
        # reported them; dropped on detach.
        self._engine_tiers: dict[int, list[common_pb2.TierStat]] = {}

    def attach(self, name: str, pid: int) -> int | None:
        """A new client's id, or None when ``max_clients`` are attached."""
        with self._lock:
            if len(self._sessions) >= self.max_clients:
                return None
            client_id = secrets.randbits(62) + 1
            while client_id in self._sessions:
                client_id = secrets.randbits(62) + 1
            self._sessions[client_id] = ClientSession(client_id, name, pid, time.time())
        return client_id

    def detach(self, client_id: int) -> bool:
        """Forget a client and its engine tiers; False if it was not attached
        (detached already)."""
        with self._lock:
            if self._sessions.pop(client_id, None) is None:
                return False
            self._engine_tiers.pop(client_id, None)
        return True

    def __contains__(self, client_id: int) -> bool:
        with self._lock:
            return client_id in self._sessions

    def __len__(self) -> int:
        with self._lock:
            return len(self._sessions)

    def sessions(self) -> list[ClientSession]:
        with self._lock:
            return list(self._sessions.values())

    def report_tiers(self, client_id: int, tiers: Sequence[common_pb2.TierStat]) -> None:
        """A client's engine tiers now (names checked by the caller); ignored
        for a client that detached meanwhile."""
        with self._lock:
            if client_id in self._sessions:
                self._engine_tiers[client_id] = list(tiers)

    def engine_tiers(self) -> list[common_pb2.TierStat]:
        """The engines' tiers, each summed over the clients that reported it."""
        with self._lock:
            reports = [t for tiers in self._engine_tiers.values() for t in tiers]
        summed: dict[str, common_pb2.TierStat] = {}
        for t in reports:
            total = summed.setdefault(t.name, common_pb2.TierStat(name=t.name))
            for field in TIER_STAT_FIELDS:
                # Saturating: a client's report of 2**64 - 1 must not break Stat.
                setattr(total, field, min(getattr(total, field) + getattr(t, field), U64_MAX))
        return [summed[name] for name in ENGINE_TIERS if name in summed]
