"""An in-memory stand-in for the NVMe tier, for unit tests of the tiered store
and of promotion: the same methods the store calls, a dict instead of a disk,
and switches to make a read fail, corrupt or raise."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import blake3

from tierstore.config.store import StoreConfig
from tierstore.counters import Counters
from tierstore.keys import BlockKey
from tierstore.load import RateMeter
from tierstore.memory.arena import Arena
from tierstore.store.nvme.tier import NvmeTier
from tierstore.store.tiered import TieredStore
from tierstore.tiers import TierName, TierStats


@dataclass(frozen=True, slots=True)
class FakeMeta:
    nbytes: int
    layout_fp: bytes
    digest: bytes


class FakeNvme:
    """Holds up to ``capacity_blocks`` blocks, LRU; every read is verified."""

    name = TierName.NVME

    def __init__(self, capacity_blocks: int = 1 << 20) -> None:
        self.capacity_blocks = capacity_blocks
        self.blocks: OrderedDict[BlockKey, tuple[bytes, bytes, bytes]] = OrderedDict()
        self.events: Any = None
        self.evict_first: Callable[[], list[BlockKey]] | None = None
        self.read_rate = RateMeter()
        self.reads = 0
        self.writes = 0
        self.hashes = 0  # blocks this tier hashed itself (no digest was given)
        self.fail_writes = False
        self.corrupt: set[BlockKey] = set()  # reads of these return flipped bytes
        self.raise_on: set[BlockKey] = set()
        self.closed = False
        self.stats_ = TierStats(capacity_bytes=0)
        self.counters = Counters(())  # the real tier's disk-full figures; none here
        self.root: Path | None = None  # no directory: no drain report is kept
        self.write_delay_s = 0.0  # each write_many takes at least this long (a slow disk)
        self.on_write: Callable[[], None] | None = None  # called as each write_many starts

    def contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        return [k in self.blocks for k in keys]

    def meta(self, key: BlockKey) -> FakeMeta | None:
        held = self.blocks.get(key)
        return None if held is None else FakeMeta(len(held[0]), held[1], held[2])

    def write_many(
        self,
        items: Sequence[tuple[BlockKey, bytes, Any]],
        digests: Sequence[bytes | None] | None = None,
    ) -> list[bool]:
        if self.on_write is not None:
            self.on_write()
        if self.write_delay_s:
            time.sleep(self.write_delay_s)
        out = []
        for i, (key, fp, data) in enumerate(items):
            if self.fail_writes:
                out.append(False)
                continue
            digest = digests[i] if digests is not None else None
            raw = bytes(data)
            if digest is None:
                self.hashes += 1
                digest = blake3.blake3(raw).digest()
            while len(self.blocks) >= self.capacity_blocks:
                self.blocks.popitem(last=False)
            self.blocks[key] = (raw, bytes(fp), digest)
            self.writes += 1
            out.append(True)
        return out

    def read_into(self, key: BlockKey, out: Any, *, in_parallel: bool = False) -> int | None:
        self.reads += 1
        if key in self.raise_on:
            raise OSError(5, "injected I/O error")
        held = self.blocks.get(key)
        if held is None:
            return None
        data, _, digest = held
        if key in self.corrupt:
            data = bytes([data[0] ^ 0xFF]) + data[1:]
        if blake3.blake3(data).digest() != digest:
            del self.blocks[key]  # dropped: a miss from now on
            self.stats_.verify_failures += 1
            return None
        memoryview(out)[: len(data)] = data
        self.blocks.move_to_end(key)
        return len(data)

    def remove(self, keys: Sequence[BlockKey]) -> int:
        return sum(self.blocks.pop(k, None) is not None for k in keys)

    def held_keys(self) -> list[BlockKey]:
        return list(self.blocks)

    def stats(self) -> TierStats:
        s = self.stats_.snapshot()
        s.num_blocks = len(self.blocks)
        return s

    def close(self) -> None:
        self.closed = True


def store_over(nvme: FakeNvme, tmp_path: Path, dram_bytes: int, **settings: Any) -> TieredStore:
    """A tiered store with ``dram_bytes`` of DRAM in one segment and ``nvme``
    under it; ``settings``: more StoreConfig fields."""
    cfg = StoreConfig(
        dram_bytes=dram_bytes,
        dram_segment_bytes=dram_bytes,
        nvme_dir=str(tmp_path / "unused"),
        **settings,
    )
    arena = Arena.create(cfg.dram_bytes, cfg.shm_dir)
    return TieredStore(cfg, arena=arena, nvme=cast(NvmeTier, nvme))
