"""The HBM tier's traffic: filling the engine's device pool, evicting from it.

Provides ``HbmWriter``, which owns the lock that serialises the pool's writes
and moves blocks between the pool (``HbmTier``), the caller's rows and the
sidecar: ``put`` (store blocks in HBM, evicting LRU blocks for room),
``read_into`` (copy one hit out), ``promote`` (keep blocks just read from the
arena), ``flush`` (write every HBM-only block down) and ``pull`` (bring a
prefix the sidecar holds into HBM, for a prefetch). Dirty victims are written
down before their slots are freed.

It reaches the sidecar only through the callables it is given: ``write_down``
(reserve, copy, commit a batch of rows) and ``load_into`` (copy a prefix out
of the arena, promoting it into HBM), and the client's layouts by fingerprint.

Runs in the engine process, on the threads that call ``StoreClient`` and on
its background (prefetch) thread. Thread-safe: writes to the pool, and hit
copies, happen under one lock; the lock is let go while victims are written
down, so other threads' HBM hits do not wait on the sidecar.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence

import torch

from tierstore.client.copier import ArenaCopier
from tierstore.client.hbm import HbmEntry, HbmTier
from tierstore.keys import BlockKey, KVLayout

HBM_PULL_CHUNK_BLOCKS = 64  # arena pins held at once while a prefetch fills HBM

# (layout, keys, rows) -> whether the sidecar holds each block now
WriteDown = Callable[[KVLayout, list[BlockKey], list[torch.Tensor]], list[bool]]
# (layout, keys) -> length of the prefix pinned in the arena, whose blocks
# were offered to ``promote`` (each copied into HBM if a slot was found)
LoadInto = Callable[[KVLayout, list[BlockKey]], int]


class HbmWriter:
    """See the module docstring. ``layouts`` is the client's registry of the
    layouts it registered (read only here): a dirty block is written down
    under the layout it was stored with."""

    def __init__(
        self,
        hbm: HbmTier,
        copier: ArenaCopier,
        layouts: Mapping[bytes, KVLayout],
        write_down: WriteDown,
        load_into: LoadInto,
        evict_batch_blocks: int,
    ) -> None:
        self.hbm = hbm
        self.evict_batch_blocks = evict_batch_blocks
        self._copier = copier
        self._layouts = layouts
        self._write_down = write_down
        self._load_into = load_into
        self._lock = threading.Lock()

    def put(
        self, layout: KVLayout, keys: list[BlockKey], rows: Sequence[torch.Tensor], dirty: bool
    ) -> list[bool]:
        """Copy ``rows`` into pool slots (keys already held are skipped),
        evicting for room. The copies are queued, not waited for: the caller
        ``sync``s the copier. Returns whether each block is held."""
        held = [True] * len(keys)
        with self._lock:
            in_hbm = self.hbm.contains(keys)
            for i, (key, row) in enumerate(zip(keys, rows)):
                if in_hbm[i]:
                    continue
                slot = self._slot(key, layout, dirty)
                if slot is None:
                    held[i] = False
                    continue
                self._copier.copy(slot, row, wait=False)
        return held

    def read_into(self, key: BlockKey, row: torch.Tensor) -> bool:
        """Copy ``key``'s block into ``row`` if the pool holds it. Under the
        lock: a prefetch thread evicting this block could otherwise reuse its
        slot between get and copy."""
        with self._lock:
            (view,) = self.hbm.get([key])
            if view is not None:
                self._copier.copy(row, view)
        return view is not None

    def promote(
        self, layout: KVLayout, keys: Sequence[BlockKey], views: Sequence[torch.Tensor]
    ) -> None:
        """Keep clean copies of blocks just read (``views`` into the arena)."""
        with self._lock:
            for key, view in zip(keys, views):
                slot = self._slot(key, layout, dirty=False)
                if slot is not None:
                    self._copier.copy(slot, view)

    def flush(self) -> int:
        """Write every HBM-only block down to the sidecar. Returns how many."""
        with self._lock:
            # Held: out of eviction's way, so their slots are not reused while
            # they are written down without the lock.
            dirty = self.hbm.hold_dirty()
        try:
            for fp, entries in _by_layout(dirty).items():
                keys = [e.key for e in entries]
                self._write_down(self._layouts[fp], keys, [self.hbm.view(e) for e in entries])
                self.hbm.mark_clean(keys)
        finally:
            self.hbm.unhold(dirty)
        return len(dirty)

    def pull(self, layout: KVLayout, keys: list[BlockKey]) -> int:
        """Copy the available prefix of ``keys`` into HBM (what is not there
        yet), ``HBM_PULL_CHUNK_BLOCKS`` pins at a time. Returns the length of
        the prefix now in HBM."""
        for lo in range(0, len(keys), HBM_PULL_CHUNK_BLOCKS):
            chunk = keys[lo : lo + HBM_PULL_CHUNK_BLOCKS]
            missing = [k for k, held in zip(chunk, self.hbm.contains(chunk)) if not held]
            if missing and self._load_into(layout, missing) < len(missing):
                break  # a gap: evicted meanwhile
        in_hbm = self.hbm.contains(keys)
        return in_hbm.index(False) if False in in_hbm else len(keys)

    def _slot(self, key: BlockKey, layout: KVLayout, dirty: bool) -> torch.Tensor | None:
        """A pool slot for ``key``, evicting (and writing down) LRU blocks. Lock held."""
        nbytes = layout.block_bytes
        slot = self.hbm.allocate(key, layout.fingerprint, nbytes, dirty)
        while slot is None and not self.hbm.contains([key])[0]:
            victims = self.hbm.take_victims(nbytes, max_blocks=self.evict_batch_blocks)
            if not victims:
                return None
            self._evict(victims)
            slot = self.hbm.allocate(key, layout.fingerprint, nbytes, dirty)
        return slot

    def _evict(self, victims: list[HbmEntry]) -> None:
        """Write dirty victims down, then free their slots. Called with the
        lock held; it is let go during the write-down (control calls and
        copies). The victims stay readable and are not reused meanwhile
        (taken, not freed)."""
        by_layout = _by_layout([v for v in victims if v.dirty])
        if by_layout:
            self._lock.release()
            try:
                for fp, entries in by_layout.items():
                    keys = [e.key for e in entries]
                    self._write_down(self._layouts[fp], keys, [self.hbm.view(e) for e in entries])
            finally:
                self._lock.acquire()
        self.hbm.free(victims)


def _by_layout(entries: Sequence[HbmEntry]) -> dict[bytes, list[HbmEntry]]:
    """``entries`` grouped by layout fingerprint, in order."""
    groups: dict[bytes, list[HbmEntry]] = {}
    for e in entries:
        groups.setdefault(e.layout_fp, []).append(e)
    return groups
