"""The local tiers as the remote tier's block source: DRAM or NVMe -> upload.

Provides ``HeldBlockSource``, which the tiered store sets as its remote
tier's ``source``: for a write-through upload it copies a held block into
the upload buffer, from DRAM (pinned for the copy) or else from NVMe (read
and verified), and returns the block's digest; None when the block is no
longer held, or is held under another layout or size.

Like the remote puller (``tierstore.store.remote.pull``), it gets its
collaborators explicitly (the DRAM and NVMe tiers and the digest function)
and never calls back into the store. Runs on the remote tier's upload
thread.
"""

from __future__ import annotations

from collections.abc import Callable

from tierstore.keys import BlockKey, KVLayout
from tierstore.memory.memcopy import copy_into
from tierstore.store.dram import STORE_OWNER, DramEntry, DramTier
from tierstore.store.nvme.tier import NvmeTier


class HeldBlockSource:
    """A ``BlockSource`` over ``dram`` and ``nvme``. See the module docstring."""

    def __init__(
        self, dram: DramTier, nvme: NvmeTier | None, digest: Callable[[DramEntry], bytes]
    ) -> None:
        self._dram = dram
        self._nvme = nvme
        self._digest = digest

    def __call__(self, layout: KVLayout, key: BlockKey, out: memoryview) -> bytes | None:
        """Copy a held block into ``out`` for a write-through upload; its digest or None."""
        entry = self._dram.pin([key], STORE_OWNER)[0]
        if entry is not None:
            try:
                if entry.layout_fp != layout.fingerprint or entry.nbytes != out.nbytes:
                    return None
                copy_into(out, self._dram.view(entry))
                return self._digest(entry)
            finally:
                self._dram.unpin([key], STORE_OWNER)
        if self._nvme is not None:
            meta = self._nvme.meta(key)
            if meta is not None and meta.layout_fp == layout.fingerprint:
                if self._nvme.read_into(key, out) == out.nbytes:
                    return meta.digest
        return None
