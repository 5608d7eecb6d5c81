"""How much of the arena is mapped with huge pages (``Arena.huge_bytes``,
``arena_huge_bytes`` in stat): none on a tmpfs without ``huge=`` (this
machine's /dev/shm), every populated unit's worth (whole 2 MiB pages) on a
tmpfs mounted ``huge=always``, and only the arena's own mapping is counted."""

from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tierstore.errors import ArenaError
from tierstore.memory.arena import UNIT_BYTES, Arena

ARENA = 32 << 20

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs")


@pytest.fixture
def huge_tmpfs() -> Iterator[Path]:
    """A 64 MiB tmpfs mounted huge=always (THP for every file on it)."""
    assert Path("/sys/kernel/mm/transparent_hugepage").is_dir(), (
        "this kernel has no transparent huge pages: a tmpfs cannot give the arena huge pages"
    )
    directory = Path(tempfile.mkdtemp(prefix="tierstore-huge-"))
    try:
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "huge=always,size=64m", "tmpfs", str(directory)],
            check=True, capture_output=True, timeout=30,
        )  # fmt: skip
        try:
            yield directory
        finally:
            subprocess.run(["umount", str(directory)], check=True, timeout=30)
    finally:
        directory.rmdir()


def test_control_an_arena_on_dev_shm_has_no_huge_pages() -> None:
    arena = Arena.create(ARENA)  # populated upfront
    try:
        assert arena.page_kind.startswith("base"), arena.page_kind  # /dev/shm without huge=
        assert arena.populated_bytes == ARENA
        assert arena.huge_bytes() == 0
    finally:
        arena.close()


@needs_root
def test_an_arena_on_a_huge_tmpfs_is_mapped_with_huge_pages_as_it_is_populated(
    huge_tmpfs: Path,
) -> None:
    arena = Arena.create(ARENA, huge_tmpfs, upfront=False)
    plain = Arena.create(ARENA)  # in the same process: its pages are not counted there
    try:
        assert arena.page_bytes == UNIT_BYTES, arena.page_kind
        assert arena.huge_bytes() == 0  # nothing populated yet
        assert arena.ensure_ready(0, 4 << 20)
        assert 0 < arena.huge_bytes() <= 4 << 20
        assert arena.populate()
        huge = arena.huge_bytes()
        assert 0 < huge <= ARENA and huge % UNIT_BYTES == 0, huge
        assert plain.huge_bytes() == 0
    finally:
        plain.close()
        arena.close()
    assert arena.huge_bytes() == 0  # closed: nothing of it is mapped


HUGE_PAGE = 2 << 20
POOL = Path(f"/sys/kernel/mm/hugepages/hugepages-{HUGE_PAGE >> 10}kB")


@pytest.fixture
def hugetlbfs() -> Iterator[Path]:
    """A hugetlbfs mount without ``size=`` (as systemd mounts /dev/hugepages:
    statvfs reports no blocks), over 16 more 2 MiB pages in the kernel's pool."""
    nr = POOL / "nr_hugepages"
    before = int(nr.read_text())
    nr.write_text(str(before + 16))
    directory = Path(tempfile.mkdtemp(prefix="tierstore-hugetlb-"))
    try:
        assert int(nr.read_text()) == before + 16, "the kernel did not give 16 more huge pages"
        subprocess.run(
            ["mount", "-t", "hugetlbfs", "-o", "pagesize=2M", "none", str(directory)],
            check=True, capture_output=True, timeout=30,
        )  # fmt: skip
        try:
            assert os.statvfs(directory).f_blocks == 0  # what the arena must not read as full
            yield directory
        finally:
            subprocess.run(["umount", str(directory)], check=True, timeout=30)
    finally:
        directory.rmdir()
        nr.write_text(str(before))


def _pool_free() -> int:
    return int((POOL / "free_hugepages").read_text()) - int((POOL / "resv_hugepages").read_text())


@needs_root
def test_an_arena_on_hugetlbfs_without_a_size_limit_takes_the_pool(hugetlbfs: Path) -> None:
    size = 8 * HUGE_PAGE
    assert _pool_free() >= 8
    arena = Arena.create(size, hugetlbfs, upfront=False)
    try:
        assert arena.page_kind == "hugetlbfs" and arena.page_bytes == HUGE_PAGE
        assert arena.populate()
        arena.array[:] = 0xA5
        assert int(arena.array[::4096].min()) == 0xA5
        assert arena.huge_bytes() == size
    finally:
        arena.close()


@needs_root
def test_an_arena_larger_than_the_free_pool_is_refused_by_name(hugetlbfs: Path) -> None:
    too_big = (_pool_free() + 1) * HUGE_PAGE
    with pytest.raises(
        ArenaError, match=r"free 2 MiB huge pages; reserve more \(sysctl vm.nr_hugepages\)"
    ):
        Arena.create(too_big, hugetlbfs, upfront=False)
    assert list(hugetlbfs.iterdir()) == []  # refused before any file was made
