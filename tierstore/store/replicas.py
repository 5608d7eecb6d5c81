"""ReplicaLedger: which blocks held here are other hosts' replicas (kv_share),
least recently pushed first, and the bytes promised to replica imports still
in flight. The order decides which replicas leave first (eviction, budget).

Pure bookkeeping behind one lock, no I/O: residency is still answered by the
tiers (the store prunes keys that no tier holds). The budget check and the
promise of room are one step (``reserve``), so concurrent imports cannot
together exceed the budget.

Cost: ``oldest(limit)`` is O(limit); the store learns which replicas may
have left every tier from the tiers' removal events (``note_removed``) and
checks only those, never the whole ledger.

Two functions are the store's replica operations over a ledger:
``prune_gone`` (forget the replicas no tier holds any more) and
``make_replica_room`` (promise room within a budget, dropping the oldest
replicas). They reach the tiers only through the ``held`` and ``drop``
callables the store passes (its own ``held`` and ``drop``, which ask every
tier), never the tiers themselves. They run on the caller's thread (a peer
import or a stat).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

from tierstore.keys import BlockKey


class ReplicaLedger:
    def __init__(self) -> None:
        self._blocks: OrderedDict[BlockKey, int] = OrderedDict()  # key -> bytes, oldest first
        self._pushed_at: dict[BlockKey, float] = {}  # key -> time.monotonic() of its last push
        self._used_bytes = 0
        self._pending_bytes = 0
        self._maybe_gone: set[BlockKey] = set()  # replicas some tier dropped since last asked
        self._lock = threading.Lock()  # a leaf: called under the tiers' locks, calls nothing

    def __bool__(self) -> bool:
        return bool(self._blocks)

    def oldest(self, limit: int | None = None) -> list[BlockKey]:
        with self._lock:
            if limit is None:
                return list(self._blocks)
            return list(itertools.islice(self._blocks, limit))

    def __len__(self) -> int:
        return len(self._blocks)

    def oldest_covering(
        self, nbytes: int, budget_bytes: int, limit: int, skip: set[BlockKey]
    ) -> list[BlockKey]:
        """The fewest of the ``limit`` oldest replicas, ``skip`` left out,
        whose bytes would make room for ``nbytes`` more within the budget
        now: none if it fits (or if all of those are skipped). O(limit)."""
        with self._lock:
            deficit = self._used_bytes + self._pending_bytes + nbytes - budget_bytes
            keys: list[BlockKey] = []
            for key, size in itertools.islice(self._blocks.items(), limit):
                if deficit <= 0:
                    break
                if key not in skip:
                    keys.append(key)
                    deficit -= size
            return keys

    def oldest_aged(self, limit: int, now: float) -> list[tuple[BlockKey, float]]:
        """Up to ``limit`` replicas, least recently pushed first, each with
        the seconds since its last push."""
        with self._lock:
            keys = list(itertools.islice(self._blocks, limit))
            return [(k, now - self._pushed_at.get(k, now)) for k in keys]

    def note_removed(self, keys: Sequence[BlockKey]) -> None:
        """A tier dropped ``keys``: the replicas among them may be gone.
        Called under the tiers' locks on every removal (the event log's
        ``on_removed``): with no replicas, it returns without the lock."""
        if not self._blocks:
            return
        with self._lock:
            if self._blocks:
                blocks = self._blocks
                self._maybe_gone.update(k for k in keys if k in blocks)

    def take_maybe_gone(self) -> list[BlockKey]:
        """The replicas noted as removed since the last call (the store asks
        the tiers whether they still hold them)."""
        with self._lock:
            keys, self._maybe_gone = list(self._maybe_gone), set()
        return keys

    def used_bytes(self) -> int:
        with self._lock:
            return self._used_bytes

    def pending_bytes(self) -> int:
        with self._lock:
            return self._pending_bytes

    def reserve(self, nbytes: int, budget_bytes: int) -> bool:
        """Promise ``nbytes`` of replica room if it fits the budget now."""
        with self._lock:
            if self._used_bytes + self._pending_bytes + nbytes > budget_bytes:
                return False
            self._pending_bytes += nbytes
            return True

    def settle(self, reserved_bytes: int, keys: Iterable[BlockKey], block_bytes: int) -> None:
        """An import ended: its promise is released, what it committed is counted."""
        now = time.monotonic()
        with self._lock:
            self._pending_bytes -= reserved_bytes
            for key in keys:
                if key not in self._blocks:
                    self._used_bytes += block_bytes
                self._blocks[key] = block_bytes
                self._blocks.move_to_end(key)
                self._pushed_at[key] = now

    def refresh(self, keys: Iterable[BlockKey]) -> None:
        """The replicas among ``keys`` were pushed again: move them to the
        newest end, in the given order (the last given ends newest). Keys that
        are not replicas (this host's own blocks) are left alone."""
        now = time.monotonic()
        with self._lock:
            for key in keys:
                if key in self._blocks:
                    self._blocks.move_to_end(key)
                    self._pushed_at[key] = now

    def discard(self, keys: Iterable[BlockKey]) -> None:
        with self._lock:
            for key in keys:
                self._used_bytes -= self._blocks.pop(key, 0)
                self._pushed_at.pop(key, None)
                self._maybe_gone.discard(key)


def prune_gone(ledger: ReplicaLedger, held: Callable[[Sequence[BlockKey]], list[bool]]) -> None:
    """Forget the replicas no tier holds any more: only those a tier
    dropped since the last call are asked about (``held``: per key, whether
    some tier holds it now)."""
    keys = ledger.take_maybe_gone()
    if keys:
        ledger.discard([k for k, h in zip(keys, held(keys)) if not h])


def make_replica_room(
    ledger: ReplicaLedger,
    nbytes: int,
    budget_bytes: int,
    *,
    held: Callable[[Sequence[BlockKey]], list[bool]],
    drop: Callable[[Sequence[BlockKey]], int],
    batch_blocks: int,
) -> bool:
    """Promise ``nbytes`` of replica room within the budget, dropping the
    oldest replicas (``drop``: from every tier, unless in use) as needed;
    the caller settles the promise with ``ledger.settle``."""
    if nbytes > budget_bytes:
        return False
    prune_gone(ledger, held)
    # Oldest first, only as many as the shortfall needs, from the
    # ``batch_blocks`` oldest (never the whole ledger): one drop and one
    # residency check per round. A pinned replica stays (and stays counted)
    # and is passed over in the next round; when the oldest batch has
    # nothing left to drop, the search ends.
    pinned: set[BlockKey] = set()
    while not ledger.reserve(nbytes, budget_bytes):
        victims = ledger.oldest_covering(nbytes, budget_bytes, batch_blocks, pinned)
        if not victims:  # it fits now (an import settled meanwhile), or nothing to drop
            return ledger.reserve(nbytes, budget_bytes)
        drop(victims)
        stayed = held(victims)
        pinned.update(key for key, still in zip(victims, stayed) if still)
        ledger.discard([key for key, still in zip(victims, stayed) if not still])
    return True
