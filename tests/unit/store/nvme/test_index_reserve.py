"""The NVMe index's reserve (disk kept allocated past the end of LMDB's
data.mdb, so index commits find room on a full disk) is used up as the index
grows on a full disk, and refilled once room comes back.

On a 4 MiB tmpfs the test mounts: the index opens with its reserve in place;
a filler file then takes every free byte; rows are committed until data.mdb
has grown through the reserve (the commits succeed: that is what the reserve
is for) and the top-up fails (counted in ``reserve_shortfalls``); the filler
is deleted, one more commit, and the reserve is whole again. The reserve is
read from the file's allocated blocks (st_blocks), not from the index's own
word for it, so the check fails when no room is held (the full-disk step
shows that).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tierstore.keys import BlockKey
from tierstore.store.nvme.index import NvmeEntry, NvmeIndex

RESERVE = 256 << 10
ROW_BATCH = 200

needs_mount = pytest.mark.skipif(
    os.geteuid() != 0 or not (shutil.which("mount") and shutil.which("umount")),
    reason="mounts a tmpfs: needs root and mount(8)/umount(8)",
)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    mnt = tmp_path / "disk"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False, capture_output=True)


def held_past_end(data: Path) -> int:
    """Bytes allocated to ``data`` beyond its size: the reserve actually held."""
    st = os.stat(data)
    return st.st_blocks * 512 - st.st_size


def fill(disk: Path) -> Path:
    """A file taking every byte the disk has left."""
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for size in (64 << 10, 4096):  # then the last pages
            chunk = b"\0" * size
            try:
                while True:
                    os.write(fd, chunk)
            except OSError:
                pass
    finally:
        os.close(fd)
    return filler


def rows(start: int, n: int) -> list[NvmeEntry]:
    return [
        NvmeEntry(BlockKey(i.to_bytes(32, "little")), b"\1" * 32, i * 4096, 4096, b"\2" * 32, 0.0)
        for i in range(start, start + n)
    ]


@needs_mount
def test_the_reserve_is_used_on_a_full_disk_and_refilled_when_room_comes_back(
    small_disk: Path,
) -> None:
    path = small_disk / "index.lmdb"
    path.mkdir()
    index = NvmeIndex(path, 1 << 30, sync=False, reserve_bytes=RESERVE)
    data = path / "data.mdb"
    try:
        assert held_past_end(data) >= RESERVE
        filler = fill(small_disk)
        size_full = data.stat().st_size
        committed = 0
        # Commit until the file has grown into the reserve and a top-up fell short;
        # bounded: the reserve holds RESERVE / 4 KiB pages.
        for _ in range(RESERVE // 4096 * 4):
            index.commit(put=rows(committed, ROW_BATCH))
            committed += ROW_BATCH
            if index.reserve_shortfalls:
                break
        assert index.reserve_shortfalls > 0, "the index never grew through its reserve"
        assert data.stat().st_size > size_full
        assert held_past_end(data) < RESERVE  # the control: a used-up reserve reads short
        # Room comes back: the next commit tops the reserve up again.
        filler.unlink()
        shortfalls = index.reserve_shortfalls
        index.commit(put=rows(committed, 1))
        assert held_past_end(data) >= RESERVE
        assert index.reserve_shortfalls == shortfalls
        entries, bad = index.load()
        assert len(entries) == committed + 1 and bad == []
    finally:
        index.close()
