"""The arena serves before it is populated: units are prepared on first use
(``ensure_ready``) or by the background populator; a tmpfs that cannot hold a
unit refuses its slots instead of raising SIGBUS later; page sizes are named."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tierstore.config import StoreConfig
from tierstore.keys import KVLayout, chain_keys
from tierstore.memory.arena import UNIT_BYTES, Arena
from tierstore.store.dram import ReserveStatus
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
        dram_bytes=256 << 20, shm_dir=str(tmp_path), nvme_bytes=0, dram_segment_bytes=1 << 20
    )
    with TieredStore(cfg) as store:
        keys = chain_keys(LAYOUT, np.arange(8 * 64))
        data = np.random.default_rng(1).integers(0, 255, (64, LAYOUT.block_bytes), np.uint8)
        assert store.lookup(LAYOUT, keys).num_hits == 0
        assert all(store.put(LAYOUT, keys, data))
        assert store.lookup(LAYOUT, keys).num_hits == 64
        assert [bytes(b) for b in store.get(LAYOUT, keys)] == [r.tobytes() for r in data]
        c = store.stat()["store"]
        assert 0 < c["arena_populated_bytes"] < c["arena_bytes"], c
        gate.set()
        deadline = threading.Event()
        for _ in range(300):  # bounded: 30 s
            if store.arena.populated_bytes == store.arena.size_bytes:
                break
            deadline.wait(0.1)
        assert store.arena.populated_bytes == store.arena.size_bytes


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
