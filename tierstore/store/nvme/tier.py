"""The NVMe tier: KV blocks in one data file on local disk, indexed by LMDB.

Runs in the sidecar process. Provides ``NvmeTier`` with ``contains``, ``meta``,
``write_many``, ``read_into``, ``remove``, ``stats`` and ``close``; it owns the
in-memory index, pins and eviction, and orders the durable steps. Pieces with
no state of their own live in ``batch`` (item checks, digests, victim order,
hashed batch writes) and ``index`` (the directory and its index); the pins
and the verified read of one block are in ``reads``, the cap on a full disk
and its schedule in ``full``.

Under ``root``: ``LOCK`` (flock'ed while open, holds the owner's pid),
``blocks.dat`` (sparse, sized to the capacity; blocks live in 4 KiB-aligned
slots of a SlabAllocator) and ``index.lmdb/`` (key -> record).

Crash safety: a batch's blocks are written with pwrite(v) and made durable
with one fdatasync, and only then one LMDB write transaction indexes them, so
an index row never points at data that is not on disk. An eviction deletes the
victims' rows in a committed transaction before their slots are written
again, so no row ever points at a slot being overwritten. Every block carries
its blake3 digest and every read is verified: a block that fails (bit rot, a
truncated file) is dropped and reported as a miss, never served.

A full disk: a write that hits ENOSPC caps the tier at what its data file
holds (new blocks evict old ones), until a later write finds room on the
filesystem again (``full.DiskFull``: the cap and when to look).

Last-access times are kept in memory and persisted lazily (in the next write
transaction and at close) so that reads never open an LMDB transaction; after
a crash, LRU order may be slightly stale, which costs only eviction quality.
With ``sync=False`` neither fdatasync nor LMDB's fsync runs: the tier still
survives a killed process (the page cache holds everything) but not a power
loss or kernel crash.

Threads: ``read_into``, ``contains`` and ``meta`` may be called from many
threads at once and concurrently with the write paths. ``write_many``,
``remove`` and ``close`` are serialised by one writer lock (LMDB allows one
writer). Reads pin their slot (``reads.SlotPins``), so a slot is never
evicted, reused or freed while a read is copying it. Large reads use helper
threads of the data file (see ``blockfile``) and large write batches one
hashing thread, so that blake3 runs while the disk works.

Never use an NvmeTier across ``fork()``: LMDB environments and the file lock
belong to the process that opened them; a child gets StorageError.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import lmdb

from tierstore.counters import Counters
from tierstore.errors import BlockSizeError, StorageError
from tierstore.keys import BlockKey, check_key
from tierstore.load import RateMeter
from tierstore.policies.eviction import EvictionPolicy, LruPolicy
from tierstore.ratelog import RateLimitedLog
from tierstore.store.nvme.batch import (
    Planned,
    VictimOrder,
    WriteBatch,
    block_digest,
    write_and_hash,
)
from tierstore.store.nvme.blockfile import IO_ERRNOS
from tierstore.store.nvme.full import FULL_COUNTERS, FULL_GAUGES, DiskFull
from tierstore.store.nvme.index import NvmeEntry, derived_index_reserve_bytes, open_root
from tierstore.store.nvme.reads import SlotPins, read_verified
from tierstore.tiers import TierName, TierStats

if TYPE_CHECKING:
    from typing_extensions import Buffer  # collections.abc.Buffer from Python 3.12

    from tierstore.store.events import BlockEventLog

logger = logging.getLogger(__name__)
_faults = RateLimitedLog(logger)

NVME_COUNTERS = (
    *FULL_COUNTERS,
    "nvme_index_reserve_shortfalls",  # index reserve top-ups the disk could not give
)
NVME_GAUGES = FULL_GAUGES


class NvmeTier:
    """Blocks on local disk; see the module docstring for the layout and protocol."""

    name = TierName.NVME

    def __init__(
        self,
        root: str | Path,
        capacity_bytes: int,
        *,
        segment_bytes: int = 64 << 20,
        policy: EvictionPolicy | None = None,
        direct_io: bool = True,
        sync: bool = True,
        index_reserve_bytes: int = 0,
        full_backoff_s: float = 5.0,
    ) -> None:
        """Open or create the tier in ``root``.

        Raises StorageError if ``root`` cannot be created or written, is used
        by another NvmeTier, or holds an index of an unknown format; ConfigError
        (from the allocator) if ``capacity_bytes`` is smaller than a segment.
        """
        self.root = Path(root)
        self.sync = sync
        self._pid = os.getpid()
        self._policy: EvictionPolicy = policy if policy is not None else LruPolicy()
        self._lock = threading.Lock()  # entries, policy, allocator, pins, counters
        self._write_lock = threading.Lock()  # LMDB writes and data-file writes
        self._entries: dict[BlockKey, NvmeEntry] = {}
        self._pins = SlotPins(self._lock)
        self.counters = Counters(NVME_COUNTERS)
        self._dirty: set[BlockKey] = set()  # last access changed since persisted
        self._stats = TierStats()
        self._closed = False
        self.events: BlockEventLog | None = None  # set by the store: tier changes for routers
        # Set by the store: keys to evict before the policy's order (other
        # hosts' replicas leave before this host's own blocks, as in DRAM).
        self.evict_first: Callable[[], list[BlockKey]] | None = None
        self.read_rate = RateMeter()  # verified reads, for routers' cost models
        self.index_reserve_bytes = index_reserve_bytes or derived_index_reserve_bytes(
            capacity_bytes
        )
        opened = open_root(
            self.root,
            capacity_bytes,
            segment_bytes,
            direct_io=direct_io,
            sync=sync,
            index_reserve_bytes=self.index_reserve_bytes,
        )
        self._lock_fd = opened.lock_fd
        self._index = opened.index
        self._alloc = opened.alloc
        self._file = opened.file
        self.segment_bytes = self._alloc.segment_bytes
        self._full = DiskFull(
            self.root, self.counters, backoff_s=full_backoff_s,
            room_bytes=self.index_reserve_bytes + self.segment_bytes,
            top_up_reserve=self._index.top_up_reserve,
        )  # fmt: skip
        for entry in opened.entries:  # least recently used first
            self._entries[entry.key] = entry
            self._policy.insert(entry.key)

    # -- lookups ---------------------------------------------------------------

    @property
    def direct_io_active(self) -> bool:
        """Whether the data file is read and written with O_DIRECT."""
        return self._file.direct

    def contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Whether each key is held (committed and readable). In memory only."""
        entries = self._entries
        return [k in entries for k in keys]

    def held_keys(self) -> list[BlockKey]:
        """Every indexed key (for a snapshot of the tier)."""
        with self._lock:
            return list(self._entries)

    def meta(self, key: BlockKey) -> NvmeEntry | None:
        """A copy of the key's index entry, or None."""
        with self._lock:
            entry = self._entries.get(key)
            return dataclasses.replace(entry) if entry is not None else None

    def stats(self) -> TierStats:
        with self._lock:
            snap = self._stats.snapshot()
            snap.capacity_bytes = self._alloc.capacity_bytes
            snap.used_bytes = self._alloc.used_bytes
            snap.num_blocks = len(self._entries)
        return snap

    # -- writes ----------------------------------------------------------------

    def write_many(
        self,
        items: Sequence[tuple[BlockKey, bytes, Buffer]],
        digests: Sequence[bytes | None] | None = None,
    ) -> list[bool]:
        """Store ``(key, layout fingerprint, block bytes)`` items; returns, per
        item, whether the tier holds it now.

        Keys already held count as held (and as accessed). Least recently used
        unpinned blocks are evicted to make room. An item too large for the
        tier, without room, or hit by a disk error is False and counted in
        ``write_failures``; I/O errors never raise. A bad key, fingerprint or
        digest raises before anything is changed. The caller must not modify
        the buffers until this returns. Serialised with other writers.
        """
        batch = WriteBatch.prepare(items, digests)
        with self._write_lock:
            self._check_usable()
            self._full.maybe_lift()
            self._plan(batch)
            if batch.planned:
                self._store(batch)
        return batch.outcome()

    def _plan(self, batch: WriteBatch) -> None:
        """Give each new block a slot, evicting as needed (in memory only)."""
        now = time.time()
        order = VictimOrder(self.evict_first, self._policy)
        with self._lock:
            for i, (key, layout_fp, data, digest) in batch.unique():
                held = self._entries.get(key)
                if held is not None:
                    self._touch(held, now)
                    batch.results[i] = True
                    continue
                offset = self._alloc_evicting(data.nbytes, batch.victims, order)
                if offset is None:
                    self._stats.write_failures += 1
                    continue
                entry = NvmeEntry(key, layout_fp, offset, data.nbytes, digest or b"", now)
                batch.planned.append(Planned(i, entry, data))
            self._log(False, [v.key for v in batch.victims])

    def _alloc_evicting(
        self, nbytes: int, victims: list[NvmeEntry], order: VictimOrder
    ) -> int | None:
        """A slot for ``nbytes``, evicting unpinned blocks: ``evict_first``'s
        keys, then in policy order. Holds _lock."""
        slot = self._alloc.slot_bytes(nbytes)
        if slot > self._alloc.capacity_bytes:
            return None
        offset = None
        if self._full.fits(self._alloc.used_bytes, slot):
            offset = self._alloc.alloc(nbytes)
        while offset is None:
            victim = order.next(self._entries, self._can_evict)
            if victim is None:
                return None
            entry = self._entries.pop(victim)
            self._dirty.discard(victim)
            self._alloc.free(entry.offset)
            victims.append(entry)
            if self._full.fits(self._alloc.used_bytes, slot):
                offset = self._alloc.alloc(nbytes)
        return offset

    def _can_evict(self, key: BlockKey) -> bool:
        return self._entries[key].offset not in self._pins

    def _store(self, batch: WriteBatch) -> None:
        """Delete victims' rows, write and sync the data, then index it. Holds _write_lock."""
        if batch.victims:
            try:
                self._commit(delete=[v.key for v in batch.victims])
            except lmdb.Error:
                self._undo_plan(batch)
                return
            with self._lock:
                self._stats.evictions += len(batch.victims)
        written: list[Planned] = []
        try:
            written = self._write_durably(batch.planned)
        finally:  # also on a bug's exception: no slot may leak
            self._publish(batch, written)

    def _write_durably(self, planned: list[Planned]) -> list[Planned]:
        """Write, fdatasync, then index; returns the blocks that are now indexed."""
        written, out_of_space = write_and_hash(self._file, planned)
        if out_of_space:
            # The filesystem is full below our budget: cap the tier at what it holds.
            ok = {id(p) for p in written}
            lost = sum(self._alloc.slot_bytes(p.data.nbytes) for p in planned if id(p) not in ok)
            with self._lock:
                held_bytes = self._alloc.used_bytes - lost
            self._full.capped(held_bytes)
        if written and self.sync:
            try:
                self._file.sync()
            except OSError as e:
                if e.errno not in IO_ERRNOS:
                    raise
                return []
        if written:
            try:
                self._commit(put=[p.entry for p in written])
            except lmdb.Error:
                return []
        return written

    def _publish(self, batch: WriteBatch, written: list[Planned]) -> None:
        """Make indexed blocks visible to readers; give the other slots back."""
        ok = {id(p) for p in written}
        with self._lock:
            for p in batch.planned:
                if id(p) in ok:
                    self._entries[p.entry.key] = p.entry
                    self._policy.insert(p.entry.key)
                    self._stats.bytes_in += p.entry.nbytes
                    batch.results[p.index] = True
                else:
                    self._alloc.free(p.entry.offset)
                    self._stats.write_failures += 1
            self._log(True, [p.entry.key for p in written])

    def _undo_plan(self, batch: WriteBatch) -> None:
        """The victims' rows could not be deleted: give their slots back to them."""
        with self._lock:
            for p in batch.planned:
                self._alloc.free(p.entry.offset)
            self._stats.write_failures += len(batch.planned)
            for v in batch.victims:
                # A slot that cannot be reclaimed stays unindexed in memory; its
                # row is verified like any other at the next open.
                if self._alloc.claim(v.offset, v.nbytes):
                    self._entries[v.key] = v
                    self._policy.insert(v.key)
                    self._log(True, [v.key])

    def _commit(self, put: Sequence[NvmeEntry] = (), delete: Sequence[BlockKey] = ()) -> None:
        """One LMDB write transaction, carrying pending last-access times too.
        Holds _write_lock; raises lmdb.Error (pending times are kept for later)."""
        with self._lock:
            dirty = [(k, self._entries[k].pack()) for k in self._dirty if k in self._entries]
            self._dirty.clear()
        try:
            self._index.commit(put=put, delete=delete, records=dirty)
            shortfalls = self._index.reserve_shortfalls
            if shortfalls != self.counters.nvme_index_reserve_shortfalls:
                self.counters.set("nvme_index_reserve_shortfalls", shortfalls)
        except lmdb.Error as e:
            _faults.warning("index", "NVMe index commit in %s failed: %s", self.root, e)
            with self._lock:
                self._dirty.update(k for k, _ in dirty)
            raise

    def remove(self, keys: Sequence[BlockKey]) -> int:
        """Drop the keys that are held and not being read; returns how many went."""
        checked = [check_key(k) for k in keys]
        with self._write_lock:
            self._check_usable()
            with self._lock:
                gone: list[NvmeEntry] = []
                for key in dict.fromkeys(checked):
                    entry = self._entries.get(key)
                    if entry is not None and entry.offset not in self._pins:
                        del self._entries[key]
                        self._policy.remove(key)
                        self._dirty.discard(key)
                        gone.append(entry)
                self._log(False, [e.key for e in gone])
            if not gone:
                return 0
            try:
                self._commit(delete=[e.key for e in gone])
            except lmdb.Error as e:
                with self._lock:
                    for entry in gone:
                        self._entries[entry.key] = entry
                        self._policy.insert(entry.key)
                    self._log(True, [e.key for e in gone])
                raise StorageError(f"cannot update the NVMe index in {self.root}: {e}") from e
            with self._lock:
                for entry in gone:
                    self._alloc.free(entry.offset)
        return len(gone)

    # -- reads -----------------------------------------------------------------

    def read_into(self, key: BlockKey, out: Buffer, *, in_parallel: bool = False) -> int | None:
        """Read the block into ``out[:nbytes]`` and verify it; returns nbytes or None.

        None is a miss: not held, or the stored bytes failed (short read, I/O
        error, digest mismatch), in which case the block is dropped. ``out``
        must be writable and at least nbytes long (else BlockSizeError); it
        is scribbled on even when None is returned. A page-aligned ``out`` is
        read into without a copy. Thread-safe; the slot is pinned meanwhile.

        ``in_parallel`` says the caller keeps other reads in flight, which
        overlap each other instead of each read with its own verify (see
        ``reads.read_verified``).
        """
        key = check_key(key)
        view = memoryview(out).cast("B")
        if view.readonly:
            raise TypeError("read_into needs a writable buffer")
        with self._lock:
            self._check_usable()
            entry = self._entries.get(key)
            if entry is None:
                self._stats.misses += 1
                return None
            if view.nbytes < entry.nbytes:
                raise BlockSizeError(
                    f"output buffer of {view.nbytes} bytes is too small for block of "
                    f"{entry.nbytes} bytes"
                )
            self._pins.pin(entry.offset)
            self._touch(entry, time.time())
        nbytes = entry.nbytes
        started = time.perf_counter()
        try:
            in_full, verified = read_verified(self._file, entry, view, in_parallel=in_parallel)
            if not verified:
                self._drop_failed(entry, verify_failed=in_full)
        finally:
            with self._lock:
                if self._pins.unpin(entry.offset):
                    self._alloc.free(entry.offset)
        with self._lock:
            if verified:
                self._stats.hits += 1
                self._stats.bytes_out += nbytes
                self.read_rate.add(nbytes, time.perf_counter() - started)
                return nbytes
            self._stats.misses += 1
            return None

    def _log(self, added: bool, keys: list[BlockKey]) -> None:
        """Record a change of what this tier holds. Holds _lock (so the log's
        order is the order of the changes)."""
        if self.events is not None and keys:
            self.events.record(added, TierName.NVME, keys)

    def _touch(self, entry: NvmeEntry, now: float) -> None:
        """Holds _lock."""
        self._policy.touch(entry.key)
        entry.last_access_s = now
        self._dirty.add(entry.key)

    def _drop_failed(self, entry: NvmeEntry, *, verify_failed: bool) -> None:
        """Unindex a block whose bytes failed; its slot is freed at the last unpin."""
        with self._write_lock:
            with self._lock:
                if verify_failed:
                    self._stats.verify_failures += 1
                else:
                    self._stats.read_failures += 1
                if self._entries.get(entry.key) is not entry:
                    return  # another reader dropped it already
                del self._entries[entry.key]
                self._policy.remove(entry.key)
                self._dirty.discard(entry.key)
                self._log(False, [entry.key])
            try:
                self._commit(delete=[entry.key])
            except lmdb.Error:
                return  # its row stays, so the slot stays used until the next open
            with self._lock:
                self._pins.retire(entry.offset)

    # -- lifetime --------------------------------------------------------------

    def _check_usable(self) -> None:
        if self._closed:
            raise StorageError(f"NVMe tier {self.root} is closed")
        if os.getpid() != self._pid:
            raise StorageError(
                f"NVMe tier {self.root} was opened by pid {self._pid}; it cannot be used "
                "across fork(), open a new one in this process"
            )

    def close(self) -> None:
        """Wait for reads in flight, persist last-access times, close everything.

        Idempotent. Reads and writes after close raise StorageError.
        """
        with self._lock:
            if self._closed or os.getpid() != self._pid:
                return
            self._closed = True
            self._pins.wait_unpinned()
        with self._write_lock:
            try:
                self._commit()
            except lmdb.Error as e:
                logger.warning("NVMe tier %s: last-access times not saved: %s", self.root, e)
            self._index.close()
            self._file.close()
            os.close(self._lock_fd)
            with self._lock:
                self._entries.clear()

    def __enter__(self) -> NvmeTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["NvmeEntry", "NvmeTier", "block_digest"]
