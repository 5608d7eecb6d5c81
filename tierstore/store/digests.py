"""Hash once: the blake3 digests of DRAM blocks, kept with their entries.

Provides ``BlockDigests``: ``digest`` (a pinned block's digest, computed now
only if nobody has yet) and ``hash_committed`` (the background hasher's
step over just-committed entries, skipping those already freed). Both
count each pass over a block as ``digests_computed``. The tiered store
makes one and hands ``digest`` to the demoter and the remote tier's block
source, and ``hash_committed`` to its ``CommitHasher``
(``tierstore.store.hasher``).

Threads: ``digest`` runs on whichever store thread needs a digest (a
caller, the demoter, the remote tier's uploader); ``hash_committed`` on the
"tierstore-hasher" thread. Nothing is locked: two threads may hash the
same block at once (both get the same digest, and both count the pass).
"""

from __future__ import annotations

import blake3

from tierstore.counters import Counters
from tierstore.store.dram import DramEntry, DramTier
from tierstore.store.nvme.tier import block_digest

# blake3 passes over DRAM blocks (hash once: one per block)
DIGEST_COUNTERS = ("digests_computed",)


class BlockDigests:
    """Digests of ``dram``'s blocks; ``counters`` gets ``DIGEST_COUNTERS``."""

    def __init__(self, dram: DramTier, counters: Counters) -> None:
        self._dram = dram
        self._counters = counters

    def digest(self, entry: DramEntry) -> bytes:
        """blake3 of a pinned block's bytes, computed once and kept with the entry
        (normally by the hasher, right after the commit)."""
        if entry.digest is None:
            entry.digest = block_digest(self._dram.view(entry))
            self._counters.add("digests_computed")
        return entry.digest

    def hash_committed(self, entries: list[DramEntry]) -> None:
        """The hasher's step: hash the blocks still held (freed ones are skipped)."""
        n = 0
        for entry, alive in zip(entries, self._dram.alive(entries)):
            if alive and entry.digest is None:
                # One thread: the hasher runs beside the engine's copies and
                # must leave them the other cores (blake3's AUTO mode takes all).
                entry.digest = blake3.blake3(self._dram.view(entry)).digest()
                n += 1
        self._counters.add("digests_computed", n)
