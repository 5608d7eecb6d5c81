"""DRAM tier: blocks in slots of the shared-memory arena.

Provides two-phase writes (``reserve`` then ``commit`` or ``abort``),
reference-counted reads (``pin`` / ``unpin``), residency (``contains``) and
eviction hand-off (``take_victim`` / ``drop``) for the tiered store's demoter.
Every reservation and pin carries an *owner* (``STORE_OWNER`` for the store itself, a
connection id for engine clients) so that a client that dies leaks nothing
(``release_owner``).

Runs in the sidecar process (or any process that owns the store); every
method is thread-safe behind one lock and does no I/O. Bytes are copied in
and out by the caller through ``view``; the tier only tracks slots.

Cost: every operation is O(1) per key in the number of blocks held. Only
committed, unpinned blocks are in the eviction policy (a pin takes a block
out, the last unpin puts it back), so finding a victim never walks pinned
keys; reservations and pins are indexed by owner (pins in
``tierstore.store.pins``), so releasing a dead owner or a transfer touches
only what it held; the readable count is kept, not counted.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tierstore.keys import BlockKey
from tierstore.memory.arena import Arena
from tierstore.memory.slab import SlabAllocator
from tierstore.policies.eviction import EvictionPolicy, LruPolicy
from tierstore.store.pins import OwnerPins
from tierstore.tiers import TierName, TierStats

if TYPE_CHECKING:
    from tierstore.store.events import BlockEventLog

STORE_OWNER = 0  # owner id of reservations and pins made by the store itself


class EntryState(enum.IntEnum):
    RESERVED = 0  # slot allocated, bytes being written; invisible to readers
    COMMITTED = 1  # readable
    EVICTING = 2  # readable; handed to the demoter, leaves when its spill ends


class ReserveStatus(enum.IntEnum):
    OK = 0
    EXISTS = 1  # already held or being written: nothing to do
    FULL = 2  # no free slot of that size: evict, then retry


@dataclass(slots=True, eq=False)  # hashed and compared by identity (keys of the pin tables)
class DramEntry:
    key: BlockKey
    layout_fp: bytes
    offset: int
    nbytes: int
    state: EntryState
    owner: int
    refs: int = 0
    digest: bytes | None = None  # blake3 of the bytes, computed when first needed


class DramTier:
    """Block slots in an arena. See the module docstring for the contract."""

    name = TierName.DRAM

    def __init__(
        self, arena: Arena, segment_bytes: int, policy: EvictionPolicy | None = None
    ) -> None:
        self.arena = arena
        self.allocator = SlabAllocator(arena.size_bytes, segment_bytes)
        self.policy: EvictionPolicy = policy if policy is not None else LruPolicy()
        self._entries: dict[BlockKey, DramEntry] = {}
        self._pins = OwnerPins()
        self._reserved: dict[int, set[BlockKey]] = {}  # owner -> keys it has RESERVED
        self._num_readable = 0
        self._lock = threading.Lock()
        self._stats = TierStats(capacity_bytes=self.allocator.capacity_bytes)
        self.events: BlockEventLog | None = None  # set by the store: tier changes for routers

    # -- writes ---------------------------------------------------------------

    def reserve(
        self, key: BlockKey, layout_fp: bytes, nbytes: int, owner: int = STORE_OWNER
    ) -> tuple[ReserveStatus, DramEntry | None]:
        """Allocate a slot for ``key``. OK returns the RESERVED entry, whose
        bytes only ``owner`` may write until ``commit`` or ``abort``."""
        return self.reserve_many([key], layout_fp, nbytes, owner)[0]

    def reserve_many(
        self, keys: Sequence[BlockKey], layout_fp: bytes, nbytes: int, owner: int = STORE_OWNER
    ) -> list[tuple[ReserveStatus, DramEntry | None]]:
        """``reserve`` for each key, under one acquisition of the lock, up to
        and including the first FULL one (the keys after it are not tried:
        evict, then reserve them)."""
        out: list[tuple[ReserveStatus, DramEntry | None]] = []
        with self._lock:
            for key in keys:
                res = self._reserve(key, layout_fp, nbytes, owner)
                out.append(res)
                if res[0] == ReserveStatus.FULL:
                    break
        # Fresh units of the arena get their pages now, outside the lock, one
        # preparation per run of adjacent slots (a batch into fresh segments
        # is one run: the populator moves on past it, not through it).
        if self._ready_in_runs(out, nbytes):
            return out
        # Some range the tmpfs cannot hold: it is never handed out. The
        # first slot there and the ones reserved after it are given back, FULL.
        for i, (status, entry) in enumerate(out):
            if status != ReserveStatus.OK or entry is None:
                continue
            if not self.arena.ensure_ready(entry.offset, nbytes):
                with self._lock:
                    for later_status, later in out[i:]:
                        if later_status == ReserveStatus.OK and later is not None:
                            if self._entries.get(later.key) is later:
                                self._free(later)
                return [*out[:i], (ReserveStatus.FULL, None)]
        return out

    def _ready_in_runs(
        self, out: list[tuple[ReserveStatus, DramEntry | None]], nbytes: int
    ) -> bool:
        """``arena.ensure_ready`` over each run of OK slots that follow each
        other in the arena (a segment's unused tail may lie between two);
        False when any run could not be made ready."""
        slot = self.allocator.slot_bytes(nbytes)
        runs: list[list[int]] = []  # [start, end) byte ranges
        for status, entry in out:
            if status != ReserveStatus.OK or entry is None:
                continue
            if runs and 0 <= entry.offset - runs[-1][1] < slot:
                runs[-1][1] = entry.offset + slot
            else:
                runs.append([entry.offset, entry.offset + slot])
        return all(self.arena.ensure_ready(start, end - start) for start, end in runs)

    def _reserve(
        self, key: BlockKey, layout_fp: bytes, nbytes: int, owner: int
    ) -> tuple[ReserveStatus, DramEntry | None]:
        held = self._entries.get(key)
        if held is not None:
            return ReserveStatus.EXISTS, held
        offset = self.allocator.alloc(nbytes)
        if offset is None:
            return ReserveStatus.FULL, None
        entry = DramEntry(key, layout_fp, offset, nbytes, EntryState.RESERVED, owner)
        self._entries[key] = entry
        reserved = self._reserved.get(owner)
        if reserved is None:
            reserved = self._reserved[owner] = set()
        reserved.add(key)
        return ReserveStatus.OK, entry

    def commit(
        self,
        keys: Iterable[BlockKey],
        owner: int = STORE_OWNER,
        pin_for: int | None = None,
        *,
        digests: Sequence[bytes | None] | None = None,
        committed: list[DramEntry] | None = None,
    ) -> list[bool]:
        """Make reserved blocks readable. False for a key this owner did not
        reserve. With ``pin_for``, each committed block is also pinned for that
        owner in the same step, so no eviction can come between. ``digests``
        (one per key, None where unknown) are the blocks' verified blake3
        digests, kept with them; ``committed`` gets the entries committed."""
        done = []
        added: list[BlockKey] = []
        pinned: list[DramEntry | None] = []
        with self._lock:
            reserved = self._reserved.get(owner)
            for i, key in enumerate(keys):
                entry = self._entries.get(key)
                ok = (
                    entry is not None
                    and entry.state == EntryState.RESERVED
                    and entry.owner == owner
                )
                if ok:
                    assert entry is not None and reserved is not None
                    reserved.discard(key)
                    entry.state = EntryState.COMMITTED
                    self._num_readable += 1
                    self._stats.bytes_in += entry.nbytes
                    if digests is not None and digests[i] is not None:
                        entry.digest = digests[i]
                    added.append(key)
                    if pin_for is not None:
                        entry.refs += 1
                        pinned.append(entry)
                    else:
                        self.policy.insert(key)
                    if committed is not None:
                        committed.append(entry)
                done.append(ok)
            if reserved is not None and not reserved:
                del self._reserved[owner]
            if pin_for is not None:
                self._pins.add(pin_for, pinned)
            self._log(True, added)
        return done

    def abort(self, keys: Iterable[BlockKey], owner: int = STORE_OWNER) -> int:
        """Free reservations of ``owner`` that were not committed."""
        n = 0
        with self._lock:
            for key in keys:
                entry = self._entries.get(key)
                if (
                    entry is not None
                    and entry.state == EntryState.RESERVED
                    and entry.owner == owner
                ):
                    self._free(entry)
                    n += 1
        return n

    # -- reads ----------------------------------------------------------------

    def contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        with self._lock:
            return [self._readable(self._entries.get(k)) for k in keys]

    def held_keys(self) -> list[BlockKey]:
        """Every readable key (for a snapshot of the tier)."""
        with self._lock:
            return [k for k, e in self._entries.items() if self._readable(e)]

    def pin(self, keys: Sequence[BlockKey], owner: int = STORE_OWNER) -> list[DramEntry | None]:
        """Pin each readable key (counted as a hit) or give None (a miss)."""
        out: list[DramEntry | None] = []
        with self._lock:
            for key in keys:
                entry = self._entries.get(key)
                if self._readable(entry):
                    assert entry is not None
                    if entry.refs == 0:
                        self.policy.remove(key)  # out of eviction's way while pinned
                    entry.refs += 1
                    self._stats.hits += 1
                    self._stats.bytes_out += entry.nbytes
                    out.append(entry)
                else:
                    self._stats.misses += 1
                    out.append(None)
            self._pins.add(owner, out)
        return out

    def pin_quiet(
        self, keys: Sequence[BlockKey], owner: int = STORE_OWNER
    ) -> list[DramEntry | None]:
        """Pin readable keys for the store's own copies (write-through, drain):
        like ``pin`` but neither a hit nor a use (the eviction order stays)."""
        out: list[DramEntry | None] = []
        with self._lock:
            for key in keys:
                entry = self._entries.get(key)
                if self._readable(entry):
                    assert entry is not None
                    # Stays in the eviction policy, in its place (skipped as a
                    # victim while pinned): the order is not this pin's business.
                    entry.refs += 1
                    out.append(entry)
                else:
                    out.append(None)
            self._pins.add(owner, out)
        return out

    def nbytes_of(self, keys: Sequence[BlockKey]) -> list[int]:
        """Each key's block size (0 when not held)."""
        with self._lock:
            return [e.nbytes if (e := self._entries.get(k)) is not None else 0 for k in keys]

    def keys_most_recent_first(self) -> list[BlockKey]:
        """Committed keys, the ones the eviction policy would keep longest first."""
        with self._lock:
            keys = list(self.policy.candidates())
            # Pinned blocks are out of the policy until their last unpin: in use
            # now, so the most recent of all (a one-off scan: drains only).
            pinned = [
                k
                for k, e in self._entries.items()
                if e.refs > 0 and e.state != EntryState.RESERVED and k not in self.policy
            ]
        keys.reverse()
        return pinned + keys

    def unpin(self, keys: Iterable[BlockKey], owner: int = STORE_OWNER) -> int:
        """Drop one pin of ``owner`` per key; unknown pins are ignored (counted in the result)."""
        with self._lock:
            dropped = self._pins.drop(owner, (self._entries.get(key) for key in keys))
            for entry in dropped:
                self._unref(entry, 1)
        return len(dropped)

    def not_reserved_by(self, keys: Sequence[BlockKey], owner: int) -> list[BlockKey]:
        """The keys that are not RESERVED by ``owner`` (a commit would fail)."""
        with self._lock:
            return [
                k
                for k in keys
                if (e := self._entries.get(k)) is None
                or e.state != EntryState.RESERVED
                or e.owner != owner
            ]

    def pin_count(self, owner: int) -> int:
        with self._lock:
            return self._pins.count(owner)

    def view(self, entry: DramEntry) -> memoryview:
        return self.arena.view(entry.offset, entry.nbytes)

    def entry(self, key: BlockKey) -> DramEntry | None:
        with self._lock:
            return self._entries.get(key)

    # -- eviction -------------------------------------------------------------

    def take_victim(self) -> DramEntry | None:
        """Hand the next eviction victim to the demoter: it stays readable
        (state EVICTING) until ``drop``; None if nothing can be evicted."""
        with self._lock:
            key = self.policy.evict(self._evictable)
            if key is None:
                return None
            entry = self._entries[key]
            entry.state = EntryState.EVICTING
            return entry

    def take_victims(self, want_bytes: int, max_blocks: int) -> list[DramEntry]:
        """``take_victim`` until ``want_bytes`` are taken or ``max_blocks``
        victims, under one lock."""
        out: list[DramEntry] = []
        taken = 0
        with self._lock:
            while taken < want_bytes and len(out) < max_blocks:
                key = self.policy.evict(self._evictable)
                if key is None:
                    break
                entry = self._entries[key]
                entry.state = EntryState.EVICTING
                out.append(entry)
                taken += entry.nbytes
        return out

    def take(self, keys: Sequence[BlockKey]) -> list[DramEntry]:
        """Like ``take_victim`` for chosen keys (committed and unpinned ones)."""
        out = []
        with self._lock:
            for key in keys:
                entry = self._entries.get(key)
                if entry is not None and self._evictable(key):
                    self.policy.remove(key)
                    entry.state = EntryState.EVICTING
                    out.append(entry)
        return out

    def untake(self, entry: DramEntry) -> None:
        """Give back a victim that will not be evicted after all."""
        with self._lock:
            if self._entries.get(entry.key) is entry and entry.state == EntryState.EVICTING:
                entry.state = EntryState.COMMITTED
                if entry.refs == 0:
                    self.policy.insert(entry.key)

    def drop(self, entry: DramEntry) -> bool:
        """End an eviction: free the slot unless a reader pinned it meanwhile,
        in which case the block stays (back in the policy) and False is returned."""
        return self.drop_many([entry]) == 1

    def drop_many(self, entries: Sequence[DramEntry]) -> int:
        """``drop`` for each entry under one lock; returns how many were freed."""
        gone: list[BlockKey] = []
        with self._lock:
            for entry in entries:
                if self._entries.get(entry.key) is not entry or entry.state != EntryState.EVICTING:
                    continue
                if entry.refs > 0:
                    entry.state = EntryState.COMMITTED  # back in the policy at its last unpin
                    continue
                self._free(entry)
                gone.append(entry.key)
            self._stats.evictions += len(gone)
            self._log(False, gone)
        return len(gone)

    def alive(self, entries: Sequence[DramEntry]) -> list[bool]:
        """Whether each entry is still the tier's entry of its key."""
        with self._lock:
            return [self._entries.get(e.key) is e for e in entries]

    def remove(self, keys: Sequence[BlockKey]) -> int:
        """Drop committed, unpinned blocks now (no spill)."""
        gone = []
        with self._lock:
            for key in keys:
                entry = self._entries.get(key)
                if entry is not None and entry.state == EntryState.COMMITTED and entry.refs == 0:
                    self.policy.remove(key)
                    self._free(entry)
                    gone.append(key)
            self._log(False, gone)
        return len(gone)

    def release_owner(self, owner: int) -> tuple[int, int]:
        """Abort every reservation and drop every pin of a dead owner.
        Returns (reservations aborted, pins dropped)."""
        with self._lock:
            reserved = self._reserved.pop(owner, set())
            for key in reserved:
                self._free(self._entries[key])
            pins = self._pins.release(owner)
            for entry, count in pins.items():
                self._unref(entry, count)
            return len(reserved), sum(pins.values())

    # -- accounting -----------------------------------------------------------

    def used_bytes(self) -> int:
        with self._lock:
            return self.allocator.used_bytes

    def can_fit(self, nbytes: int) -> bool:
        with self._lock:
            return self.allocator.can_alloc(nbytes)

    def stats(self) -> TierStats:
        with self._lock:
            snap = self._stats.snapshot()
            snap.used_bytes = self.allocator.used_bytes
            snap.num_blocks = self._num_readable
            return snap

    def close(self) -> None:
        with self._lock:
            self._entries.clear()
            self._pins.clear()
            self._reserved.clear()
            self._num_readable = 0

    # -- internals (lock held) --------------------------------------------------

    @staticmethod
    def _readable(entry: DramEntry | None) -> bool:
        return entry is not None and entry.state != EntryState.RESERVED

    def _evictable(self, key: BlockKey) -> bool:
        entry = self._entries[key]
        return entry.state == EntryState.COMMITTED and entry.refs == 0

    def _log(self, added: bool, keys: list[BlockKey]) -> None:
        """Record a change of what this tier holds (in the order of the changes)."""
        if self.events is not None and keys:
            self.events.record(added, TierName.DRAM, keys)

    def _unref(self, entry: DramEntry, count: int) -> None:
        """Drop ``count`` pins of an entry; the last one puts a committed
        block back in the eviction policy (as just used)."""
        entry.refs -= count
        if entry.refs == 0 and entry.state == EntryState.COMMITTED:
            # Back as the most recently used; a quiet pin left it in its place.
            self.policy.readmit(entry.key)

    def _free(self, entry: DramEntry) -> None:
        del self._entries[entry.key]
        if entry.state == EntryState.RESERVED:
            reserved = self._reserved.get(entry.owner)
            if reserved is not None:
                reserved.discard(entry.key)
                if not reserved:
                    del self._reserved[entry.owner]
        else:
            self._num_readable -= 1
        self.allocator.free(entry.offset)
