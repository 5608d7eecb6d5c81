"""Prefetch before decode: promote announced blocks toward DRAM in the
background, under a policy that says how long the caller waits.

Provides:
- pure policy objects, one per mode (``BestEffort``, ``WaitAll``,
  ``Timeout``), that answer only "how long may the caller wait";
- ``Prefetcher``: a bounded queue and worker threads that promote a prefix of
  keys (NVMe -> DRAM; first, what this host lacks, from the group's peers and
  then the remote tier: pre-positioning) through ``TieredStore.acquire`` / ``release``, stop at
  the first block that is not available, and are cancelled at a deadline.

Runs in the sidecar. ``submit`` is called from RPC threads; workers are the
``tierstore-prefetch-N`` threads. Outcome counters are exported in stat.
"""

from __future__ import annotations

import enum
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from tierstore.counters import Counters
from tierstore.keys import BlockKey, KVLayout
from tierstore.store.tiered import TieredStore
from tierstore.workers import Workers

PROMOTE_CHUNK_BLOCKS = 8  # keys promoted per acquire call: small enough to cancel promptly


class Outcome(enum.IntEnum):
    STARTED = 0
    DONE = 1
    LATE = 2
    CANCELLED = 3


class PrefetchPolicy(Protocol):
    def wait_s(self, num_tokens: int) -> float:
        """How long the caller waits for completion (0: not at all)."""
        ...

    def deadline_s(self, num_tokens: int) -> float | None:
        """Time after which the remaining work is cancelled (None: never)."""
        ...


@dataclass(frozen=True)
class BestEffort:
    """Start and return at once; the work runs to completion in the background."""

    def wait_s(self, num_tokens: int) -> float:
        return 0.0

    def deadline_s(self, num_tokens: int) -> float | None:
        return None


@dataclass(frozen=True)
class WaitAll:
    """Wait until every available block is in DRAM (bounded by ``max_wait_s``)."""

    max_wait_s: float

    def wait_s(self, num_tokens: int) -> float:
        return self.max_wait_s

    def deadline_s(self, num_tokens: int) -> float | None:
        return self.max_wait_s


@dataclass(frozen=True)
class Timeout:
    """Wait up to ``base_s + per_1k_tokens_s * tokens / 1000`` (or a fixed
    ``fixed_s``), then cancel what is left: the engine prefills the rest."""

    base_s: float
    per_1k_tokens_s: float
    fixed_s: float = 0.0

    def wait_s(self, num_tokens: int) -> float:
        if self.fixed_s > 0:
            return self.fixed_s
        return self.base_s + self.per_1k_tokens_s * num_tokens / 1000.0

    def deadline_s(self, num_tokens: int) -> float | None:
        return self.wait_s(num_tokens)


@dataclass
class PrefetchJob:
    layout: KVLayout
    keys: Sequence[BlockKey]
    deadline: float | None  # time.monotonic() value
    done: threading.Event = field(default_factory=threading.Event)
    ready_blocks: int = 0
    available_blocks: int = 0
    late: bool = False
    cancelled: bool = False
    outcome: Outcome | None = None  # DONE, LATE or CANCELLED once counted (exactly once)


# ``started``: best-effort prefetches answered at once. ``done``, ``late``,
# ``cancelled``: the outcome of each prefetch, counted once per prefetch (a
# best-effort one is counted again only if it is cancelled).
PREFETCH_COUNTERS = (
    "started", "done", "late", "cancelled", "blocks_promoted", "io_errors", "peer_pulls",
)  # fmt: skip
# Fetches a prefix this host lacks from a peer within a timeout; returns the blocks received.
PeerPull = Callable[[KVLayout, Sequence[BlockKey], float], int]


class Prefetcher:
    """Bounded queue of prefetch jobs served by ``num_threads`` workers."""

    def __init__(
        self,
        store: TieredStore,
        num_threads: int,
        queue_max: int,
        workers: Workers | None = None,
        pull_peers: PeerPull | None = None,
        peer_fetch_timeout_s: float = 30.0,
    ) -> None:
        """``pull_peers``: fetch a prefix from the group's peers (``PeerTier.pull``),
        so a prefetch pre-positions blocks other hosts hold too."""
        self.store = store
        self._pull_peers = pull_peers
        self._peer_fetch_timeout_s = peer_fetch_timeout_s
        self.counters = Counters(PREFETCH_COUNTERS)
        self._lock = threading.Lock()  # a job's outcome is settled once
        self._queue: queue.Queue[PrefetchJob | None] = queue.Queue(maxsize=queue_max)
        workers = workers if workers is not None else Workers()
        self._threads = [
            workers.start(f"tierstore-prefetch-{i}", self._work) for i in range(num_threads)
        ]

    def run(
        self, layout: KVLayout, keys: Sequence[BlockKey], policy: PrefetchPolicy
    ) -> tuple[Outcome, PrefetchJob]:
        """Queue a prefetch and wait as the policy says."""
        tokens = len(keys) * layout.block_tokens
        deadline_s = policy.deadline_s(tokens)
        now = time.monotonic()
        job = PrefetchJob(layout, keys, None if deadline_s is None else now + deadline_s)
        job.available_blocks = self.store.lookup(layout, keys).num_hits
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            job.cancelled = True
            return self._settle(job, Outcome.CANCELLED), job
        wait_s = policy.wait_s(tokens)
        if wait_s <= 0:
            self.counters.add("started")
            return Outcome.STARTED, job
        if not job.done.wait(wait_s):
            job.late = True  # the worker stops at its next chunk
        # close() may have cancelled (and counted) the job meanwhile: then that stands.
        return self._settle(job, Outcome.LATE if job.late else Outcome.DONE), job

    def _settle(self, job: PrefetchJob, outcome: Outcome) -> Outcome:
        """Give ``job`` this outcome and count it, unless it has one already;
        returns the outcome that stands."""
        with self._lock:
            if job.outcome is None:
                job.outcome = outcome
                self.counters.add(outcome.name.lower())
            return job.outcome

    def _work(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                self._promote(job)
            except OSError:  # a disk error the NVMe tier re-raised: this job's rest is a miss
                self.counters.add("io_errors")
            finally:
                job.done.set()

    def _promote(self, job: PrefetchJob) -> None:
        self._pre_position(job)
        keys = job.keys[: job.available_blocks]
        for lo in range(0, len(keys), PROMOTE_CHUNK_BLOCKS):
            if job.late or job.cancelled:
                return
            if job.deadline is not None and time.monotonic() > job.deadline:
                job.late = True
                return
            chunk = keys[lo : lo + PROMOTE_CHUNK_BLOCKS]
            entries = self.store.acquire(job.layout, chunk)
            self.store.release([e.key for e in entries])
            job.ready_blocks += len(entries)
            self.counters.add("blocks_promoted", len(entries))
            if len(entries) < len(chunk):
                return  # a gap: the rest of the prefix is not available

    def _pre_position(self, job: PrefetchJob) -> None:
        """Bring the part of the prefix this host lacks from the peers, then
        from the remote tier, under the job's deadline (pre-positioning: a
        router's or engine's prefetch before the request arrives)."""
        if self._pull_peers is not None and job.available_blocks < len(job.keys):
            left = self._left(job, self._peer_fetch_timeout_s)
            if left > 0 and self._pull_peers(job.layout, job.keys[job.available_blocks :], left):
                self.counters.add("peer_pulls")
                job.available_blocks = self.store.lookup(job.layout, job.keys).num_hits
        if self.store.has_remote and job.available_blocks < len(job.keys):
            left = self._left(job, self.store.remote_fetch_timeout_s)
            if left > 0:
                pulled = self.store.pull_remote(job.layout, job.keys, left)
                job.available_blocks = max(job.available_blocks, pulled)

    @staticmethod
    def _left(job: PrefetchJob, default_s: float) -> float:
        if job.deadline is None:
            return default_s
        return min(default_s, job.deadline - time.monotonic())

    def close(self) -> None:
        """Cancel the queued jobs (each counted as cancelled, unless its caller
        already gave up on it as late) and stop the workers once their
        running jobs end. A caller still waiting on a cancelled job gets
        CANCELLED."""
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.cancelled = True
                self._settle(job, Outcome.CANCELLED)
                job.done.set()
        for _ in self._threads:
            self._queue.put(None)
        for t in self._threads:
            t.join(timeout=10)
