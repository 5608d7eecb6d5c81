"""The arena serves before it is populated: units are prepared on first use
(``ensure_ready``) or by the background populator, which a first use never
waits for and which moves on past what a first use prepared; the store's
first slots are ready before it serves; a tmpfs that cannot hold a unit
refuses its slots instead of raising SIGBUS later; page sizes are named."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import tierstore.memory.arena as arena_module
from tierstore.config.store import StoreConfig
from tierstore.keys import KVLayout, chain_keys
from tierstore.memory.arena import UNIT_BYTES, Arena
from tierstore.store.dram import DramTier, ReserveStatus
from tierstore.store.tiered import TieredStore

LAYOUT = KVLayout("populate", 2, 2, 64, "float16", 8)  # 8 KiB blocks

needs_mount = pytest.mark.skipif(
    os.geteuid() != 0 or not (shutil.which("mount") and shutil.which("umount")),
    reason="mounts a tmpfs: needs root and mount(8)/umount(8)",
)


@pytest.fixture
def tmpfs(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Path]:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", request.param, "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_units_are_prepared_on_first_use_and_by_populate(tmp_path: Path) -> None:
    arena = Arena.create(8 * UNIT_BYTES, tmp_path, tag="t", upfront=False)
    try:
        assert arena.populated_bytes == 0
        assert os.stat(arena.path).st_blocks == 0  # sized, not filled
        assert arena.ensure_ready(UNIT_BYTES + 100, 10)
        assert arena.populated_bytes == UNIT_BYTES
        assert arena.ensure_ready(0, 3 * UNIT_BYTES)  # spans units 0-2; 1 was ready
        assert arena.populated_bytes == 3 * UNIT_BYTES
        arena.view(0, 4)[:] = b"abcd"
        assert arena.populate()
        assert arena.populated_bytes == arena.size_bytes
        assert os.stat(arena.path).st_blocks * 512 >= arena.size_bytes
        other = Arena.attach(arena.path, arena.size_bytes)
        try:
            assert other.populated_bytes == 0  # a client maps without populating
            assert other.ensure_ready(0, 4) and bytes(other.view(0, 4)) == b"abcd"
        finally:
            other.close()
    finally:
        arena.close()


def test_store_serves_lookups_and_puts_before_population_finishes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = threading.Event()
    real_populate = Arena.populate

    def held_populate(self: Arena, stop: object = None) -> bool:
        gate.wait(30)  # the background populator waits until the test is done
        return real_populate(self, stop)  # type: ignore[arg-type]

    monkeypatch.setattr(Arena, "populate", held_populate)
    cfg = StoreConfig(
        dram_bytes=256 << 20,
        shm_dir=str(tmp_path),
        nvme_bytes=0,
        dram_segment_bytes=1 << 20,
        dram_ready_bytes=4 << 20,
    )
    with TieredStore(cfg) as store:
        # The first slots are ready before the store serves, the rest is not.
        assert store.arena.populated_bytes == 4 << 20
        keys = chain_keys(LAYOUT, np.arange(8 * 64))
        data = np.random.default_rng(1).integers(0, 255, (64, LAYOUT.block_bytes), np.uint8)
        assert store.lookup(LAYOUT, keys).num_hits == 0
        assert all(store.put(LAYOUT, keys, data))
        assert store.lookup(LAYOUT, keys).num_hits == 64
        assert [bytes(b) for b in store.get(LAYOUT, keys)] == [r.tobytes() for r in data]
        c = store.stat()["store"]
        # 512 KiB of blocks went into the ready head: nothing had to be prepared.
        assert c["arena_populated_bytes"] == 4 << 20, c
        gate.set()
        deadline = threading.Event()
        for _ in range(300):  # bounded: 30 s
            if store.arena.populated_bytes == store.arena.size_bytes:
                break
            deadline.wait(0.1)
        assert store.arena.populated_bytes == store.arena.size_bytes


def test_a_first_use_does_not_wait_for_the_populator(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A populator stalled inside a unit (a niced thread on a busy host) does
    not hold up a first use of that unit, and close waits for it."""
    arena = Arena.create(8 * UNIT_BYTES, tmp_path, tag="t", upfront=False)
    stalled, release = threading.Event(), threading.Event()
    real_fallocate = os.posix_fallocate

    def fallocate(fd: int, offset: int, length: int) -> None:
        if threading.current_thread().name == "populator":
            stalled.set()
            release.wait(30)
        real_fallocate(fd, offset, length)

    monkeypatch.setattr(arena_module.os, "posix_fallocate", fallocate)
    populator = threading.Thread(target=arena.populate, name="populator")
    populator.start()
    closer = threading.Thread(target=arena.close)
    try:
        assert stalled.wait(10)  # the populator is inside unit 0
        first_use = threading.Thread(target=lambda: arena.ensure_ready(0, 3 * UNIT_BYTES))
        first_use.start()
        first_use.join(10)
        assert not first_use.is_alive(), "the first use waited for the populator"
        assert arena.ensure_ready(0, 3 * UNIT_BYTES)  # ready now: a bytearray scan
        assert arena.populated_bytes >= 3 * UNIT_BYTES
        arena.view(0, 4)[:] = b"abcd"
        closer.start()
        closer.join(0.2)
        assert closer.is_alive(), "close did not wait for the populator's unit"
    finally:
        release.set()
        populator.join(10)
        if closer.ident is not None:
            closer.join(10)
        else:
            arena.close()
    assert not populator.is_alive() and not closer.is_alive()
    assert not arena.path.exists()


def test_the_populator_moves_on_past_a_first_use(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a first use prepared units 2-3, the populator takes 4 onwards,
    then the units it skipped: it does not walk the same units behind it."""
    arena = Arena.create(8 * UNIT_BYTES, tmp_path, tag="t", upfront=False)
    try:
        assert arena.ensure_ready(2 * UNIT_BYTES, 2 * UNIT_BYTES)
        order: list[int] = []
        real_prepare = arena._prepare

        def prepare(first: int, end: int) -> bool:
            order.extend(range(first, end))
            return real_prepare(first, end)

        monkeypatch.setattr(arena, "_prepare", prepare)
        assert arena.populate()
        assert order == [4, 5, 6, 7, 0, 1]
        assert arena.populated_bytes == arena.size_bytes
    finally:
        arena.close()


def test_a_batch_into_fresh_units_is_prepared_in_one_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    arena = Arena.create(16 * UNIT_BYTES, tmp_path, tag="t", upfront=False)
    dram = DramTier(arena, segment_bytes=4 * UNIT_BYTES)
    calls: list[tuple[int, int]] = []
    real_ensure = arena.ensure_ready

    def ensure_ready(offset: int, nbytes: int) -> bool:
        calls.append((offset, nbytes))
        return real_ensure(offset, nbytes)

    monkeypatch.setattr(arena, "ensure_ready", ensure_ready)
    try:
        keys = chain_keys(LAYOUT, np.arange(8 * 6))
        block = 3 * UNIT_BYTES // 2  # 3 MiB: two per 8 MiB segment, 2 MiB of tail each
        got = dram.reserve_many(keys, LAYOUT.fingerprint, block)
        assert [s for s, _ in got] == [ReserveStatus.OK] * 6
        # One run over 3 segments (the tails between them included), not one call per slot.
        assert calls == [(0, 22 << 20)], calls
        assert arena.populated_bytes == 11 * UNIT_BYTES
    finally:
        dram.close()
        arena.close()


@needs_mount
@pytest.mark.parametrize("tmpfs", ["size=8m"], indirect=True)
def test_a_unit_the_tmpfs_cannot_hold_is_a_full_tier(tmpfs: Path) -> None:
    cfg = StoreConfig(
        dram_bytes=6 << 20, shm_dir=str(tmpfs), nvme_bytes=0, dram_segment_bytes=1 << 20
    )
    arena = Arena.create(6 << 20, tmpfs, tag="t", upfront=False)
    (tmpfs / "ballast").write_bytes(b"\1" * (6 << 20))  # another user of the tmpfs
    store = TieredStore(cfg, arena=arena)
    try:
        keys = chain_keys(LAYOUT, np.arange(8 * 700))
        got = store.reserve(LAYOUT, keys)
        ok = sum(r.status == ReserveStatus.OK for r in got)
        assert 0 < ok < len(keys)  # the first units fit, the rest are refused, no SIGBUS
        assert any(r.status == ReserveStatus.FULL for r in got)
        store.abort([r.key for r in got if r.status == ReserveStatus.OK])
    finally:
        store.close()
        store.arena.close()


@needs_mount
@pytest.mark.parametrize("tmpfs", ["size=64m,huge=always"], indirect=True)
def test_huge_tmpfs_is_named(tmpfs: Path) -> None:
    arena = Arena.create(8 * UNIT_BYTES, tmpfs, tag="t", upfront=False)
    try:
        assert arena.page_bytes == UNIT_BYTES and arena.page_kind.startswith("thp")
    finally:
        arena.close()
    plain = Arena.create(8 * UNIT_BYTES, "/dev/shm", tag="t", upfront=False)
    try:
        assert plain.page_kind  # base pages or whatever /dev/shm gives; named either way
    finally:
        plain.close()
