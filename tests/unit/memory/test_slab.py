"""Slab allocator: alignment, no overlap, reuse across size classes, claim."""

from __future__ import annotations

import random
from itertools import pairwise

import pytest

from tierstore.errors import ConfigError
from tierstore.memory.slab import SlabAllocator


def _check_no_overlap(allocs: dict[int, int]) -> None:
    spans = sorted((off, off + size) for off, size in allocs.items())
    for (_, end), (start, _) in pairwise(spans):
        assert end <= start


def test_alloc_is_aligned_and_bounded() -> None:
    slab = SlabAllocator(1 << 20, 64 << 10)
    got = []
    while (off := slab.alloc(10_000)) is not None:
        assert off % 4096 == 0
        got.append(off)
    # 64 KiB segments hold 5 slots of 12 KiB (10,000 rounded up); 16 segments.
    assert len(got) == 16 * 5
    assert slab.used_bytes == len(got) * 12288
    _check_no_overlap({o: 12288 for o in got})


def test_free_segments_serve_other_sizes() -> None:
    slab = SlabAllocator(256 << 10, 64 << 10)
    small = [slab.alloc(4096) for _ in range(64)]
    assert slab.alloc(64 << 10) is None  # every segment holds small slots
    for off in small[:16]:  # exactly one segment's worth (the first 16 offsets)
        slab.free(off)
    assert slab.alloc(64 << 10) is not None


def test_multi_segment_slots() -> None:
    slab = SlabAllocator(1 << 20, 64 << 10)
    a = slab.alloc(200 << 10)  # spans 4 segments
    b = slab.alloc(200 << 10)
    assert a is not None and b is not None and a % (256 << 10) == 0 and b % (256 << 10) == 0
    assert abs(a - b) >= 200 << 10
    slab.free(a)
    assert slab.alloc(200 << 10) == a


def test_random_operations_never_overlap() -> None:
    rng = random.Random(7)
    slab = SlabAllocator(4 << 20, 128 << 10)
    live: dict[int, int] = {}
    for _ in range(3000):
        if live and rng.random() < 0.45:
            off = rng.choice(list(live))
            slab.free(off)
            del live[off]
        else:
            size = rng.choice([4096, 10_000, 65536, 200_000])
            off = slab.alloc(size)
            if off is not None:
                assert off not in live
                live[off] = slab.slot_bytes(size)
        _check_no_overlap(live)
        assert slab.used_bytes == sum(live.values())


def test_claim_rebuilds_state() -> None:
    first = SlabAllocator(1 << 20, 64 << 10)
    offsets = {first.alloc(20_000): 20_000 for _ in range(7)}
    big = first.alloc(150_000)
    offsets[big] = 150_000
    second = SlabAllocator(1 << 20, 64 << 10)
    for off, size in offsets.items():
        assert second.claim(off, size)
    assert second.used_bytes == first.used_bytes
    assert not second.claim(next(iter(offsets)), 20_000)  # already used
    assert not second.claim(4096 * 3 + (512 << 10), 20_000)  # not a slot boundary of its class
    new = second.alloc(20_000)
    assert new is not None and new not in offsets


def test_double_free_and_bad_geometry() -> None:
    slab = SlabAllocator(1 << 20, 64 << 10)
    with pytest.raises(ValueError, match="not allocated"):
        slab.free(0)
    with pytest.raises(ConfigError, match="segment"):
        SlabAllocator(1 << 20, 1000)
    with pytest.raises(ConfigError, match="capacity"):
        SlabAllocator(1000, 4096)
