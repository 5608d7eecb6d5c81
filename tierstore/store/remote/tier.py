"""The remote persistent tier: one object per block in an S3-compatible
bucket, shared by every host of the group and by later sessions.

Provides ``RemoteTier``:
- ``lookup_prefix(layout_fp, keys, timeout_s)``: the longest prefix held,
  in a few round trips (see below), never one per block;
- ``get(layout_fp, key)`` (a coroutine-backed future) and
  ``verify``: the caller pulls several blocks at once and verifies each
  (``tierstore.store.remote.pull``);
- ``offer``: a block leaving DRAM is copied and uploaded in the background
  (never blocks: when ``remote_upload_queue_bytes`` are queued it is
  skipped and counted); ``end_turn``: a long turn's chain is written
  through by the ``tierstore-remote-writer`` thread, then its manifests;
  ``end_turn_durable``: any turn written through, waited for until the
  bucket acknowledged every block (bounded); ``flush``: wait for all (all
  four: ``tierstore.store.remote.upload``; the turns not yet durable are
  counted by ``tierstore.store.remote.turns``);
- ``gc_once`` and the ``tierstore-remote-gc`` thread: keep the bucket under
  ``remote_bytes``, least recently used first (``tierstore.store.remote.gc``,
  ``tierstore.policies``);
- ``contains`` / ``remove`` / ``stats`` / ``close`` (``bound(layout_fp)``
  gives the ``tierstore.store.base.Tier`` protocol for one layout).

The uploader and the GC get their collaborators from the tier (the client,
the counters, the answers cache and last-use record of
``tierstore.store.remote.cache``; the uploader also the tier's public
``contains``), never the tier itself.

Lookup cost: wave 1 sends, at once, a GET of the manifest at every
checkpoint (every ``remote_manifest_every_blocks`` blocks of the chain) and
a HEAD of the first ``remote_lookup_window_blocks`` blocks not known
present; the longest valid manifest vouches for everything before it.
Each further wave HEADs up to ``remote_lookup_concurrency`` blocks after
the prefix known so far and stops at the first absent one. A written-through
chain of 500 blocks answers in 2 waves (7 manifests + 57 HEADs, then the
<= 63 blocks after the last manifest); a chain that is absent answers in 1.
Answers are kept in a bounded cache (``remote_cache_keys``, trusted for
``remote_cache_ttl_s``). A manifest can outlive a block that GC deleted:
the lookup then overstates the prefix and the pull stops at the hole
(a counted miss); the bytes served are always verified.

Threads: callers on any thread; requests run on ``RemoteClient``'s loop
thread; the writer (``RemoteUploader``) and GC (``RemoteGC``) threads are
started through ``Workers``; the tier owns both and stops them in ``close``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import time
from collections.abc import Coroutine, Sequence
from typing import Any

from tierstore.config.remote import RemoteConfig
from tierstore.counters import Counters
from tierstore.keys import BlockKey, KVLayout
from tierstore.policies.remote import RemotePlacement
from tierstore.store.remote import format as fmt
from tierstore.store.remote.cache import Answers, LastUse
from tierstore.store.remote.client import REQUEST_COUNTERS, ClientClosed, RemoteClient
from tierstore.store.remote.gc import GC_COUNTERS, RemoteGC
from tierstore.store.remote.turns import TURN_GAUGES, Durability
from tierstore.store.remote.upload import UPLOAD_COUNTERS, BlockSource, RemoteUploader
from tierstore.tiers import TierName, TierStats
from tierstore.workers import Workers

log = logging.getLogger(__name__)

__all__ = [
    "COUNTERS", "GAUGES", "BlockSource", "BoundRemoteTier", "Durability", "RemoteTier",
]  # fmt: skip

COUNTERS = (
    *REQUEST_COUNTERS,
    *UPLOAD_COUNTERS,
    "remote_reads", "remote_read_bytes", "remote_read_misses", "remote_read_failures",
    "remote_verify_failures", "remote_bad_objects_deleted",
    "remote_lookups", "remote_lookup_keys", "remote_lookup_hit_keys",
    "remote_lookup_round_trips", "remote_lookup_timeouts",
    "remote_pulls", "remote_pulled_blocks", "remote_pull_timeouts",
    *GC_COUNTERS,
    "remote_unreachable_at_start",
)  # fmt: skip
# The counters that go down too (metrics export them as gauges).
GAUGES = frozenset(
    {
        "remote_uploads_queued", "remote_upload_bytes_queued", "remote_objects",
        "remote_used_bytes", "remote_request_us_max", "remote_unreachable_at_start",
        *TURN_GAUGES,
    }
)  # fmt: skip


class RemoteTier:
    """The bucket under ``remote_url``. See the module docstring."""

    name = TierName.REMOTE

    def __init__(
        self, cfg: RemoteConfig, workers: Workers | None = None, *, probe_timeout_s: float = 15.0
    ) -> None:
        self.cfg = cfg
        self.workers = workers if workers is not None else Workers()
        self.counters = Counters(COUNTERS)
        self.client = RemoteClient(cfg, self.counters, self.workers)
        self.prefix = self.client.prefix
        self.placement = RemotePlacement(cfg.remote_placement, cfg.remote_min_tokens)
        self._answers = Answers(cfg.remote_cache_keys, cfg.remote_cache_ttl_s)
        self._last_use = LastUse(cfg.remote_cache_keys)  # this host's last use, for GC
        self._read_sem: asyncio.Semaphore | None = None  # made and used on the loop thread only
        try:
            problem = self.client.probe(probe_timeout_s)
        except BaseException:
            self.client.close()
            raise
        if problem:
            self.counters.set("remote_unreachable_at_start", 1)
            log.warning("%s; the remote tier answers misses until it is", problem)
        self._uploads = RemoteUploader(
            cfg,
            self.client,
            self.counters,
            self._answers,
            self._last_use,
            self.contains,
            self.workers,
        )
        self._gc = RemoteGC(cfg, self.client, self.counters, self._answers, self._last_use)
        if cfg.remote_bytes > 0:
            self._gc.start(self.workers)

    @property
    def source(self) -> BlockSource | None:
        """Where write-through reads a held block's bytes; set by the store."""
        return self._uploads.source

    @source.setter
    def source(self, source: BlockSource | None) -> None:
        self._uploads.source = source

    # -- names ------------------------------------------------------------------------

    def path(self, layout_fp: bytes, key: BlockKey) -> str:
        return fmt.object_path(self.prefix, layout_fp, key)

    # -- lookup -------------------------------------------------------------------------

    def lookup_prefix(
        self, layout_fp: bytes, keys: Sequence[BlockKey], timeout_s: float
    ) -> tuple[int, int]:
        """(blocks of the longest prefix the bucket holds, request waves it took)."""
        deadline = time.monotonic() + timeout_s
        n_keys = len(keys)
        now = time.monotonic()
        known = [self._answers.get(k, now) for k in keys]
        lo = 0
        while lo < n_keys and known[lo] is True:
            lo += 1
        waves = 0
        try:
            if lo < n_keys and known[lo] is None:
                lo, waves = self._lookup_waves(layout_fp, keys, known, lo, deadline)
        except TimeoutError:
            self.counters.add("remote_lookup_timeouts")
            lo = self._confirmed(known)
        self.counters.add_many(
            {
                "remote_lookups": 1,
                "remote_lookup_keys": n_keys,
                "remote_lookup_hit_keys": lo,
                "remote_lookup_round_trips": waves,
            }
        )
        return lo, waves

    @staticmethod
    def _confirmed(known: list[bool | None]) -> int:
        n = 0
        while n < len(known) and known[n] is True:
            n += 1
        return n

    def _lookup_waves(
        self,
        fp: bytes,
        keys: Sequence[BlockKey],
        known: list[bool | None],
        lo: int,
        deadline: float,
    ) -> tuple[int, int]:
        cfg, n_keys = self.cfg, len(keys)
        every = cfg.remote_manifest_every_blocks
        checkpoints = [c for c in range(every - 1, n_keys, every) if c >= lo]
        # The first wave fits in one round of requests: manifests, then HEADs.
        width = max(
            1,
            min(cfg.remote_lookup_window_blocks, cfg.remote_lookup_concurrency - len(checkpoints)),
        )
        window = list(range(lo, min(n_keys, lo + width)))
        probes = [i for i in window if known[i] is not True]
        manifests = [fmt.manifest_path(self.prefix, fp, keys[c]) for c in checkpoints]
        heads = [self.path(fp, keys[i]) for i in probes]
        got = self._wave(
            [self._manifest(p, fp, keys[c]) for p, c in zip(manifests, checkpoints)]
            + [self.client.head(p) for p in heads],
            deadline,
        )
        waves = math.ceil(len(got) / cfg.remote_lookup_concurrency)
        vouched = 0
        for c, count in zip(checkpoints, got[: len(checkpoints)]):
            if count == c + 1:
                vouched = c + 1
        self._record(keys, probes, got[len(checkpoints) :], known)
        for i in window:
            if known[i] is not True:
                return i, waves  # a hole inside the first window: that is the answer
        window_end = window[-1] + 1
        for i in range(window_end, vouched):
            known[i] = True
        lo = max(window_end, vouched)
        self._answers.put(keys[window_end:lo], True, time.monotonic())
        while lo < n_keys:
            probes = [
                i
                for i in range(lo, min(n_keys, lo + cfg.remote_lookup_concurrency))
                if known[i] is not True
            ]
            got = self._wave([self.client.head(self.path(fp, keys[i])) for i in probes], deadline)
            waves += 1 if probes else 0
            self._record(keys, probes, got, known)
            end = min(n_keys, lo + cfg.remote_lookup_concurrency)
            while lo < end and known[lo] is True:
                lo += 1
            if lo < end:
                break
        return lo, waves

    def _record(
        self,
        keys: Sequence[BlockKey],
        probes: list[int],
        answers: list[Any],
        known: list[bool | None],
    ) -> None:
        now = time.monotonic()
        for i, answer in zip(probes, answers):
            known[i] = answer if isinstance(answer, bool) else False
            if isinstance(answer, bool):  # a failed request is not remembered
                self._answers.put([keys[i]], answer, now)

    async def _manifest(self, path: str, fp: bytes, key: BlockKey) -> int | None:
        data = await self.client.get(path)
        if not isinstance(data, memoryview):
            return None
        count = fmt.decode_manifest(data, fp, key)
        if count is None:
            self.counters.add("remote_verify_failures")
        return count

    def _wave(self, coros: list[Coroutine[Any, Any, Any]], deadline: float) -> list[Any]:
        """Run the requests, at most ``remote_lookup_concurrency`` at a time;
        TimeoutError at ``deadline``."""
        if not coros:
            return []
        limit = self.cfg.remote_lookup_concurrency

        async def run_all() -> list[Any]:
            sem = asyncio.Semaphore(limit)

            async def one(c: Coroutine[Any, Any, Any]) -> Any:
                async with sem:
                    return await c

            return list(await asyncio.gather(*(one(c) for c in coros)))

        return self.client.call(run_all(), max(0.0, deadline - time.monotonic()))

    def contains(self, layout_fp: bytes, keys: Sequence[BlockKey], timeout_s: float) -> list[bool]:
        """Whether each key is held (one HEAD per key not remembered; a failed
        one, or one still unanswered at the deadline, is False)."""
        now = time.monotonic()
        known = [self._answers.get(k, now) for k in keys]
        probes = [i for i, k in enumerate(known) if k is None]
        try:
            got = self._wave(
                [self.client.head(self.path(layout_fp, keys[i])) for i in probes],
                time.monotonic() + timeout_s,
            )
        except TimeoutError:
            self.counters.add("remote_lookup_timeouts")
            got = []
        self._record(keys, probes, got, known)
        return [k is True for k in known]

    # -- reads ----------------------------------------------------------------------------

    def get(
        self, layout_fp: bytes, key: BlockKey, limit: asyncio.Semaphore | None = None
    ) -> concurrent.futures.Future[Any]:
        """Start a GET of the block; the future's result goes to ``verify``.
        With ``limit`` (one pull's, see ``remote_pull``) the GET waits on the
        loop for a place under it, so a pull can queue GETs ahead of the one
        it waits for and the loop starts each the moment another ends."""
        return self.client.submit(self._get(self.path(layout_fp, key), limit))

    async def _get(self, path: str, limit: asyncio.Semaphore | None) -> memoryview | bool | None:
        if limit is None:
            return await self._get_shared(path)
        async with limit:
            return await self._get_shared(path)

    async def _get_shared(self, path: str) -> memoryview | bool | None:
        if self._read_sem is None:
            self._read_sem = asyncio.Semaphore(self.cfg.remote_read_depth * 4)
        async with self._read_sem:
            return await self.client.get(path)

    def verify(
        self, result: Any, layout_fp: bytes, key: BlockKey, nbytes: int
    ) -> memoryview | None:
        """The verified payload of a GET's result, or None (a miss, counted)."""
        if not isinstance(result, memoryview):
            self.counters.add("remote_read_failures" if result is None else "remote_read_misses")
            if result is False:
                self._answers.forget([key])
            return None
        payload = fmt.decode_block(result, layout_fp, key, nbytes)
        if payload is None:
            self.counters.add_many({"remote_verify_failures": 1, "remote_read_misses": 1})
            self._answers.forget([key])
            self._delete_bad(self.path(layout_fp, key))
            return None
        self.counters.add_many({"remote_reads": 1, "remote_read_bytes": nbytes})
        self._last_use.note([self.path(layout_fp, key)])
        return payload

    def _delete_bad(self, path: str) -> None:
        """Delete an object that failed verification, so that the next upload
        of the block (which skips present objects) repairs it. In the
        background; a good copy another host writes meanwhile may go too,
        which costs a miss, never a wrong byte."""
        try:
            self.client.submit(self._delete_counted(path))
        except ClientClosed:
            pass

    async def _delete_counted(self, path: str) -> None:
        if await self.client.delete([path]):
            self.counters.add("remote_bad_objects_deleted")

    # -- uploads (tierstore.store.remote.upload) ---------------------------------------------

    def offer(
        self, layout_fp: bytes, key: BlockKey, data: memoryview, digest: bytes | None
    ) -> bool:
        """Queue an upload of a copy of ``data`` (a block leaving DRAM).
        Never blocks; False when the queue is full or the tier closed."""
        return self._uploads.offer(layout_fp, key, data, digest)

    def end_turn(self, layout: KVLayout, keys: Sequence[BlockKey], num_tokens: int) -> bool:
        """Write a finished turn's chain through if the placement says so.
        Never blocks; False if not (policy, queue full, closed)."""
        if not keys or not self.placement.on_end_turn(num_tokens):
            return False
        return self._uploads.queue_turn(layout, keys) is not None

    def end_turn_durable(
        self, layout: KVLayout, keys: Sequence[BlockKey], timeout_s: float
    ) -> Durability:
        """Write a finished turn's chain through whatever the placement says
        (the engine asked for it) and wait up to ``timeout_s`` until the
        bucket acknowledged every block; past the deadline the write goes on."""
        if not keys:
            return Durability(0, 0, 0.0)
        return self._uploads.write_durable(layout, keys, timeout_s)

    def flush(self, timeout_s: float) -> bool:
        """Wait until every queued upload and write-through finished; False at the deadline."""
        return self._uploads.flush(timeout_s)

    # -- garbage collection (tierstore.store.remote.gc) --------------------------------------

    def gc_once(self) -> int:
        """List the bucket's objects under the prefix and delete the least
        recently used until under the budget; returns how many went."""
        return self._gc.gc_once()

    def remove(self, layout_fp: bytes, keys: Sequence[BlockKey]) -> int:
        """Delete the keys' objects (missing ones count too); returns how many were asked."""
        paths = [self.path(layout_fp, k) for k in keys]
        self._answers.forget(keys)
        ok = self.client.call(self.client.delete(paths), self.cfg.remote_request_timeout_s)
        return len(paths) if ok else 0

    # -- inspection ------------------------------------------------------------------------------

    def stats(self) -> TierStats:
        c = self.counters.snapshot()
        return TierStats(
            capacity_bytes=self.cfg.remote_bytes,
            used_bytes=c["remote_used_bytes"],
            num_blocks=c["remote_objects"],
            hits=c["remote_reads"],
            misses=c["remote_read_misses"],
            bytes_in=c["remote_upload_bytes"],
            bytes_out=c["remote_read_bytes"],
            evictions=c["remote_gc_deletions"],
            verify_failures=c["remote_verify_failures"],
            write_failures=c["remote_uploads_failed"],
            read_failures=c["remote_read_failures"],
        )

    def bound(self, layout_fp: bytes) -> BoundRemoteTier:
        return BoundRemoteTier(self, layout_fp)

    def close(self) -> None:
        """Wait up to ``remote_flush_on_close_s`` for queued uploads, then stop. Idempotent."""
        if self._uploads.closed:
            return
        self._uploads.flush(self.cfg.remote_flush_on_close_s)
        self._uploads.stop()
        self._gc.stop()
        self._uploads.join(5)
        self._gc.join(5)
        self.client.close()


class BoundRemoteTier:
    """The remote tier for one layout, as the ``Tier`` protocol sees it."""

    name = TierName.REMOTE

    def __init__(self, tier: RemoteTier, layout_fp: bytes) -> None:
        self.tier, self.layout_fp = tier, layout_fp

    def contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        return self.tier.contains(self.layout_fp, keys, self.tier.cfg.remote_lookup_timeout_s)

    def remove(self, keys: Sequence[BlockKey]) -> int:
        return self.tier.remove(self.layout_fp, keys)

    def stats(self) -> TierStats:
        return self.tier.stats()

    def close(self) -> None:
        """The shared tier is closed by its store, not through one layout's view."""
