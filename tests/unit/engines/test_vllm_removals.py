"""``vllm.removals``: which announced blocks a WatchBlocks stream removes, and
a watcher thread that reconnects and never dies silently (no sidecar)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest

from tierstore.engines.vllm.removals import GapError, RemovalWatcher, StoredBlocks
from tierstore.v1 import common_pb2, peer_pb2

DRAM, NVME = common_pb2.TIER_DRAM, common_pb2.TIER_NVME
EPOCH = 7


def key(i: int) -> bytes:
    return i.to_bytes(32, "big")


def msg(op: int, seq: int = 0, tier: int = DRAM, keys: tuple[int, ...] = ()) -> Any:
    return peer_pb2.BlockEvents(
        epoch=EPOCH, seq=seq, op=op, tier=tier, keys=b"".join(key(k) for k in keys)
    )


def synced(blocks: StoredBlocks, held: tuple[int, ...] = (), seq: int = 0) -> None:
    blocks.apply(msg(peer_pb2.BLOCK_OP_RESET))
    if held:
        blocks.apply(msg(peer_pb2.BLOCK_OP_SNAPSHOT, keys=held))
    blocks.apply(msg(peer_pb2.BLOCK_OP_SYNCED, seq=seq))


def test_a_block_leaves_with_its_last_local_tier_not_with_a_demotion() -> None:
    blocks = StoredBlocks(100)
    synced(blocks)
    blocks.stored([("h1", (key(1),)), ("h2", (key(2),))])
    blocks.apply(msg(peer_pb2.BLOCK_OP_ADD, 1, NVME, (1,)))  # spilled: NVMe first
    blocks.apply(msg(peer_pb2.BLOCK_OP_REMOVE, 2, DRAM, (1, 2, 3)))  # 3: never announced
    assert blocks.take() == ["h2"]
    blocks.apply(msg(peer_pb2.BLOCK_OP_REMOVE, 3, NVME, (1,)))
    assert blocks.take() == ["h1"]
    assert blocks.take() == [] and len(blocks) == 0


def test_any_ranks_part_leaving_removes_the_block_once() -> None:
    blocks = StoredBlocks(100)
    synced(blocks)
    blocks.stored([("h", (key(1), key(2)))])  # tp_rank 0 and 1
    blocks.apply(msg(peer_pb2.BLOCK_OP_REMOVE, 1, DRAM, (2,)))
    blocks.apply(msg(peer_pb2.BLOCK_OP_REMOVE, 2, DRAM, (1,)))
    assert blocks.take() == ["h"]


def test_a_resync_removes_what_the_snapshot_lacks_unless_announced_since() -> None:
    blocks = StoredBlocks(100)
    synced(blocks, seq=5)
    blocks.stored([("old", (key(1),)), ("held", (key(2),))])
    blocks.apply(msg(peer_pb2.BLOCK_OP_RESET))
    blocks.stored([("new", (key(3),))])  # committed after the snapshot was taken
    blocks.apply(msg(peer_pb2.BLOCK_OP_SNAPSHOT, keys=(2,), tier=NVME))
    blocks.apply(msg(peer_pb2.BLOCK_OP_SYNCED, seq=9))
    assert blocks.take() == ["old"]
    assert blocks.cursor() == (EPOCH, 9)
    blocks.apply(msg(peer_pb2.BLOCK_OP_REMOVE, 10, DRAM, (2,)))  # it is on NVMe
    assert blocks.take() == []


def test_a_gap_resets_the_cursor() -> None:
    blocks = StoredBlocks(100)
    synced(blocks, seq=3)
    with pytest.raises(GapError):
        blocks.apply(msg(peer_pb2.BLOCK_OP_ADD, 5, DRAM, (1,)))
    assert blocks.cursor() == (0, 0)


def test_the_map_is_an_lru_and_re_announcing_keeps_a_block() -> None:
    blocks = StoredBlocks(2)
    synced(blocks)
    blocks.stored([("a", (key(1),)), ("b", (key(2),))])
    blocks.stored([("a", (key(1),))])  # used again: "b" is the oldest now
    blocks.stored([("c", (key(3),))])
    blocks.apply(msg(peer_pb2.BLOCK_OP_REMOVE, 1, DRAM, (1, 2, 3)))
    assert sorted(blocks.take()) == ["a", "c"]
    assert blocks.counters.forgotten == 1


class Stream:
    """A WatchBlocks call: yields its messages, then raises ``end``."""

    def __init__(self, msgs: list[Any], end: BaseException | None) -> None:
        self.msgs, self.end, self.cancelled = msgs, end, threading.Event()

    def __iter__(self) -> Iterator[Any]:
        yield from self.msgs
        if self.end is not None:
            raise self.end
        self.cancelled.wait(10)

    def cancel(self) -> None:
        self.cancelled.set()


class RpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode) -> None:
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return "test"


def wait_for(cond: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def test_the_watcher_reconnects_resumes_and_dies_visibly() -> None:
    opened: list[tuple[int, int, float]] = []
    sync = [msg(peer_pb2.BLOCK_OP_RESET), msg(peer_pb2.BLOCK_OP_SYNCED, seq=1)]

    def open_stream(epoch: int, seq: int, timeout_s: float) -> Stream:
        opened.append((epoch, seq, timeout_s))
        n = len(opened)
        if n == 1:
            raise ValueError("no sidecar yet")  # retried after a backoff
        if n == 2:
            return Stream(sync, RpcError(grpc.StatusCode.DEADLINE_EXCEEDED))
        if n == 3:  # resumed from the cursor: no snapshot
            return Stream([msg(peer_pb2.BLOCK_OP_REMOVE, 2, DRAM, (1,))],
                          RpcError(grpc.StatusCode.UNAVAILABLE))  # fmt: skip
        return Stream([], RuntimeError("a bug"))

    blocks = StoredBlocks(10)
    blocks.stored([("h", (key(1),))])
    w = RemovalWatcher(blocks, open_stream, stream_s=3.0)
    try:
        wait_for(lambda: not w.alive())
        assert [o[:2] for o in opened] == [(0, 0), (0, 0), (EPOCH, 1), (EPOCH, 2)]
        assert all(o[2] == 3.0 for o in opened)
        assert blocks.take() == ["h"]
        stats = w.stats()
        assert stats["watcher_died"] == 1 and "RuntimeError: a bug" in stats["error"]
        assert stats["stream_errors"] == 2 and stats["stream_ends"] == 1
    finally:
        w.close()
