"""Write-through to NVMe and the drain of a graceful stop.

Provides:
- ``NvmeWriter``: the store's write-through writer. The tiered store tells it
  what was committed, read again or finished as a turn; the write policy
  (``tierstore.policies.write.WritePolicy``) picks the keys, which wait in a queue
  bounded in bytes (``write_queue_bytes``) for one background worker that
  copies their DRAM blocks to NVMe in batches (one fdatasync each). Offering
  never blocks and never copies: a full queue drops the key (counted) and the
  worker comes back for such keys once the queue has emptied (a resync scan
  of DRAM). A block evicted before its turn is spilled by the evictor
  instead; one already on NVMe is skipped. What a SIGKILL can lose is what
  waits in the queue or is being written (``write_queue_bytes`` gauge), plus
  dropped keys not yet resynced.
- ``drain``: on a graceful stop, write DRAM-only blocks to NVMe, most
  recently used first, until a time budget is spent; returns a ``DrainReport``
  (what was written, what was not, how fast).

Threads: ``offer_*`` run on callers' threads (one short lock); the worker is
started through ``tierstore.workers.Workers`` (``tierstore-nvme-writer``);
``drain`` runs on the thread stopping the sidecar, after ``close``.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from tierstore.counters import Counters
from tierstore.keys import BlockKey
from tierstore.policies.write import WritePolicy
from tierstore.store.dram import DramEntry, DramTier
from tierstore.store.nvme.tier import NvmeTier
from tierstore.workers import Workers

log = logging.getLogger(__name__)

WRITER_OWNER = 0  # pins of the writer and the drain are the store's own (STORE_OWNER)
WRITER_COUNTERS = (
    "write_queued",  # keys put in the queue
    "write_written",  # blocks the writer stored on NVMe
    "write_written_bytes",
    "write_dropped",  # keys refused by a full queue (picked up again by a resync)
    "write_skipped",  # keys already on NVMe, or gone from DRAM, when their turn came
    "write_failed",  # blocks whose NVMe write failed (they stay in DRAM only)
    "write_resyncs",  # scans of DRAM for blocks a full queue dropped
    "write_queue_blocks",  # gauge: keys waiting or being written
    "write_queue_bytes",  # gauge: their bytes (what a SIGKILL can lose)
)
WRITER_GAUGES = frozenset({"write_queue_blocks", "write_queue_bytes"})
DRAIN_FILE = "last_drain.json"
PINNED_SHARE_DIVISOR = 16  # the write-through batch pins at most 1/16 of DRAM
BATCH_BYTES = 8 << 20
"""A drain batch (one fdatasync) holds at least ``batch_blocks`` blocks and
at least this many bytes, a writer batch at most this many bytes: small
blocks would otherwise pay a sync each few KiB."""


def _batch_end(sizes: Sequence[int], start: int, stop: int, batch_blocks: int) -> int:
    """End of a batch from ``start`` (at most ``stop``): see ``BATCH_BYTES``."""
    end, nbytes = start, 0
    while end < stop and (end - start < batch_blocks or nbytes < BATCH_BYTES):
        nbytes += sizes[end]
        end += 1
    return end


def _batch_start(sizes: Sequence[int], lo: int, end: int, batch_blocks: int) -> int:
    """Start of a batch that ends at ``end`` (at least ``lo``): the same rule backwards."""
    start, nbytes = end, 0
    while start > lo and (end - start < batch_blocks or nbytes < BATCH_BYTES):
        start -= 1
        nbytes += sizes[start]
    return start


class NvmeWriter:
    """Bounded write-through queue and its worker. See the module docstring."""

    def __init__(
        self,
        dram: DramTier,
        nvme: NvmeTier,
        policy: WritePolicy,
        *,
        queue_bytes: int,
        workers: Workers,
    ) -> None:
        self.dram = dram
        self.nvme = nvme
        self.policy = policy
        self.queue_bytes_max = queue_bytes
        # A batch (one fdatasync) takes what waits, up to BATCH_BYTES; it is
        # pinned in DRAM while it is written, so it is also kept a small
        # share of the tier: eviction always finds victims beside it.
        self.batch_bytes = min(BATCH_BYTES, dram.allocator.capacity_bytes // PINNED_SHARE_DIVISOR)
        self.counters = Counters(WRITER_COUNTERS)
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._queue: collections.OrderedDict[BlockKey, int] = collections.OrderedDict()
        self._queued_bytes = 0  # waiting + in flight
        self._in_flight: dict[BlockKey, int] = {}
        self._dropped_since_resync = 0
        self._closed = False
        self._thread = workers.start("tierstore-nvme-writer", self._loop)

    # -- offers (callers' threads) --------------------------------------------------

    def offer_committed(self, keys: Sequence[BlockKey]) -> None:
        with self._lock:
            chosen = [k for k in keys if self.policy.on_commit(k)]
        self._offer(chosen)

    def offer_hits(self, keys: Sequence[BlockKey]) -> None:
        if not self.policy.watches_hits:
            return
        with self._lock:
            chosen = [k for k in keys if self.policy.on_hit(k)]
        self._offer(chosen)

    def offer_turn(self, keys: Sequence[BlockKey], num_tokens: int) -> None:
        with self._lock:
            take = self.policy.on_turn(num_tokens)
        if take:
            self._offer(keys)

    def _offer(self, keys: Sequence[BlockKey]) -> None:
        if not keys:
            return
        sizes = self.dram.nbytes_of(keys)
        queued = dropped = never = 0
        with self._lock:
            if self._closed:
                return
            for key, nbytes in zip(keys, sizes):
                if nbytes == 0 or key in self._queue or key in self._in_flight:
                    continue
                if nbytes > self.queue_bytes_max:
                    never += 1  # larger than the whole queue: write-back only, no resync
                    continue
                if self._queued_bytes + nbytes > self.queue_bytes_max:
                    dropped += 1
                    continue
                self._queue[key] = nbytes
                self._queued_bytes += nbytes
                queued += 1
            self._dropped_since_resync += dropped
            if queued:
                self._ready.notify()
            self._publish_gauges()
        self.counters.add_many({"write_queued": queued, "write_dropped": dropped + never})

    # -- the worker -------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            batch = self._next_batch()
            if batch is None:
                return
            try:
                self._write(batch)
            finally:
                with self._lock:
                    for key in batch:
                        self._queued_bytes -= self._in_flight.pop(key, 0)
                    self._publish_gauges()
                    self._ready.notify_all()

    def _next_batch(self) -> list[BlockKey] | None:
        """Keys to write next (now in flight), or None once closed. Waits
        with a deadline so a resync is never later than a second."""
        with self._lock:
            while not self._queue and not self._closed:
                if self._dropped_since_resync:
                    self._dropped_since_resync = 0
                    self._lock.release()
                    try:
                        self._resync()
                    finally:
                        self._lock.acquire()
                    continue
                self._ready.wait(timeout=1.0)
            if self._closed:
                return None
            batch: list[BlockKey] = []
            nbytes = 0
            while self._queue and (not batch or nbytes < self.batch_bytes):
                key, size = self._queue.popitem(last=False)
                self._in_flight[key] = size
                nbytes += size
                batch.append(key)
            return batch

    def _resync(self) -> None:
        """Queue again the DRAM-only blocks a full queue dropped, most recent
        first (those the policy writes at commit; a dropped hit of the
        selective policy waits for eviction, as in write-back)."""
        self.counters.add("write_resyncs")
        keys = self.dram.keys_most_recent_first()
        held = self.nvme.contains(keys)
        with self._lock:
            keys = [k for k, h in zip(keys, held) if not h and self.policy.on_commit(k)]
        self._offer(keys)

    def _write(self, keys: list[BlockKey]) -> None:
        entries, skipped = pin_dram_only(self.dram, self.nvme, keys)
        try:
            written, failed, nbytes = write_entries(self.dram, self.nvme, entries)
        finally:
            self.dram.unpin([e.key for e in entries], WRITER_OWNER)
        self.counters.add_many(
            {
                "write_written": written,
                "write_written_bytes": nbytes,
                "write_failed": failed,
                "write_skipped": skipped,
            }
        )

    def _publish_gauges(self) -> None:
        """Holds _lock."""
        self.counters.set("write_queue_blocks", len(self._queue) + len(self._in_flight))
        self.counters.set("write_queue_bytes", self._queued_bytes)

    def close(self, timeout_s: float = 30.0) -> int:
        """Stop taking keys, let the batch in flight finish, discard the queue
        (a drain writes what is still DRAM-only). Returns how many keys were
        discarded. Idempotent."""
        with self._lock:
            self._closed = True
            discarded = len(self._queue)
            self._queued_bytes -= sum(self._queue.values())
            self._queue.clear()
            self._ready.notify_all()
        self._thread.join(timeout=timeout_s)
        with self._lock:
            self._publish_gauges()
        return discarded


# -- shared by the writer and the drain ------------------------------------------------


def pin_dram_only(
    dram: DramTier, nvme: NvmeTier, keys: Sequence[BlockKey]
) -> tuple[list[DramEntry], int]:
    """Pin the keys still in DRAM and not on NVMe; returns them and how many were skipped."""
    pinned = dram.pin_quiet(keys, WRITER_OWNER)
    held = nvme.contains(keys)
    entries: list[DramEntry] = []
    extra: list[BlockKey] = []
    for key, entry, on_nvme in zip(keys, pinned, held):
        if entry is None:
            continue
        if on_nvme:
            extra.append(key)
        else:
            entries.append(entry)
    dram.unpin(extra, WRITER_OWNER)
    return entries, len(keys) - len(entries)


def write_entries(dram: DramTier, nvme: NvmeTier, entries: list[DramEntry]) -> tuple[int, int, int]:
    """Write pinned DRAM entries to NVMe in one batch: (written, failed, bytes written)."""
    if not entries:
        return 0, 0, 0
    ok = nvme.write_many(
        [(e.key, e.layout_fp, dram.view(e)) for e in entries], digests=[e.digest for e in entries]
    )
    for e, done in zip(entries, ok):
        if done and e.digest is None:
            # Hashed by the NVMe write (beside its pwrite): the digest travels
            # back to the pinned DRAM block, so nothing hashes it again.
            meta = nvme.meta(e.key)
            if meta is not None and meta.digest:
                e.digest = meta.digest
    nbytes = sum(e.nbytes for e, done in zip(entries, ok) if done)
    written = sum(ok)
    return written, len(ok) - written, nbytes


@dataclasses.dataclass(frozen=True)
class DrainReport:
    """What a graceful stop's drain did (kept in the NVMe directory for the next start)."""

    blocks: int = 0  # DRAM-only blocks written to NVMe
    bytes: int = 0
    dropped_blocks: int = 0  # DRAM-only blocks left unwritten (time, room or a failed write)
    dropped_bytes: int = 0
    seconds: float = 0.0
    budget_s: float = 0.0

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def counters(self) -> dict[str, int]:
        """The figures as stat counters (``last_drain_*``)."""
        return {
            "last_drain_blocks": self.blocks,
            "last_drain_bytes": self.bytes,
            "last_drain_dropped_blocks": self.dropped_blocks,
            "last_drain_dropped_bytes": self.dropped_bytes,
            "last_drain_ms": round(self.seconds * 1000),
            "last_drain_budget_ms": round(self.budget_s * 1000),
        }

    def save(self, root: Path | None) -> None:
        """Keep the report next to the index (written atomically); a failure is logged."""
        if root is None:
            return
        tmp = root / (DRAIN_FILE + ".tmp")
        try:
            tmp.write_text(json.dumps(dataclasses.asdict(self)))
            os.replace(tmp, root / DRAIN_FILE)
        except OSError as e:
            log.warning("drain report not saved in %s: %s", root, e)

    @classmethod
    def load(cls, root: Path | None) -> DrainReport | None:
        """The report the last graceful stop saved in ``root``, if any (None if unreadable)."""
        if root is None:
            return None
        try:
            raw = json.loads((root / DRAIN_FILE).read_text())
            return cls(**{f.name: raw[f.name] for f in dataclasses.fields(cls)})
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def line(self) -> str:
        return (
            f"drain: wrote {self.blocks} DRAM-only blocks ({self.bytes / 2**20:.1f} MiB) to "
            f"NVMe in {self.seconds:.2f}s ({self.gbps:.2f} GB/s); dropped {self.dropped_blocks} "
            f"({self.dropped_bytes / 2**20:.1f} MiB) that did not fit in "
            f"shutdown_drain_s={self.budget_s:g} or on the tier"
        )


def drain(dram: DramTier, nvme: NvmeTier, budget_s: float, batch_blocks: int) -> DrainReport:
    """Write DRAM-only blocks to NVMe within ``budget_s``: the most recently
    used ones, as many as the measured write rate says fit in the time left
    (and in the NVMe tier's capacity: more would evict what was just
    drained). Within that set, older blocks are written first: a prefix is
    older than its continuation (it was stored and read first), so a drain cut
    short keeps heads of prefixes, which a lookup can use, rather than tails,
    which it cannot. The first batch, from the most recent end, measures the
    rate. A batch starts only while the last batch's time still fits."""
    started = time.monotonic()
    deadline = started + budget_s
    keys = dram.keys_most_recent_first()
    keys = [k for k, held in zip(keys, nvme.contains(keys)) if not held]
    sizes = dram.nbytes_of(keys)
    cum = [0]
    for n in sizes:
        cum.append(cum[-1] + n)
    lo, hi = 0, len(keys)  # keys[lo:hi] wait; keys[0] is the most recent
    room = nvme.stats().capacity_bytes
    while hi > lo and cum[hi] > room:
        hi -= 1
    blocks = nbytes = 0
    batch_s = 0.0
    while lo < hi and budget_s > 0:
        now = time.monotonic()
        if now + batch_s > deadline:
            break
        if blocks == 0:  # probe the rate with the most recent blocks
            end = _batch_end(sizes, lo, hi, batch_blocks)
            batch = keys[lo:end]
            lo = end
        else:
            rate = nbytes / max(now - started, 1e-6)
            fit = rate * (deadline - now)
            while hi > lo and cum[hi] - cum[lo] > fit:
                hi -= 1
            if hi == lo:
                break
            start = _batch_start(sizes, lo, hi, batch_blocks)
            batch = keys[start:hi]
            hi = start
        entries, _ = pin_dram_only(dram, nvme, batch)
        try:
            written, _failed, wrote = write_entries(dram, nvme, entries)
        finally:
            dram.unpin([e.key for e in entries], WRITER_OWNER)
        blocks += written
        nbytes += wrote
        batch_s = time.monotonic() - now
    return DrainReport(
        blocks=blocks,
        bytes=nbytes,
        dropped_blocks=len(keys) - blocks,
        dropped_bytes=cum[-1] - nbytes,
        seconds=time.monotonic() - started,
        budget_s=budget_s,
    )
