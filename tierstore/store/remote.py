"""The remote persistent tier: one object per block in an S3-compatible
bucket, shared by every host of the group and by later sessions.

Provides ``RemoteTier``:
- ``lookup_prefix(layout_fp, keys, timeout_s)``: the longest prefix held,
  in a few round trips (see below), never one per block;
- ``get(layout_fp, key, nbytes)`` (a coroutine-backed future) and
  ``verify``: the caller pulls several blocks at once and verifies each
  (``tierstore.store.remote_pull``);
- ``offer``: a block leaving DRAM is copied and uploaded in the background
  (never blocks: when ``remote_upload_queue_bytes`` are queued it is
  skipped and counted); ``end_turn``: a long turn's chain is written
  through by the ``tierstore-remote-writer`` thread, then its manifests;
  ``flush``: wait for both;
- ``gc_once`` and the ``tierstore-remote-gc`` thread: keep the bucket under
  ``remote_bytes``, least recently used first (``tierstore.policies``);
- ``contains`` / ``remove`` / ``stats`` / ``close`` (``bound(layout_fp)``
  gives the ``tierstore.store.base.Tier`` protocol for one layout).

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
thread; the writer and GC threads are started through ``Workers``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from tierstore.config import RemoteConfig
from tierstore.counters import Counters
from tierstore.keys import BlockKey, KVLayout
from tierstore.policies import RemoteObject, RemotePlacement, remote_gc_victims
from tierstore.store import remote_format as fmt
from tierstore.store.remote_client import REQUEST_COUNTERS, ClientClosed, RemoteClient
from tierstore.tiers import TierName, TierStats
from tierstore.workers import Workers

log = logging.getLogger(__name__)

COUNTERS = (
    *REQUEST_COUNTERS,
    "remote_uploads", "remote_upload_bytes", "remote_uploads_failed", "remote_upload_retries",
    "remote_uploads_skipped_present", "remote_uploads_skipped_full",
    "remote_uploads_queued", "remote_upload_bytes_queued",  # gauges
    "remote_write_through_turns", "remote_write_through_dropped", "remote_write_through_failed",
    "remote_manifests_written",
    "remote_reads", "remote_read_bytes", "remote_read_misses", "remote_read_failures",
    "remote_verify_failures", "remote_bad_objects_deleted",
    "remote_lookups", "remote_lookup_keys", "remote_lookup_hit_keys",
    "remote_lookup_round_trips", "remote_lookup_timeouts",
    "remote_pulls", "remote_pulled_blocks", "remote_pull_timeouts",
    "remote_gc_runs", "remote_gc_deletions", "remote_gc_bytes_deleted", "remote_gc_failures",
    "remote_objects", "remote_used_bytes",  # gauges, as of the last GC listing
    "remote_unreachable_at_start",
)  # fmt: skip

# Fills ``out`` with a held block's bytes (DRAM or NVMe, verified); returns
# its blake3 digest, or None if the block is no longer held. Set by the store.
BlockSource = Callable[[KVLayout, BlockKey, memoryview], "bytes | None"]


class _Answers:
    """Bounded, expiring memory of which keys the bucket holds (thread-safe)."""

    def __init__(self, max_keys: int, ttl_s: float) -> None:
        self._max, self._ttl = max_keys, ttl_s
        self._d: OrderedDict[BlockKey, tuple[bool, float]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: BlockKey, now: float) -> bool | None:
        with self._lock:
            got = self._d.get(key)
            if got is None or now - got[1] > self._ttl:
                return None
            return got[0]

    def put(self, keys: Sequence[BlockKey], present: bool, now: float) -> None:
        with self._lock:
            for key in keys:
                self._d[key] = (present, now)
                self._d.move_to_end(key)
            while len(self._d) > self._max:
                self._d.popitem(last=False)

    def forget(self, keys: Sequence[BlockKey]) -> None:
        with self._lock:
            for key in keys:
                self._d.pop(key, None)


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
        self.source: BlockSource | None = None
        self._answers = _Answers(cfg.remote_cache_keys, cfg.remote_cache_ttl_s)
        self._used: OrderedDict[str, float] = OrderedDict()  # path -> this host's last use
        self._cond = threading.Condition()
        self._queued_bytes = 0
        self._pending = 0  # uploads queued or running, plus write-through jobs
        self._closed = False
        self._sems: dict[str, asyncio.Semaphore] = {}
        self._jobs: queue.Queue[tuple[KVLayout, list[BlockKey]] | None] = queue.Queue(64)
        try:
            problem = self.client.probe(probe_timeout_s)
        except BaseException:
            self.client.close()
            raise
        if problem:
            self.counters.set("remote_unreachable_at_start", 1)
            log.warning("%s; the remote tier answers misses until it is", problem)
        self._writer = self.workers.start("tierstore-remote-writer", self._write_loop)
        self._gc_wake = threading.Event()
        self._gc: threading.Thread | None = None
        if cfg.remote_bytes > 0:
            self._gc = self.workers.start("tierstore-remote-gc", self._gc_loop)

    # -- names ------------------------------------------------------------------------

    def path(self, layout_fp: bytes, key: BlockKey) -> str:
        return fmt.object_path(self.prefix, layout_fp, key)

    def _note_used(self, paths: Sequence[str]) -> None:
        now = time.time()
        with self._cond:
            for p in paths:
                self._used[p] = now
                self._used.move_to_end(p)
            while len(self._used) > self.cfg.remote_cache_keys:
                self._used.popitem(last=False)

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

    def get(self, layout_fp: bytes, key: BlockKey) -> concurrent.futures.Future[Any]:
        """Start a GET of the block; the future's result goes to ``verify``."""
        return self.client.submit(self._get(self.path(layout_fp, key)))

    async def _get(self, path: str) -> memoryview | bool | None:
        sem = self._sem("read", self.cfg.remote_read_depth * 4)
        async with sem:
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
        self._note_used([self.path(layout_fp, key)])
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

    # -- uploads ---------------------------------------------------------------------------

    def offer(
        self, layout_fp: bytes, key: BlockKey, data: memoryview, digest: bytes | None
    ) -> bool:
        """Queue an upload of a copy of ``data`` (a block leaving DRAM).
        Never blocks; False when the queue is full or the tier closed."""
        if self._answers.get(key, time.monotonic()) is True:
            self.counters.add("remote_uploads_skipped_present")
            return True
        nbytes = fmt.HEADER_BYTES + data.nbytes
        if not self._take_room(nbytes, block=False):
            self.counters.add("remote_uploads_skipped_full")
            return False
        try:
            buf = fmt.encode_block(layout_fp, key, data, digest)
        except BaseException:
            self._upload_done(nbytes)
            raise
        self._start_upload(self.path(layout_fp, key), key, buf)
        return True

    def _take_room(self, nbytes: int, block: bool) -> bool:
        with self._cond:
            while not self._closed:
                if self._queued_bytes + nbytes <= self.cfg.remote_upload_queue_bytes or (
                    self._queued_bytes == 0
                ):
                    self._queued_bytes += nbytes
                    self._pending += 1
                    self._gauges()
                    return True
                if not block:
                    return False
                self._cond.wait(1.0)
            return False

    def _gauges(self) -> None:  # under _cond
        self.counters.set("remote_uploads_queued", self._pending)
        self.counters.set("remote_upload_bytes_queued", self._queued_bytes)

    def _upload_done(self, nbytes: int) -> None:
        with self._cond:
            self._queued_bytes -= nbytes
            self._pending -= 1
            self._gauges()
            self._cond.notify_all()

    def _start_upload(
        self, path: str, key: BlockKey, buf: bytearray | bytes
    ) -> concurrent.futures.Future[bool]:
        try:
            return self.client.submit(self._upload(path, key, buf))
        except ClientClosed:  # closed meanwhile
            self._upload_done(len(buf))
            fut: concurrent.futures.Future[bool] = concurrent.futures.Future()
            fut.set_result(False)
            return fut

    def _sem(self, name: str, limit: int) -> asyncio.Semaphore:
        sem = self._sems.get(name)  # only the loop thread gets here
        if sem is None:
            sem = self._sems[name] = asyncio.Semaphore(limit)
        return sem

    async def _upload(self, path: str, key: BlockKey, buf: bytearray | bytes) -> bool:
        """HEAD first (content-addressed: present means done), then PUT;
        failures retry with backoff while the tier is open."""
        sem = self._sem("upload", self.cfg.remote_upload_concurrency)
        backoff, first = 0.25, time.monotonic()
        try:
            while True:
                async with sem:
                    present = await self.client.head(path)
                    if present is True:
                        self.counters.add("remote_uploads_skipped_present")
                        done = True
                    elif present is False and await self.client.put(path, buf):
                        self.counters.add_many(
                            {"remote_uploads": 1, "remote_upload_bytes": len(buf)}
                        )
                        done = True
                    else:
                        done = False
                if done:
                    self._answers.put([key], True, time.monotonic())
                    self._note_used([path])
                    return True
                if self._closed or time.monotonic() - first > self.cfg.remote_upload_give_up_s:
                    self.counters.add("remote_uploads_failed")
                    return False
                self.counters.add("remote_upload_retries")
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
        except asyncio.CancelledError:  # the tier closed with this upload unfinished
            self.counters.add("remote_uploads_failed")
            raise
        finally:
            self._upload_done(len(buf))

    def end_turn(self, layout: KVLayout, keys: Sequence[BlockKey], num_tokens: int) -> bool:
        """Write a finished turn's chain through if the placement says so.
        Never blocks; False if not (policy, queue full, closed)."""
        if not keys or not self.placement.on_end_turn(num_tokens) or self._closed:
            return False
        with self._cond:
            self._pending += 1
            self._gauges()
        try:
            self._jobs.put_nowait((layout, list(keys)))
        except queue.Full:
            self.counters.add("remote_write_through_dropped")
            self._upload_done(0)
            return False
        return True

    def _write_loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                self._write_through(*job)
            except TimeoutError:  # the store did not answer in time: the turn stays local
                self.counters.add("remote_write_through_failed")
            except ClientClosed:  # the client closed under the job: shutting down
                return
            finally:
                self._upload_done(0)

    def _write_through(self, layout: KVLayout, keys: list[BlockKey]) -> None:
        """Upload the chain's blocks that the bucket lacks, then a manifest at
        every checkpoint the uploaded prefix reaches."""
        fp, nbytes = layout.fingerprint, layout.block_bytes
        self.counters.add("remote_write_through_turns")
        present = self.contains(fp, keys, self.cfg.remote_request_timeout_s)
        uploads: list[concurrent.futures.Future[bool]] = []
        prefix = 0
        for key, held in zip(keys, present):
            if not held:
                if self.source is None or not self._take_room(fmt.HEADER_BYTES + nbytes, True):
                    break
                buf = bytearray(fmt.HEADER_BYTES + nbytes)
                digest = self.source(layout, key, memoryview(buf)[fmt.HEADER_BYTES :])
                if digest is None:  # no longer held here: the chain stops
                    self._upload_done(len(buf))
                    break
                buf[: fmt.HEADER_BYTES] = fmt.header(fmt.KIND_BLOCK, fp, key, digest, nbytes)
                uploads.append(self._start_upload(self.path(fp, key), key, buf))
            prefix += 1
        for fut in uploads:
            try:
                ok = fut.result(
                    self.cfg.remote_upload_give_up_s + self.cfg.remote_request_timeout_s
                )
            except concurrent.futures.TimeoutError:
                ok = False
            if not ok:
                return  # a hole: no manifest may vouch for it
        every = self.cfg.remote_manifest_every_blocks
        for c in range(every - 1, prefix, every):
            data = fmt.encode_manifest(fp, keys[c], c + 1)
            path = fmt.manifest_path(self.prefix, fp, keys[c])
            try:
                if self.client.call(self.client.put(path, data), self.cfg.remote_request_timeout_s):
                    self.counters.add("remote_manifests_written")
            except TimeoutError:
                return

    def flush(self, timeout_s: float) -> bool:
        """Wait until every queued upload and write-through finished; False at the deadline."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._pending > 0:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.5))
        return True

    # -- garbage collection -----------------------------------------------------------------

    def _gc_loop(self) -> None:
        while not self._gc_wake.wait(self.cfg.remote_gc_interval_s):
            try:
                self.gc_once()
            except ClientClosed:  # the client closed under the pass: shutting down
                return

    def gc_once(self) -> int:
        """List the bucket's objects under the prefix and delete the least
        recently used until under the budget; returns how many went."""
        self.counters.add("remote_gc_runs")
        under = f"{self.prefix}/" if self.prefix else None
        try:
            listed = self.client.call(
                self.client.list_objects(under or "", self.cfg.remote_gc_max_objects),
                self.cfg.remote_request_timeout_s * 6,
            )
        except TimeoutError:
            listed = None
        if listed is None:
            self.counters.add("remote_gc_failures")
            return 0
        with self._cond:
            used = dict(self._used)
        objects = [
            RemoteObject(o.path, o.size, o.last_modified_s, used.get(o.path, 0.0))
            for o in listed
            if "/_probe/" not in f"/{o.path}"
        ]
        self.counters.set("remote_objects", len(objects))
        self.counters.set("remote_used_bytes", sum(o.size for o in objects))
        if self.cfg.remote_bytes <= 0:
            return 0
        victims = remote_gc_victims(
            objects, self.cfg.remote_bytes, self.cfg.remote_gc_low_watermark
        )
        deleted = 0
        for lo in range(0, len(victims), 1000):
            batch = victims[lo : lo + 1000]
            try:
                ok = self.client.call(
                    self.client.delete([v.path for v in batch]), self.cfg.remote_request_timeout_s
                )
            except TimeoutError:
                ok = False
            if not ok:
                self.counters.add("remote_gc_failures")
                break
            self._answers.forget([_key_of(v.path) for v in batch])
            deleted += len(batch)
            self.counters.add_many(
                {
                    "remote_gc_deletions": len(batch),
                    "remote_gc_bytes_deleted": sum(v.size for v in batch),
                }
            )
        self.counters.set("remote_objects", len(objects) - deleted)
        self.counters.set(
            "remote_used_bytes",
            sum(o.size for o in objects) - sum(v.size for v in victims[:deleted]),
        )
        return deleted

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
        if self._closed:
            return
        self.flush(self.cfg.remote_flush_on_close_s)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._gc_wake.set()
        try:
            self._jobs.put_nowait(None)
        except queue.Full:
            pass
        self._writer.join(timeout=5)
        if self._gc is not None:
            self._gc.join(timeout=5)
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


def _key_of(path: str) -> BlockKey:
    name = path.rsplit("/", 1)[-1]
    try:
        return BlockKey(bytes.fromhex(name))
    except ValueError:
        return BlockKey(b"")
