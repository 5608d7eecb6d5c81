"""Building a ``TieredStore``'s parts from its config: the tiers, then the
collaborators that move blocks between them.

Provides ``build_parts``, which makes, in this order: the remote tier (when
``remote_url`` is set; first, so a configuration it refuses fails before
anything is allocated), the DRAM arena and tier, the NVMe tier (when
``nvme_bytes`` > 0), the event log and the replica ledger wired into the
tiers, the digests and the hasher, the demoter, the promoter, the write
policy and the write-through writer; and returns them as one ``StoreParts``.
If building any part fails, the parts built here so far are closed in
reverse (threads stopped, the arena file removed; not the tiers the caller
passed) and the error propagates. Also provides
``populate_in_background``, which logs the arena and, unless it is
populated already, starts its populator thread and makes the arena's first
``dram_ready_bytes`` ready before the store serves.

Every collaborator gets what it works with explicitly (tiers, ledger,
policies, the digest function, the counters): nothing here, or in what it
builds, holds the store itself.

Runs on the thread that constructs the store (sidecar process). The
constructors it calls start the hasher's, the demoter's, the writer's and
the remote tier's threads on ``workers``; ``populate_in_background`` starts
"tierstore-arena-populator".
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from tierstore.config.remote import RemoteConfig
from tierstore.config.store import StoreConfig
from tierstore.counters import Counters
from tierstore.errors import ArenaError
from tierstore.memory.arena import Arena
from tierstore.policies.admission import make_admission_policy
from tierstore.policies.eviction import make_eviction_policy
from tierstore.policies.replication import ReplicaRetention
from tierstore.policies.write import WritePolicy, make_write_policy
from tierstore.store.demoter import Demoter
from tierstore.store.digests import BlockDigests
from tierstore.store.dram import DramTier
from tierstore.store.events import BlockEventLog
from tierstore.store.hasher import CommitHasher
from tierstore.store.nvme.tier import NvmeTier
from tierstore.store.nvme.writer import NvmeWriter
from tierstore.store.promoter import Promoter
from tierstore.store.remote.source import HeldBlockSource
from tierstore.store.remote.tier import RemoteTier
from tierstore.store.replicas import ReplicaLedger
from tierstore.workers import Workers

log = logging.getLogger(__name__)
POPULATOR_NICE = 10  # the arena populator thread's niceness (Linux: per thread)


@dataclass(frozen=True, slots=True)
class StoreParts:
    """What ``build_parts`` made; the store keeps each as an attribute and
    closes the tiers and the threaded ones in ``close``."""

    remote: RemoteTier | None
    arena: Arena
    dram: DramTier
    nvme: NvmeTier | None
    events: BlockEventLog
    replicas: ReplicaLedger
    digests: BlockDigests
    hasher: CommitHasher | None
    demoter: Demoter
    promoter: Promoter
    write_policy: WritePolicy
    writer: NvmeWriter | None


def build_parts(
    config: StoreConfig,
    workers: Workers,
    counters: Counters,
    *,
    arena: Arena | None = None,
    nvme: NvmeTier | None = None,
    remote: RemoteConfig | None = None,
) -> StoreParts:
    """The store's parts (see the module docstring). ``arena`` and ``nvme``:
    tiers built by the caller, used as they are; ``remote``: the remote
    tier's settings (none, or an empty ``remote_url``: no remote tier).
    ``counters`` gets the promoter's, hasher's, digests' and demoter's figures.
    If any part fails, what was built here is closed again in reverse (its
    threads stopped, the arena file removed); the caller's tiers are not."""
    with contextlib.ExitStack() as undo:
        parts = _build_parts(config, workers, counters, arena, nvme, remote, undo)
        undo.pop_all()
    return parts


def _build_parts(
    config: StoreConfig,
    workers: Workers,
    counters: Counters,
    arena: Arena | None,
    nvme: NvmeTier | None,
    remote: RemoteConfig | None,
    undo: contextlib.ExitStack,
) -> StoreParts:
    remote_tier, arena, dram, nvme = _build_tiers(config, workers, arena, nvme, remote, undo)
    # Tier changes in order, for routers (PeerService.WatchBlocks).
    events = BlockEventLog(config.event_log_keys)
    dram.events = events
    if nvme is not None:
        nvme.events = events
    # Blocks imported for other hosts (kv_share): evicted before the
    # host's own blocks and bounded by a budget.
    replicas = ReplicaLedger()
    events.on_removed = replicas.note_removed
    if nvme is not None:
        # and on NVMe too (a bounded batch of them per write batch: the
        # policy's order takes over after it)
        nvme.evict_first = lambda: replicas.oldest(4 * config.demote_batch_blocks)
    digests = BlockDigests(dram, counters)
    hasher: CommitHasher | None = None
    if config.hash_queue_blocks > 0:
        hasher = CommitHasher(
            digests.hash_committed,
            workers=workers,
            counters=counters,
            queue_blocks=config.hash_queue_blocks,
        )
        undo.callback(hasher.close)
    demoter = _build_demoter(config, workers, counters, dram, nvme, remote_tier, replicas, digests)
    undo.callback(demoter.close)
    promoter = Promoter(
        nvme,
        dram,
        arena,
        make_room=demoter.make_room,
        on_promoted=demoter.wake,
        counters=counters,
        read_depth=config.nvme_read_depth,
        wait_s=config.promote_wait_s,
    )
    undo.callback(promoter.close)
    write_policy = make_write_policy(config.write_policy, config.write_through_min_tokens)
    writer: NvmeWriter | None = None
    if nvme is not None and write_policy.name != "write_back":
        writer = NvmeWriter(
            dram, nvme, write_policy, queue_bytes=config.write_queue_bytes, workers=workers
        )
        undo.callback(writer.close)
    if remote_tier is not None:
        remote_tier.source = HeldBlockSource(dram, nvme, digests.digest)
    return StoreParts(
        remote_tier, arena, dram, nvme, events, replicas, digests, hasher, demoter, promoter,
        write_policy, writer,
    )  # fmt: skip


def _build_tiers(
    config: StoreConfig,
    workers: Workers,
    arena: Arena | None,
    nvme: NvmeTier | None,
    remote: RemoteConfig | None,
    undo: contextlib.ExitStack,
) -> tuple[RemoteTier | None, Arena, DramTier, NvmeTier | None]:
    """The remote tier, the arena, the DRAM tier and the NVMe tier; the
    ones built here get their close on ``undo``."""
    remote_tier: RemoteTier | None = None
    if remote is not None and remote.remote_url:
        remote_tier = RemoteTier(remote, workers)
        undo.callback(remote_tier.close)
    if arena is None:
        arena = Arena.create(
            config.dram_bytes,
            config.shm_dir,
            upfront=config.dram_populate == "upfront",
            huge_pages=config.dram_huge_pages,
        )
        undo.callback(arena.close)
        lock_arena(arena, config.dram_lock)
    # A tier smaller than one segment is one segment (small test and demo stores).
    dram = DramTier(
        arena,
        min(config.dram_segment_bytes, arena.size_bytes),
        make_eviction_policy(config.eviction_policy),
    )
    if nvme is None and config.nvme_bytes > 0:
        nvme = NvmeTier(
            config.nvme_dir,
            config.nvme_bytes,
            segment_bytes=min(config.nvme_segment_bytes, config.nvme_bytes // 4096 * 4096),
            policy=make_eviction_policy(config.eviction_policy),
            direct_io=config.nvme_direct_io,
            index_reserve_bytes=config.nvme_index_reserve_bytes,
            full_backoff_s=config.nvme_full_backoff_s,
        )
        undo.callback(nvme.close)
    return remote_tier, arena, dram, nvme


def _build_demoter(
    config: StoreConfig,
    workers: Workers,
    counters: Counters,
    dram: DramTier,
    nvme: NvmeTier | None,
    remote: RemoteTier | None,
    replicas: ReplicaLedger,
    digests: BlockDigests,
) -> Demoter:
    capacity = dram.allocator.capacity_bytes
    return Demoter(
        dram,
        nvme,
        remote,
        replicas,
        retention=ReplicaRetention(config.replica_live_s),
        admission=make_admission_policy(config.nvme_admission),
        digest=digests.digest,
        counters=counters,
        batch_blocks=config.demote_batch_blocks,
        batch_bytes=config.demote_batch_bytes,
        high_bytes=int(config.dram_high_watermark * capacity),
        low_bytes=int(config.dram_low_watermark * capacity),
        poll_s=config.demoter_poll_s,
        workers=workers,
    )


def lock_arena(arena: Arena, mode: str) -> None:
    """Lock the arena's pages as they are faulted in (``dram_lock``): "auto"
    says loudly, at start-up, when the host does not allow it; "require"
    refuses to start then; "off" does not try."""
    if mode == "off":
        return
    why = arena.lock()
    if not why:
        return
    message = (
        f"DRAM arena of {arena.size_bytes / 2**30:.2f} GiB is NOT locked in memory: {why}. "
        "Its pages may be taken back once idle, and the first copy out of them is then "
        "slower. Fix: a memory-lock limit of at least the arena's size (ulimit -l; "
        "systemd LimitMEMLOCK=infinity; a container's IPC_LOCK capability), or "
        'dram_lock = "off" to run unlocked on purpose'
    )
    if mode == "require":
        raise ArenaError(message)
    log.warning(message)


def populate_in_background(
    arena: Arena, workers: Workers, stop: Callable[[], bool], ready_bytes: int
) -> None:
    """Log the arena; unless it is populated already, populate it on the
    "tierstore-arena-populator" thread until done or ``stop()`` is true, and
    prepare its first ``ready_bytes`` (the slots handed out first) on this
    thread before returning, while that thread starts on the rest.

    The head is there so that the first puts land in ready memory (a
    50k-token turn of an 8B model is about 240 MB): preparing runs at
    1.5-3.5 GB/s on 4 KiB pages here, a few times slower than the copy it
    precedes. A fixed size, so start-up does not grow with ``dram_bytes``."""
    state = "populated"
    if arena.populated_bytes < arena.size_bytes:
        workers.start("tierstore-arena-populator", lambda: _populate(arena, stop))
        t0 = time.monotonic()
        head = min(ready_bytes, arena.size_bytes)
        arena.ensure_ready(0, head)  # a unit the tmpfs refuses is refused again on use
        state = (
            f"first {head >> 20} MiB ready in {time.monotonic() - t0:.2f}s, "
            "the rest populating in the background"
        )
    log.info(
        "DRAM arena %s: %.2f GiB, pages of %d KiB (%s), %s, %s",
        arena.path,
        arena.size_bytes / 2**30,
        arena.page_bytes >> 10,
        arena.page_kind,
        "locked in memory as it is faulted in" if arena.locked else "not locked",
        state,
    )


def _populate(arena: Arena, stop: Callable[[], bool]) -> None:
    # Background work: serving threads come first on a busy host.
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), POPULATOR_NICE)
    started = time.monotonic()
    if arena.populate(stop=stop):
        log.info(
            "DRAM arena populated (%.2f GiB in %.1fs)",
            arena.size_bytes / 2**30,
            time.monotonic() - started,
        )
