"""Moving blocks out of DRAM: choosing victims, spilling them, the demoter thread.

Provides ``Demoter``. The tiered store makes one and asks it to make room
(a caller that finds DRAM full evicts synchronously), to demote chosen
blocks, and to wake when DRAM passes the high watermark; its thread
("tierstore-demoter") then spills least-valuable blocks until DRAM is under
the low watermark.

A victim leaves DRAM after it is written to NVMe (unless NVMe holds it
already or the admission policy refuses it) and offered to the remote tier
when there is one; its digest goes with it (computed now only if the hasher
has not reached it yet). Replicas no longer live go first
(``ReplicaRetention``), then the DRAM eviction policy's order, a bounded
batch per pass: at most ``batch_blocks`` blocks and, for the thread's
passes, about ``batch_bytes``. Eviction is serialised by ``lock``, which the
store also holds for a drain and at close. It is a ``FairLock``: a writer
that finds DRAM full while the thread spills waits for that one batch (its
NVMe write), not for every batch the thread would take next.

Collaborators are explicit (the tiers, the replica ledger, the policies,
the digest function, the store's counters): it never calls back into the
store.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from tierstore.counters import Counters
from tierstore.keys import BlockKey
from tierstore.policies.admission import AdmissionPolicy
from tierstore.policies.replication import ReplicaRetention
from tierstore.ratelog import RateLimitedLog
from tierstore.store.dram import DramEntry, DramTier
from tierstore.store.nvme.tier import NvmeTier
from tierstore.store.remote.tier import RemoteTier
from tierstore.store.replicas import ReplicaLedger
from tierstore.workers import Workers

log = logging.getLogger(__name__)
_faults = RateLimitedLog(log)
DEMOTER_COUNTERS = (
    "spilled_blocks", "spill_failures", "spill_skipped_admission", "dropped_blocks",
    # make_room: writes and promotions that found DRAM full (the demoter behind) and
    # made room in the caller's call, the blocks they evicted, and the microseconds they
    # waited (the victims' NVMe writes included): the time engines wait on a slow tier.
    "full_waits", "full_wait_evicted_blocks", "full_wait_us",
)  # fmt: skip


class FairLock:
    """A lock taken in the order it was asked for (a ticket lock). A thread
    that releases it and asks again at once, as the demoter does between
    batches, queues behind the threads already waiting. ``threading.Lock``
    makes no such promise: in tests/unit/store/test_demoter_fair.py the
    releasing thread took it back before the waiting one in most tries."""

    def __init__(self) -> None:
        self._turn = threading.Condition(threading.Lock())
        self._next_ticket = 0
        self._serving = 0
        self._abandoned: set[int] = set()  # tickets whose waiter left (an exception)

    def __enter__(self) -> FairLock:
        with self._turn:
            ticket = self._next_ticket
            self._next_ticket += 1
            try:
                while ticket != self._serving:
                    self._turn.wait()
            except BaseException:  # e.g. KeyboardInterrupt: give the turn up, not the lock
                self._abandoned.add(ticket)
                self._advance()
                raise
        return self

    def __exit__(self, *exc: object) -> None:
        with self._turn:
            if self._serving >= self._next_ticket:
                raise RuntimeError("FairLock released while nobody holds it")
            self._abandoned.add(self._serving)
            self._advance()

    def _advance(self) -> None:
        """Serve the next ticket whose waiter is still there. Holds ``_turn``."""
        while self._serving in self._abandoned:
            self._abandoned.discard(self._serving)
            self._serving += 1
        self._turn.notify_all()

    @property
    def waiting(self) -> int:
        """Threads queued for the lock, the holder not counted."""
        with self._turn:
            return max(0, self._next_ticket - self._serving - 1 - len(self._abandoned))


class Demoter:
    """See the module docstring."""

    def __init__(
        self,
        dram: DramTier,
        nvme: NvmeTier | None,
        remote: RemoteTier | None,
        replicas: ReplicaLedger,
        *,
        retention: ReplicaRetention,
        admission: AdmissionPolicy,
        digest: Callable[[DramEntry], bytes],
        counters: Counters,
        batch_blocks: int,
        batch_bytes: int,
        high_bytes: int,
        low_bytes: int,
        poll_s: float,
        workers: Workers,
    ) -> None:
        self.dram = dram
        self.nvme = nvme
        self.remote = remote
        self.replicas = replicas
        self._retention = retention
        self._admission = admission
        self._admission_lock = threading.Lock()
        self._digest = digest
        self.counters = counters
        self._batch_blocks = batch_blocks
        self._batch_bytes = batch_bytes
        self.high_bytes = high_bytes
        self.low_bytes = low_bytes
        self._poll_s = poll_s
        self.lock = FairLock()  # serialises eviction, in the order it is asked for
        self._wake = threading.Condition()
        self._closing = False
        self._thread = workers.start("tierstore-demoter", self._loop)

    def make_room(self, nbytes: int, count: int = 1) -> bool:
        """Evict synchronously until a slot of ``nbytes`` fits, evicting room
        for up to ``count`` such slots in the first batch (a caller with many
        blocks to place evicts once, not once per block). False if no slot fits.
        Each call is counted (``full_waits``, with the blocks it evicted and the
        time it took): a caller here waits on NVMe writes the demoter did not
        make in the background."""
        if nbytes > self.dram.allocator.capacity_bytes:
            return False  # would never fit: evict nothing
        started = time.perf_counter()
        evicted = 0
        try:
            with self.lock:
                free_bytes = self.dram.allocator.capacity_bytes - self.dram.used_bytes()
                want = nbytes * max(1, count) - free_bytes
                while want > 0 or not self.dram.can_fit(nbytes):
                    victims = self._take_victims(max(want, nbytes))
                    if not victims:
                        return self.dram.can_fit(nbytes)
                    want -= sum(v.nbytes for v in victims)
                    evicted += self._spill(victims)
                return True
        finally:
            waited_us = int((time.perf_counter() - started) * 1e6)
            self.counters.add_many(
                {"full_waits": 1, "full_wait_evicted_blocks": evicted, "full_wait_us": waited_us}
            )

    def demote(self, keys: list[BlockKey]) -> int:
        """Move these committed, unpinned blocks out of DRAM now (spilled to
        NVMe when admitted). Returns how many left DRAM."""
        with self.lock:
            return self._spill(self.dram.take(keys))

    def wake(self) -> None:
        """DRAM may have passed the high watermark: the thread looks."""
        if self.dram.used_bytes() > self.high_bytes:
            with self._wake:
                self._wake.notify()

    def close(self) -> None:
        """Stop the thread (it ends its current batch first). Idempotent."""
        with self._wake:
            self._closing = True
            self._wake.notify_all()
        self._thread.join(timeout=30)

    def _loop(self) -> None:
        while True:
            with self._wake:
                if self._closing:
                    return
                if self.dram.used_bytes() <= self.high_bytes:
                    self._wake.wait(timeout=self._poll_s)
                if self._closing:
                    return
                if self.dram.used_bytes() <= self.high_bytes:
                    continue  # a poll, not a pass of the high watermark: spill nothing
            while self.dram.used_bytes() > self.low_bytes and not self._closing:
                with self.lock:
                    want = min(self.dram.used_bytes() - self.low_bytes, self._batch_bytes)
                    victims = self._take_victims(want)
                    if not victims:
                        break
                    self._spill(victims)

    def _take_victims(self, want_bytes: int) -> list[DramEntry]:
        """DRAM victims for ``want_bytes``: replicas no longer live first
        (``ReplicaRetention``), then the policy's order (live replicas keep
        their recency place in it), a batch at most."""
        batch = self._batch_blocks
        victims: list[DramEntry] = []
        freed = 0
        if self.replicas:
            now = time.monotonic()
            stale = [
                k
                for k, age in self.replicas.oldest_aged(batch, now)
                if self._retention.evict_before_own(age)
            ]
            for victim in self.dram.take(stale):
                if freed >= want_bytes:
                    self.dram.untake(victim)
                    continue
                victims.append(victim)
                freed += victim.nbytes
        if freed < want_bytes and len(victims) < batch:
            victims += self.dram.take_victims(want_bytes - freed, batch - len(victims))
        return victims

    def _spill(self, victims: list[DramEntry]) -> int:
        """Write victims to NVMe (unless already there or not admitted), then
        free their DRAM slots. Caller holds ``lock``."""
        if not victims:
            return 0
        if self.nvme is not None:
            held = self.nvme.contains([v.key for v in victims])
            to_write = []
            skipped = 0
            with self._admission_lock:
                for victim, present in zip(victims, held):
                    if present:
                        continue
                    if self._admission.admit(victim.key):
                        to_write.append(victim)
                    else:
                        skipped += 1
            if skipped:
                self.counters.add("spill_skipped_admission", skipped)
            if to_write:
                # The digest travels with the block: computed now only if the
                # hasher has not reached it yet (still once: it stays with the entry).
                ok = self.nvme.write_many(
                    [(v.key, v.layout_fp, self.dram.view(v)) for v in to_write],
                    digests=[self._digest(v) for v in to_write],
                )
                written = sum(ok)
                self.counters.add_many(
                    {"spilled_blocks": written, "spill_failures": len(ok) - written}
                )
                if written < len(ok):
                    _faults.warning(
                        "spill",
                        "spill to NVMe failed for %d of %d blocks (dropped from DRAM: "
                        "misses later); see the NVMe tier's write failures",
                        len(ok) - written,
                        len(ok),
                    )
        if self.remote is not None:  # remote tier: write back what leaves DRAM
            self._offer_remote(victims)
        dropped = self.dram.drop_many(victims)
        self.counters.add("dropped_blocks", dropped)
        return dropped

    def _offer_remote(self, victims: list[DramEntry]) -> None:
        remote = self.remote
        assert remote is not None
        for v in victims:
            if remote.placement.on_demote(v.key):
                digest = v.digest
                if digest is None and self.nvme is not None:
                    meta = self.nvme.meta(v.key)
                    digest = meta.digest if meta is not None else None
                if digest is None:  # hash once: kept with the block from now on
                    digest = self._digest(v)
                remote.offer(v.layout_fp, v.key, self.dram.view(v), digest)
