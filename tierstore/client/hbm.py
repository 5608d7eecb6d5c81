"""HBM tier: a device block pool in the engine process.

One flat ``uint8`` tensor of ``capacity_bytes`` on the engine's device (a GPU,
or the CPU where there is none), carved into aligned slots by the same slab
allocator as the DRAM arena, so blocks of several layouts share it. LRU by
default. The tier only tracks slots and hands out views; the client moves
bytes between them and the arena, and writes eviction victims down to the
sidecar before their slots are freed (``take_victims`` then ``free``).

Runs in the engine process. Thread-safe behind one lock.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tierstore.keys import BlockKey
from tierstore.memory.slab import SlabAllocator
from tierstore.policies.eviction import EvictionPolicy, LruPolicy
from tierstore.tiers import TierName, TierStats

HBM_ALIGN_BYTES = 512  # copy kernels and DMA like aligned starts


@dataclass(slots=True)
class HbmEntry:
    key: BlockKey
    layout_fp: bytes
    offset: int
    nbytes: int
    dirty: bool  # not yet written to the sidecar
    evicting: bool = False


class HbmTier:
    name = TierName.HBM

    def __init__(
        self,
        capacity_bytes: int,
        device: Any = "cpu",
        segment_bytes: int = 64 << 20,
        policy: EvictionPolicy | None = None,
    ) -> None:
        segment_bytes = min(segment_bytes, capacity_bytes)
        self.allocator = SlabAllocator(capacity_bytes, segment_bytes, HBM_ALIGN_BYTES)
        self.device = torch.device(device)
        self.pool = torch.empty(
            self.allocator.capacity_bytes, dtype=torch.uint8, device=self.device
        )
        self.policy: EvictionPolicy = policy if policy is not None else LruPolicy()
        self._entries: dict[BlockKey, HbmEntry] = {}
        self._dirty: set[BlockKey] = set()  # not yet written down: flush touches only these
        self._lock = threading.Lock()
        self._stats = TierStats(capacity_bytes=self.allocator.capacity_bytes)

    def contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        with self._lock:
            return [k in self._entries for k in keys]

    def get(self, keys: Sequence[BlockKey]) -> list[torch.Tensor | None]:
        """Views of held blocks (hits) or None (misses)."""
        out: list[torch.Tensor | None] = []
        with self._lock:
            for key in keys:
                entry = self._entries.get(key)
                if entry is None:
                    self._stats.misses += 1
                    out.append(None)
                    continue
                self.policy.touch(key)
                self._stats.hits += 1
                self._stats.bytes_out += entry.nbytes
                out.append(self.pool[entry.offset : entry.offset + entry.nbytes])
        return out

    def allocate(
        self, key: BlockKey, layout_fp: bytes, nbytes: int, dirty: bool
    ) -> torch.Tensor | None:
        """A slot view to copy a block into, or None if the pool is full
        (evict first). The block is visible at once: callers copy before
        anyone can look it up (one engine thread owns the pool's writes)."""
        with self._lock:
            if key in self._entries:
                return None
            offset = self.allocator.alloc(nbytes)
            if offset is None:
                return None
            self._entries[key] = HbmEntry(key, layout_fp, offset, nbytes, dirty)
            if dirty:
                self._dirty.add(key)
            self.policy.insert(key)
            self._stats.bytes_in += nbytes
            return self.pool[offset : offset + nbytes]

    def take_victims(self, want_bytes: int, max_blocks: int) -> list[HbmEntry]:
        """Remove victims from the policy (they stay readable) until
        ``want_bytes`` would be freed; the caller writes dirty ones down, then ``free``s."""
        victims: list[HbmEntry] = []
        freed = 0
        with self._lock:
            while freed < want_bytes and len(victims) < max_blocks:
                key = self.policy.evict(lambda k: not self._entries[k].evicting)
                if key is None:
                    break
                entry = self._entries[key]
                entry.evicting = True
                victims.append(entry)
                freed += entry.nbytes
        return victims

    def view(self, entry: HbmEntry) -> torch.Tensor:
        return self.pool[entry.offset : entry.offset + entry.nbytes]

    def free(self, entries: Sequence[HbmEntry]) -> None:
        with self._lock:
            for entry in entries:
                if self._entries.get(entry.key) is entry:
                    del self._entries[entry.key]
                    self._dirty.discard(entry.key)
                    self.policy.remove(entry.key)
                    self.allocator.free(entry.offset)
                    self._stats.evictions += 1

    def dirty(self) -> list[HbmEntry]:
        with self._lock:
            return [self._entries[k] for k in self._dirty]

    def hold_dirty(self) -> list[HbmEntry]:
        """The dirty blocks, taken out of eviction's way (readable, never a
        victim) until ``unhold``: a flush writes them down without the lock."""
        with self._lock:
            held = [e for k in self._dirty if not (e := self._entries[k]).evicting]
            for e in held:
                self.policy.remove(e.key)
                e.evicting = True
            return held

    def unhold(self, entries: Sequence[HbmEntry]) -> None:
        with self._lock:
            for e in entries:
                if self._entries.get(e.key) is e and e.evicting:
                    e.evicting = False
                    self.policy.insert(e.key)

    def mark_clean(self, keys: Sequence[BlockKey]) -> None:
        with self._lock:
            for key in keys:
                if (entry := self._entries.get(key)) is not None:
                    entry.dirty = False
                    self._dirty.discard(key)

    def remove(self, keys: Sequence[BlockKey]) -> int:
        with self._lock:
            entries = [self._entries[k] for k in keys if k in self._entries]
        self.free(entries)
        return len(entries)

    def stats(self) -> TierStats:
        with self._lock:
            snap = self._stats.snapshot()
            snap.used_bytes = self.allocator.used_bytes
            snap.num_blocks = len(self._entries)
            return snap

    def close(self) -> None:
        with self._lock:
            self._entries.clear()
            self._dirty.clear()
