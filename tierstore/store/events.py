"""The block event log: which keys entered or left which tier, in order.

Provides ``BlockEventLog``, the sidecar's bounded, sequence-numbered record of
tier changes, which ``PeerService.WatchBlocks`` streams to routers so that
their index of the fleet stays current without asking every host on every
request. The tiers record a batch of keys under their own lock, so the order
of the log is the order of the changes; one sequence number per batch.

The log keeps at most ``max_keys`` keys in at most ``max_keys / 8`` batches
(at least 64; oldest batches dropped first: an eviction storm records one
key per batch, and a batch costs more than its key). A
watcher that falls behind the retained log, or sees another epoch (a random
number per sidecar start), must resynchronise from a snapshot: the snapshot
is taken after reading ``seq``, and replaying the batches after it on top is
exact, because the last event of a key decides its state.
"""

from __future__ import annotations

import itertools
import secrets
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tierstore.keys import KEY_BYTES, BlockKey
from tierstore.tiers import TierName


@dataclass(frozen=True, slots=True)
class EventBatch:
    seq: int
    added: bool  # False: removed
    tier: TierName
    keys: bytes  # n * 32 bytes


class BlockEventLog:
    def __init__(self, max_keys: int) -> None:
        if max_keys < 1:
            raise ValueError(f"max_keys must be >= 1, got {max_keys}")
        self.max_keys = max_keys
        self.max_batches = max(64, max_keys // 8)
        self.epoch = secrets.randbits(63) + 1  # never 0: 0 means "none" on the wire
        self._batches: deque[EventBatch] = deque()
        self._keys = 0
        self._seq = 0
        self._cond = threading.Condition()
        # Set by the store: told of every removal, under the tier's lock (must not
        # call back into a tier).
        self.on_removed: Callable[[Sequence[BlockKey]], None] | None = None

    @property
    def seq(self) -> int:
        """Number of the last batch recorded (0: none yet)."""
        with self._cond:
            return self._seq

    def record(self, added: bool, tier: TierName, keys: Sequence[BlockKey]) -> None:
        if not keys:
            return
        if not added and self.on_removed is not None:
            self.on_removed(keys)
        with self._cond:
            self._seq += 1
            self._batches.append(EventBatch(self._seq, added, tier, b"".join(keys)))
            self._keys += len(keys)
            while (self._keys > self.max_keys or len(self._batches) > self.max_batches) and len(
                self._batches
            ) > 1:
                self._keys -= len(self._batches.popleft().keys) // KEY_BYTES
            self._cond.notify_all()

    def retained_from(self) -> int:
        """The oldest batch number still in the log (``seq + 1`` when empty)."""
        with self._cond:
            return self._batches[0].seq if self._batches else self._seq + 1

    def after(self, seq: int, timeout_s: float, limit: int = 64) -> list[EventBatch] | None:
        """Up to ``limit`` batches after ``seq``, waiting up to ``timeout_s`` for
        one; [] if none came; None if batches after ``seq`` were dropped
        already (the caller must resynchronise)."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._seq > seq, timeout=timeout_s):
                return []
            first = self._batches[0].seq  # a batch was recorded, and one is always kept
            if seq + 1 < first:
                return None
            start = seq + 1 - first
            return list(itertools.islice(self._batches, start, start + limit))
