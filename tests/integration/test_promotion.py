"""NVMe -> DRAM promotion with several reads in flight (tierstore.store.promoter):
the prefix comes back byte-exact and in order, a gap or a failing read stops
it there, and no pin or half-written slot is left behind."""

from __future__ import annotations

import os
import pathlib
import threading

import numpy as np
import pytest

from tierstore.keys import BlockKey, KVLayout, chain_keys
from tierstore.store.tiered import TieredStore
from tierstore.tiers import TierName

OWNER = 7


def blocks_for(keys: list[BlockKey], size: int) -> list[bytes]:
    return [np.random.default_rng(int.from_bytes(k[:8], "little")).bytes(size) for k in keys]


@pytest.fixture(params=[1, 4], ids=["depth1", "depth4"])
def on_nvme(request, store_config, layout):
    """A store whose 60 blocks all sit on NVMe only."""
    store = TieredStore(store_config(nvme_read_depth=request.param))
    keys = chain_keys(layout, np.arange(layout.block_tokens * 60))
    data = blocks_for(keys, layout.block_bytes)
    assert all(store.put(layout, keys, data))
    store.demote(keys)
    assert store.lookup(layout, keys).tiers == (TierName.NVME,) * 60
    yield store, keys, data
    store.close()


def test_promotes_the_whole_prefix_in_order(on_nvme, layout: KVLayout) -> None:
    store, keys, data = on_nvme
    entries = store.acquire(layout, keys, OWNER)
    assert [e.key for e in entries] == keys
    assert [bytes(store.view(e)) for e in entries] == data
    assert store.dram.pin_count(OWNER) == 60
    store.release(keys, OWNER)
    assert store.dram.pin_count(OWNER) == 0
    assert store.lookup(layout, keys).tiers == (TierName.DRAM,) * 60
    assert store.stat()["store"]["promotions"] == 60


def test_a_gap_on_nvme_ends_the_prefix_without_leaking_pins(on_nvme, layout) -> None:
    store, keys, data = on_nvme
    store.drop([keys[25]], tiers=(TierName.NVME,))
    entries = store.acquire(layout, keys, OWNER)
    assert [bytes(store.view(e)) for e in entries] == data[:25]
    # Blocks read past the gap were promoted but are not the caller's.
    assert store.dram.pin_count(OWNER) == 25
    store.release([e.key for e in entries], OWNER)
    assert store.dram.pin_count(OWNER) == 0


def test_a_corrupt_block_is_a_gap_and_is_dropped(on_nvme, layout, store_config) -> None:
    """A byte flipped on disk: the promotion's own verification finds it, the
    prefix ends before it, nothing corrupt reaches DRAM, and it is dropped."""
    store, keys, data = on_nvme
    meta = store.nvme.meta(keys[10])
    assert meta is not None
    path = pathlib.Path(store_config().nvme_dir) / "blocks.dat"
    with open(path, "r+b") as f:
        f.seek(meta.offset + layout.block_bytes // 2)
        byte = f.read(1)
        f.seek(meta.offset + layout.block_bytes // 2)
        f.write(bytes([byte[0] ^ 0x40]))
        f.flush()
        os.fsync(f.fileno())
    before = store.nvme.stats().verify_failures
    entries = store.acquire(layout, keys, OWNER)
    assert len(entries) == 10
    assert [bytes(store.view(e)) for e in entries] == data[:10]
    store.release([e.key for e in entries], OWNER)
    assert store.pin_count(OWNER) == 0
    assert store.nvme.stats().verify_failures == before + 1
    assert store.held([keys[10]]) == [False]  # dropped: a miss from now on
    assert store.lookup(layout, keys).num_hits == 10


def test_a_read_that_raises_leaves_no_pin_or_reservation(on_nvme, layout, monkeypatch) -> None:
    store, keys, _ = on_nvme
    real_read = store.nvme.read_into

    def read_failing(key, out, **kw):
        if key == keys[5]:
            raise RuntimeError("disk controller on fire")
        return real_read(key, out, **kw)

    monkeypatch.setattr(store.nvme, "read_into", read_failing)
    with pytest.raises(RuntimeError, match="on fire"):
        store.acquire(layout, keys, OWNER)
    assert store.dram.pin_count(OWNER) == 0
    monkeypatch.setattr(store.nvme, "read_into", real_read)
    entries = store.acquire(layout, keys, OWNER)  # the failed slot was aborted, not wedged
    assert len(entries) == 60
    store.release(keys, OWNER)


def test_concurrent_requests_for_the_same_blocks_read_each_once(on_nvme, layout) -> None:
    store, keys, data = on_nvme
    results: dict[int, list[bytes]] = {}

    def reader(owner: int) -> None:
        entries = store.acquire(layout, keys, owner)
        results[owner] = [bytes(store.view(e)) for e in entries]
        store.release([e.key for e in entries], owner)

    threads = [threading.Thread(target=reader, args=(100 + i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert all(not t.is_alive() for t in threads)
    assert all(r == data for r in results.values()) and len(results) == 4
    assert store.stat()["store"]["promotions"] == 60
