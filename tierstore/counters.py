"""One counters mechanism for every part of a process: a fixed set of named,
thread-safe integers, read as a snapshot by ``tierstore stat`` and
``/metrics`` (exported from one place: ``tierstore.sidecar.stat.stat_reply``).

Names are declared when the set is made, so a misspelt name fails at its
first use instead of counting into a new key nobody exports. ``add`` takes a
lock: call it per batch or per transfer, not per block of a hot loop (count
locally, add once). Reads (``snapshot``, attribute access) see one consistent
moment of the whole set.

Imported by every process; pure (no I/O).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping


class Counters:
    """Named integer counters. Thread-safe; attribute reads give the current
    value (``counters.hits``); writes go through ``add``/``set`` only."""

    __slots__ = ("_lock", "_values")
    _lock: threading.Lock
    _values: dict[str, int]

    def __init__(self, names: Iterable[str]) -> None:
        object.__setattr__(self, "_values", dict.fromkeys(names, 0))
        object.__setattr__(self, "_lock", threading.Lock())

    def add(self, name: str, n: int = 1) -> None:
        """Add ``n`` to ``name`` (KeyError if ``name`` was never declared)."""
        with self._lock:
            self._values[name] += n

    def add_many(self, deltas: Mapping[str, int]) -> None:
        """Add several deltas under one lock (one moment for a reader)."""
        with self._lock:
            for name, n in deltas.items():
                self._values[name] += n

    def set(self, name: str, value: int) -> None:
        """Set a gauge-like figure (one that also goes down)."""
        with self._lock:
            if name not in self._values:
                raise KeyError(name)
            self._values[name] = value

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._values)

    def names(self) -> tuple[str, ...]:
        return tuple(self._values)

    def __getattr__(self, name: str) -> int:
        try:
            with self._lock:
                return self._values[name]
        except KeyError:
            raise AttributeError(name) from None

    def __getitem__(self, name: str) -> int:
        with self._lock:
            return self._values[name]

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"counters are written with add() or set(), not by assigning {name}")

    def __repr__(self) -> str:
        return f"Counters({self.snapshot()})"
