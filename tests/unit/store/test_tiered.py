"""TieredStore over an in-memory NVMe stand-in (tests/unit/store/fakes.py):
what the store decides, apart from what a disk does. Run under every
eviction policy."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any, cast

import numpy as np
import pytest

from tierstore.config.store import StoreConfig
from tierstore.keys import BlockKey, chain_keys
from tierstore.memory.arena import Arena
from tierstore.store.dram import ReserveStatus
from tierstore.store.nvme.tier import NvmeTier
from tierstore.store.tiered import TieredStore
from tierstore.tiers import TIER_CODES, TierName

from ...conftest import SMALL_LAYOUT
from .fakes import FakeNvme, store_over

L = SMALL_LAYOUT
BLOCKS_IN_DRAM = 16


def data_for(keys: list[BlockKey]) -> list[bytes]:
    return [
        np.random.default_rng(int.from_bytes(k[:8], "little")).bytes(L.block_bytes) for k in keys
    ]


@pytest.fixture(params=["lru", "s3fifo"])
def store(request, tmp_path) -> Iterator[tuple[TieredStore, FakeNvme]]:
    nvme = FakeNvme()
    s = store_over(
        nvme, tmp_path, BLOCKS_IN_DRAM * L.block_bytes,
        eviction_policy=request.param, demoter_poll_s=0.05,
    )  # fmt: skip
    yield s, nvme
    s.close()
    assert nvme.closed


def keys_of(n: int, start: int = 0) -> list[BlockKey]:
    return chain_keys(L, np.arange(start, start + n * L.block_tokens))


def test_put_then_lookup_names_dram(store) -> None:
    s, _ = store
    keys = keys_of(4)
    assert s.put(L, keys, data_for(keys)) == [True] * 4
    found = s.lookup(L, keys)
    assert (found.num_hits, found.tiers) == (4, (TierName.DRAM,) * 4)
    assert s.lookup(L, keys).codes == bytes([TIER_CODES[TierName.DRAM]]) * 4  # the wire form
    assert s.get(L, keys) == data_for(keys)
    c = s.counters.snapshot()
    assert c["lookups"] == 2 and c["lookup_keys"] == 8 and c["lookup_hit_keys"] == 8


def test_a_full_dram_spills_to_nvme_and_promotes_back(store) -> None:
    s, nvme = store
    keys = keys_of(BLOCKS_IN_DRAM * 3)
    data = data_for(keys)
    for i in range(0, len(keys), 4):
        assert all(s.put(L, keys[i : i + 4], data[i : i + 4]))
    res = s.lookup(L, keys)
    assert res.num_hits == len(keys)  # the prefix spans both tiers, no gap
    assert TierName.NVME in res.tiers and TierName.DRAM in res.tiers
    for i in range(0, len(keys), 4):  # a read may pin at most what DRAM holds
        assert s.get(L, keys[i : i + 4]) == data[i : i + 4]  # promoted back, byte-exact
    assert s.counters.spilled_blocks == nvme.writes > 0


def test_lookup_stops_at_the_first_block_no_tier_holds(store) -> None:
    s, _ = store
    keys = keys_of(6)
    s.put(L, keys, data_for(keys))
    s.demote(keys[:3])
    s.drop([keys[4]])
    assert s.lookup(L, keys).tiers == (TierName.NVME,) * 3 + (TierName.DRAM,)
    assert s.held(keys) == [True, True, True, True, False, True]


def test_promotion_of_a_corrupt_block_is_a_gap_never_its_bytes(store) -> None:
    s, nvme = store
    keys = keys_of(8)
    data = data_for(keys)
    s.put(L, keys, data)
    s.demote(keys)
    nvme.corrupt.add(keys[5])
    entries = s.acquire(L, keys, owner=3)
    assert [bytes(s.view(e)) for e in entries] == data[:5]
    s.release([e.key for e in entries], owner=3)
    assert s.pin_count(3) == 0
    assert s.held([keys[5]]) == [False]  # dropped by the tier's verification
    assert s.counters.promotion_failures == 1


def test_a_read_that_raises_leaves_nothing_reserved_or_pinned(store) -> None:
    s, nvme = store
    keys = keys_of(6)
    s.put(L, keys, data_for(keys))
    s.demote(keys)
    nvme.raise_on.add(keys[2])
    with pytest.raises(OSError, match="injected"):
        s.acquire(L, keys, owner=4)
    assert s.pin_count(4) == 0
    nvme.raise_on.clear()
    assert len(s.acquire(L, keys, owner=4)) == 6  # the failed slot was aborted, not wedged
    s.release(keys, owner=4)


def test_writes_that_find_dram_full_count_their_wait_and_what_they_evicted(tmp_path) -> None:
    """The demoter off (high watermark 1.0): every eviction is a writer's own,
    and each such write is counted with the time it waited, here at least the
    20 ms a slow NVMe write takes. Writes that fit count nothing (the control)."""
    nvme = FakeNvme()
    nvme.write_delay_s = 0.02
    s = store_over(
        nvme, tmp_path, BLOCKS_IN_DRAM * L.block_bytes,
        dram_high_watermark=1.0, dram_low_watermark=0.95,
    )  # fmt: skip
    try:
        keys = keys_of(BLOCKS_IN_DRAM * 2)
        for i in range(0, BLOCKS_IN_DRAM, 4):
            assert all(s.put(L, keys[i : i + 4], data_for(keys[i : i + 4])))
        c = s.counters.snapshot()
        assert (c["full_waits"], c["full_wait_evicted_blocks"], c["full_wait_us"]) == (0, 0, 0)
        for i in range(BLOCKS_IN_DRAM, len(keys), 4):
            assert all(s.put(L, keys[i : i + 4], data_for(keys[i : i + 4])))
        c = s.counters.snapshot()
        assert c["full_waits"] == BLOCKS_IN_DRAM // 4  # each later batch found DRAM full
        assert c["full_wait_evicted_blocks"] == c["spilled_blocks"] == BLOCKS_IN_DRAM
        assert c["full_wait_us"] >= c["full_waits"] * 20_000
    finally:
        s.close()


def test_reserve_reports_blocks_held_on_nvme_as_existing(store) -> None:
    s, _ = store
    keys = keys_of(3)
    s.put(L, keys[:1], data_for(keys[:1]))
    s.demote(keys[:1])
    res = s.reserve(L, keys, owner=9)
    assert [r.status for r in res] == [ReserveStatus.EXISTS, ReserveStatus.OK, ReserveStatus.OK]
    with pytest.raises(ValueError, match="EXISTS"):
        s.reserved_view(res[0], L.block_bytes)
    assert s.not_reserved_by(keys, 9) == [keys[0]]
    s.abort(keys[1:], owner=9)


def test_failed_spills_are_counted_and_the_victims_leave_dram(store) -> None:
    s, nvme = store
    nvme.fail_writes = True
    keys = keys_of(BLOCKS_IN_DRAM * 2)
    for i in range(0, len(keys), 4):
        s.put(L, keys[i : i + 4], data_for(keys[i : i + 4]))
    c = s.counters.snapshot()
    assert c["spill_failures"] > 0 and c["spilled_blocks"] == 0
    assert c["dropped_blocks"] >= len(keys) - BLOCKS_IN_DRAM
    assert s.lookup(L, keys[-1:]).num_hits == 1  # the newest block is still held


@pytest.mark.parametrize("policy", ["lru", "s3fifo"])
def test_stale_replicas_leave_dram_before_the_hosts_own_blocks(tmp_path, policy: str) -> None:
    cfg = StoreConfig(
        dram_bytes=BLOCKS_IN_DRAM * L.block_bytes,
        dram_segment_bytes=BLOCKS_IN_DRAM * L.block_bytes,
        nvme_dir=str(tmp_path / "unused"),
        eviction_policy=policy,
        replica_live_s=0.0,  # every replica is stale at once
    )
    nvme = FakeNvme()
    s = TieredStore(cfg, arena=Arena.create(cfg.dram_bytes, cfg.shm_dir), nvme=cast(NvmeTier, nvme))
    try:
        _stale_replicas_leave_first(s)
    finally:
        s.close()


def _stale_replicas_leave_first(s: TieredStore) -> None:
    own = keys_of(BLOCKS_IN_DRAM // 2)
    s.put(L, own, data_for(own))
    replica = keys_of(BLOCKS_IN_DRAM // 2, start=10_000)
    assert s.make_replica_room(len(replica) * L.block_bytes, 1 << 30)
    s.put(L, replica, data_for(replica))
    s.finish_replica_import(len(replica) * L.block_bytes, L, replica)
    assert s.replica_bytes() == len(replica) * L.block_bytes
    more = keys_of(4, start=20_000)
    s.put(L, more, data_for(more))  # DRAM is full: someone must go
    in_dram = [t == TierName.DRAM for t in s.lookup(L, own).tiers]
    assert all(in_dram) and len(in_dram) == len(own)


def test_stat_reports_counters_and_tiers(store) -> None:
    s, _ = store
    keys = keys_of(2)
    s.put(L, keys, data_for(keys))
    st: dict[str, Any] = s.stat()
    assert set(st["tiers"]) == {"dram", "nvme"}
    assert st["tiers"]["dram"]["num_blocks"] == 2
    assert set(st["store"]) >= {"lookups", "promotions", "spilled_blocks", "dropped_blocks"}


@pytest.mark.parametrize("hash_queue_blocks", [1 << 16, 0])
def test_a_block_is_hashed_once_and_its_digest_travels_to_nvme(
    tmp_path, hash_queue_blocks: int
) -> None:
    """In the background after the commit (or, with no hasher, when the
    spill needs it): once either way, and the NVMe tier never hashes."""
    cfg = StoreConfig(
        dram_bytes=BLOCKS_IN_DRAM * L.block_bytes,
        dram_segment_bytes=BLOCKS_IN_DRAM * L.block_bytes,
        nvme_dir=str(tmp_path / "unused"),
        hash_queue_blocks=hash_queue_blocks,
    )
    nvme = FakeNvme()
    s = TieredStore(cfg, arena=Arena.create(cfg.dram_bytes, cfg.shm_dir), nvme=cast(NvmeTier, nvme))
    try:
        keys = keys_of(8, start=90_000)
        s.put(L, keys, data_for(keys))
        assert s.wait_hashed(10.0)
        assert s.counters.snapshot()["digests_computed"] == (8 if hash_queue_blocks else 0)
        assert s.demote(keys) == 8
        assert nvme.hashes == 0 and s.counters.snapshot()["digests_computed"] == 8
        assert s.get(L, keys) == data_for(keys)  # promoted back, verified
        assert s.counters.snapshot()["digests_computed"] == 8  # kept from the NVMe read
    finally:
        s.close()


@pytest.mark.parametrize(("live_s", "replicas_stay"), [(300.0, True), (0.0, False)])
def test_live_replicas_stay_in_dram_ahead_of_finished_conversations(
    tmp_path, live_s: float, replicas_stay: bool
) -> None:
    """Own blocks of an old conversation, then a replica pushed just now,
    then new own blocks that need room: a live replica keeps its recency
    place (the old conversation leaves); with live_s = 0 it leaves first."""
    cfg = StoreConfig(
        dram_bytes=BLOCKS_IN_DRAM * L.block_bytes,
        dram_segment_bytes=BLOCKS_IN_DRAM * L.block_bytes,
        nvme_dir=str(tmp_path / "unused"),
        replica_live_s=live_s,
        dram_high_watermark=1.0,
        dram_low_watermark=0.99,
    )
    nvme = FakeNvme()
    s = TieredStore(cfg, arena=Arena.create(cfg.dram_bytes, cfg.shm_dir), nvme=cast(NvmeTier, nvme))
    try:
        finished = keys_of(6, start=200_000)
        replica = keys_of(6, start=300_000)
        new = keys_of(6, start=400_000)
        s.put(L, finished, data_for(finished))
        s.put(L, replica, data_for(replica))
        s.finish_replica_import(0, L, replica)
        s.put(L, new, data_for(new))  # 18 blocks into 16: two must leave DRAM
        in_dram = s.dram.contains(replica)
        assert all(in_dram) is replicas_stay
        assert (s.dram.contains(finished)[:2] == [False, False]) is replicas_stay
        assert all(s.dram.contains(new))
        assert all(s.held(finished + replica + new))  # spilled, not lost
    finally:
        s.close()


def test_a_drop_during_a_spill_leaves_no_copy_behind(store) -> None:
    """A spill has taken a block out of DRAM and is writing it to NVMe when
    the block is dropped: the drop waits for the spill, so the copy it writes
    is dropped too (without that, the block came back on NVMe after its drop;
    the stateful store test caught it once)."""
    s, nvme = store
    keys = keys_of(1, start=90_000)
    assert s.put(L, keys, data_for(keys)) == [True]
    writing, go = threading.Event(), threading.Event()
    real_write = nvme.write_many

    def slow_write(items, digests=None):
        writing.set()
        assert go.wait(10)
        return real_write(items, digests)

    nvme.write_many = slow_write  # type: ignore[method-assign]
    spill = threading.Thread(target=s.demote, args=(keys,))
    spill.start()
    assert writing.wait(10), "the spill never started writing"
    drop = threading.Thread(target=s.drop, args=(keys,))
    drop.start()
    drop.join(0.3)  # a drop that does not wait for the spill is done by now
    go.set()
    spill.join(10)
    drop.join(10)
    assert not spill.is_alive() and not drop.is_alive()
    assert nvme.writes >= 1  # the spill did write the block
    assert s.lookup(L, keys).num_hits == 0
    assert nvme.contains(keys) == [False], "the dropped block came back on NVMe"
