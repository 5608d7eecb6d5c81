"""Promoter on its own: a fake source, a real DRAM tier over a small arena,
and the collaborators it is given (no TieredStore)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from tests.conftest import SMALL_LAYOUT
from tests.unit.store.fakes import FakeNvme
from tierstore.counters import Counters
from tierstore.keys import BlockKey, chain_keys
from tierstore.memory.arena import Arena
from tierstore.store.dram import DramEntry, DramTier
from tierstore.store.promoter import PROMOTER_COUNTERS, Promoter

L = SMALL_LAYOUT
SLOTS = 32


class Rig:
    def __init__(self, read_depth: int) -> None:
        self.arena = Arena.create(SLOTS * L.block_bytes, "/dev/shm")
        self.dram = DramTier(self.arena, SLOTS * L.block_bytes)
        self.source = FakeNvme()
        self.counters = Counters(PROMOTER_COUNTERS)
        self.room_asked: list[int] = []
        self.promoted = 0
        self.promoter = Promoter(
            self.source,
            self.dram,
            self.arena,
            make_room=self.make_room,
            on_promoted=self.on_promoted,
            counters=self.counters,
            read_depth=read_depth,
            wait_s=5.0,
        )

    def make_room(self, nbytes: int) -> bool:
        self.room_asked.append(nbytes)
        victim = self.dram.take_victim()
        if victim is None:
            return False
        self.dram.drop(victim)
        return True

    def on_promoted(self) -> None:
        self.promoted += 1

    def on_source(self, n: int) -> tuple[list[BlockKey], list[bytes]]:
        keys = chain_keys(L, np.arange(n * L.block_tokens))
        rng = np.random.default_rng(1)
        data = [rng.bytes(L.block_bytes) for _ in keys]
        self.source.write_many([(k, L.fingerprint, d) for k, d in zip(keys, data)])
        return keys, data

    def close(self) -> None:
        self.promoter.close()
        self.dram.close()
        self.arena.close()


@pytest.fixture(params=[1, 4], ids=["depth1", "depth4"])
def rig(request) -> Iterator[Rig]:
    r = Rig(request.param)
    yield r
    r.close()


def test_fills_every_missing_entry_in_order_and_pins_it(rig: Rig) -> None:
    keys, data = rig.on_source(10)
    pinned: list[DramEntry | None] = [None] * 10
    rig.promoter.promote_missing(L, keys, pinned, owner=5)
    assert all(e is not None for e in pinned)
    assert [bytes(rig.dram.view(e)) for e in pinned if e is not None] == data
    assert rig.dram.pin_count(5) == 10
    assert rig.counters.promotions == 10 and rig.promoted == 10
    # The digest the source verified travels with the DRAM entry (no second hash).
    assert all(e is not None and e.digest == rig.source.meta(e.key).digest for e in pinned)


def test_stops_at_a_block_the_source_lacks(rig: Rig) -> None:
    keys, _ = rig.on_source(10)
    rig.source.remove([keys[4]])
    pinned: list[DramEntry | None] = [None] * 10
    rig.promoter.promote_missing(L, keys, pinned, owner=5)
    assert all(e is not None for e in pinned[:4]) and pinned[4] is None


def test_a_block_of_another_layout_is_a_miss(rig: Rig) -> None:
    keys, _ = rig.on_source(2)
    other = type(L)("other-model", 2, 2, 64, "float16", 8)
    assert rig.promoter.promote(other, keys[0], owner=5) is None
    assert rig.dram.contains(keys[:1]) == [False]


def test_a_full_dram_asks_for_room(rig: Rig) -> None:
    keys, data = rig.on_source(SLOTS + 4)
    for k in keys[:SLOTS]:  # fill DRAM with committed, unpinned blocks
        entry = rig.promoter.promote(L, k, owner=6)
        assert entry is not None
        rig.dram.unpin([k], 6)
    entry = rig.promoter.promote(L, keys[SLOTS], owner=6)
    assert entry is not None and bytes(rig.dram.view(entry)) == data[SLOTS]
    assert rig.room_asked == [L.block_bytes]


def test_concurrent_promotions_of_one_key_read_it_once(rig: Rig) -> None:
    keys, data = rig.on_source(1)
    gate = threading.Event()
    real = rig.source.read_into

    def slow_read(key, out, **kw):
        gate.wait(5)
        return real(key, out, **kw)

    rig.source.read_into = slow_read  # type: ignore[method-assign]
    got: list[DramEntry | None] = []
    threads = [
        threading.Thread(target=lambda o=o: got.append(rig.promoter.promote(L, keys[0], o)))
        for o in (11, 12, 13)
    ]
    for t in threads:
        t.start()
    gate.set()
    for t in threads:
        t.join(10)
    assert len(got) == 3 and all(e is not None and bytes(rig.dram.view(e)) == data[0] for e in got)
    assert rig.source.reads == 1
    assert sum(rig.dram.pin_count(o) for o in (11, 12, 13)) == 3


def test_a_waiter_whose_block_was_evicted_before_its_pin_promotes_it_itself(rig: Rig) -> None:
    """Seen under overload (tests/reliability/test_overload.py): a load waits
    on a prefetch's promotion of its block, the prefetch ends and lets go of
    it, another promotion's make_room evicts it, and the load's pin finds
    nothing. The waiter then reads the block itself instead of missing."""
    keys, data = rig.on_source(1)
    gate = threading.Event()
    real_read, real_pin = rig.source.read_into, rig.dram.pin

    def slow_read(key, out, **kw):
        gate.wait(5)
        return real_read(key, out, **kw)

    evicted: list[int] = []

    def pin(ks, owner):
        if owner == 12 and not evicted:  # between the first promotion's end and this pin
            rig.dram.release_owner(11)
            evicted.append(rig.dram.remove(ks))
        return real_pin(ks, owner)

    rig.source.read_into = slow_read  # type: ignore[method-assign]
    rig.dram.pin = pin  # type: ignore[method-assign]
    got: dict[int, DramEntry | None] = {}
    first = threading.Thread(target=lambda: got.update({11: rig.promoter.promote(L, keys[0], 11)}))
    first.start()
    deadline = time.monotonic() + 5
    while not rig.promoter._running and time.monotonic() < deadline:  # the read has begun
        time.sleep(0.001)
    waiter = threading.Thread(target=lambda: got.update({12: rig.promoter.promote(L, keys[0], 12)}))
    waiter.start()
    time.sleep(0.05)  # the waiter is waiting on the first promotion
    gate.set()
    first.join(10)
    waiter.join(10)
    assert evicted == [1]
    entry = got[12]
    assert entry is not None and bytes(rig.dram.view(entry)) == data[0]
    assert rig.source.reads == 2 and rig.dram.pin_count(12) == 1


def test_a_closed_promoter_refuses_parallel_work(rig: Rig) -> None:
    keys, _ = rig.on_source(4)
    rig.promoter.close()
    if rig.promoter._read_depth > 1:
        with pytest.raises(RuntimeError, match="closed"):
            rig.promoter.promote_missing(L, keys, [None] * 4, owner=1)
