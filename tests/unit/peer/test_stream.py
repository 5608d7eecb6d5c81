"""ReplicaStreamer with a stand-in push: bounded bytes queued, chunks in
order, the policy's no, and a finished turn leaving the rest to end_turn."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from tierstore.counters import Counters
from tierstore.keys import BlockKey, KVLayout
from tierstore.peer.stream import STREAM_CHUNK_BLOCKS, STREAM_COUNTERS, ReplicaStreamer
from tierstore.workers import Workers

L = KVLayout("stream-test", 1, 1, 64, "float16", 16)  # 4 KiB blocks
WAIT_S = 10.0


def k(i: int) -> BlockKey:
    return BlockKey(i.to_bytes(32, "little"))


class FakePush:
    def __init__(self) -> None:
        self.calls: list[tuple[str, list[BlockKey], str]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()

    def __call__(self, target: str, layout: KVLayout, keys: list[BlockKey], session: str) -> int:
        self.entered.set()
        assert self.gate.wait(WAIT_S)
        self.calls.append((target, list(keys), session))
        return len(keys)


@pytest.fixture
def rig() -> Iterator[tuple[ReplicaStreamer, FakePush, Counters, Workers]]:
    push, counters, workers = FakePush(), Counters(STREAM_COUNTERS), Workers()
    streamer = ReplicaStreamer(
        push,
        lambda target: 1e12,  # pacing never waits here
        workers=workers,
        counters=counters,
        max_bytes=100 * L.block_bytes,
        link_share=0.5,
        max_sessions=8,
    )
    yield streamer, push, counters, workers
    streamer.close()
    assert not workers.failed()


def test_blocks_go_to_the_target_in_order_and_in_chunks(rig) -> None:
    streamer, push, counters, _ = rig
    keys = [k(i) for i in range(90)]
    streamer.offer("s1", "hostB:1", L, keys[:40], True)
    streamer.offer("s1", "hostB:1", L, keys[40:], True)
    assert streamer.wait_idle(WAIT_S)
    sent = [key for _, chunk, _ in push.calls for key in chunk]
    assert sent == keys
    assert all(len(c) <= STREAM_CHUNK_BLOCKS and t == "hostB:1" for t, c, _ in push.calls)
    assert counters.snapshot()["streamed_blocks"] == 90
    assert streamer.offered_blocks("s1") == 90


def test_bytes_queued_are_bounded_and_the_rest_is_deferred(rig) -> None:
    streamer, push, counters, _ = rig
    push.gate.clear()  # the first chunk stays in flight
    streamer.offer("s1", "hostB:1", L, [k(i) for i in range(64)], True)
    assert push.entered.wait(WAIT_S)
    streamer.offer("s1", "hostB:1", L, [k(i) for i in range(64, 164)], True)
    assert streamer.backlog_bytes() == 100 * L.block_bytes  # 64 in flight + 36 queued
    assert counters.snapshot()["stream_deferred_blocks"] == 64
    push.gate.set()
    assert streamer.wait_idle(WAIT_S)
    assert sum(len(c) for _, c, _ in push.calls) == 100


def test_the_policys_no_is_counted_and_nothing_is_sent(rig) -> None:
    streamer, push, counters, _ = rig
    streamer.offer("s2", "hostB:1", L, [k(i) for i in range(5)], False)
    assert streamer.wait_idle(WAIT_S)
    assert push.calls == [] and counters.snapshot()["stream_skipped_blocks"] == 5
    assert streamer.offered_blocks("s2") == 5  # the context still grew


def test_a_finished_turn_leaves_what_is_queued_to_end_turn(rig) -> None:
    streamer, push, _, _ = rig
    push.gate.clear()
    streamer.offer("s3", "hostB:1", L, [k(i) for i in range(64)], True)
    assert push.entered.wait(WAIT_S)
    streamer.offer("s3", "hostB:1", L, [k(i) for i in range(64, 80)], True)
    streamer.finish("s3")
    assert streamer.backlog_bytes() == 64 * L.block_bytes  # only the chunk in flight
    assert streamer.offered_blocks("s3") == 0  # a new turn counts afresh
    push.gate.set()
    assert streamer.wait_idle(WAIT_S)
    assert [len(c) for _, c, _ in push.calls] == [64]


def test_the_oldest_stream_goes_first_chunk_after_chunk(rig) -> None:
    streamer, push, _, _ = rig
    push.gate.clear()  # s-old's first chunk stays in flight while the others queue
    streamer.offer("s-old", "hostB:1", L, [k(i) for i in range(64)], True)
    assert push.entered.wait(WAIT_S)
    streamer.offer("s-new", "hostB:1", L, [k(i) for i in range(100, 110)], True)
    streamer.offer("s-old", "hostB:1", L, [k(i) for i in range(64, 74)], True)
    push.gate.set()
    assert streamer.wait_idle(WAIT_S)
    # Not round robin: the older session's rest before the newer one.
    assert [s for _, _, s in push.calls] == ["s-old", "s-old", "s-new"]


def _paced_streamer(contended: bool) -> tuple[ReplicaStreamer, FakePush, Workers]:
    push, workers = FakePush(), Workers()
    streamer = ReplicaStreamer(
        push,
        lambda target: 64 * L.block_bytes / 60.0,  # a chunk's share of the link: minutes
        contended=lambda: contended,
        workers=workers,
        counters=Counters(STREAM_COUNTERS),
        max_bytes=1000 * L.block_bytes,
        link_share=0.5,
        max_sessions=8,
    )
    return streamer, push, workers


def test_a_link_to_itself_is_not_paced() -> None:
    streamer, push, workers = _paced_streamer(contended=False)
    try:
        streamer.offer("s", "hostB:1", L, [k(i) for i in range(3 * 64)], True)
        assert streamer.wait_idle(WAIT_S)  # three chunks, no pause between them
        assert len(push.calls) == 3
    finally:
        streamer.close()
    assert not workers.failed()


def test_pushes_sharing_the_link_pace_the_stream() -> None:
    streamer, push, workers = _paced_streamer(contended=True)
    try:
        streamer.offer("s", "hostB:1", L, [k(i) for i in range(3 * 64)], True)
        assert not streamer.wait_idle(0.5)  # the second chunk waits its turn on the link
        assert len(push.calls) == 1
    finally:
        streamer.close()
    assert not workers.failed()
