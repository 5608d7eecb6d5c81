"""NvmeTier: round trips, persistence, eviction, pins, corruption, bad input,
I/O errors, and random operation sequences against a dict model."""

from __future__ import annotations

import errno
import logging
import mmap
import os
import re
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import blake3
import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    rule,
)

from tierstore.errors import BlockSizeError, KeyFormatError, LayoutError, StorageError
from tierstore.keys import BlockKey
from tierstore.store.nvme import blockfile
from tierstore.store.nvme.tier import NvmeTier
from tierstore.tiers import TierName

CAPACITY = 8 << 20
SEGMENT = 64 << 10
FP = bytes(range(32))


def key_of(i: int) -> BlockKey:
    return BlockKey(blake3.blake3(i.to_bytes(8, "little")).digest())


def block_of(i: int, nbytes: int) -> bytes:
    return np.random.default_rng(i).integers(0, 256, nbytes, dtype=np.uint8).tobytes()


class Aligned:
    """A page-aligned writable buffer (an anonymous mmap)."""

    def __init__(self, nbytes: int) -> None:
        self._map = mmap.mmap(-1, max(nbytes, 1))
        self.view = memoryview(self._map)[:nbytes]

    def close(self) -> None:
        self.view.release()
        self._map.close()


@pytest.fixture
def aligned() -> Iterator[type[Aligned]]:
    made: list[Aligned] = []

    class Tracked(Aligned):
        def __init__(self, nbytes: int) -> None:
            super().__init__(nbytes)
            made.append(self)

    yield Tracked
    for buf in made:
        buf.close()


@pytest.fixture(params=[True, False], ids=["direct", "buffered"])
def direct_io(request: pytest.FixtureRequest) -> bool:
    return bool(request.param)


@pytest.fixture
def open_tier(tmp_path: Path, direct_io: bool) -> Iterator:
    opened: list[NvmeTier] = []

    def make(root: Path | None = None, capacity: int = CAPACITY, **kw: object) -> NvmeTier:
        kw.setdefault("segment_bytes", SEGMENT)
        kw.setdefault("direct_io", direct_io)
        tier = NvmeTier(root or tmp_path / "nvme", capacity, **kw)  # type: ignore[arg-type]
        opened.append(tier)
        return tier

    yield make
    for tier in opened:
        tier.close()


def read(tier: NvmeTier, key: BlockKey, size: int = 256 << 10) -> bytes | None:
    out = bytearray(size)
    n = tier.read_into(key, out)
    return None if n is None else bytes(out[:n])


def read_any(tier: NvmeTier, key: BlockKey, size: int, aligned: bool) -> bytes | None:
    """Read into a page-aligned (zero copy) or an unaligned buffer."""
    if not aligned:
        return read(tier, key, size)
    buf = Aligned(size)
    try:
        n = tier.read_into(key, buf.view)
        return None if n is None else bytes(buf.view[:n])
    finally:
        buf.close()


# -- round trips ---------------------------------------------------------------

SIZES = [16 << 10, 20_000, 4097, 100 << 10, 65_536, 1]


def test_round_trip_every_buffer_kind(open_tier, aligned) -> None:
    tier = open_tier()
    assert tier.name is TierName.NVME
    blocks = {key_of(i): block_of(i, n) for i, n in enumerate(SIZES)}
    assert tier.write_many([(k, FP, v) for k, v in blocks.items()]) == [True] * len(SIZES)
    for key, data in blocks.items():
        n = len(data)
        slot = -(-n // 4096) * 4096
        outs = [
            bytearray(n),  # unaligned, exact
            np.zeros(n + 1, np.uint8)[1:],  # unaligned numpy view
            aligned(slot).view,  # aligned, slot-sized: zero copy
            aligned(n).view,  # aligned but shorter than the slot
        ]
        for out in outs:
            assert tier.read_into(key, out) == n
            assert bytes(memoryview(out)[:n]) == data
    stats = tier.stats()
    assert stats.hits == 4 * len(SIZES) and stats.misses == 0
    assert stats.bytes_in == sum(SIZES)
    assert stats.bytes_out == 4 * sum(SIZES)
    assert stats.num_blocks == len(SIZES)
    assert stats.capacity_bytes == CAPACITY
    assert stats.used_bytes == sum(-(-n // 4096) * 4096 for n in SIZES)


def test_write_from_aligned_and_numpy_buffers(open_tier, aligned) -> None:
    tier = open_tier()
    items = []
    for i, n in enumerate([8192, 12_345, 4096 * 3 + 7]):
        src = aligned(n)
        src.view[:] = block_of(i, n)
        items.append((key_of(i), FP, src.view))
    arr = np.frombuffer(block_of(9, 30_000), np.uint8).reshape(100, 300)
    items.append((key_of(9), FP, arr))
    assert all(tier.write_many(items))
    for key, _, src in items:
        assert read(tier, key) == bytes(memoryview(src).cast("B"))


def test_reopen_serves_same_blocks_and_digests(open_tier, tmp_path) -> None:
    tier = open_tier()
    blocks = {key_of(i): block_of(i, 10_000 + i * 3000) for i in range(12)}
    tier.write_many([(k, FP, v) for k, v in blocks.items()])
    read(tier, key_of(3))
    metas = {k: tier.meta(k) for k in blocks}
    tier.close()
    tier.close()  # idempotent
    again = open_tier()
    assert again.contains(list(blocks)) == [True] * len(blocks)
    for key, data in blocks.items():
        meta = again.meta(key)
        assert meta == metas[key]  # including the persisted last access time
        assert meta is not None and meta.digest == blake3.blake3(data).digest()
        assert meta.layout_fp == FP and meta.nbytes == len(data)
        assert read(again, key) == data


def test_contains_meta_misses_and_existing_keys(open_tier) -> None:
    tier = open_tier()
    a, b = key_of(1), key_of(2)
    assert tier.contains([a, b]) == [False, False]
    assert tier.meta(a) is None
    assert tier.read_into(a, bytearray(10)) is None
    assert tier.write_many([(a, FP, b"x" * 5000), (a, FP, b"y" * 5000)]) == [True, True]
    assert tier.write_many([(a, FP, b"z" * 5000), (b, FP, b"w" * 10)]) == [True, True]
    assert read(tier, a) == b"x" * 5000  # the first write wins; held keys are skipped
    assert tier.contains([a, b]) == [True, True]
    stats = tier.stats()
    assert (stats.hits, stats.misses, stats.bytes_in) == (1, 1, 5010)
    with pytest.raises(BlockSizeError):
        tier.read_into(a, bytearray(100))


def test_given_digests_are_stored(open_tier) -> None:
    tier = open_tier()
    data = block_of(1, 9000)
    digest = blake3.blake3(data).digest()
    assert tier.write_many([(key_of(1), FP, data)], digests=[digest]) == [True]
    meta = tier.meta(key_of(1))
    assert meta is not None and meta.digest == digest
    # A wrong digest given by the caller makes the block fail verification, not
    # serve bytes that do not match it.
    tier.write_many([(key_of(2), FP, data)], digests=[bytes(32)])
    assert read(tier, key_of(2)) is None
    assert tier.stats().verify_failures == 1


def test_remove(open_tier) -> None:
    tier = open_tier()
    keys = [key_of(i) for i in range(4)]
    tier.write_many([(k, FP, b"a" * 5000) for k in keys])
    used = tier.stats().used_bytes
    assert tier.remove([keys[0], keys[0], keys[1], key_of(99)]) == 2
    assert tier.contains(keys) == [False, False, True, True]
    assert tier.stats().used_bytes == used - 2 * 8192
    tier.close()
    again = open_tier()
    assert again.contains(keys) == [False, False, True, True]


def test_closed_tier_raises(open_tier) -> None:
    tier = open_tier()
    tier.close()
    with pytest.raises(StorageError, match="closed"):
        tier.write_many([(key_of(1), FP, b"x")])
    with pytest.raises(StorageError, match="closed"):
        tier.read_into(key_of(1), bytearray(1))


def test_use_after_fork_raises(open_tier) -> None:
    tier = open_tier()
    tier._pid = -1  # what a forked child sees
    with pytest.raises(StorageError, match="fork"):
        tier.read_into(key_of(1), bytearray(1))
    tier._pid = os.getpid()


def test_coalesces_adjacent_slots(tmp_path, monkeypatch) -> None:
    tier = NvmeTier(tmp_path, CAPACITY, segment_bytes=SEGMENT)
    calls: list[int] = []
    real = os.pwritev

    def spy(fd: int, iov: list, offset: int) -> int:
        calls.append(len(iov))
        return real(fd, iov, offset)

    monkeypatch.setattr(blockfile.os, "pwritev", spy)
    assert all(tier.write_many([(key_of(i), FP, block_of(i, 16 << 10)) for i in range(32)]))
    # 32 blocks in 8 segments of 4 slots each, consecutive: one write per run of slots.
    assert len(calls) <= 2
    tier.close()


LARGE = [600_000, 3 << 19, (1 << 20) + 5]  # read in chunks, each hashed while the next is read


def test_large_blocks_round_trip_in_chunks(open_tier, aligned, tmp_path) -> None:
    tier = open_tier()
    blocks = {key_of(i): block_of(i, n) for i, n in enumerate(LARGE)}
    assert all(tier.write_many([(k, FP, v) for k, v in blocks.items()]))
    for key, data in blocks.items():
        n = len(data)
        for out in (aligned(-(-n // 4096) * 4096).view, bytearray(n), aligned(n).view):
            assert tier.read_into(key, out) == n
            assert bytes(memoryview(out)[:n]) == data
    # A flipped byte in the last chunk, and a file that ends inside a block.
    meta = tier.meta(key_of(1))
    assert meta is not None
    with open(tmp_path / "nvme" / "blocks.dat", "r+b") as f:
        f.seek(meta.offset + meta.nbytes - 1)
        f.write(bytes([blocks[key_of(1)][-1] ^ 1]))
    assert tier.read_into(key_of(1), aligned(3 << 19).view) is None
    assert tier.stats().verify_failures == 1
    meta = tier.meta(key_of(2))
    assert meta is not None
    os.truncate(tmp_path / "nvme" / "blocks.dat", meta.offset + 700_000)
    assert tier.read_into(key_of(2), aligned(2 << 20).view) is None
    assert tier.stats().read_failures == 1


def test_error_in_a_later_chunk_is_a_miss(open_tier, aligned, monkeypatch) -> None:
    tier = open_tier()
    data = block_of(7, 3 << 19)
    tier.write_many([(key_of(7), FP, data)])
    real = os.preadv
    calls: list[int] = []

    def eio_on_second(fd: int, iov: list, offset: int) -> int:
        calls.append(offset)
        if len(calls) == 2:
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, iov, offset)

    monkeypatch.setattr(blockfile.os, "preadv", eio_on_second)
    out = Aligned(3 << 19)
    assert tier.read_into(key_of(7), out.view) is None
    out.close()  # nothing holds on to the caller's buffer after an error
    assert tier.stats().read_failures == 1 and tier.contains([key_of(7)]) == [False]


# -- eviction and pins ---------------------------------------------------------

BLOCK = 64 << 10  # one block per segment: 128 fit


def test_eviction_is_lru_and_spares_touched(open_tier) -> None:
    tier = open_tier()
    keys = [key_of(i) for i in range(148)]
    assert all(tier.write_many([(k, FP, block_of(i, BLOCK)) for i, k in enumerate(keys[:128])]))
    assert tier.stats().evictions == 0
    for k in keys[:10]:
        assert read(tier, k) is not None
    assert all(
        tier.write_many([(k, FP, block_of(i + 128, BLOCK)) for i, k in enumerate(keys[128:])])
    )
    held = tier.contains(keys)
    assert held[:10] == [True] * 10  # touched: survive
    assert held[10:30] == [False] * 20  # least recently used: evicted
    assert all(held[30:])
    stats = tier.stats()
    assert stats.evictions == 20 and stats.num_blocks == 128
    assert stats.used_bytes <= stats.capacity_bytes
    for i in (0, 5, 30, 147):
        assert read(tier, keys[i]) == block_of(i, BLOCK)
    # The evictions are durable: a reopen does not bring evicted keys back.
    tier.close()
    assert open_tier().contains(keys) == held


def test_evict_first_keys_leave_before_the_policy_order(open_tier) -> None:
    """The store's replicas of other hosts (oldest first) leave NVMe before
    the host's own blocks; a key not held or being read is skipped."""
    tier = open_tier(capacity=8 * BLOCK)
    keys = [key_of(i) for i in range(12)]
    own, replicas, new = keys[:4], keys[4:8], keys[8:12]
    assert all(tier.write_many([(k, FP, block_of(i, BLOCK)) for i, k in enumerate(keys[:8])]))
    asked: list[int] = []

    def oldest_replicas() -> list[BlockKey]:
        asked.append(1)
        return [key_of(999), *replicas]  # one the tier does not hold

    tier.evict_first = oldest_replicas
    pinned = tier.meta(replicas[0]).offset
    with tier._lock:
        tier._pins.pin(pinned)  # being read: stays
    try:
        assert all(tier.write_many([(k, FP, block_of(8 + i, BLOCK)) for i, k in enumerate(new)]))
    finally:
        with tier._lock:
            tier._pins.unpin(pinned)
    held = dict(zip(keys, tier.contains(keys)))
    assert [held[k] for k in replicas] == [True, False, False, False]
    # Three replicas made room for three blocks; the fourth took the LRU own block.
    assert [held[k] for k in own] == [False, True, True, True]
    assert all(held[k] for k in new)
    assert len(asked) == 1  # once per write batch, not per victim
    assert tier.stats().evictions == 4


def test_too_large_block_and_full_tier(open_tier) -> None:
    tier = open_tier(capacity=256 << 10)
    big = b"b" * ((256 << 10) + 1)
    ok = tier.write_many([(key_of(1), FP, big), (key_of(2), FP, b"s" * 100)])
    assert ok == [False, True]
    assert tier.stats().write_failures == 1
    assert tier.stats().evictions == 0  # nothing was evicted for a block that cannot fit


def test_reading_block_is_never_evicted(open_tier) -> None:
    tier = open_tier(capacity=4 * BLOCK)
    keys = [key_of(i) for i in range(8)]
    tier.write_many([(k, FP, block_of(i, BLOCK)) for i, k in enumerate(keys[:4])])
    in_read, release = threading.Event(), threading.Event()
    real_read = tier._file.read

    def slow_read(offset: int, nbytes: int, out: memoryview) -> int:
        got = real_read(offset, nbytes, out)
        in_read.set()
        assert release.wait(5)
        return got

    tier._file.read = slow_read  # type: ignore[method-assign]
    result: list[bytes | None] = []
    reader = threading.Thread(target=lambda: result.append(read(tier, keys[0])))
    reader.start()
    assert in_read.wait(5)
    # Reading touched keys[0]; make it least recently used again.
    for k in keys[1:4]:
        tier._policy.touch(k)
    # Room for three more blocks: the pinned keys[0] is skipped, keys[1:4] go.
    assert tier.write_many([(k, FP, block_of(i + 4, BLOCK)) for i, k in enumerate(keys[4:7])])
    assert tier.contains(keys[:4]) == [True, False, False, False]
    assert tier.remove([keys[0]]) == 0  # in use: not removed
    assert tier.write_many([(keys[7], FP, block_of(11, BLOCK))]) == [True]
    assert tier.contains([keys[0], keys[4]]) == [True, False]
    release.set()
    reader.join(5)
    assert result == [block_of(0, BLOCK)]


def test_no_room_when_everything_is_pinned(open_tier) -> None:
    tier = open_tier(capacity=2 * BLOCK)
    tier.write_many([(key_of(i), FP, block_of(i, BLOCK)) for i in range(2)])
    offsets = [e.offset for e in tier._entries.values()]
    with tier._lock:
        for offset in offsets:
            tier._pins.pin(offset)
    assert tier.write_many([(key_of(5), FP, block_of(5, BLOCK))]) == [False]
    assert tier.stats().write_failures == 1
    assert tier.contains([key_of(0), key_of(1)]) == [True, True]
    with tier._lock:
        for offset in offsets:
            tier._pins.unpin(offset)


def test_concurrent_readers_and_writer_never_see_wrong_bytes(open_tier) -> None:
    tier = open_tier(capacity=16 * BLOCK)
    size = 20_000
    stop = threading.Event()
    errors: list[str] = []

    def reader(seed: int) -> None:
        rng = np.random.default_rng(seed)
        out = bytearray(size)
        while not stop.is_set():
            i = int(rng.integers(0, 200))
            n = tier.read_into(key_of(i), out)
            if n is not None and bytes(out[:n]) != block_of(i, size):
                errors.append(f"wrong bytes for block {i}")

    threads = [threading.Thread(target=reader, args=(s,)) for s in range(3)]
    for t in threads:
        t.start()
    for start in range(0, 200, 10):
        tier.write_many([(key_of(i), FP, block_of(i, size)) for i in range(start, start + 10)])
    stop.set()
    for t in threads:
        t.join(5)
    assert not errors
    stats = tier.stats()
    assert stats.verify_failures == 0 and stats.read_failures == 0
    assert stats.evictions > 0


# -- corruption and I/O errors -------------------------------------------------


def test_flipped_byte_is_a_miss_and_dropped(open_tier, tmp_path) -> None:
    tier = open_tier()
    blocks = {key_of(i): block_of(i, 30_000) for i in range(5)}
    tier.write_many([(k, FP, v) for k, v in blocks.items()])
    victim = key_of(2)
    meta = tier.meta(victim)
    assert meta is not None
    with open(tmp_path / "nvme" / "blocks.dat", "r+b") as f:
        f.seek(meta.offset + 12_345)
        byte = f.read(1)
        f.seek(meta.offset + 12_345)
        f.write(bytes([byte[0] ^ 0x40]))
    out = bytearray(30_000)
    assert tier.read_into(victim, out) is None
    stats = tier.stats()
    assert stats.verify_failures == 1 and stats.misses == 1 and stats.hits == 0
    assert tier.contains([victim]) == [False]
    assert tier.read_into(victim, out) is None  # now a plain miss
    assert tier.stats().verify_failures == 1
    for key, data in blocks.items():
        if key != victim:
            assert read(tier, key) == data
    tier.close()
    again = open_tier()
    assert again.contains([victim]) == [False]
    assert again.stats().num_blocks == 4
    # Its slot is reusable.
    assert again.write_many([(victim, FP, blocks[victim])]) == [True]
    assert read(again, victim) == blocks[victim]


def test_truncated_data_file_gives_misses(open_tier, tmp_path) -> None:
    tier = open_tier()
    keys = [key_of(i) for i in range(6)]
    tier.write_many([(k, FP, block_of(i, 9000)) for i, k in enumerate(keys)])
    os.truncate(tmp_path / "nvme" / "blocks.dat", 0)
    for key in keys:
        assert read(tier, key) is None
    stats = tier.stats()
    assert stats.read_failures == 6 and stats.num_blocks == 0 and stats.used_bytes == 0


def test_vanished_data_file_drops_index_on_open(open_tier, tmp_path) -> None:
    tier = open_tier()
    tier.write_many([(key_of(i), FP, b"q" * 5000) for i in range(3)])
    tier.close()
    os.unlink(tmp_path / "nvme" / "blocks.dat")
    again = open_tier()
    assert again.contains([key_of(i) for i in range(3)]) == [False] * 3
    assert again.stats().used_bytes == 0


def test_io_errors_are_counted_not_raised(open_tier, monkeypatch) -> None:
    tier = open_tier()
    keep = block_of(1, 9000)
    tier.write_many([(key_of(1), FP, keep)])

    def no_space(*args: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(blockfile.os, "pwritev", no_space)
        assert tier.write_many([(key_of(i), FP, b"x" * 5000) for i in (2, 3)]) == [False] * 2
    assert tier.stats().write_failures == 2

    def eio(*args: object) -> None:
        raise OSError(errno.EIO, "Input/output error")

    # The filesystem filled before the budget: the tier caps itself at what it
    # holds (12 KiB), so a new block evicts the oldest instead of failing.
    assert tier.write_many([(key_of(5), FP, block_of(5, 9000))]) == [True]
    assert tier.contains([key_of(1), key_of(5)]) == [False, True]
    assert tier.stats().used_bytes == 12 << 10

    with monkeypatch.context() as m:
        m.setattr(blockfile.os, "fdatasync", eio)
        assert tier.write_many([(key_of(4), FP, b"y" * 5000)]) == [False]
    assert tier.stats().write_failures == 3
    assert tier.contains([key_of(i) for i in range(1, 6)]) == [False, False, False, False, False]
    assert tier.stats().used_bytes == 0  # failed slots were given back

    assert tier.write_many([(key_of(6), FP, keep)]) == [True]
    with monkeypatch.context() as m:
        m.setattr(blockfile.os, "preadv", eio)
        out = Aligned(9000)
        assert tier.read_into(key_of(6), out.view) is None
        out.close()  # nothing holds on to the caller's buffer after an error
    assert tier.stats().read_failures == 1
    assert tier.contains([key_of(6)]) == [False]


def test_o_direct_refused_later_falls_back_to_buffered(tmp_path, monkeypatch) -> None:
    tier = NvmeTier(tmp_path, CAPACITY, segment_bytes=SEGMENT)
    if not tier.direct_io_active:
        tier.close()
        pytest.skip("this filesystem has no O_DIRECT")
    real = os.pwritev
    refused: list[int] = []

    def einval_once(fd: int, iov: list, offset: int) -> int:
        if not refused:
            refused.append(fd)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, iov, offset)

    monkeypatch.setattr(blockfile.os, "pwritev", einval_once)
    data = [block_of(i, 10_000) for i in range(3)]
    assert tier.write_many([(key_of(i), FP, d) for i, d in enumerate(data)]) == [True] * 3
    assert refused and not tier.direct_io_active
    for i, d in enumerate(data):
        assert read(tier, key_of(i)) == d
    tier.close()


def test_close_waits_for_reads_in_flight(open_tier) -> None:
    tier = open_tier()
    tier.write_many([(key_of(1), FP, block_of(1, 50_000))])
    in_read, release = threading.Event(), threading.Event()
    real_read = tier._file.read

    def slow_read(offset: int, nbytes: int, out: memoryview) -> int:
        in_read.set()
        assert release.wait(5)
        return real_read(offset, nbytes, out)

    tier._file.read = slow_read  # type: ignore[method-assign]
    result: list[bytes | None] = []
    reader = threading.Thread(target=lambda: result.append(read(tier, key_of(1))))
    reader.start()
    assert in_read.wait(5)
    closer = threading.Thread(target=tier.close)
    closer.start()
    closer.join(0.2)
    assert closer.is_alive()  # waiting for the read
    with pytest.raises(StorageError, match="closed"):
        tier.read_into(key_of(1), bytearray(50_000))
    release.set()
    reader.join(5)
    closer.join(5)
    assert not closer.is_alive()
    assert result == [block_of(1, 50_000)]


# -- bad input and unusable roots ----------------------------------------------


def test_bad_items_raise_before_anything_changes(open_tier) -> None:
    tier = open_tier()
    tier.write_many([(key_of(1), FP, b"k" * 100)])
    with pytest.raises(KeyFormatError):
        tier.write_many([(key_of(2), FP, b"x"), (BlockKey(b"short"), FP, b"y")])
    with pytest.raises(LayoutError):
        tier.write_many([(key_of(2), b"fp", b"x")])
    with pytest.raises(ValueError, match="digest"):
        tier.write_many([(key_of(2), FP, b"x")], digests=[b"abc"])
    with pytest.raises(KeyFormatError):
        tier.read_into(BlockKey(b"x" * 31), bytearray(10))
    with pytest.raises(KeyFormatError):
        tier.remove([BlockKey(b"")])
    assert tier.contains([key_of(1), key_of(2)]) == [True, False]
    assert read(tier, key_of(1)) == b"k" * 100


def test_second_tier_on_same_dir_fails(open_tier, tmp_path) -> None:
    open_tier()
    with pytest.raises(
        StorageError, match=rf"in use by another tierstore process \(pid {os.getpid()}\)"
    ):
        NvmeTier(tmp_path / "nvme", CAPACITY, segment_bytes=SEGMENT)


@pytest.mark.parametrize("case", ["file", "proc", "file_parent"])
def test_unusable_root(tmp_path, case) -> None:
    if case == "file":
        root = tmp_path / "plain"
        root.write_bytes(b"not a dir")
    elif case == "file_parent":
        (tmp_path / "plain").write_bytes(b"")
        root = tmp_path / "plain" / "sub"
    else:
        root = Path("/proc/self/tierstore-nvme")
    with pytest.raises(StorageError, match=re.escape(str(root))):
        NvmeTier(root, CAPACITY, segment_bytes=SEGMENT)


def test_read_only_root_directory(tmp_path) -> None:
    """Permission bits for a user; a read-only mount for root (CI runs as root,
    where mode 0500 does not block a write)."""
    root = tmp_path / "ro"
    root.mkdir()
    if os.geteuid() == 0:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(root)], check=True)
    else:
        root.chmod(0o500)
    try:
        assert not os.access(root, os.W_OK), "the directory is still writable"
        with pytest.raises(StorageError, match="not writable"):
            NvmeTier(root, CAPACITY, segment_bytes=SEGMENT)
    finally:
        if os.geteuid() == 0:
            subprocess.run(["umount", "-l", str(root)], check=False)
        else:
            root.chmod(0o700)


def test_capacity_smaller_than_segment_and_lock_released(tmp_path) -> None:
    from tierstore.errors import ConfigError

    with pytest.raises(ConfigError):
        NvmeTier(tmp_path, SEGMENT - 1, segment_bytes=SEGMENT)
    NvmeTier(tmp_path, CAPACITY, segment_bytes=SEGMENT).close()  # nothing left locked


def test_geometry_change_keeps_recorded_segments(open_tier, tmp_path, caplog) -> None:
    tier = open_tier()
    blocks = {key_of(i): block_of(i, 20_000) for i in range(8)}
    tier.write_many([(k, FP, v) for k, v in blocks.items()])
    tier.close()
    with caplog.at_level(logging.WARNING, logger="tierstore.store.nvme.tier"):
        again = open_tier(segment_bytes=1 << 20)
    assert "segment_bytes=65536" in caplog.text
    assert again.segment_bytes == SEGMENT
    for key, data in blocks.items():
        assert read(again, key) == data


def test_shrunk_capacity_drops_blocks_beyond_it(open_tier) -> None:
    tier = open_tier()
    keys = [key_of(i) for i in range(32)]
    tier.write_many([(k, FP, block_of(i, BLOCK)) for i, k in enumerate(keys)])
    tier.close()
    small = open_tier(capacity=16 * BLOCK)
    held = small.contains(keys)
    assert held == [True] * 16 + [False] * 16
    for i in range(16):
        assert read(small, keys[i]) == block_of(i, BLOCK)
    assert all(small.write_many([(key_of(99), FP, block_of(99, BLOCK))]))
    assert small.stats().evictions == 1


def test_buffered_and_direct_give_identical_results(tmp_path) -> None:
    results = []
    for direct in (True, False):
        tier = NvmeTier(tmp_path / str(direct), CAPACITY, segment_bytes=SEGMENT, direct_io=direct)
        tier.write_many([(key_of(i), FP, block_of(i, n)) for i, n in enumerate(SIZES)])
        results.append([read(tier, key_of(i)) for i in range(len(SIZES))])
        results.append([tier.meta(key_of(i)).digest for i in range(len(SIZES))])  # type: ignore[union-attr]
        if not direct:
            assert not tier.direct_io_active
        tier.close()
    assert results[0] == results[2] and results[1] == results[3]


# -- random operation sequences ------------------------------------------------


class NvmeModel(RuleBasedStateMachine):
    """Capacity large enough that nothing is evicted: the model is exact."""

    capacity = CAPACITY
    keys = Bundle("keys")

    def __init__(self) -> None:
        super().__init__()
        import tempfile

        self.dir = tempfile.TemporaryDirectory()
        self.direct = True
        self.tier = self._open()
        self.model: dict[BlockKey, bytes] = {}

    def _open(self) -> NvmeTier:
        return NvmeTier(
            self.dir.name, self.capacity, segment_bytes=SEGMENT, direct_io=self.direct, sync=False
        )

    @rule(target=keys, i=st.integers(0, 10**6))
    def new_key(self, i: int) -> BlockKey:
        return key_of(i)

    @rule(key=keys, size=st.integers(1, 40_000), seed=st.integers(0, 1000))
    def write(self, key: BlockKey, size: int, seed: int) -> None:
        data = block_of(seed, size)
        assert self.tier.write_many([(key, FP, data)]) == [True]
        self.model.setdefault(key, data)

    @rule(key=keys, aligned=st.booleans())
    def read(self, key: BlockKey, aligned: bool) -> None:
        got = read_any(self.tier, key, 40_000, aligned)
        assert got == self.model.get(key)

    @rule(key=consumes(keys))
    def remove(self, key: BlockKey) -> None:
        assert self.tier.remove([key]) == (1 if key in self.model else 0)
        self.model.pop(key, None)

    @rule(direct=st.booleans())
    def reopen(self, direct: bool) -> None:
        self.tier.close()
        self.direct = direct
        self.tier = self._open()

    @invariant()
    def held_matches_model(self) -> None:
        stats = self.tier.stats()
        assert stats.num_blocks == len(self.model)
        assert stats.verify_failures == stats.read_failures == stats.write_failures == 0

    def teardown(self) -> None:
        self.tier.close()
        self.dir.cleanup()


class NvmeEvictingModel(NvmeModel):
    """Small capacity: blocks may be evicted, but a read never returns wrong bytes."""

    capacity = 4 * SEGMENT

    @rule(key=NvmeModel.keys, size=st.integers(1, 3 * SEGMENT), seed=st.integers(0, 1000))
    def write(self, key: BlockKey, size: int, seed: int) -> None:
        data = block_of(seed, size)
        held_before = self.tier.contains([key])[0]
        ok = self.tier.write_many([(key, FP, data)])[0]
        assert ok  # one block never exceeds capacity, and nothing is pinned
        if not held_before:
            self.model[key] = data

    @rule(key=NvmeModel.keys, aligned=st.booleans())
    def read(self, key: BlockKey, aligned: bool) -> None:
        got = read_any(self.tier, key, 3 * SEGMENT, aligned)
        assert got is None or got == self.model.get(key)

    @rule(key=consumes(NvmeModel.keys))
    def remove(self, key: BlockKey) -> None:
        self.tier.remove([key])
        self.model.pop(key, None)

    @invariant()
    def held_matches_model(self) -> None:
        stats = self.tier.stats()
        held = [k for k in self.model if self.tier.contains([k])[0]]
        assert stats.num_blocks == len(held)
        assert stats.used_bytes <= stats.capacity_bytes
        assert stats.verify_failures == stats.read_failures == 0


TestNvmeModel = NvmeModel.TestCase
TestNvmeModel.settings = settings(max_examples=40, deadline=None, stateful_step_count=25)
TestNvmeEvictingModel = NvmeEvictingModel.TestCase
TestNvmeEvictingModel.settings = settings(max_examples=30, deadline=None, stateful_step_count=25)
