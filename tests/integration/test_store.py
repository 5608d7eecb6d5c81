"""TieredStore over real arenas and NVMe directories, under every eviction
policy the store offers (and its NVMe admission filters where they matter)."""

from __future__ import annotations

import tempfile
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    rule,
    run_state_machine_as_test,
)

from tierstore.config.store import StoreConfig
from tierstore.errors import BlockSizeError, KeyFormatError, LayoutError
from tierstore.keys import BlockKey, KVLayout, chain_keys
from tierstore.policies.admission import ADMISSION_POLICIES
from tierstore.policies.eviction import EVICTION_POLICIES
from tierstore.store.dram import ReserveStatus
from tierstore.store.tiered import TieredStore
from tierstore.tiers import TierName

from ..conftest import SMALL_LAYOUT


def blocks_for(keys: list[BlockKey], size: int) -> list[bytes]:
    return [np.random.default_rng(int.from_bytes(k[:8], "little")).bytes(size) for k in keys]


WAIT_S = 30.0  # deadline of every wait for background work (none should come near it)


@pytest.fixture(params=sorted(EVICTION_POLICIES))
def eviction(request: pytest.FixtureRequest) -> str:
    """The eviction policy of the store's tiers (config ``eviction_policy``)."""
    return str(request.param)


@pytest.fixture(params=sorted(ADMISSION_POLICIES))
def admission(request: pytest.FixtureRequest) -> str:
    """The filter of blocks spilled to NVMe (config ``nvme_admission``)."""
    return str(request.param)


@pytest.fixture
def store(store_config, eviction: str):
    s = TieredStore(store_config(eviction_policy=eviction))
    assert type(s.dram.policy) is EVICTION_POLICIES[eviction]  # the config reached the tier
    yield s
    s.close()


def test_put_get_lookup(store: TieredStore, layout: KVLayout) -> None:
    keys = chain_keys(layout, np.arange(8 * 10))
    data = blocks_for(keys, layout.block_bytes)
    assert store.put(layout, keys, data) == [True] * 10
    assert store.get(layout, keys) == data
    res = store.lookup(layout, keys + chain_keys(layout, np.arange(8) + 999))
    assert res.num_hits == 10 and set(res.tiers) == {TierName.DRAM}


def test_cascade_to_nvme_and_promotion(store: TieredStore, layout: KVLayout) -> None:
    # 1 MiB of DRAM holds 128 blocks of 8 KiB; store 400.
    keys = chain_keys(layout, np.arange(8 * 400))
    data = blocks_for(keys, layout.block_bytes)
    for i in range(0, 400, 50):
        assert all(store.put(layout, keys[i : i + 50], data[i : i + 50]))
    res = store.lookup(layout, keys)
    assert res.num_hits == 400
    assert res.tiers[0] == TierName.NVME and res.tiers[-1] == TierName.DRAM
    assert store.get(layout, keys[:20]) == data[:20]  # promoted back
    assert store.lookup(layout, keys[:20]).tiers == (TierName.DRAM,) * 20
    stat = store.stat()
    assert stat["store"]["promotions"] >= 20 and stat["store"]["spilled_blocks"] >= 272
    assert stat["tiers"]["nvme"]["num_blocks"] >= 272


def test_seen_twice_admission_spills_only_blocks_evicted_twice(
    store_config, layout: KVLayout, eviction: str
) -> None:
    """nvme_admission=seen_twice: a block evicted for the first time is
    dropped (a one-hit block costs no disk write); evicted again after it
    was stored again, it is spilled."""
    with TieredStore(store_config(eviction_policy=eviction, nvme_admission="seen_twice")) as s:
        keys = chain_keys(layout, np.arange(8 * 400))
        data = blocks_for(keys, layout.block_bytes)
        for i in range(0, 400, 50):  # 1 MiB of DRAM holds 128 blocks of 8 KiB
            assert all(s.put(layout, keys[i : i + 50], data[i : i + 50]))
        # The demoter may be between counting a batch as not admitted and
        # freeing its slots: wait (bounded) for the two counts to meet.
        deadline = time.monotonic() + 10
        while True:
            stat = s.stat()
            evicted = stat["tiers"]["dram"]["evictions"]
            if stat["store"]["spill_skipped_admission"] == evicted or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        assert evicted >= 272 and stat["store"]["spill_skipped_admission"] == evicted
        assert stat["store"]["spilled_blocks"] == stat["tiers"]["nvme"]["num_blocks"] == 0
        assert s.lookup(layout, keys).num_hits == 0  # the first blocks are gone
        assert s.get(layout, keys[:1]) == []

        for i in range(0, 400, 50):  # again: keys[:272] are evicted a second time
            assert all(s.put(layout, keys[i : i + 50], data[i : i + 50]))
        res = s.lookup(layout, keys[:272])
        assert res.num_hits == 272 and res.tiers[0] == TierName.NVME
        assert s.stat()["tiers"]["nvme"]["num_blocks"] >= 272 - 128
        assert s.get(layout, keys[:20]) == data[:20]


def test_admission_filter_under_explicit_demotion(
    store_config, layout: KVLayout, eviction: str, admission: str
) -> None:
    keys = chain_keys(layout, np.arange(8 * 10))
    data = blocks_for(keys, layout.block_bytes)
    with TieredStore(store_config(eviction_policy=eviction, nvme_admission=admission)) as s:
        assert all(s.put(layout, keys, data)) and s.demote(keys) == 10
        if admission == "seen_twice":  # offered once: dropped, not written
            assert s.lookup(layout, keys).num_hits == 0
            assert s.stat()["store"]["spill_skipped_admission"] == 10
            assert all(s.put(layout, keys, data)) and s.demote(keys) == 10
        assert s.lookup(layout, keys).tiers == (TierName.NVME,) * 10
        assert s.get(layout, keys) == data
        assert s.stat()["store"]["spilled_blocks"] == 10


def test_prefix_spans_tiers_and_stops_at_gap(store: TieredStore, layout: KVLayout) -> None:
    keys = chain_keys(layout, np.arange(8 * 6))
    data = blocks_for(keys, layout.block_bytes)
    store.put(layout, keys, data)
    assert store.demote(keys[:2]) == 2
    assert store.drop(keys[3:4]) == 1
    res = store.lookup(layout, keys)
    assert res.num_hits == 3 and res.tiers == (TierName.NVME, TierName.NVME, TierName.DRAM)
    assert store.get(layout, keys) == data[:3]


def test_residency_is_answered_by_the_tier(store: TieredStore, layout: KVLayout) -> None:
    keys = chain_keys(layout, np.arange(8 * 3))
    store.put(layout, keys, blocks_for(keys, layout.block_bytes))
    store.demote(keys)
    assert store.lookup(layout, keys).tiers == (TierName.NVME,) * 3
    store.drop(keys, tiers=[TierName.NVME])
    assert store.lookup(layout, keys).num_hits == 0
    assert store.get(layout, keys) == []


def test_restart_serves_what_nvme_holds(store_config, layout: KVLayout, eviction: str) -> None:
    keys = chain_keys(layout, np.arange(8 * 5))
    data = blocks_for(keys, layout.block_bytes)
    with TieredStore(store_config(eviction_policy=eviction)) as s:
        s.put(layout, keys, data)
        s.demote(keys[:3])
    with TieredStore(store_config(eviction_policy=eviction)) as s:
        res = s.lookup(layout, keys)
        assert res.num_hits == 3 and res.tiers == (TierName.NVME,) * 3
        assert s.get(layout, keys) == data[:3]


def test_dedup_and_two_phase(store: TieredStore, layout: KVLayout) -> None:
    keys = chain_keys(layout, np.arange(8 * 2))
    res = store.reserve(layout, keys, owner=3)
    assert [r.status for r in res] == [ReserveStatus.OK] * 2
    assert store.lookup(layout, keys).num_hits == 0
    store.arena.buf[res[0].offset : res[0].offset + layout.block_bytes] = (
        b"\x07" * layout.block_bytes
    )
    assert store.commit(keys[:1], owner=3) == [True]
    assert store.abort(keys[1:], owner=3) == 1
    assert store.lookup(layout, keys).num_hits == 1
    assert store.reserve(layout, keys[:1])[0].status == ReserveStatus.EXISTS


def test_pinned_blocks_survive_pressure(store: TieredStore, layout: KVLayout) -> None:
    keys = chain_keys(layout, np.arange(8 * 300))
    data = blocks_for(keys, layout.block_bytes)
    store.put(layout, keys[:10], data[:10])
    pinned = store.acquire(layout, keys[:10])
    for i in range(10, 300, 40):
        store.put(layout, keys[i : i + 40], data[i : i + 40])
    assert store.lookup(layout, keys[:10]).tiers == (TierName.DRAM,) * 10
    assert [bytes(store.view(e)) for e in pinned] == data[:10]
    assert store.release(keys[:10]) == 10


def test_between_the_watermarks_the_demoter_spills_nothing(store_config, layout: KVLayout) -> None:
    """Usage above the low watermark but never past the high one is left
    alone, however many times the demoter polls: the high mark is what
    wakes it (it once spilled to the low mark at every poll, so DRAM held
    no more than the low mark and loads from it went to NVMe)."""
    cfg = store_config(dram_high_watermark=0.9, dram_low_watermark=0.25, demoter_poll_s=0.02)
    with TieredStore(cfg) as s:
        capacity = s.dram.allocator.capacity_bytes
        n = int(0.8 * capacity) // layout.block_bytes  # 0.8: between the marks
        keys = chain_keys(layout, np.arange(layout.block_tokens * n))
        assert all(s.put(layout, keys, blocks_for(keys, layout.block_bytes)))
        time.sleep(20 * cfg.demoter_poll_s)  # many polls
        assert s.dram.used_bytes() == n * layout.block_bytes > cfg.dram_low_watermark * capacity
        assert list(s.lookup(layout, keys).tiers) == [TierName.DRAM] * n


def test_background_demoter_spills_from_high_to_low_watermark(
    store_config, layout: KVLayout, eviction: str
) -> None:
    """Past the high watermark the demoter spills victims to NVMe until DRAM
    is at the low one, and no further: 100 blocks put at once (800 KiB of
    1 MiB, above 0.5) leave 32 in DRAM (256 KiB, the 0.25 mark) and 68 on NVMe."""
    cfg = store_config(eviction_policy=eviction, dram_high_watermark=0.5, dram_low_watermark=0.25)
    with TieredStore(cfg) as s:
        capacity = s.dram.allocator.capacity_bytes
        low_bytes = cfg.dram_low_watermark * capacity
        keys = chain_keys(layout, np.arange(8 * 100))
        data = blocks_for(keys, layout.block_bytes)
        assert all(s.put(layout, keys, data))  # fits: nothing is evicted synchronously
        deadline = time.monotonic() + WAIT_S
        while s.dram.used_bytes() > low_bytes:
            assert time.monotonic() < deadline, "the demoter did not reach the low watermark"
            time.sleep(0.02)
        # It stops at the low mark: one block less would already be below it.
        assert low_bytes - layout.block_bytes < s.dram.used_bytes() <= low_bytes
        res = s.lookup(layout, keys)
        assert res.num_hits == 100
        spilled = [k for k, t in zip(keys, res.tiers) if t == TierName.NVME]
        assert len(spilled) == 100 - int(low_bytes // layout.block_bytes) == 68
        stat = s.stat()
        assert stat["store"]["spilled_blocks"] == stat["tiers"]["nvme"]["num_blocks"] == 68
        assert stat["tiers"]["dram"]["evictions"] == 68
        assert s.nvme is not None
        # The victims' bytes are on NVMe, verified, and only the victims' are.
        assert s.nvme.contains(spilled) == [True] * 68
        resident = [k for k in keys if k not in set(spilled)]
        assert s.nvme.contains(resident) == [False] * 32
        buf = bytearray(layout.block_bytes)
        by_key = dict(zip(keys, data))
        for key in spilled:
            assert s.nvme.read_into(key, buf) == layout.block_bytes
            assert bytes(buf) == by_key[key]


def test_without_nvme_evictions_drop(store_config, layout, eviction: str) -> None:
    with TieredStore(store_config(nvme_bytes=0, eviction_policy=eviction)) as s:
        keys = chain_keys(layout, np.arange(8 * 300))
        for i in range(0, 300, 50):
            s.put(layout, keys[i : i + 50], blocks_for(keys[i : i + 50], layout.block_bytes))
        res = s.lookup(layout, keys)
        assert res.num_hits == 0  # the oldest blocks are gone, so no prefix
        assert s.lookup(layout, keys[-50:]).num_hits == 50


def test_concurrent_readers_and_writers(store: TieredStore, layout: KVLayout) -> None:
    keys = chain_keys(layout, np.arange(8 * 200))
    data = blocks_for(keys, layout.block_bytes)
    errors: list[str] = []

    def writer(lo: int, hi: int) -> None:
        for i in range(lo, hi, 10):
            if not all(store.put(layout, keys[i : i + 10], data[i : i + 10])):
                errors.append(f"put {i} refused")

    def reader() -> None:
        # Windows of 20 so that pins never fill the 128-slot arena.
        for _ in range(10):
            for lo in range(0, 200, 20):
                for j, got in enumerate(store.get(layout, keys[lo : lo + 20])):
                    if got != data[lo + j]:
                        errors.append(f"block {lo + j} wrong")

    threads = [
        threading.Thread(target=writer, args=(0, 100)),
        threading.Thread(target=writer, args=(100, 200)),
    ]
    threads += [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors
    assert store.lookup(layout, keys).num_hits == 200
    for lo in range(0, 200, 50):  # 200 pinned blocks would not fit the arena at once
        assert store.get(layout, keys[lo : lo + 50]) == data[lo : lo + 50]


def test_bad_input_keeps_what_is_stored(store: TieredStore, layout: KVLayout) -> None:
    keys = chain_keys(layout, np.arange(8 * 2))
    data = blocks_for(keys, layout.block_bytes)
    store.put(layout, keys, data)
    with pytest.raises(BlockSizeError, match="8192"):
        store.put(layout, keys, [b"x" * 100, b"y" * 100])
    with pytest.raises(BlockSizeError, match="expected"):
        store.put(layout, keys, b"x" * 10)
    with pytest.raises(KeyFormatError, match="32 bytes"):
        store.put(layout, [b"short"], data[:1])
    with pytest.raises(LayoutError, match="unknown layout"):
        store.layout(b"\x00" * 32)
    assert store.get(layout, keys) == data


NUM_KEYS = 24
MACHINE_DRAM_BLOCKS = 8  # 64 KiB of DRAM: a third of the keys, so puts evict and spill
DRAM, NVME = TierName.DRAM, TierName.NVME


class StoreMachine(RuleBasedStateMachine):
    """Random put/get/demote/drop/restart sequences against a model of what
    the store must, may and must not hold.

    DRAM holds 8 of the 24 blocks and the demoter runs, so blocks are evicted
    and spilled to NVMe at times the model cannot predict; the NVMe budget
    holds all of them, so NVMe evicts nothing. The model keeps:
    - ``alive``: may be held (put and not dropped or seen gone since);
    - ``sure``: must be held. With the ``always`` admission every alive block
      is (an evicted block is spilled); with ``seen_twice`` an evicted block
      may be dropped, so only blocks seen on NVMe are;
    - ``on_nvme``: seen on NVMe (checked after every step): stay there.
    Whatever is held reads back byte-exact, lookup names the tier that holds
    it, and after a restart exactly what NVMe held is served, from NVMe.
    """

    def __init__(self, eviction: str, admission: str) -> None:
        super().__init__()
        self.tmp = tempfile.TemporaryDirectory()
        self.admission = admission
        block_bytes = SMALL_LAYOUT.block_bytes
        self.cfg = StoreConfig(
            dram_bytes=MACHINE_DRAM_BLOCKS * block_bytes,
            dram_segment_bytes=MACHINE_DRAM_BLOCKS * block_bytes,
            nvme_dir=self.tmp.name,
            nvme_bytes=4 << 20,
            nvme_segment_bytes=64 << 10,
            eviction_policy=eviction,
            nvme_admission=admission,
        )
        self.store = TieredStore(self.cfg)
        self.keys = chain_keys(SMALL_LAYOUT, np.arange(8 * NUM_KEYS))
        self.data = blocks_for(self.keys, block_bytes)
        self.alive: set[int] = set()
        self.sure: set[int] = set()
        self.on_nvme: set[int] = set()

    def _stored(self, i: int) -> None:
        self.alive.add(i)
        if self.admission == "always":
            self.sure.add(i)

    def _gone(self, i: int) -> None:
        assert i not in self.sure, f"block {i} must be held but is not"
        self.alive.discard(i)

    @rule(i=st.integers(0, NUM_KEYS - 1))
    def put(self, i: int) -> None:
        # Nothing is pinned between steps, so a put always finds room.
        assert self.store.put(SMALL_LAYOUT, [self.keys[i]], [self.data[i]]) == [True]
        self._stored(i)

    @rule(lo=st.integers(0, NUM_KEYS - 1), n=st.integers(2, 12))
    def put_batch(self, lo: int, n: int) -> None:
        """Several blocks at once; past what DRAM holds the rest get FULL (this
        put's reservations fill it). put() says whether each block is held
        afterwards: a FULL block is in no tier (it was not stored, and an old
        copy this batch evicted was dropped, not spilled: see
        test_put_reports_a_block_spilled_by_its_own_batch)."""
        idx = list(range(lo, min(lo + n, NUM_KEYS)))
        held = self.store.put(
            SMALL_LAYOUT, [self.keys[i] for i in idx], [self.data[i] for i in idx]
        )
        for i, ok in zip(idx, held):
            if ok:
                self._stored(i)
            else:
                # Nothing moves a block into a tier but a put or a get.
                assert self.store.lookup(SMALL_LAYOUT, [self.keys[i]]).num_hits == 0, i
                self._gone(i)

    @rule(lo=st.integers(0, NUM_KEYS - 1), n=st.integers(1, MACHINE_DRAM_BLOCKS // 2))
    def get(self, lo: int, n: int) -> None:
        """The longest held prefix, byte-exact; at most half of DRAM is pinned
        at once, so promotions always find room."""
        idx = list(range(lo, min(lo + n, NUM_KEYS)))
        got = self.store.get(SMALL_LAYOUT, [self.keys[i] for i in idx])
        for i, block in zip(idx, got):
            assert i in self.alive, f"block {i} was never stored or was dropped"
            assert block == self.data[i], f"wrong bytes for block {i}"
        if len(got) < len(idx):
            self._gone(idx[len(got)])

    @rule(i=st.integers(0, NUM_KEYS - 1))
    def demote(self, i: int) -> None:
        key = self.keys[i]
        left_dram = self.store.demote([key]) == 1
        tiers = self.store.lookup(SMALL_LAYOUT, [key]).tiers
        if left_dram:
            assert i in self.alive
            assert tiers in ((NVME,), ()), tiers  # nothing promotes it meanwhile
        if tiers == (NVME,):
            self.on_nvme.add(i)
            self.sure.add(i)  # NVMe evicts nothing here: it stays until dropped
        elif not tiers:
            self._gone(i)
        if self.admission == "always" and i in self.alive:
            assert tiers == (NVME,), f"block {i} was demoted but not spilled"

    @rule(i=st.integers(0, NUM_KEYS - 1))
    def drop(self, i: int) -> None:
        self.store.drop([self.keys[i]])
        self.alive.discard(i)
        self.sure.discard(i)
        self.on_nvme.discard(i)

    @rule()
    def restart(self) -> None:
        self.store.close()
        self.store = TieredStore(self.cfg)
        assert self.store.dram.used_bytes() == 0
        assert self.store.nvme is not None
        held = {i for i, h in enumerate(self.store.nvme.contains(self.keys)) if h}
        assert self.on_nvme <= held, f"lost from NVMe: {sorted(self.on_nvme - held)}"
        assert held <= self.alive, f"back from the dead: {sorted(held - self.alive)}"
        # Only what NVMe held is served, and from NVMe; the rest was DRAM only.
        self.alive, self.sure, self.on_nvme = set(held), set(held), set(held)
        for i in range(NUM_KEYS):
            expect = (NVME,) if i in held else ()
            assert self.store.lookup(SMALL_LAYOUT, [self.keys[i]]).tiers == expect

    @invariant()
    def lookup_names_the_tier_that_holds_each_block(self) -> None:
        assert self.store.nvme is not None
        for i, key in enumerate(self.keys):
            # The demoter may move a block DRAM -> NVMe meanwhile (only that):
            # ask the tiers before and after the lookup.
            dram_before, nvme_before = (
                self.store.dram.contains([key])[0],
                self.store.nvme.contains([key])[0],
            )
            tiers = self.store.lookup(SMALL_LAYOUT, [key]).tiers
            dram_after, nvme_after = (
                self.store.dram.contains([key])[0],
                self.store.nvme.contains([key])[0],
            )
            if dram_before and dram_after:
                assert tiers == (DRAM,), (i, tiers)
            elif not dram_before and not dram_after:
                assert tiers == ((NVME,) if nvme_before else ()), (i, tiers)
            assert tiers in ((DRAM,), (NVME,), ()), (i, tiers)
            if i not in self.alive:
                assert not (dram_before or nvme_before or tiers), f"block {i} is held"
            if i in self.sure:
                assert tiers, f"block {i} must be held"
            if i in self.on_nvme:
                assert nvme_after, f"block {i} left NVMe"
            elif nvme_after:  # spilled meanwhile: from now on it stays there
                self.on_nvme.add(i)
                self.sure.add(i)

    def teardown(self) -> None:
        self.store.close()
        self.tmp.cleanup()


@pytest.mark.parametrize("admission", sorted(ADMISSION_POLICIES))
@pytest.mark.parametrize("eviction", sorted(EVICTION_POLICIES))
def test_store_machine(eviction: str, admission: str) -> None:
    run_state_machine_as_test(
        lambda: StoreMachine(eviction, admission),
        settings=settings(
            max_examples=25,
            stateful_step_count=50,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )


def test_put_reports_a_block_spilled_by_its_own_batch(store_config, layout: KVLayout) -> None:
    """put() says whether each block is held afterwards. Eight blocks fill
    DRAM; a batch of eight new ones plus the last old one spills all the
    old ones (LRU) while reserving, so the old one is on NVMe: held."""
    keys = chain_keys(layout, np.arange(8 * 16))
    data = blocks_for(keys, layout.block_bytes)
    cfg = store_config(dram_bytes=8 * layout.block_bytes, dram_segment_bytes=64 << 10)
    with TieredStore(cfg) as s:
        assert all(s.put(layout, keys[:8], data[:8]))
        batch = keys[8:16] + keys[7:8]
        held = s.put(layout, batch, data[8:16] + data[7:8])
        assert s.lookup(layout, keys[7:8]).tiers == (TierName.NVME,)
        assert held == [True] * 9


@pytest.mark.parametrize("failing", ["Promoter", "NvmeWriter"])
def test_a_store_whose_start_fails_late_closes_what_it_built(
    store_config, monkeypatch: pytest.MonkeyPatch, failing: str
) -> None:
    """A part built after the tiers fails: the threads already started stop,
    the arena file goes (the autouse fixture checks /dev/shm) and the NVMe
    index is closed (a new store opens the same directory)."""
    import tierstore.store.build as build

    def refuse(*args: object, **kwargs: object) -> None:
        raise RuntimeError(f"{failing} refused")

    cfg = store_config(write_policy="write_through")  # so that the NVMe writer is built
    monkeypatch.setattr(build, failing, refuse)
    with pytest.raises(RuntimeError, match="refused"):
        TieredStore(cfg)
    monkeypatch.undo()
    started = {"tierstore-hasher", "tierstore-demoter", "tierstore-nvme-writer"}
    assert not started & {t.name for t in threading.enumerate()}
    with TieredStore(cfg) as s:
        keys = chain_keys(SMALL_LAYOUT, list(range(8)))
        assert s.put(SMALL_LAYOUT, keys, blocks_for(keys, SMALL_LAYOUT.block_bytes)) == [True]
