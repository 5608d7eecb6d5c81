"""The vLLM connector's background loads (vLLM's async loads), worker side.

Provides ``BackgroundLoader``: ``submit(spec)`` queues a ``LoadSpec`` whose
request waits in vLLM's WAITING_FOR_REMOTE_KVS; one loader thread pins its
blocks in the sidecar's arena (the sidecar promotes them from NVMe, fetches
them from a peer or the bucket, within ``load_deadline_s``) and copies them
into the request's pages while the engine keeps running other requests. A
load of more than ``load_piece_bytes`` first asks the sidecar to prefetch
the whole prefix, then pins and copies it a piece at a time, so the copy of
each piece runs while the sidecar brings in the next (the sidecar's pull
lets a pin of blocks it is fetching return once they have landed).
``poll()`` returns the requests whose loads ended (vLLM's ``get_finished``),
the blocks that did not load (``get_block_ids_with_load_errors``, one KV
cache group) and the requests with such blocks (``failed_recving``). In a
step that computes nothing (the engine only waits on loads) it first waits
up to ``IDLE_POLL_WAIT_S`` for a load to end: vLLM would otherwise step
again at once, its scheduler and worker processes spinning on each other
and taking the cores the sidecar and this thread need for the load (on 2
cores, measured: the worker process at 0.7 s of CPU in a 0.75 s peer load).
A request that arrives meanwhile waits that long at most.

Bounded: a load not done ``async_load_timeout_s`` after it was submitted is
cancelled and reported with its missing blocks, never left pending. A
cancelled load copies nothing more (its copies and the cancel take the
load's lock), so vLLM may recompute into those pages at once. The loader has
its own ``StoreLink`` (its own attach), so the model's thread and the loader
never share a client.

Runs in vLLM's worker process: ``submit``, ``poll`` and ``close`` on the
model's thread, the loads on the thread "tierstore-vllm-loader".
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tierstore.client import StoreClient
from tierstore.engines.vllm.layout import ConnectorSettings
from tierstore.engines.vllm.link import StoreLink
from tierstore.engines.vllm.plan import GroupIds, LoadSpec
from tierstore.errors import TierstoreError
from tierstore.keys import KVLayout

log = logging.getLogger("tierstore.engines.vllm")

# Copies pinned blocks (client, layout, arena offsets) into vLLM's blocks (ids per
# group), every layer, and returns once the copies are done (the pins are released after).
CopyIn = Callable[[StoreClient, KVLayout, list[int], GroupIds], None]
# While the engine has nothing to compute but waits on loads, ``poll`` waits this long
# at most for one to end, instead of vLLM stepping (and its processes spinning) at once.
IDLE_POLL_WAIT_S = 0.02


@dataclass(slots=True)
class LoaderCounters:
    loads: int = 0  # background loads submitted
    loaded_blocks: int = 0
    failed_blocks: int = 0  # reported to vLLM for recompute
    timeouts: int = 0  # loads cancelled at async_load_timeout_s
    errors: int = 0  # unexpected exceptions in the loader thread (a bug: logged once)


@dataclass(slots=True)
class _Job:
    spec: LoadSpec
    deadline: float  # time.monotonic()
    submitted: float = field(default_factory=time.monotonic)
    ended: float = 0.0  # time.monotonic() when the thread finished it (under lock)
    lock: threading.Lock = field(default_factory=threading.Lock)
    got: int = 0  # blocks copied into their pages (under lock)
    cancelled: bool = False  # under lock: copy nothing more
    done: bool = False  # the thread ended it (under lock)


class BackgroundLoader:
    """See the module docstring."""

    def __init__(
        self,
        settings: ConnectorSettings,
        layouts_for: Callable[[str], tuple[KVLayout, ...]],
        tp_rank: int,
        copy_in: CopyIn,
        link: StoreLink | None = None,
        on_ended: Callable[[LoadSpec, int, float], None] | None = None,
    ) -> None:
        self.settings = settings
        self.layouts_for = layouts_for
        self.tp_rank = tp_rank
        self.copy_in = copy_in
        self.on_ended = on_ended  # (spec, blocks loaded, seconds from submit to end), in poll
        self.counters = LoaderCounters()
        self.link = link if link is not None else StoreLink(settings, "vllm-loader")
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._jobs: dict[str, _Job] = {}  # submitted, not yet polled as ended
        self._ended = threading.Event()  # set by the thread as each job ends
        # Attach now, not in the first background load (before the thread uses the link).
        self.link.client()
        self._thread = threading.Thread(target=self._run, name="tierstore-vllm-loader", daemon=True)
        self._thread.start()

    # -- the model's thread ---------------------------------------------------------------

    def submit(self, spec: LoadSpec) -> None:
        job = _Job(spec, time.monotonic() + self.settings.async_load_timeout_s)
        self._jobs[spec.req_id] = job
        self.counters.loads += 1
        self._queue.put(job)

    @property
    def in_flight(self) -> int:
        return len(self._jobs)

    def poll(self, wait_s: float = 0.0) -> tuple[set[str], set[int], set[str]]:
        """Requests whose loads ended (done, failed or past their deadline),
        the vLLM blocks of theirs that did not load (first group's ids) and
        the requests with such blocks. ``wait_s`` > 0: if loads are in
        flight, first wait that long at most (never past a load's deadline)
        for one to end."""
        if wait_s > 0 and self._jobs:
            soonest = min(job.deadline for job in self._jobs.values())
            self._ended.wait(min(wait_s, max(0.0, soonest - time.monotonic())))
        self._ended.clear()  # a job ending from here on is seen below or sets it again
        finished: set[str] = set()
        failed: set[int] = set()
        failed_reqs: set[str] = set()
        now = time.monotonic()
        for req_id, job in list(self._jobs.items()):
            if not job.done and now < job.deadline:
                continue  # running: never wait here for its copy (it holds the lock)
            with job.lock:
                if not job.done:
                    if now < job.deadline:
                        continue
                    job.cancelled = True  # the thread copies nothing more into these pages
                    self.counters.timeouts += 1
                got = job.got
                ended = job.ended if job.done else now
            del self._jobs[req_id]
            if self.on_ended is not None:
                self.on_ended(job.spec, got, ended - job.submitted)
            finished.add(req_id)
            missing = job.spec.block_ids[0][got:]
            failed.update(missing)
            if missing:
                failed_reqs.add(req_id)
            self.counters.loaded_blocks += got
            self.counters.failed_blocks += len(missing)
        return finished, failed, failed_reqs

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=self.settings.call_timeout_s)
        self.link.close()

    # -- the loader thread ----------------------------------------------------------------

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            try:
                self._load(job)
            except TierstoreError as e:
                self.link.failed(e)
            except Exception:  # a bug: the request is still reported (failed)
                if not self.counters.errors:
                    log.exception("tierstore connector: background load failed")
                self.counters.errors += 1
            finally:
                with job.lock:
                    job.done = True
                    job.ended = time.monotonic()
                self._ended.set()

    def _load(self, job: _Job) -> None:
        spec = job.spec
        client = self.link.client()
        if client is None:
            return
        layout = self.layouts_for(spec.salt)[self.tp_rank]
        keys = list(spec.keys[self.tp_rank])
        piece = client.max_batch_keys
        if self.settings.load_piece_bytes:
            piece = min(piece, max(1, self.settings.load_piece_bytes // layout.block_bytes))
            if len(keys) > piece:
                # The sidecar brings the whole prefix toward DRAM in the background
                # (one peer pull, NVMe promotions) while this thread pins and copies
                # it piece by piece: each copy overlaps the arrival of what follows.
                client.prefetch(layout, keys, "best_effort")
        while job.got < len(keys):
            left_s = job.deadline - time.monotonic()
            if left_s <= 0:
                return
            chunk = keys[job.got : job.got + piece]
            pinned = client.acquire(
                layout,
                chunk,
                include_peers=self.settings.include_peers,
                deadline_s=min(self.settings.load_deadline_s, left_s),
            )
            try:
                with job.lock:
                    if job.cancelled:
                        return
                    end = job.got + len(pinned.offsets)
                    ids = tuple(g[job.got : end] for g in spec.block_ids)
                    self.copy_in(client, layout, pinned.offsets, ids)
                    job.got = end
            finally:
                pinned.release()
            if len(pinned.offsets) < len(chunk):
                return  # a gap: the rest is recomputed
