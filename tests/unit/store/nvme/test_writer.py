"""The write-through writer and the drain of a graceful stop, over a real
DRAM tier and the in-memory NVMe stand-in (tests/unit/store/fakes.py)."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from typing import Any, cast

import numpy as np
import pytest

from tests.conftest import SMALL_LAYOUT
from tests.unit.store.fakes import FakeNvme
from tierstore.keys import BlockKey, chain_keys
from tierstore.memory.arena import Arena
from tierstore.policies.write import WriteThrough, WriteThroughSelective
from tierstore.store.dram import STORE_OWNER, DramTier, ReserveStatus
from tierstore.store.nvme import writer as writer_module
from tierstore.store.nvme.tier import NvmeTier
from tierstore.store.nvme.writer import PINNED_SHARE_DIVISOR, NvmeWriter, drain
from tierstore.workers import Workers

L = SMALL_LAYOUT
WAIT_S = 10.0


class GatedNvme(FakeNvme):
    """Writes wait for ``gate`` (to hold a batch in flight)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.gate.set()
        self.in_write = threading.Event()
        self.stats_.capacity_bytes = 1 << 30

    def write_many(self, items: Sequence[Any], digests: Any = None) -> list[bool]:
        self.in_write.set()
        assert self.gate.wait(WAIT_S)
        return super().write_many(items, digests)


@pytest.fixture
def dram() -> Iterator[DramTier]:
    arena = Arena.create(256 * L.block_bytes, tag="writer-test")
    tier = DramTier(arena, 64 * L.block_bytes)
    yield tier
    tier.close()
    arena.close()


def commit(dram: DramTier, n: int, start: int = 0) -> list[BlockKey]:
    keys = chain_keys(L, np.arange(start, start + n * L.block_tokens))
    for i, key in enumerate(keys):
        status, entry = dram.reserve(key, L.fingerprint, L.block_bytes)
        assert status == ReserveStatus.OK and entry is not None
        dram.view(entry)[:8] = i.to_bytes(8, "little")
    assert all(dram.commit(keys))
    return keys


def wait_until(cond: Any) -> None:
    done = threading.Event()
    for _ in range(int(WAIT_S / 0.01)):
        if cond():
            return
        done.wait(0.01)
    raise AssertionError("condition not reached in time")


def make_writer(dram: DramTier, nvme: FakeNvme, policy: Any, queue_blocks: int) -> NvmeWriter:
    return NvmeWriter(
        dram, cast(NvmeTier, nvme), policy,
        queue_bytes=queue_blocks * L.block_bytes, workers=Workers(),
    )  # fmt: skip


def test_write_through_writes_every_committed_block(dram: DramTier) -> None:
    nvme = GatedNvme()
    writer = make_writer(dram, nvme, WriteThrough(), 64)
    try:
        keys = commit(dram, 40)
        writer.offer_committed(keys)
        wait_until(lambda: writer.counters.write_written == 40)
        assert nvme.contains(keys) == [True] * 40
        c = writer.counters.snapshot()
        assert c["write_queued"] == 40 and c["write_dropped"] == 0
        assert c["write_queue_bytes"] == 0 and c["write_queue_blocks"] == 0
        assert dram.pin_count(STORE_OWNER) == 0  # the writer's pins are gone
        assert dram.stats().hits == 0  # its reads are not hits
    finally:
        writer.close()


def test_queue_is_bounded_and_a_full_queue_never_blocks(dram: DramTier) -> None:
    nvme = GatedNvme()
    nvme.gate.clear()
    writer = make_writer(dram, nvme, WriteThrough(), 16)
    try:
        first = commit(dram, 8)
        writer.offer_committed(first)
        assert nvme.in_write.wait(WAIT_S)  # a batch is in flight, held
        more = commit(dram, 100, start=10_000)
        writer.offer_committed(more)  # returns at once although the writer is stuck
        c = writer.counters.snapshot()
        assert c["write_queue_bytes"] <= 16 * L.block_bytes
        assert c["write_dropped"] == 100 - (16 - 8)
        nvme.gate.set()
        # The dropped blocks are queued again once the queue has emptied.
        wait_until(lambda: all(nvme.contains(first + more)))
        assert writer.counters.write_resyncs >= 1
    finally:
        nvme.gate.set()
        writer.close()


def test_blocks_gone_or_already_written_are_skipped(dram: DramTier) -> None:
    nvme = GatedNvme()
    nvme.gate.clear()
    writer = make_writer(dram, nvme, WriteThrough(), 64)
    try:
        held = commit(dram, 8)
        writer.offer_committed(held)
        assert nvme.in_write.wait(WAIT_S)
        keys = commit(dram, 8, start=5000)
        writer.offer_committed(keys)
        dram.remove(keys[:4])  # evicted meanwhile
        FakeNvme.write_many(nvme, [(keys[4], L.fingerprint, bytes(L.block_bytes))])  # spilled
        nvme.gate.set()
        wait_until(lambda: writer.counters.write_skipped == 5)
        assert writer.counters.write_written == 8 + 3
    finally:
        nvme.gate.set()
        writer.close()


def test_close_discards_the_queue(dram: DramTier) -> None:
    nvme = GatedNvme()
    nvme.gate.clear()
    writer = make_writer(dram, nvme, WriteThrough(), 64)
    writer.offer_committed(commit(dram, 8))
    assert nvme.in_write.wait(WAIT_S)
    writer.offer_committed(commit(dram, 8, start=5000))
    nvme.gate.set()
    assert writer.close() in range(0, 9)
    assert writer.counters.write_queue_blocks == 0
    writer.offer_committed(commit(dram, 4, start=9000))  # after close: ignored
    assert writer.counters.write_queued <= 16


def test_selective_writes_hits_and_long_turns(dram: DramTier) -> None:
    nvme = GatedNvme()
    writer = make_writer(dram, nvme, WriteThroughSelective(min_tokens=1000), 64)
    try:
        keys = commit(dram, 12)
        writer.offer_committed(keys)
        writer.offer_hits(keys[:2])
        writer.offer_turn(keys[2:6], num_tokens=999)  # short: not written
        writer.offer_turn(keys[6:10], num_tokens=1000)
        wait_until(lambda: writer.counters.write_written == 6)
        assert nvme.contains(keys) == [True] * 2 + [False] * 4 + [True] * 4 + [False] * 2
    finally:
        writer.close()


def test_a_batch_pins_a_small_share_of_dram(dram: DramTier) -> None:
    writer = make_writer(dram, GatedNvme(), WriteThrough(), 1 << 20)
    try:
        assert writer.batch_bytes <= dram.allocator.capacity_bytes // PINNED_SHARE_DIVISOR
    finally:
        writer.close()


def test_drain_writes_everything_that_fits(dram: DramTier) -> None:
    nvme = GatedNvme()
    keys = commit(dram, 50)
    report = drain(dram, cast(NvmeTier, nvme), budget_s=30.0, batch_blocks=8)
    assert nvme.contains(keys) == [True] * 50
    assert (report.blocks, report.dropped_blocks) == (50, 0)
    assert report.bytes == 50 * L.block_bytes
    again = drain(dram, cast(NvmeTier, nvme), budget_s=30.0, batch_blocks=8)
    assert again.blocks == 0 and again.dropped_blocks == 0  # nothing DRAM-only is left


def test_drain_keeps_the_most_recent_blocks_and_writes_older_first(
    dram: DramTier, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(writer_module, "BATCH_BYTES", 1)  # batches of exactly batch_blocks
    nvme = GatedNvme()
    nvme.stats_.capacity_bytes = 20 * L.block_bytes  # room for 20 of 50
    keys = commit(dram, 50)  # keys[49] is the most recent
    report = drain(dram, cast(NvmeTier, nvme), budget_s=30.0, batch_blocks=2)
    assert report.blocks == 20 and report.dropped_blocks == 30
    assert set(nvme.blocks) == set(keys[30:])
    # The first batch probes the rate at the most recent end; then the kept
    # set is written from its old end, so prefix heads go before their tails.
    order = [keys.index(k) for k in nvme.blocks]
    assert sorted(order[:2]) == [48, 49]
    assert [min(order[i : i + 2]) for i in range(2, 20, 2)] == list(range(30, 48, 2))


def test_drain_with_no_time_writes_nothing(dram: DramTier) -> None:
    nvme = GatedNvme()
    commit(dram, 10)
    report = drain(dram, cast(NvmeTier, nvme), budget_s=0.0, batch_blocks=8)
    assert report.blocks == 0 and report.dropped_blocks == 10 and not nvme.blocks
