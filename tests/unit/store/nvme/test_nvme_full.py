"""The NVMe tier on a full disk: when it looks at the free space again.

A fake clock (``tierstore.store.nvme.full.time``) and a fake disk (``pwritev``
raises ENOSPC and ``statvfs`` reports no room while it is full) make the
schedule exact: the first write ``full_backoff_s`` after the cap looks, then
after each look the wait doubles to at most 16x; an ENOSPC while capped does
not postpone the look, and the first look after room is freed lifts the cap.
"""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import blake3
import pytest

from tierstore.keys import BlockKey
from tierstore.store.nvme import blockfile
from tierstore.store.nvme import full as full_module
from tierstore.store.nvme.full import FULL_BACKOFF_MAX_FACTOR
from tierstore.store.nvme.tier import NvmeTier

FP = bytes(range(32))
BLOCK_BYTES = 4096
BACKOFF_S = 1.0


def key_of(i: int) -> BlockKey:
    return BlockKey(blake3.blake3(i.to_bytes(8, "little")).digest())


class FakeDisk:
    """While ``full``: every data write fails with ENOSPC; while ``no_room``:
    statvfs says 0 bytes free. ``full`` sets both."""

    def __init__(self) -> None:
        self.writes_fail = self.no_room = False
        self._pwritev = os.pwritev
        self._statvfs = os.statvfs

    @property
    def full(self) -> bool:
        return self.writes_fail and self.no_room

    @full.setter
    def full(self, value: bool) -> None:
        self.writes_fail = self.no_room = value

    def pwritev(self, fd: int, iov: Any, offset: int) -> int:
        if self.writes_fail:
            raise OSError(errno.ENOSPC, "No space left on device")
        return self._pwritev(fd, iov, offset)

    def statvfs(self, path: Any) -> Any:
        if self.no_room:
            return SimpleNamespace(f_bavail=0, f_frsize=4096)
        return self._statvfs(path)


@pytest.fixture
def capped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A tier holding 64 blocks, capped by a full disk at t = 0 of its clock."""
    clock = SimpleNamespace(now=0.0)
    fake_time = SimpleNamespace(
        monotonic=lambda: clock.now, time=time.time, perf_counter=time.perf_counter
    )
    disk = FakeDisk()
    monkeypatch.setattr(full_module, "time", fake_time)
    monkeypatch.setattr(blockfile.os, "pwritev", disk.pwritev)
    monkeypatch.setattr(full_module.os, "statvfs", disk.statvfs)
    tier = NvmeTier(
        Path(tmp_path) / "nvme", 4 << 20, segment_bytes=64 << 10, direct_io=False, sync=False,
        index_reserve_bytes=64 << 10, full_backoff_s=BACKOFF_S,
    )  # fmt: skip
    ok = tier.write_many([(key_of(i), FP, bytes([i]) * BLOCK_BYTES) for i in range(64)])
    assert all(ok)
    disk.full = True
    assert tier.write_many([(key_of(1000), FP, b"x" * BLOCK_BYTES)]) == [False]
    assert tier.counters.nvme_full_events == 1 and tier.counters.nvme_disk_full == 1
    yield SimpleNamespace(tier=tier, clock=clock, disk=disk)
    tier.close()


def write_at(capped: Any, t: float, i: int) -> bool:
    capped.clock.now = t
    return capped.tier.write_many([(key_of(i), FP, b"y" * BLOCK_BYTES)])[0]


def test_enospc_while_capped_does_not_postpone_the_look(capped: Any) -> None:
    # A write every 0.25 s, each failing with ENOSPC again: the looks still
    # come at 1 s (the backoff after the cap) and at 3 s (then doubled).
    looked_at = []
    for step in range(1, 17):
        t = step * 0.25
        before = capped.tier.counters.nvme_full_rechecks
        assert not write_at(capped, t, 2000 + step)
        if capped.tier.counters.nvme_full_rechecks > before:
            looked_at.append(t)
    assert looked_at == [1.0, 3.0]
    assert capped.tier.counters.nvme_full_events == 17  # each of them hit ENOSPC
    assert capped.tier.counters.nvme_full_resumed == 0
    used = capped.tier.stats().used_bytes

    # Room is freed: the next look is due at 3 + 4 s; the first write then
    # lifts the cap, and the tier grows past what it held.
    capped.disk.full = False
    assert write_at(capped, 6.5, 3000)  # capped still (not due): an old block made room
    assert capped.tier.counters.nvme_full_resumed == 0
    assert capped.tier.stats().used_bytes == used
    assert write_at(capped, 7.0, 3001)
    assert capped.tier.counters.nvme_full_resumed == 1
    assert capped.tier.counters.nvme_disk_full == 0
    for i in range(8):
        assert write_at(capped, 7.0, 3100 + i)
    assert capped.tier.stats().used_bytes == used + 9 * BLOCK_BYTES  # 3001 and these 8


def test_the_wait_between_looks_is_bounded(capped: Any) -> None:
    # The disk stays full and capped writes succeed (they reuse evicted
    # blocks' slots): a write every 0.5 s for 120 s sees the waits double to
    # 16 backoffs and stay there.
    capped.disk.writes_fail = False  # statvfs still says no room
    looked_at = []
    for step in range(1, 241):
        before = capped.tier.counters.nvme_full_rechecks
        assert write_at(capped, step * 0.5, 4000 + step)
        if capped.tier.counters.nvme_full_rechecks > before:
            looked_at.append(step * 0.5)
    waits = [b - a for a, b in zip([0.0, *looked_at], looked_at)]
    max_wait_s = BACKOFF_S * FULL_BACKOFF_MAX_FACTOR
    assert waits[:5] == [1.0, 2.0, 4.0, 8.0, 16.0]
    assert all(w == max_wait_s for w in waits[4:]) and len(waits) >= 9, waits
    assert capped.tier.counters.nvme_full_resumed == 0
    assert capped.tier.counters.nvme_disk_full == 1
