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
