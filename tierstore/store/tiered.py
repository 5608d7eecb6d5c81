"""TieredStore: the DRAM tier over the NVMe tier, the only module that knows
more than one tier.

Provides batched two-phase writes (``reserve`` / ``commit`` / ``abort``, or
``put``), prefix ``lookup`` across tiers, ``acquire`` / ``release`` (promote
to DRAM on hit and pin), forced ``demote`` and ``drop``, ``stat``, and what
the services ask of it instead of reaching into its tiers. Its parts are
built from the config by ``tierstore.store.build``; its helpers get them
explicitly and never reach into the store's privates (``replicas``: replica
room, given the store's public ``held`` / ``drop``; ``stat``: the figures;
``reserve``: a batch's DRAM slots, given the tiers and ``make_room``;
``digests``, ``layouts``, ``buffers``, ``results``).

The remote tier (``tierstore.store.remote.tier``, when ``remote_url`` is set)
hangs off ``self.remote`` and is touched in few places, each marked
"remote tier": victims leaving DRAM are offered to it by the demoter; its
write-through reads held blocks through ``tierstore.store.remote.source``;
``lookup_remote`` / ``pull_remote`` / ``end_turn_remote`` are what the
services call after the local tiers and peers; ``stat`` and ``close``.

Threads: any number of caller threads; one background *demoter* thread that
spills least-valuable DRAM blocks to NVMe once DRAM usage passes the high
watermark, until it is under the low one (``tierstore.store.demoter``: the
victims, the spill, the thread). A caller that finds DRAM full evicts
synchronously. With a write-through policy, ``tierstore.store.nvme.writer``
also copies chosen blocks to NVMe soon after their commit (its own worker),
and ``drain`` writes what is DRAM-only on a graceful stop. Eviction is
serialised by one lock; promotion from NVMe (several reads in flight,
same-key promotions coalesced) is ``tierstore.store.promoter``'s.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

from tierstore.config.remote import RemoteConfig
from tierstore.config.store import StoreConfig
from tierstore.counters import Counters
from tierstore.errors import BlockSizeError
from tierstore.keys import BlockKey, KVLayout, check_keys
from tierstore.memory.arena import Arena
from tierstore.memory.memcopy import copy_into
from tierstore.store.base import Tier
from tierstore.store.buffers import as_byte_view as as_byte_view  # re-exported (public API)
from tierstore.store.buffers import split_blocks
from tierstore.store.build import build_parts, populate_in_background
from tierstore.store.demoter import DEMOTER_COUNTERS
from tierstore.store.digests import DIGEST_COUNTERS
from tierstore.store.dram import STORE_OWNER, DramEntry, ReserveStatus
from tierstore.store.hasher import HASHER_COUNTERS
from tierstore.store.layouts import LayoutRegistry
from tierstore.store.nvme.tier import NvmeTier
from tierstore.store.nvme.writer import DrainReport, drain
from tierstore.store.promoter import PROMOTER_COUNTERS
from tierstore.store.remote.pull import pull_prefix
from tierstore.store.remote.turns import Durability
from tierstore.store.replicas import make_replica_room, prune_gone
from tierstore.store.reserve import reserve_slots
from tierstore.store.results import LookupResult, Reservation
from tierstore.store.stat import STORE_GAUGES as STORE_GAUGES  # re-exported (/metrics)
from tierstore.store.stat import store_stat
from tierstore.tiers import TIER_CODES, TierName
from tierstore.workers import Workers

log = logging.getLogger(__name__)
_DRAM_CODE = TIER_CODES[TierName.DRAM]
_NVME_CODE = TIER_CODES[TierName.NVME]


STORE_COUNTERS = (
    "lookups",
    "lookup_keys",
    "lookup_hit_keys",
    *PROMOTER_COUNTERS,
    *HASHER_COUNTERS,
    *DIGEST_COUNTERS,
    *DEMOTER_COUNTERS,
)


class TieredStore:
    """DRAM over NVMe. See the module docstring."""

    def __init__(
        self,
        config: StoreConfig,
        *,
        arena: Arena | None = None,
        workers: Workers | None = None,
        nvme: NvmeTier | None = None,
        remote: RemoteConfig | None = None,
    ) -> None:
        """``arena`` and ``nvme``: tiers built by the caller (tests pass fakes;
        the store closes them); else built from ``config``. ``remote``: the
        remote tier's settings (none, or an empty ``remote_url``: no remote tier)."""
        self.config = config
        # The sidecar passes its own, so a dead demoter turns its health NOT_SERVING.
        self.workers = workers if workers is not None else Workers()
        self.counters = Counters(STORE_COUNTERS)
        parts = build_parts(
            config, self.workers, self.counters, arena=arena, nvme=nvme, remote=remote
        )
        self.remote = parts.remote
        self.arena = parts.arena
        self.dram = parts.dram
        self.nvme = parts.nvme
        self.events = parts.events  # tier changes in order, for routers
        self.replicas = parts.replicas  # blocks imported for other hosts (kv_share)
        self._digests = parts.digests
        self.hasher = parts.hasher
        self.demoter = parts.demoter
        self.promoter = parts.promoter
        self.write_policy = parts.write_policy
        self.writer = parts.writer
        self._layouts = LayoutRegistry()
        self._closing = False
        self._close_lock = threading.Lock()  # close runs once, whoever calls it
        self.last_drain = DrainReport.load(self.nvme.root) if self.nvme is not None else None
        populate_in_background(
            self.arena, self.workers, lambda: self._closing, config.dram_ready_bytes
        )

    # -- layouts ----------------------------------------------------------------

    def _check_fits(self, layout: KVLayout) -> None:
        capacity = self.dram.allocator.capacity_bytes
        if layout.block_bytes > capacity:
            raise BlockSizeError(
                f"a block of layout {layout.model!r} is {layout.block_bytes} bytes; "
                f"the DRAM arena holds {capacity}"
            )

    def register_layout(self, layout: KVLayout) -> bytes:
        return self._layouts.register(layout)

    def layout(self, fingerprint: bytes) -> KVLayout:
        """The registered layout with this fingerprint, or LayoutError."""
        return self._layouts.get(fingerprint)

    def layouts(self) -> list[KVLayout]:
        """Every registered layout, in the order first registered."""
        return self._layouts.all()

    # -- writes -------------------------------------------------------------------

    def reserve(
        self, layout: KVLayout, keys: Sequence[BlockKey], owner: int = STORE_OWNER
    ) -> list[Reservation]:
        """Reserve an arena slot per key. The caller writes ``layout.block_bytes``
        at each OK offset, then ``commit``s (or ``abort``s) with the same owner."""
        keys = check_keys(keys)
        fp = self.register_layout(layout)
        nbytes = layout.block_bytes
        self._check_fits(layout)
        below = self.nvme.contains if self.nvme is not None else None
        return reserve_slots(self.dram, below, keys, fp, nbytes, owner, self.make_room)

    def commit(
        self,
        keys: Sequence[BlockKey],
        owner: int = STORE_OWNER,
        digests: Sequence[bytes | None] | None = None,
    ) -> list[bool]:
        """Make reserved blocks readable. ``digests``: their blake3 digests
        where the caller verified them already (a peer's frames); the others
        are hashed once, in the background (``tierstore.store.hasher``)."""
        keys = check_keys(keys)
        committed: list[DramEntry] = []
        done = self.dram.commit(keys, owner, digests=digests, committed=committed)
        if self.hasher is not None:
            self.hasher.submit(committed)
        if self.writer is not None:
            self.writer.offer_committed([e.key for e in committed])
        self.maybe_wake_demoter()
        return done

    def abort(self, keys: Sequence[BlockKey], owner: int = STORE_OWNER) -> int:
        return self.dram.abort(check_keys(keys), owner)

    def put(
        self,
        layout: KVLayout,
        keys: Sequence[BlockKey],
        blocks: Any,
    ) -> list[bool]:
        """Store blocks given as one buffer of ``len(keys) * block_bytes`` bytes
        or as one buffer per key. Returns whether each key is held afterwards."""
        keys = check_keys(keys)
        views = split_blocks(layout, keys, blocks)
        held = []
        reservations = self.reserve(layout, keys)
        for res, view in zip(reservations, views):
            if res.status == ReserveStatus.OK:
                copy_into(self.arena.view(res.offset, len(view)), view)
        self.commit([r.key for r in reservations if r.status == ReserveStatus.OK])
        for res in reservations:
            held.append(res.status != ReserveStatus.FULL)
        return held

    # -- reads --------------------------------------------------------------------

    def lookup(self, layout: KVLayout, keys: Sequence[BlockKey]) -> LookupResult:
        """Longest available prefix of ``keys`` and the tier of each block.
        Asks each tier now; nothing is remembered from earlier answers."""
        keys = check_keys(keys)
        self.register_layout(layout)
        in_dram = self.dram.contains(keys)
        first_miss = in_dram.index(False) if False in in_dram else len(keys)
        codes = bytearray([_DRAM_CODE]) * first_miss
        if first_miss < len(keys) and self.nvme is not None:
            for held_dram, held_nvme in zip(
                in_dram[first_miss:], self.nvme.contains(keys[first_miss:])
            ):
                if held_dram:
                    codes.append(_DRAM_CODE)
                elif held_nvme:
                    codes.append(_NVME_CODE)
                else:
                    break
        self.counters.add_many(
            {"lookups": 1, "lookup_keys": len(keys), "lookup_hit_keys": len(codes)}
        )
        return LookupResult(len(codes), bytes(codes))

    def acquire(
        self, layout: KVLayout, keys: Sequence[BlockKey], owner: int = STORE_OWNER
    ) -> list[DramEntry]:
        """Pin the longest available prefix of ``keys`` in DRAM, promoting
        blocks from NVMe as needed (several reads in flight, see
        ``tierstore.store.promoter``). The caller reads each entry's bytes via
        ``view`` and must ``release`` the returned keys with the same owner."""
        keys = check_keys(keys)
        fp = self.register_layout(layout)
        pinned = self.dram.pin(keys, owner)
        result: list[DramEntry] = []
        try:
            for i, (key, entry) in enumerate(zip(keys, pinned)):
                if entry is not None and entry.layout_fp != fp:
                    # Stored under another layout (keys embed the layout, so
                    # only a confused caller gets here): a miss, never a read
                    # of the wrong size.
                    self.dram.unpin([key], owner)
                    pinned[i] = None
            self.promoter.promote_missing(layout, keys, pinned, owner)
            for entry in pinned:
                if entry is None:
                    break
                result.append(entry)
        finally:
            # Everything pinned past the prefix kept (all of it on an error).
            rest = [k for k, e in zip(keys[len(result) :], pinned[len(result) :]) if e]
            self.dram.unpin(rest, owner)
        if self.writer is not None and result:
            self.writer.offer_hits([e.key for e in result])
        return result

    def turn_ended(self, keys: Sequence[BlockKey], num_tokens: int) -> None:
        """A turn of ``num_tokens`` tokens ended with these keys (the write
        policy may write a long session through)."""
        if self.writer is not None:
            self.writer.offer_turn(check_keys(keys), num_tokens)

    def release(self, keys: Sequence[BlockKey], owner: int = STORE_OWNER) -> int:
        return self.dram.unpin(keys, owner)

    def view(self, entry: DramEntry) -> memoryview:
        return self.dram.view(entry)

    def get(self, layout: KVLayout, keys: Sequence[BlockKey]) -> list[bytes]:
        """Copies of the longest available prefix of blocks (tests, tools)."""
        entries = self.acquire(layout, keys)
        try:
            return [bytes(self.dram.view(e)) for e in entries]
        finally:
            self.release([e.key for e in entries])

    def release_owner(self, owner: int) -> tuple[int, int]:
        """Free everything a dead client held: (reservations aborted, pins dropped)."""
        return self.dram.release_owner(owner)

    def digest(self, entry: DramEntry) -> bytes:
        """blake3 of a pinned block's bytes, computed once and kept with the entry
        (normally by the hasher, right after the commit)."""
        return self._digests.digest(entry)

    def wait_hashed(self, timeout_s: float) -> bool:
        """Wait until every block committed so far has its digest (tests, benchmarks)."""
        return self.hasher.wait_idle(timeout_s) if self.hasher is not None else True

    # -- replicas (kv_share) ---------------------------------------------------------

    def adopt(self, keys: Sequence[BlockKey]) -> None:
        """Blocks a local engine used are this host's own now, not replicas."""
        if self.replicas:
            self.replicas.discard(keys)

    def replica_bytes(self) -> int:
        """Bytes of replicas still held in some tier (asked of the tiers)."""
        prune_gone(self.replicas, self.held)
        return self.replicas.used_bytes()

    def make_replica_room(self, nbytes: int, budget_bytes: int) -> bool:
        """Promise ``nbytes`` of replica room within the budget, dropping the
        oldest replicas as needed; settle it with ``finish_replica_import``."""
        return make_replica_room(
            self.replicas, nbytes, budget_bytes,
            held=self.held, drop=self.drop, batch_blocks=self.config.demote_batch_blocks,
        )  # fmt: skip

    def finish_replica_import(
        self, reserved_bytes: int, layout: KVLayout, keys: Sequence[BlockKey]
    ) -> None:
        self.replicas.settle(reserved_bytes, keys, layout.block_bytes)

    def held(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Whether each key is held in DRAM or on NVMe now (asked of the tiers)."""
        held = self.dram.contains(keys)
        if self.nvme is not None:
            held = [a or b for a, b in zip(held, self.nvme.contains(keys))]
        return held

    # -- moving blocks down -------------------------------------------------------

    def demote(self, keys: Sequence[BlockKey]) -> int:
        """Move committed, unpinned blocks out of DRAM now (spilled to NVMe
        when admitted). Returns how many left DRAM."""
        return self.demoter.demote(check_keys(keys))

    def drop(
        self, keys: Sequence[BlockKey], tiers: Sequence[TierName] = (TierName.DRAM, TierName.NVME)
    ) -> int:
        """Remove blocks from the given tiers without spilling (unpinned ones).
        Holds the demoter's lock: a block a spill has taken out of DRAM and
        not yet written would otherwise land on NVMe after the drop."""
        keys = check_keys(keys)
        with self.demoter.lock:
            return sum(t.remove(keys) for t in self.tiers() if t.name in tiers)

    def make_room(self, nbytes: int, count: int = 1) -> bool:
        """Evict synchronously until a slot of ``nbytes`` fits (room for up to
        ``count`` of them); False if no slot fits (``Demoter.make_room``)."""
        return self.demoter.make_room(nbytes, count)

    # -- remote tier -------------------------------------------------------------------

    @property
    def has_remote(self) -> bool:
        return self.remote is not None

    @property
    def remote_fetch_timeout_s(self) -> float:
        """Default deadline of a pull from the remote tier (0 without one)."""
        return self.remote.cfg.remote_fetch_timeout_s if self.remote is not None else 0.0

    def lookup_remote(self, layout: KVLayout, keys: Sequence[BlockKey], timeout_s: float) -> int:
        """How many leading ``keys`` the remote tier holds (0 without one)."""
        if self.remote is None or not keys:
            return 0
        return self.remote.lookup_prefix(layout.fingerprint, check_keys(keys), timeout_s)[0]

    def pull_remote(self, layout: KVLayout, keys: Sequence[BlockKey], timeout_s: float) -> int:
        """Bring the remote tier's blocks of the prefix into DRAM (unpinned);
        returns how many leading keys are held here afterwards."""
        if self.remote is None or not keys:
            return 0
        self.register_layout(layout)
        keys = check_keys(keys)
        return pull_prefix(
            self.remote, self.dram, self.arena, layout, keys, self.held(keys), timeout_s,
            make_room=self.make_room, on_pulled=self.maybe_wake_demoter,
        )  # fmt: skip

    def end_turn_remote(self, layout: KVLayout, keys: Sequence[BlockKey], num_tokens: int) -> bool:
        """Write a long turn through to the remote tier (in the background)."""
        if self.remote is None:
            return False
        return self.remote.end_turn(layout, check_keys(keys), num_tokens)

    def end_turn_remote_durable(
        self, layout: KVLayout, keys: Sequence[BlockKey], timeout_s: float
    ) -> Durability:
        """Write a turn through to the remote tier, whatever its length, and
        wait (up to ``timeout_s``) until the bucket acknowledged every block."""
        keys = check_keys(keys)
        if self.remote is None:
            return Durability(len(keys), 0, 0.0, "this sidecar has no remote tier (remote_url)")
        return self.remote.end_turn_durable(layout, keys, timeout_s)

    def flush_remote(self, timeout_s: float) -> bool:
        """Wait for the remote tier's queued uploads; False at the deadline."""
        return True if self.remote is None else self.remote.flush(timeout_s)

    def maybe_wake_demoter(self) -> None:
        self.demoter.wake()

    # -- what services ask of the store (they never reach into its tiers) -------------

    @property
    def has_nvme(self) -> bool:
        return self.nvme is not None

    def nvme_read_bytes_per_s(self) -> float:
        """Verified NVMe read speed measured so far (0: none yet or no NVMe)."""
        return self.nvme.read_rate.bytes_per_s if self.nvme is not None else 0.0

    def pin_count(self, owner: int) -> int:
        return self.dram.pin_count(owner)

    def not_reserved_by(self, keys: Sequence[BlockKey], owner: int) -> list[BlockKey]:
        """The keys that are not reserved by ``owner`` (a commit would fail)."""
        return self.dram.not_reserved_by(keys, owner)

    def reserved_view(self, reservation: Reservation, nbytes: int) -> memoryview:
        """The arena bytes of an OK reservation, for its owner to write."""
        if reservation.status != ReserveStatus.OK:
            raise ValueError(f"reservation of a block is {reservation.status.name}, not OK")
        return self.arena.view(reservation.offset, nbytes)

    # -- inspection -------------------------------------------------------------------

    def snapshot(self) -> tuple[int, dict[TierName, list[BlockKey]]]:
        """What each tier holds, and the event batch number it is current to
        at least: replaying the batches after that number on top is exact
        (see ``tierstore.store.events``)."""
        seq = self.events.seq  # read first: later changes are replayed, never lost
        held = {TierName.DRAM: self.dram.held_keys()}
        if self.nvme is not None:
            held[TierName.NVME] = self.nvme.held_keys()
        return seq, held

    def tiers(self) -> list[Tier]:
        """The local tiers, fastest first, behind the protocol every tier keeps."""
        return [self.dram] if self.nvme is None else [self.dram, self.nvme]

    def stat(self) -> dict[str, Any]:
        """Per-tier stats, the store's figures, setup facts (``tierstore.store.stat``)."""
        return store_stat(
            self.tiers(), self.counters, arena=self.arena, nvme=self.nvme, writer=self.writer,
            remote=self.remote, last_drain=self.last_drain,
            write_queue_bytes=self.config.write_queue_bytes,
            write_policy=self.write_policy.name, num_layouts=len(self._layouts),
        )  # fmt: skip

    def drain(self, budget_s: float) -> DrainReport:
        """Graceful stop: stop write-through, then write DRAM-only blocks to
        NVMe, most recently used first, for at most ``budget_s`` (see
        ``tierstore.store.nvme.writer.drain``). Logs one line, keeps the report in
        the NVMe directory (the next start shows it) and returns it."""
        if self.writer is not None:
            self.writer.close()
        if self.nvme is None:
            return DrainReport(budget_s=budget_s)
        with self.demoter.lock:  # no spill races the drain for the same blocks
            report = drain(self.dram, self.nvme, budget_s, self.config.demote_batch_blocks)
        (log.warning if report.dropped_blocks else log.info)("%s", report.line())
        report.save(self.nvme.root)
        self.last_drain = report
        return report

    def close(self) -> None:
        """Stop the demoter and the writer, close NVMe (index flushed) and the
        arena. Idempotent."""
        with self._close_lock:
            if self._closing:
                return
            self._closing = True
        self.demoter.close()
        if self.writer is not None:
            self.writer.close()
        if self.remote is not None:  # remote tier: its writer still reads DRAM and NVMe
            self.remote.close()
        if self.hasher is not None:
            self.hasher.close()
        self.promoter.close()
        with self.demoter.lock:
            if self.nvme is not None:
                self.nvme.close()
            self.dram.close()
            self.arena.close()

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
