"""The DRAM tier's pins, indexed by owner: ``OwnerPins``.

Every pin of a DRAM block belongs to an owner (the store itself, or an
engine client's connection). ``OwnerPins`` keeps, per owner, the entries it
pins and how many pins of each, keyed by the entry itself (dropping a
transfer's pins probes no index), and the owner's total, so that releasing
a dead owner or a finished transfer touches only what it held. The entries'
own reference counts (``DramEntry.refs``) and the eviction policy stay the
tier's.

Runs in the sidecar process (or any process that owns the store). Not
thread-safe: the DRAM tier (``tierstore.store.dram``) holds its lock around
every call. No I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tierstore.store.dram import DramEntry


class OwnerPins:
    """owner -> {entry: pins}, and owner -> pins it holds (the sum of its table)."""

    def __init__(self) -> None:
        self._tables: dict[int, dict[DramEntry, int]] = {}
        self._totals: dict[int, int] = {}

    def add(self, owner: int, entries: Sequence[DramEntry | None]) -> None:
        """One more pin of ``owner`` on each entry (None: nothing pinned there)."""
        n = len(entries) - entries.count(None)
        if not n:
            return
        table = self._tables.setdefault(owner, {})
        for entry in entries:
            if entry is not None:
                table[entry] = table.get(entry, 0) + 1
        self._totals[owner] = self._totals.get(owner, 0) + n

    def drop(self, owner: int, entries: Iterable[DramEntry | None]) -> list[DramEntry]:
        """Drop one pin of ``owner`` per entry; entries it does not pin (or
        None) are skipped. Returns the entries whose pin went."""
        table = self._tables.get(owner)
        if table is None:
            return []
        dropped: list[DramEntry] = []
        for entry in entries:
            count = table.get(entry, 0) if entry is not None else 0
            if count <= 0:
                continue
            assert entry is not None
            if count == 1:
                del table[entry]
            else:
                table[entry] = count - 1
            dropped.append(entry)
        self._totals[owner] = self._totals.get(owner, 0) - len(dropped)
        if not table:
            del self._tables[owner]
            self._totals.pop(owner, None)
        return dropped

    def release(self, owner: int) -> dict[DramEntry, int]:
        """Forget every pin of ``owner``: its entries and how many pins of each."""
        self._totals.pop(owner, None)
        return self._tables.pop(owner, {})

    def count(self, owner: int) -> int:
        """The pins ``owner`` holds."""
        return self._totals.get(owner, 0)

    def clear(self) -> None:
        self._tables.clear()
        self._totals.clear()
