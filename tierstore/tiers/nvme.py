"""The NVMe tier: KV blocks in one data file on local disk, indexed by LMDB.

Runs in the sidecar process. Provides ``NvmeTier`` with ``contains``, ``meta``,
``write_many``, ``read_into``, ``remove``, ``stats`` and ``close``.

Under ``root``: ``LOCK`` (flock'ed while open, holds the owner's pid),
``blocks.dat`` (the data file, sparse, sized to the capacity; blocks live in
4 KiB-aligned slots of a SlabAllocator) and ``index.lmdb/`` (key -> offset,
nbytes, digest, layout fingerprint, last access; see ``nvme_index``).

Crash safety: a batch's blocks are written with pwrite(v) and made durable
with one fdatasync, and only then one LMDB write transaction indexes them, so
an index row never points at data that is not on disk. An eviction deletes the
victims' rows in a committed transaction before their slots are written
again, so no row ever points at a slot being overwritten. Every block carries
its blake3 digest and every read is verified: a block that fails (bit rot, a
truncated file) is dropped and reported as a miss, never served.

Last-access times are kept in memory and persisted lazily (in the next write
transaction and at close) so that reads never open an LMDB transaction; after
a crash, LRU order may be slightly stale, which costs only eviction quality.
With ``sync=False`` neither fdatasync nor LMDB's fsync runs: the tier still
survives a killed process (the page cache holds everything) but not a power
loss or kernel crash.

Threads: ``read_into``, ``contains`` and ``meta`` may be called from many
threads at once and concurrently with the write paths. ``write_many``,
``remove`` and ``close`` are serialised by one writer lock (LMDB allows one
writer). Reads pin their slot (a reference count), so a slot is never evicted,
reused or freed while a read is copying it. Large reads use helper threads of
the data file (see ``blockfile``) and large write batches one hashing thread,
so that blake3 runs while the disk works.

Never use an NvmeTier across ``fork()``: LMDB environments and the file lock
belong to the process that opened them; a child gets StorageError.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import blake3
import lmdb

from tierstore.errors import BlockSizeError, LayoutError, StorageError
from tierstore.keys import BlockKey, check_key
from tierstore.loadboard import RateMeter
from tierstore.policies import EvictionPolicy, LruPolicy
from tierstore.ratelog import RateLimitedLog
from tierstore.tiers.base import TierName, TierStats
from tierstore.tiers.blockfile import ALIGN_BYTES, IO_ERRNOS, BlockFile
from tierstore.tiers.nvme_index import NvmeEntry, NvmeIndex, lock_root, prepare_root
from tierstore.tiers.slab import SlabAllocator

if TYPE_CHECKING:
    from typing_extensions import Buffer  # collections.abc.Buffer from Python 3.12

    from tierstore.events import BlockEventLog

logger = logging.getLogger(__name__)
_faults = RateLimitedLog(logger)

DIGEST_BYTES = 32
FINGERPRINT_BYTES = 32
PARALLEL_HASH_MIN_BYTES = 1 << 20
"""Blocks at least this large are hashed with blake3's multithreaded mode."""
READ_CHUNK_BYTES = 512 << 10
"""Blocks larger than this are read in chunks of it, each hashed while the next
is read (measured ~10% faster than read-then-hash for 2 MiB blocks)."""
OVERLAP_HASH_MIN_BYTES = 4 << 20
"""Write batches with at least this many bytes to hash are hashed in a helper
thread while the data is written (below it, a thread costs more than it saves)."""


def block_digest(data: Buffer) -> bytes:
    """blake3 of ``data``; multithreaded for large blocks."""
    hasher = _hasher(memoryview(data).nbytes)
    hasher.update(data)
    return hasher.digest()


def _hasher(nbytes: int) -> blake3.blake3:
    if nbytes >= PARALLEL_HASH_MIN_BYTES:
        return blake3.blake3(max_threads=blake3.blake3.AUTO)
    return blake3.blake3()


@dataclass(slots=True)
class _Planned:
    """One block of a write batch that got a slot."""

    index: int
    entry: NvmeEntry
    data: memoryview


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
        self._unpinned = threading.Condition(self._lock)
        self._write_lock = threading.Lock()  # LMDB writes and data-file writes
        self._entries: dict[BlockKey, NvmeEntry] = {}
        self._pins: dict[int, int] = {}  # slot offset -> readers copying it
        self._full_at_bytes: int | None = None  # set when the filesystem filled up first
        self._retired: set[int] = set()  # slots dropped while pinned; freed at unpin
        self._dirty: set[BlockKey] = set()  # last access changed since persisted
        self._stats = TierStats()
        self._closed = False
        self.events: BlockEventLog | None = None  # set by the store: tier changes for routers
        # Set by the store: keys to evict before the policy's order (other
        # hosts' replicas leave before this host's own blocks, as in DRAM).
        self.evict_first: Callable[[], list[BlockKey]] | None = None
        self.read_rate = RateMeter()  # verified reads, for routers' cost models
        with ExitStack() as stack:
            prepare_root(self.root)
            self._lock_fd = lock_root(self.root)
            stack.callback(os.close, self._lock_fd)
            self._index = NvmeIndex(self.root / "index.lmdb", capacity_bytes, sync=sync)
            stack.callback(self._index.close)
            try:
                self.segment_bytes = self._index.segment_bytes(segment_bytes)
                self._alloc = SlabAllocator(capacity_bytes, self.segment_bytes, ALIGN_BYTES)
                self._file = self._open_file(direct_io)
                stack.callback(self._file.close)
                self._load_index()
            except lmdb.Error as e:
                raise StorageError(f"cannot use the NVMe index in {self.root}: {e}") from e
            stack.pop_all()

    # -- opening ---------------------------------------------------------------

    def _open_file(self, direct_io: bool) -> BlockFile:
        path = self.root / "blocks.dat"
        try:
            return BlockFile(path, self._alloc.capacity_bytes, direct_io=direct_io)
        except OSError as e:
            raise StorageError(f"cannot open NVMe data file {path}: {e.strerror or e}") from e

    def _load_index(self) -> None:
        """Rebuild entries, allocator and policy order from LMDB; drop rows that
        cannot be placed (geometry change, beyond a shrunk capacity, or a data
        file that vanished)."""
        loaded, bad = self._index.load()
        if not self._file.existed:
            bad.extend(e.key for e in loaded)
            loaded = []
        # Highest offsets first: the allocator hands out (and looks up) free
        # slots from the top of a run, so each claim finds its slot at once.
        loaded.sort(key=lambda e: e.offset, reverse=True)
        kept: list[NvmeEntry] = []
        for entry in loaded:
            if self._alloc.claim(entry.offset, entry.nbytes):
                kept.append(entry)
            else:
                bad.append(entry.key)
        if bad:
            self._index.commit(delete=bad)
            logger.warning(
                "NVMe tier %s dropped %d index rows that do not fit its data file",
                self.root,
                len(bad),
            )
        if self._file.size_bytes() > self._alloc.capacity_bytes:
            self._file.truncate(self._alloc.capacity_bytes)
        kept.sort(key=lambda e: e.last_access_s)
        for entry in kept:
            self._entries[entry.key] = entry
            self._policy.insert(entry.key)

    @property
    def direct_io_active(self) -> bool:
        """Whether the data file is read and written with O_DIRECT."""
        return self._file.direct

    # -- lookups ---------------------------------------------------------------

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
        if digests is not None and len(digests) != len(items):
            raise ValueError(f"got {len(digests)} digests for {len(items)} items")
        prepared = [
            _prepare_item(item, digests[i] if digests is not None else None)
            for i, item in enumerate(items)
        ]
        results = [False] * len(items)
        with self._write_lock:
            self._check_usable()
            planned, victims, first_of = self._plan(prepared, results)
            if planned:
                self._store(planned, victims, results)
        for i, first in first_of.items():
            results[i] = results[first]
        return results

    def _plan(
        self,
        prepared: list[tuple[BlockKey, bytes, memoryview, bytes | None]],
        results: list[bool],
    ) -> tuple[list[_Planned], list[NvmeEntry], dict[int, int]]:
        """Give each new block a slot, evicting as needed (in memory only)."""
        planned: list[_Planned] = []
        victims: list[NvmeEntry] = []
        first_of: dict[int, int] = {}  # duplicate item -> its first occurrence
        seen: dict[BlockKey, int] = {}
        now = time.time()
        first = _FirstVictims(self.evict_first)
        with self._lock:
            for i, (key, layout_fp, data, digest) in enumerate(prepared):
                if key in seen:
                    first_of[i] = seen[key]
                    continue
                seen[key] = i
                held = self._entries.get(key)
                if held is not None:
                    self._touch(held, now)
                    results[i] = True
                    continue
                offset = self._alloc_evicting(data.nbytes, victims, first)
                if offset is None:
                    self._stats.write_failures += 1
                    continue
                entry = NvmeEntry(key, layout_fp, offset, data.nbytes, digest or b"", now)
                planned.append(_Planned(i, entry, data))
            self._log(False, [v.key for v in victims])
        return planned, victims, first_of

    def _alloc_evicting(
        self, nbytes: int, victims: list[NvmeEntry], first: _FirstVictims
    ) -> int | None:
        """A slot for ``nbytes``, evicting unpinned blocks: ``evict_first``'s
        keys, then in policy order. Holds _lock."""
        slot = self._alloc.slot_bytes(nbytes)
        if slot > self._alloc.capacity_bytes:
            return None
        full_at = self._full_at_bytes
        offset = None
        if full_at is None or self._alloc.used_bytes + slot <= full_at:
            offset = self._alloc.alloc(nbytes)
        while offset is None:
            victim = first.next(self._entries, self._can_evict)
            if victim is not None:
                self._policy.remove(victim)
            else:
                victim = self._policy.evict(self._can_evict)
            if victim is None:
                return None
            entry = self._entries.pop(victim)
            self._dirty.discard(victim)
            self._alloc.free(entry.offset)
            victims.append(entry)
            if full_at is None or self._alloc.used_bytes + slot <= full_at:
                offset = self._alloc.alloc(nbytes)
        return offset

    def _can_evict(self, key: BlockKey) -> bool:
        return self._entries[key].offset not in self._pins

    def _store(
        self, planned: list[_Planned], victims: list[NvmeEntry], results: list[bool]
    ) -> None:
        """Delete victims' rows, write and sync the data, then index it. Holds _write_lock."""
        if victims:
            try:
                self._commit(delete=[v.key for v in victims])
            except lmdb.Error:
                self._undo_plan(planned, victims)
                return
            with self._lock:
                self._stats.evictions += len(victims)
        written: list[_Planned] = []
        try:
            written = self._write_durably(planned)
        finally:  # also on a bug's exception: no slot may leak
            self._publish(planned, written, results)

    def _write_durably(self, planned: list[_Planned]) -> list[_Planned]:
        """Write, fdatasync, then index; returns the blocks that are now indexed."""
        errors = self._write_and_hash(planned)
        written = [p for p, err in zip(planned, errors, strict=True) if err is None]
        failed = [err for err in errors if err is not None]
        if failed:
            _faults.warning(
                "write", "NVMe write of %d blocks to %s failed: %s",
                len(failed), self.root / "blocks.dat", failed[0],
            )  # fmt: skip
            if any(err.errno == errno.ENOSPC for err in failed):
                # The filesystem is full below our budget: cap the tier at what
                # it holds, so new blocks evict old ones (whose slots are
                # already on disk) instead of failing from now on.
                ok = {id(p) for p in written}
                lost = sum(
                    self._alloc.slot_bytes(p.data.nbytes) for p in planned if id(p) not in ok
                )
                with self._lock:
                    self._full_at_bytes = self._alloc.used_bytes - lost
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

    def _publish(
        self, planned: list[_Planned], written: list[_Planned], results: list[bool]
    ) -> None:
        """Make indexed blocks visible to readers; give the other slots back."""
        ok = {id(p) for p in written}
        with self._lock:
            for p in planned:
                if id(p) in ok:
                    self._entries[p.entry.key] = p.entry
                    self._policy.insert(p.entry.key)
                    self._stats.bytes_in += p.entry.nbytes
                    results[p.index] = True
                else:
                    self._alloc.free(p.entry.offset)
                    self._stats.write_failures += 1
            self._log(True, [p.entry.key for p in written])

    def _write_and_hash(self, planned: list[_Planned]) -> list[OSError | None]:
        """Write the batch's data; hash the blocks that came without a digest
        meanwhile (the digest is needed only for the index commit)."""
        unhashed = [p for p in planned if not p.entry.digest]

        def hash_all() -> None:
            for p in unhashed:
                p.entry.digest = block_digest(p.data)

        if sum(p.data.nbytes for p in unhashed) < OVERLAP_HASH_MIN_BYTES:
            hash_all()
            return self._file.write_batch([(p.entry.offset, p.data) for p in planned])
        # blake3 and pwritev both release the GIL, so the hash overlaps the
        # disk write (measured on 32 MiB batches of 2 MiB blocks: ~75% of raw
        # O_DIRECT write speed with the hash first, ~90% overlapped).
        hasher = threading.Thread(target=hash_all, name="nvme-hash", daemon=True)
        hasher.start()
        try:
            return self._file.write_batch([(p.entry.offset, p.data) for p in planned])
        finally:
            hasher.join()
            if any(not p.entry.digest for p in unhashed):
                raise RuntimeError("hashing a write batch failed (see the thread's traceback)")

    def _undo_plan(self, planned: list[_Planned], victims: list[NvmeEntry]) -> None:
        """The victims' rows could not be deleted: give their slots back to them."""
        with self._lock:
            for p in planned:
                self._alloc.free(p.entry.offset)
            self._stats.write_failures += len(planned)
            for v in victims:
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

        A lone read overlaps its own verify with the disk (chunked reads on a
        helper thread, a multithreaded hash). ``in_parallel`` says the caller
        keeps other reads in flight, which overlap instead: the block is read
        in one request and hashed on this thread, with no extra threads to
        crowd the cores.
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
            self._pins[entry.offset] = self._pins.get(entry.offset, 0) + 1
            self._touch(entry, time.time())
        nbytes = entry.nbytes
        started = time.perf_counter()
        try:
            hasher = blake3.blake3() if in_parallel else _hasher(nbytes)
            chunk_bytes = nbytes if in_parallel else READ_CHUNK_BYTES
            try:
                got = self._file.read_streamed(
                    entry.offset, nbytes, view, hasher.update, chunk_bytes
                )
            except OSError as e:
                if e.errno not in IO_ERRNOS:
                    raise
                got = -1
            verified = got == nbytes and hasher.digest() == entry.digest
            if not verified:
                self._drop_failed(entry, verify_failed=got == nbytes)
        finally:
            self._unpin(entry.offset)
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
        _faults.warning(
            "verify" if verify_failed else "read",
            "NVMe block at offset %d of %s %s; dropped (a miss, never served)",
            entry.offset,
            self.root / "blocks.dat",
            "failed blake3 verification" if verify_failed else "could not be read in full",
        )
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
                self._retired.add(entry.offset)

    def _unpin(self, offset: int) -> None:
        with self._lock:
            count = self._pins[offset] - 1
            if count:
                self._pins[offset] = count
                return
            del self._pins[offset]
            if offset in self._retired:
                self._retired.discard(offset)
                self._alloc.free(offset)
            self._unpinned.notify_all()

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
            while self._pins:
                self._unpinned.wait()
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


class _FirstVictims:
    """The keys a write batch evicts before the policy's order (the store's
    replicas of other hosts, oldest first), asked for once per batch and
    only if the batch has to evict."""

    def __init__(self, source: Callable[[], list[BlockKey]] | None) -> None:
        self._source = source
        self._keys: Iterator[BlockKey] | None = None

    def next(
        self, entries: dict[BlockKey, NvmeEntry], can_evict: Callable[[BlockKey], bool]
    ) -> BlockKey | None:
        if self._source is None:
            return None
        if self._keys is None:
            self._keys = iter(self._source())
        for key in self._keys:
            if key in entries and can_evict(key):
                return key
        return None


def _prepare_item(
    item: tuple[BlockKey, bytes, Buffer], digest: bytes | None
) -> tuple[BlockKey, bytes, memoryview, bytes | None]:
    """Validate one write item (caller errors raise) and view its bytes."""
    key, layout_fp, data = item
    key = check_key(key)
    layout_fp = bytes(layout_fp)
    if len(layout_fp) != FINGERPRINT_BYTES:
        raise LayoutError(
            f"layout fingerprint must be {FINGERPRINT_BYTES} bytes, got {len(layout_fp)}"
        )
    if digest is not None and len(digest) != DIGEST_BYTES:
        raise ValueError(f"block digest must be {DIGEST_BYTES} bytes, got {len(digest)}")
    return key, layout_fp, memoryview(data).cast("B"), bytes(digest) if digest else None


__all__ = ["NvmeEntry", "NvmeTier", "block_digest"]
