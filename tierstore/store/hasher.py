"""Hash once: the blake3 digest of each block, computed once, after its commit.

Provides ``CommitHasher``: the store hands it the DRAM entries it just
committed without a digest, and its one "tierstore-hasher" thread computes
each digest off the put's critical path and keeps it with the entry. From
there the digest travels with the block: to NVMe (the spill passes it, so the
NVMe tier never hashes again), to peers (the sender puts it in the frame
header and never hashes) and up again (a promotion keeps the digest it
verified against).

The queue is bounded (``queue_blocks``); entries that do not fit are left
for whoever needs the digest first (``TieredStore.digest``), which computes
it then, still once. An entry already hashed, or freed meanwhile, is
skipped: a dead entry's digest is never read.

Threads: any committing thread enqueues; one worker hashes.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence

from tierstore.counters import Counters
from tierstore.store.dram import DramEntry
from tierstore.workers import Workers

HASHER_COUNTERS = ("digests_queued", "digests_deferred")
HASH_BATCH_BLOCKS = 64  # entries taken per step (one liveness check, one counter update)


class CommitHasher:
    """Background blake3 of committed blocks. See the module docstring."""

    def __init__(
        self,
        digest: Callable[[list[DramEntry]], None],
        *,
        workers: Workers,
        counters: Counters,
        queue_blocks: int,
    ) -> None:
        self._digest = digest
        self._counters = counters
        self._queue_blocks = queue_blocks
        self._queue: deque[DramEntry] = deque()
        self._busy = False
        self._closing = False
        self._cond = threading.Condition()
        self._thread = workers.start("tierstore-hasher", self._loop)

    def submit(self, entries: Sequence[DramEntry]) -> None:
        """Queue entries without a digest; what does not fit is deferred."""
        todo = [e for e in entries if e.digest is None]
        if not todo:
            return
        with self._cond:
            room = max(0, self._queue_blocks - len(self._queue))
            self._queue.extend(todo[:room])
            self._cond.notify()
        queued = min(room, len(todo))
        self._counters.add_many({"digests_queued": queued, "digests_deferred": len(todo) - queued})

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until every queued entry is hashed (tests, benchmarks)."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._busy, timeout_s)

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._busy = False
                self._cond.notify_all()
                self._cond.wait_for(lambda: self._queue or self._closing)
                if self._closing:
                    return
                q = self._queue
                batch = [q.popleft() for _ in range(min(HASH_BATCH_BLOCKS, len(q)))]
                self._busy = True
            self._digest(batch)

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._queue.clear()
            self._cond.notify_all()
        self._thread.join(timeout=30)
