"""Moving blocks down to the remote tier: DRAM/NVMe -> bucket.

Provides ``RemoteUploader``, the write side of ``tierstore.store.remote.tier``:
- ``offer``: a copy of a block leaving DRAM is uploaded in the background
  (never blocks: when ``remote_upload_queue_bytes`` are queued it is
  skipped and counted);
- ``queue_turn``: a long turn's chain is written through by the
  ``tierstore-remote-writer`` thread (the blocks the bucket lacks, read
  from the store through ``source``), then a manifest at every checkpoint
  the uploaded prefix reaches; it returns the turn's ``TurnJob``, which a
  durable EndTurn waits on (``write_durable``) and which ``TurnLedger``
  (``tierstore.store.remote.turns``) counts until the bucket has the turn;
- ``flush``: wait for both; ``stop`` / ``join``: refuse new work and end
  the writer.

Every upload is a HEAD (content-addressed: present means done), then a
PUT, at most ``remote_upload_concurrency`` at a time, retried with backoff
for up to ``remote_upload_give_up_s`` while the tier is open.

Priorities: a durable EndTurn waits seconds at most, so nothing queued in
the background may stand in front of it. Durable turns have their own lane
of the write-through queue, taken before the background turns' lane (each
lane holds ``remote_write_through_queue_turns``), and a write-through's
uploads pass every write-back copy waiting for a place (``PriorityGate``).
Found by bench/reliability/faults.py: with DRAM churning, tens of thousands
of write-back copies queued, and every durable EndTurn ran out of time.

It gets its collaborators explicitly (the S3 client, the tier's counters,
the answers cache, the last-use record, the tier's ``contains``) and calls
nothing else of the tier. Threads: ``offer``, ``queue_turn`` and ``flush``
on any thread (the demoter, gRPC handlers); the uploads run on the client's
``tierstore-remote-io`` loop thread; write-through on the
``tierstore-remote-writer`` thread, started through ``Workers``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import queue
import threading
import time
from collections.abc import Callable, Sequence

from tierstore.config.remote import RemoteConfig
from tierstore.counters import Counters
from tierstore.keys import BlockKey, KVLayout
from tierstore.store.remote import format as fmt
from tierstore.store.remote.cache import Answers, LastUse
from tierstore.store.remote.client import ClientClosed, RemoteClient
from tierstore.store.remote.gate import PriorityGate
from tierstore.store.remote.turns import TURN_COUNTERS, Durability, TurnJob, TurnLedger
from tierstore.workers import Workers

UPLOAD_COUNTERS = (
    "remote_uploads", "remote_upload_bytes", "remote_uploads_failed", "remote_upload_retries",
    "remote_uploads_skipped_present", "remote_uploads_skipped_full",
    "remote_uploads_queued", "remote_upload_bytes_queued",  # gauges
    "remote_write_through_turns", "remote_write_through_dropped", "remote_write_through_failed",
    "remote_manifests_written",
    *TURN_COUNTERS,
)  # fmt: skip

# Fills ``out`` with a held block's bytes (DRAM or NVMe, verified); returns
# its blake3 digest, or None if the block is no longer held. Set by the store.
BlockSource = Callable[[KVLayout, BlockKey, memoryview], "bytes | None"]

# The tier's ``contains(layout_fp, keys, timeout_s)``: whether the bucket
# holds each key (a failed or unanswered HEAD is False).
Contains = Callable[[bytes, Sequence[BlockKey], float], list[bool]]


class RemoteUploader:
    """The bounded upload queue and the write-through thread of one remote
    tier. See the module docstring."""

    def __init__(
        self,
        cfg: RemoteConfig,
        client: RemoteClient,
        counters: Counters,
        answers: Answers,
        last_use: LastUse,
        contains: Contains,
        workers: Workers,
    ) -> None:
        self.cfg, self.client, self.counters = cfg, client, counters
        self.answers, self.last_use, self.contains = answers, last_use, contains
        self.prefix = client.prefix
        self.source: BlockSource | None = None
        self._cond = threading.Condition()
        self._queued_bytes = 0
        self._pending = 0  # uploads queued or running, plus write-through jobs
        self._closed = False
        self._gate: PriorityGate | None = None  # made and used on the loop thread only
        # Turns to write through, durable ones first (lane 0), each lane bounded
        # by remote_write_through_queue_turns (``_lanes``); the stop signal (lane
        # -1) always fits and comes before both.
        self._jobs: queue.PriorityQueue[tuple[int, int, TurnJob | None]] = queue.PriorityQueue()
        self._lanes = [0, 0]  # jobs waiting: durable, background (under _cond)
        self._seq = itertools.count()
        self.turns = TurnLedger(counters)
        self._writer = workers.start("tierstore-remote-writer", self._write_loop)

    @property
    def closed(self) -> bool:
        return self._closed

    def _path(self, layout_fp: bytes, key: BlockKey) -> str:
        return fmt.object_path(self.prefix, layout_fp, key)

    # -- write-back -------------------------------------------------------------------

    def offer(
        self, layout_fp: bytes, key: BlockKey, data: memoryview, digest: bytes | None
    ) -> bool:
        """Queue an upload of a copy of ``data`` (a block leaving DRAM).
        Never blocks; False when the queue is full or the tier closed."""
        if self.answers.get(key, time.monotonic()) is True:
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
        self._start_upload(self._path(layout_fp, key), key, buf)
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
        self, path: str, key: BlockKey, buf: bytearray | bytes, urgent: bool = False
    ) -> concurrent.futures.Future[bool]:
        try:
            return self.client.submit(self._upload(path, key, buf, urgent))
        except ClientClosed:  # closed meanwhile
            self._upload_done(len(buf))
            fut: concurrent.futures.Future[bool] = concurrent.futures.Future()
            fut.set_result(False)
            return fut

    async def _upload(self, path: str, key: BlockKey, buf: bytearray | bytes, urgent: bool) -> bool:
        """HEAD first (content-addressed: present means done), then PUT;
        failures retry with backoff while the tier is open. ``urgent`` (a
        turn's write-through) goes before every write-back copy waiting."""
        if self._gate is None:
            self._gate = PriorityGate(self.cfg.remote_upload_concurrency)
        gate = self._gate
        backoff, first = self.cfg.remote_upload_backoff_s, time.monotonic()
        try:
            while True:
                async with gate.hold(urgent):
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
                    self.answers.put([key], True, time.monotonic())
                    self.last_use.note([path])
                    return True
                if self._closed or time.monotonic() - first > self.cfg.remote_upload_give_up_s:
                    self.counters.add("remote_uploads_failed")
                    return False
                self.counters.add("remote_upload_retries")
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.cfg.remote_upload_backoff_max_s)
        except asyncio.CancelledError:  # the tier closed with this upload unfinished
            self.counters.add("remote_uploads_failed")
            raise
        finally:
            self._upload_done(len(buf))

    # -- write-through ----------------------------------------------------------------

    def queue_turn(self, layout: KVLayout, keys: Sequence[BlockKey]) -> TurnJob | None:
        """Queue a write-through of a finished turn's chain (the placement
        already said yes). Never blocks; returns the job, or None if the job
        queue is full or the tier closed. Under the lock with ``stop``: a turn
        accepted is either written or counted as dropped, never left pending."""
        job = self._queue(layout, keys, durable=False)
        return None if isinstance(job, str) else job

    def write_durable(
        self, layout: KVLayout, keys: Sequence[BlockKey], timeout_s: float
    ) -> Durability:
        """Queue a write-through of the turn ahead of every turn written
        through in the background, then wait up to ``timeout_s`` until the
        bucket acknowledged every block of it."""
        job = self._queue(layout, keys, durable=True)
        if isinstance(job, str):
            return self.turns.wait(None, len(keys), timeout_s, job)
        return self.turns.wait(job, len(keys), timeout_s, "")

    def _queue(self, layout: KVLayout, keys: Sequence[BlockKey], durable: bool) -> TurnJob | str:
        """The job queued in its lane (durable turns first), or why not."""
        job = TurnJob(layout, list(keys))
        lane = 0 if durable else 1
        with self._cond:
            if self._closed:
                return "the remote tier is closing"
            if self._lanes[lane] >= self.cfg.remote_write_through_queue_turns:
                self.counters.add("remote_write_through_dropped")
                return (
                    f"the {'durable ' if durable else ''}write-through queue is full "
                    f"({self.cfg.remote_write_through_queue_turns} turns)"
                )
            self._lanes[lane] += 1
            self._jobs.put_nowait((lane, next(self._seq), job))
            self.turns.accept(job)
            self._pending += 1  # before the writer's _upload_done: it needs the lock
            self._gauges()
        return job

    def _write_loop(self) -> None:
        while True:
            lane, _, job = self._jobs.get()
            if job is not None:
                with self._cond:
                    self._lanes[lane] -= 1
            if job is None or self._closed:
                # Closing (the stop signal, or the tier closed while this
                # job waited): this and the queued turns stay local.
                self._drop_queued(job)
                return
            durable, reason = 0, "the write-through of the turn failed"
            try:
                durable, reason = self._write_through(job.layout, job.keys)
            except TimeoutError:  # the store did not answer in time: the turn stays local
                self.counters.add("remote_write_through_failed")
                reason = "the store did not read the turn's blocks in time"
            except (ClientClosed, concurrent.futures.CancelledError):
                # The client closed (its uploads cancelled) under the job: shutting down.
                reason = "the remote tier closed while the turn was written"
                self._drop_queued(None)
                return
            finally:
                self.turns.finish(job, durable, reason)
                self._upload_done(0)

    def _drop_queued(self, job: TurnJob | None) -> None:
        jobs = [] if job is None else [job]
        while True:
            try:
                lane, _, more = self._jobs.get_nowait()
            except queue.Empty:
                break
            if more is not None:
                jobs.append(more)
                with self._cond:
                    self._lanes[lane] -= 1
        for j in jobs:
            self.turns.finish(j, 0, "the remote tier closed before the turn was written")
        dropped = len(jobs)
        if dropped:
            self.counters.add("remote_write_through_dropped", dropped)
            with self._cond:
                self._pending -= dropped
                self._gauges()
                self._cond.notify_all()

    def _write_through(self, layout: KVLayout, keys: list[BlockKey]) -> tuple[int, str]:
        """Upload the chain's blocks that the bucket lacks, then a manifest at
        every checkpoint the uploaded prefix reaches. Returns how many leading
        blocks the bucket acknowledged, and why not all ("" when all)."""
        fp, nbytes = layout.fingerprint, layout.block_bytes
        self.counters.add("remote_write_through_turns")
        present = self.contains(fp, keys, self.cfg.remote_request_timeout_s)
        uploads: list[tuple[int, concurrent.futures.Future[bool]]] = []
        prefix, stop = 0, ""
        for i, (key, held) in enumerate(zip(keys, present)):
            if not held:
                if self.source is None or not self._take_room(fmt.HEADER_BYTES + nbytes, True):
                    stop = f"block {i} could not be read for upload (no source, or closing)"
                    break
                buf = bytearray(fmt.HEADER_BYTES + nbytes)
                digest = self.source(layout, key, memoryview(buf)[fmt.HEADER_BYTES :])
                if digest is None:  # no longer held here: the chain stops
                    self._upload_done(len(buf))
                    stop = f"block {i} of the turn is no longer held here"
                    break
                buf[: fmt.HEADER_BYTES] = fmt.header(fmt.KIND_BLOCK, fp, key, digest, nbytes)
                uploads.append((i, self._start_upload(self._path(fp, key), key, buf, urgent=True)))
            prefix += 1
        for i, fut in uploads:
            try:
                ok = fut.result(
                    self.cfg.remote_upload_give_up_s + self.cfg.remote_request_timeout_s
                )
            except concurrent.futures.TimeoutError:
                ok = False
            if not ok:
                return i, f"the upload of block {i} failed"  # a hole: no manifest may vouch for it
        self._write_manifests(fp, keys, prefix)
        return prefix, stop

    def _write_manifests(self, fp: bytes, keys: list[BlockKey], prefix: int) -> None:
        every = self.cfg.remote_manifest_every_blocks
        for c in range(every - 1, prefix, every):
            data = fmt.encode_manifest(fp, keys[c], c + 1)
            path = fmt.manifest_path(self.prefix, fp, keys[c])
            try:
                if self.client.call(self.client.put(path, data), self.cfg.remote_request_timeout_s):
                    self.counters.add("remote_manifests_written")
            except TimeoutError:
                return

    # -- lifecycle --------------------------------------------------------------------

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

    def stop(self) -> None:
        """Refuse new work, wake whoever waits for room, and tell the writer
        to end after its current job (the queued ones stay local). Does not
        wait (``join`` does)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            self._jobs.put_nowait((-1, next(self._seq), None))  # before any queued turn

    def join(self, timeout_s: float) -> None:
        self._writer.join(timeout=timeout_s)
