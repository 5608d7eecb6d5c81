"""Moving blocks up: NVMe -> DRAM promotion for ``TieredStore.acquire``.

Provides ``Promoter.promote_missing``, which reads every block of a request
that is not in DRAM from NVMe into a fresh DRAM slot and pins it for the
caller, with up to ``nvme_read_depth`` reads in flight. One NVMe read at a
time leaves the disk idle while the block just read is verified (blake3 over
2 MiB is about as long as reading it); a few in flight keep the disk busy
and the verify of one block overlaps the reads of the next.

Its collaborators are explicit (``PromotionSource``: the tier blocks come
up from; the DRAM tier and the arena they go to; ``make_room``, which the
store evicts through; ``on_promoted``, which wakes its demoter), so it never
calls back into the store that owns it.

Threads: called from any caller thread of the store; the reads run on a
small pool of "tierstore-promote" threads started on first use. Promotions
of the same key are coalesced: one thread reads, the others wait for it,
bounded by ``promote_wait_s``.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from typing import Protocol

from tierstore.counters import Counters
from tierstore.keys import BlockKey, KVLayout
from tierstore.memory.arena import Arena
from tierstore.store.base import BlockMeta, Buffer
from tierstore.store.dram import STORE_OWNER, DramEntry, DramTier, ReserveStatus

PROMOTER_COUNTERS = ("promotions", "promotion_failures")
# Reserves again after a block held at the reserve was evicted before the pin; a
# waiter on another's promotion reads the block itself after it was evicted so.
PIN_RACE_RETRIES = 2


class PromotionSource(Protocol):
    """A tier below DRAM that blocks are promoted from (NVMe)."""

    def meta(self, key: BlockKey) -> BlockMeta | None:
        """Size, layout and digest of a held block; None if not held."""
        ...

    def read_into(self, key: BlockKey, out: Buffer, *, in_parallel: bool = False) -> int | None:
        """Read and verify ``key`` into ``out``: the bytes read, or None/short
        on a miss (absent, unreadable, failed verification)."""
        ...


@dataclass(slots=True)
class _Promotion:
    done: threading.Event = field(default_factory=threading.Event)


class Promoter:
    """Promotion from ``source`` into ``dram``; owned by one ``TieredStore``
    and closed with it. ``counters`` gets ``PROMOTER_COUNTERS``."""

    def __init__(
        self,
        source: PromotionSource | None,
        dram: DramTier,
        arena: Arena,
        *,
        make_room: Callable[[int], bool],
        on_promoted: Callable[[], None],
        counters: Counters,
        read_depth: int,
        wait_s: float,
    ) -> None:
        self._source = source
        self._dram = dram
        self._arena = arena
        self._make_room = make_room
        self._on_promoted = on_promoted
        self._counters = counters
        self._read_depth = read_depth
        self._wait_s = wait_s
        self._running: dict[BlockKey, _Promotion] = {}
        self._lock = threading.Lock()
        self._pool: futures.ThreadPoolExecutor | None = None
        self._closed = False

    def promote_missing(
        self,
        layout: KVLayout,
        keys: Sequence[BlockKey],
        pinned: list[DramEntry | None],
        owner: int,
    ) -> None:
        """Fill the ``None`` entries of ``pinned`` (one per key) by promotion,
        in key order, stopping at the first block that cannot be promoted.

        Promotions that finished beyond that gap are stored in ``pinned``
        too: the caller unpins everything after the prefix it keeps. If a
        read raises, the reads in flight are waited for and stored first,
        then the error propagates.
        """
        missing = [i for i, entry in enumerate(pinned) if entry is None]
        if not missing or self._source is None:
            return
        if len(missing) == 1 or self._read_depth <= 1:
            for i in missing:
                pinned[i] = self.promote(layout, keys[i], owner, in_parallel=False)
                if pinned[i] is None:
                    return
            return
        self._promote_windowed(layout, keys, pinned, owner, missing)

    def _promote_windowed(
        self,
        layout: KVLayout,
        keys: Sequence[BlockKey],
        pinned: list[DramEntry | None],
        owner: int,
        missing: list[int],
    ) -> None:
        pool = self._reader_pool()
        waiting = iter(missing)
        in_flight: deque[tuple[int, futures.Future[DramEntry | None]]] = deque()

        def submit_next() -> None:
            i = next(waiting, None)
            if i is not None:
                in_flight.append((i, pool.submit(self.promote, layout, keys[i], owner, True)))

        for _ in range(self._read_depth):
            submit_next()
        try:
            while in_flight:
                i, done = in_flight.popleft()
                pinned[i] = done.result()
                if pinned[i] is None:
                    return
                submit_next()
        finally:
            # Past a gap or an error: let the reads in flight land, so that
            # their pins are the caller's to drop and no slot is half written.
            for i, running in in_flight:
                try:
                    pinned[i] = running.result()
                except Exception:  # the first error is the one that propagates
                    pinned[i] = None

    def promote(
        self, layout: KVLayout, key: BlockKey, owner: int, in_parallel: bool = False
    ) -> DramEntry | None:
        """Read ``key`` from NVMe into a DRAM slot and pin it for ``owner``;
        None if it is not on NVMe (under this layout) or the read failed.
        ``in_parallel``: other reads are in flight (see ``NvmeTier.read_into``)."""
        for _ in range(PIN_RACE_RETRIES + 1):
            with self._lock:
                running = self._running.get(key)
                if running is None:
                    self._running[key] = _Promotion()
            if running is None:
                try:
                    return self._promote_now(layout, key, owner, in_parallel)
                finally:
                    with self._lock:
                        self._running.pop(key).done.set()
            done = running.done.wait(self._wait_s)
            held = self._pin_matching(key, layout.fingerprint, owner)
            if held is not None or not done:
                return held  # pinned, or the other read is still running past the wait
            # The other promotion ended and the block is not in DRAM: its read
            # failed, or a make_room for another promotion evicted it before this
            # pin (seen under overload). Promote it here, as the reader this time.
        return None

    def _pin_matching(self, key: BlockKey, layout_fp: bytes, owner: int) -> DramEntry | None:
        dram = self._dram
        entry = dram.pin([key], owner)[0]
        if entry is not None and entry.layout_fp != layout_fp:
            dram.unpin([key], owner)
            return None
        return entry

    def _promote_now(
        self, layout: KVLayout, key: BlockKey, owner: int, in_parallel: bool
    ) -> DramEntry | None:
        source, dram = self._source, self._dram
        if source is None:
            return None
        meta = source.meta(key)
        nbytes = layout.block_bytes
        if meta is None or meta.nbytes != nbytes or meta.layout_fp != layout.fingerprint:
            return None  # absent, or stored under another layout: a miss
        for _ in range(PIN_RACE_RETRIES + 1):
            status, entry = dram.reserve(key, layout.fingerprint, nbytes, STORE_OWNER)
            if status == ReserveStatus.FULL and self._make_room(nbytes):
                status, entry = dram.reserve(key, layout.fingerprint, nbytes, STORE_OWNER)
            if status != ReserveStatus.EXISTS:
                break
            held = self._pin_matching(key, layout.fingerprint, owner)
            if held is not None:
                return held
            # In DRAM at the reserve but evicted before the pin (a concurrent
            # make_room took it): reserve again, so the block is promoted.
        else:
            return None
        if status != ReserveStatus.OK or entry is None:
            self._counters.add("promotion_failures")
            return None
        slot = self._arena.view(entry.offset, dram.allocator.slot_bytes(nbytes))
        try:
            got = source.read_into(key, slot, in_parallel=in_parallel)
        except BaseException:
            dram.abort([key], STORE_OWNER)
            raise
        after = source.meta(key)
        if after is not None and meta.digest == after.digest:
            # The read verified the bytes against this digest: peers need not hash again.
            entry.digest = meta.digest
        if got != nbytes:
            dram.abort([key], STORE_OWNER)
            self._counters.add("promotion_failures")
            return None
        dram.commit([key], STORE_OWNER, pin_for=owner)
        self._counters.add("promotions")
        self._on_promoted()
        return entry

    def _reader_pool(self) -> futures.ThreadPoolExecutor:
        with self._lock:
            if self._closed:
                raise RuntimeError("the store is closed")
            if self._pool is None:
                self._pool = futures.ThreadPoolExecutor(
                    self._read_depth, thread_name_prefix="tierstore-promote"
                )
            return self._pool

    def close(self) -> None:
        """Wait for the reads in flight and stop the pool. Idempotent."""
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
