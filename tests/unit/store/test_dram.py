"""DRAM tier and arena: two-phase writes, pins, eviction hand-off, owners."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tierstore.errors import ArenaError
from tierstore.keys import BlockKey
from tierstore.memory.arena import Arena
from tierstore.store.dram import DramTier, EntryState, ReserveStatus

FP = b"\x01" * 32
BLOCK = 16 << 10


def k(i: int) -> BlockKey:
    return BlockKey(i.to_bytes(32, "little"))


@pytest.fixture
def dram():
    arena = Arena.create(1 << 20, tag="test")
    tier = DramTier(arena, segment_bytes=64 << 10)
    yield tier
    tier.close()
    arena.close()


def test_reserve_commit_read(dram: DramTier) -> None:
    status, entry = dram.reserve(k(1), FP, BLOCK, owner=5)
    assert status == ReserveStatus.OK and entry is not None
    assert dram.contains([k(1)]) == [False]  # half-written data is invisible
    assert dram.pin([k(1)]) == [None]
    dram.view(entry)[:] = b"\xab" * BLOCK
    assert dram.commit([k(1)], owner=4) == [False]  # only the reserving owner commits
    assert dram.commit([k(1)], owner=5) == [True]
    assert dram.contains([k(1)]) == [True]
    (pinned,) = dram.pin([k(1)])
    assert pinned is not None and bytes(dram.view(pinned)) == b"\xab" * BLOCK
    assert dram.reserve(k(1), FP, BLOCK)[0] == ReserveStatus.EXISTS
    stats = dram.stats()
    assert (stats.hits, stats.misses, stats.num_blocks) == (1, 1, 1)
    assert stats.bytes_in == BLOCK and stats.bytes_out == BLOCK


def test_abort_frees_the_slot(dram: DramTier) -> None:
    dram.reserve(k(1), FP, BLOCK)
    used = dram.used_bytes()
    assert dram.abort([k(1)]) == 1
    assert dram.used_bytes() == used - BLOCK
    assert dram.contains([k(1)]) == [False]


def test_full_then_evict(dram: DramTier) -> None:
    n = 0
    while dram.reserve(k(n), FP, BLOCK)[0] == ReserveStatus.OK:
        dram.commit([k(n)])
        n += 1
    assert n == 64 and dram.reserve(k(n), FP, BLOCK)[0] == ReserveStatus.FULL
    dram.pin([k(0)])
    victim = dram.take_victim()
    assert victim is not None and victim.key == k(1)  # k(0) is pinned
    assert victim.state == EntryState.EVICTING and dram.contains([k(1)]) == [True]
    assert dram.drop(victim)
    assert dram.contains([k(1)]) == [False]
    assert dram.reserve(k(n), FP, BLOCK)[0] == ReserveStatus.OK
    assert dram.stats().evictions == 1


def test_pin_during_eviction_keeps_the_block(dram: DramTier) -> None:
    for i in range(3):
        dram.reserve(k(i), FP, BLOCK)
        dram.commit([k(i)])
    victim = dram.take_victim()
    assert victim is not None
    dram.pin([victim.key], owner=9)
    assert not dram.drop(victim)
    assert dram.contains([victim.key]) == [True]
    assert victim.key not in dram.policy  # pinned: out of eviction's way
    dram.unpin([victim.key], owner=9)
    assert victim.key in dram.policy  # back at its last unpin


def test_pinned_blocks_are_not_walked_by_eviction(dram: DramTier) -> None:
    for i in range(4):
        dram.reserve(k(i), FP, BLOCK)
        dram.commit([k(i)])
    dram.pin([k(0), k(1)], owner=3)
    assert len(dram.policy) == 2  # only unpinned blocks are candidates
    victim = dram.take_victim()
    assert victim is not None and victim.key == k(2)
    assert dram.pin_count(3) == 2
    assert dram.release_owner(3) == (0, 2)
    assert len(dram.policy) == 3 and dram.stats().num_blocks == 4


def test_release_owner_frees_pins_and_reservations(dram: DramTier) -> None:
    dram.reserve(k(1), FP, BLOCK, owner=1)
    dram.commit([k(1)], owner=1)
    dram.reserve(k(2), FP, BLOCK, owner=7)  # never committed: the client died
    dram.pin([k(1), k(1)], owner=7)
    assert dram.remove([k(1)]) == 0  # pinned
    assert dram.release_owner(7) == (1, 2)
    assert dram.contains([k(2)]) == [False]
    assert dram.remove([k(1)]) == 1


def test_unpin_is_per_owner(dram: DramTier) -> None:
    dram.reserve(k(1), FP, BLOCK)
    dram.commit([k(1)])
    dram.pin([k(1)], owner=3)
    assert dram.unpin([k(1)], owner=4) == 0
    assert dram.remove([k(1)]) == 0
    assert dram.unpin([k(1)], owner=3) == 1
    assert dram.remove([k(1)]) == 1


def test_arena_is_shared_between_processes() -> None:
    arena = Arena.create(1 << 20, tag="test")
    try:
        code = (
            "import sys; from tierstore.memory.arena import Arena;"
            f"a = Arena.attach({str(arena.path)!r}, {arena.size_bytes});"
            "a.view(4096, 5)[:] = b'hello'; a.close()"
        )
        subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
        assert bytes(arena.view(4096, 5)) == b"hello"
        assert (arena.path.stat().st_mode & 0o777) == 0o600
    finally:
        arena.close()
    assert not arena.path.exists()


def test_arena_errors_name_the_problem(tmp_path) -> None:
    with pytest.raises(ArenaError, match=r"available memory|does not fit"):
        Arena.create(1 << 50, tag="test")
    with pytest.raises(ArenaError, match="multiple of"):
        Arena.create(1000)
    with pytest.raises(ArenaError, match="does not exist"):
        Arena.create(1 << 20, directory=tmp_path / "nope")
    with pytest.raises(ArenaError, match="cannot open"):
        Arena.attach(tmp_path / "missing", 1 << 20)


def test_stale_arenas_of_dead_processes_are_removed(tmp_path) -> None:
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    stale = tmp_path / f"tierstore-{dead.stdout.strip()}-0123abcd"
    stale.write_bytes(b"x")
    live = tmp_path / f"tierstore-{os.getpid()}-0123abcd"
    live.write_bytes(b"x")
    other = tmp_path / "unrelated-1-0123abcd"
    other.write_bytes(b"x")
    arena = Arena.create(1 << 20, directory=tmp_path, tag="test")
    arena.close()
    assert not stale.exists() and live.exists() and other.exists()
