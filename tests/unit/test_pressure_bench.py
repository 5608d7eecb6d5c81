"""bench/tiers/pressure.py's oracles: the arena's pattern check (with a
changed word as its control) and the smaps reading of one mapping
(``memory.arena.smaps_bytes``, which the arena's huge-page figure uses too)."""

from __future__ import annotations

import mmap

import numpy as np

from bench.tiers.pressure import read_all
from tierstore.memory.arena import smaps_bytes


def test_the_pattern_check_passes_intact_bytes_and_catches_one_changed_word() -> None:
    words = np.arange(10_000, dtype=np.uint64)
    out = np.empty(4096, dtype=np.uint64)  # several pieces, the last one short
    seconds, intact = read_all(words, out)
    assert intact and seconds >= 0
    words[7_777] ^= 1
    assert read_all(words, out)[1] is False


def test_smaps_counts_only_the_mapping_asked_for() -> None:
    size = 8 << 20
    with mmap.mmap(-1, size) as touched, mmap.mmap(-1, size):
        a = np.frombuffer(touched, dtype=np.uint8)
        a[::4096] = 1  # every page of the first mapping in memory, none of the second
        start = a.ctypes.data
        got = smaps_bytes(start, start + size, (b"Rss:", b"Swap:"))
        assert got == {b"Rss:": size, b"Swap:": 0}
        del a
