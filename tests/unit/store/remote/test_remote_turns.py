"""What a crash would lose, and the durable EndTurn, without a bucket: the
ledger counts a turn until the bucket holds all of it, times EndTurn ->
durable (p50 / p99), and a durable wait ends at its deadline, or at once
with the reason when the turn was not queued."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from types import SimpleNamespace
from typing import cast

import pytest

from tests.conftest import SMALL_LAYOUT
from tierstore.config.remote import RemoteConfig
from tierstore.counters import Counters
from tierstore.keys import BlockKey, chain_keys
from tierstore.store.remote.cache import Answers, LastUse
from tierstore.store.remote.client import RemoteClient
from tierstore.store.remote.turns import TURN_COUNTERS, TurnJob, TurnLedger, percentile
from tierstore.store.remote.upload import UPLOAD_COUNTERS, RemoteUploader
from tierstore.workers import Workers

WAIT_S = 10.0
KEYS = chain_keys(SMALL_LAYOUT, list(range(8 * SMALL_LAYOUT.block_tokens)))


@pytest.mark.parametrize(
    ("values", "q", "want"),
    [
        ([5], 0.5, 5),
        ([1, 2, 3, 4], 0.5, 2),
        ([1, 2, 3, 4], 0.99, 4),
        (list(range(1, 101)), 0.99, 99),
    ],
)
def test_percentile_is_nearest_rank(values: list[int], q: float, want: int) -> None:
    assert percentile(values, q) == want


def test_a_turn_is_counted_until_the_bucket_holds_all_of_it() -> None:
    counters = Counters(TURN_COUNTERS)
    ledger = TurnLedger(counters, window_turns=4)
    a, b = TurnJob(SMALL_LAYOUT, KEYS), TurnJob(SMALL_LAYOUT, KEYS[:3])
    ledger.accept(a)
    ledger.accept(b)
    c = counters.snapshot()
    assert (c["remote_turns_not_durable"], c["remote_turn_blocks_not_durable"]) == (2, 11)
    ledger.finish(b, 1)  # a hole after the first block: not durable
    ledger.finish(b, 3)  # a job ends once: the second call changes nothing
    assert b.done.result(0) == (1, "only 1 of 3 blocks reached the bucket")
    ledger.finish(a, len(KEYS))
    assert a.done.result(0) == (len(KEYS), "")
    c = counters.snapshot()
    assert (c["remote_turns_not_durable"], c["remote_turn_blocks_not_durable"]) == (0, 0)
    assert (c["remote_turns_durable"], c["remote_turns_not_written"]) == (1, 1)
    assert 0 < c["remote_turn_durable_p50_us"] == c["remote_turn_durable_p99_us"]
    assert c["remote_turn_durable_us_total"] == c["remote_turn_durable_us_max"]


def test_p50_and_p99_describe_the_recent_turns() -> None:
    counters = Counters(TURN_COUNTERS)
    ledger = TurnLedger(counters, window_turns=100)
    for i in range(1, 201):  # accepted i ms ago; the window keeps the last 100
        job = TurnJob(SMALL_LAYOUT, KEYS[:1], accepted_s=time.monotonic() - i / 1000)
        ledger.accept(job)
        ledger.finish(job, 1)  # measured from accepted_s to now
    c = counters.snapshot()
    assert 150_000 <= c["remote_turn_durable_p50_us"] < 160_000  # turns 101..200: 150 ms
    assert 199_000 <= c["remote_turn_durable_p99_us"] < 210_000
    assert c["remote_turn_durable_us_max"] >= 200_000 and c["remote_turns_durable"] == 200


def uploader(contains: object, **cfg: object) -> tuple[RemoteUploader, Counters, Workers]:
    workers = Workers()
    counters = Counters(UPLOAD_COUNTERS)
    up = RemoteUploader(
        RemoteConfig(remote_manifest_every_blocks=1 << 20, **cfg),  # type: ignore[arg-type]
        cast(RemoteClient, SimpleNamespace(prefix="p")), counters,
        Answers(16, 60.0), LastUse(16), contains, workers,  # type: ignore[arg-type]
    )  # fmt: skip
    return up, counters, workers


def test_a_durable_turn_returns_once_the_bucket_holds_every_block() -> None:
    def contains(fp: bytes, keys: Sequence[BlockKey], timeout_s: float) -> list[bool]:
        return [True] * len(keys)  # all acknowledged already

    up, counters, _ = uploader(contains)
    try:
        got = up.write_durable(SMALL_LAYOUT, KEYS, WAIT_S)
        assert got.durable and got.durable_blocks == len(KEYS) and got.reason == ""
        c = counters.snapshot()
        assert (c["remote_durable_end_turns"], c["remote_durable_end_turns_failed"]) == (1, 0)
        assert c["remote_turns_durable"] == 1 and c["remote_turns_not_durable"] == 0
    finally:
        up.stop()
        up.join(WAIT_S)


def test_a_durable_wait_ends_at_its_deadline_and_the_turn_stays_counted() -> None:
    busy, go_on = threading.Event(), threading.Event()

    def contains(fp: bytes, keys: Sequence[BlockKey], timeout_s: float) -> list[bool]:
        busy.set()
        assert go_on.wait(WAIT_S)  # the bucket does not answer yet
        return [True] * len(keys)

    up, counters, workers = uploader(contains)
    try:
        got = up.write_durable(SMALL_LAYOUT, KEYS, 0.2)
        assert busy.is_set() and not got.durable and got.durable_blocks == 0
        assert "had not acknowledged it in 0.2 s" in got.reason and got.wait_s >= 0.2
        c = counters.snapshot()
        assert c["remote_turns_not_durable"] == 1  # what a crash now would lose
        assert c["remote_turn_blocks_not_durable"] == len(KEYS)
        assert c["remote_durable_end_turns_failed"] == 1
        go_on.set()
        assert up.flush(WAIT_S)  # the write went on past the deadline
        assert counters.snapshot()["remote_turns_not_durable"] == 0
        assert not workers.failed()
    finally:
        go_on.set()
        up.stop()
        up.join(WAIT_S)


def test_a_turn_whose_blocks_cannot_be_read_is_not_durable_and_says_why() -> None:
    def contains(fp: bytes, keys: Sequence[BlockKey], timeout_s: float) -> list[bool]:
        return [True, True] + [False] * (len(keys) - 2)  # blocks 2.. are not in the bucket

    up, counters, _ = uploader(contains)  # no source: the store cannot supply block 2
    try:
        got = up.write_durable(SMALL_LAYOUT, KEYS, WAIT_S)
        assert (got.durable, got.durable_blocks) == (False, 2)
        assert "block 2" in got.reason
        assert counters.snapshot()["remote_turns_not_written"] == 1
    finally:
        up.stop()
        up.join(WAIT_S)


def test_a_durable_turn_goes_before_the_background_turns_and_is_refused_only_by_its_lane() -> None:
    """Background write-throughs filling their lane do not refuse a durable
    turn, which is written before them; a full durable lane, or a closed
    tier, refuses it at once with the reason."""
    busy, go_on = threading.Event(), threading.Event()
    written: list[int] = []

    def contains(fp: bytes, keys: Sequence[BlockKey], timeout_s: float) -> list[bool]:
        busy.set()
        assert go_on.wait(WAIT_S)
        written.append(len(keys))
        return [True] * len(keys)

    up, counters, _ = uploader(contains, remote_write_through_queue_turns=1)
    durable_keys = KEYS[:5]
    try:
        assert up.queue_turn(SMALL_LAYOUT, KEYS) is not None
        assert busy.wait(WAIT_S)  # the writer has it, and waits
        assert up.queue_turn(SMALL_LAYOUT, KEYS) is not None
        assert up.queue_turn(SMALL_LAYOUT, KEYS) is None  # the background lane is full
        first = threading.Thread(target=up.write_durable, args=(SMALL_LAYOUT, durable_keys, WAIT_S))
        first.start()  # fills the durable lane (one turn)
        deadline = time.monotonic() + WAIT_S
        while counters.snapshot()["remote_turns_not_durable"] < 3:  # 2 background, 1 durable
            assert time.monotonic() < deadline
            time.sleep(0.01)
        got = up.write_durable(SMALL_LAYOUT, durable_keys, WAIT_S)
        assert not got.durable and got.wait_s == 0.0
        assert "durable write-through queue is full (1 turns)" in got.reason
        go_on.set()
        first.join(WAIT_S)
        assert up.flush(WAIT_S)
        # The turn in the writer's hands first, then the durable one before the queued one.
        assert written == [len(KEYS), len(durable_keys), len(KEYS)]
        up.stop()
        got = up.write_durable(SMALL_LAYOUT, KEYS, WAIT_S)
        assert not got.durable and "closing" in got.reason
        assert counters.snapshot()["remote_durable_end_turns_failed"] == 2
        assert counters.snapshot()["remote_durable_end_turns"] == 3
    finally:
        go_on.set()
        up.stop()
        up.join(WAIT_S)
