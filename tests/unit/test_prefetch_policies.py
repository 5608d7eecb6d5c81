"""Prefetch policies are pure: they only say how long a caller waits.
The Prefetcher's outcomes (started, done, late, cancelled) are checked
against a stand-in store whose worker a test holds and lets go."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from types import SimpleNamespace
from typing import cast

import numpy as np
import pytest

from tierstore.keys import BlockKey, KVLayout, chain_keys
from tierstore.sidecar.prefetch import (
    BestEffort,
    Outcome,
    Prefetcher,
    PrefetchJob,
    Timeout,
    WaitAll,
)
from tierstore.store.tiered import TieredStore


def test_best_effort_never_waits() -> None:
    assert BestEffort().wait_s(100_000) == 0 and BestEffort().deadline_s(100_000) is None


def test_wait_is_bounded() -> None:
    assert WaitAll(30.0).wait_s(10) == 30.0 == WaitAll(30.0).deadline_s(10)


def test_timeout_grows_with_tokens() -> None:
    policy = Timeout(base_s=0.05, per_1k_tokens_s=0.02)
    assert policy.wait_s(0) == 0.05
    assert abs(policy.wait_s(50_000) - 1.05) < 1e-9
    assert Timeout(0.05, 0.02, fixed_s=0.3).deadline_s(50_000) == 0.3


class _GatedStore:
    """Stands in for TieredStore: every key is available; ``acquire`` blocks
    until ``gate`` is set, so a test decides when the worker finishes."""

    has_remote = False  # no remote tier

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.entered = threading.Event()

    def lookup(self, layout: KVLayout, keys: Sequence[BlockKey]) -> SimpleNamespace:
        return SimpleNamespace(num_hits=len(keys))

    def acquire(self, layout: KVLayout, keys: Sequence[BlockKey]) -> list[SimpleNamespace]:
        self.entered.set()
        assert self.gate.wait(WAIT_S), "test never opened the gate"
        return [SimpleNamespace(key=k) for k in keys]

    def release(self, keys: Sequence[BlockKey]) -> int:
        return len(keys)


WAIT_S = 30.0  # deadline of every wait in these tests (none should come near it)
LAYOUT = KVLayout("m", 1, 1, 8, "float16", 4)


def _keys(n: int, start: int = 0) -> list[BlockKey]:
    return chain_keys(LAYOUT, np.arange(start, start + 4 * n))


@pytest.fixture
def gated() -> Iterator[tuple[Prefetcher, _GatedStore]]:
    """One worker, busy with a first job until the test opens the gate."""
    store = _GatedStore()
    prefetcher = Prefetcher(cast(TieredStore, store), num_threads=1, queue_max=2)
    outcome, _ = prefetcher.run(LAYOUT, _keys(1), BestEffort())
    assert outcome == Outcome.STARTED and store.entered.wait(WAIT_S)
    yield prefetcher, store
    store.gate.set()
    prefetcher.close()


def test_a_full_queue_cancels(gated: tuple[Prefetcher, _GatedStore]) -> None:
    prefetcher, _ = gated
    for i in range(2):  # the worker is busy: these fill the queue
        assert prefetcher.run(LAYOUT, _keys(1, 100 + i), BestEffort())[0] == Outcome.STARTED
    outcome, job = prefetcher.run(LAYOUT, _keys(1, 200), WaitAll(WAIT_S))
    assert outcome == Outcome.CANCELLED and job.cancelled and job.ready_blocks == 0
    c = prefetcher.counters
    assert (c.started, c.done, c.late, c.cancelled) == (3, 0, 0, 1)


def test_close_cancels_and_counts_queued_jobs(gated: tuple[Prefetcher, _GatedStore]) -> None:
    prefetcher, store = gated
    _, queued = prefetcher.run(LAYOUT, _keys(1, 100), BestEffort())
    waiting: list[tuple[Outcome, PrefetchJob]] = []
    waiter = threading.Thread(
        target=lambda: waiting.append(prefetcher.run(LAYOUT, _keys(1, 200), WaitAll(WAIT_S)))
    )
    waiter.start()
    deadline = time.monotonic() + WAIT_S
    while prefetcher._queue.qsize() < 2:  # both jobs queued behind the busy worker
        assert time.monotonic() < deadline, "the waiting prefetch was never queued"
        time.sleep(0.01)
    closer = threading.Thread(target=prefetcher.close)
    closer.start()  # cancels the queued jobs, then waits for the worker's running one
    assert queued.done.wait(WAIT_S) and queued.cancelled and queued.ready_blocks == 0
    waiter.join(WAIT_S)
    assert not waiter.is_alive() and waiting[0][0] == Outcome.CANCELLED
    store.gate.set()
    closer.join(WAIT_S)
    assert not closer.is_alive()
    c = prefetcher.counters
    assert (c.started, c.done, c.late, c.cancelled) == (2, 0, 0, 2)
    assert c.blocks_promoted == 1  # the running job finished; the cancelled ones never ran


def test_late_then_cancelled_is_counted_once(gated: tuple[Prefetcher, _GatedStore]) -> None:
    prefetcher, store = gated
    outcome, job = prefetcher.run(LAYOUT, _keys(1, 100), Timeout(0.0, 0.0, fixed_s=1e-9))
    assert outcome == Outcome.LATE and job.late  # queued behind the busy worker: late
    closer = threading.Thread(target=prefetcher.close)
    closer.start()  # the late job, still queued, is cancelled but not counted again
    assert job.done.wait(WAIT_S) and job.cancelled
    store.gate.set()
    closer.join(WAIT_S)
    assert not closer.is_alive()
    c = prefetcher.counters
    assert (c.done, c.late, c.cancelled) == (0, 1, 0)


def test_waited_prefetch_is_done(gated: tuple[Prefetcher, _GatedStore]) -> None:
    prefetcher, store = gated
    store.gate.set()
    outcome, job = prefetcher.run(LAYOUT, _keys(20, 100), WaitAll(WAIT_S))
    assert outcome == Outcome.DONE and job.ready_blocks == job.available_blocks == 20
    assert (prefetcher.counters.done, prefetcher.counters.cancelled) == (1, 0)
