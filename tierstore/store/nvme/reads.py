"""The NVMe tier's reads: pins on the slots being read, and one verified read.

Provides, for ``NvmeTier.read_into`` (``tier``):
- ``SlotPins``: a count of the reads copying each slot. A pinned slot is
  never evicted, reused or freed; a block dropped while pinned (it failed
  verification) has its slot *retired*, freed at its last unpin; ``close``
  waits until no slot is pinned.
- ``read_verified``: read one block's bytes into a buffer and check them
  against its blake3 digest; a block that fails is logged (rate-limited, on
  the tier's logger), and the tier drops it. A lone read overlaps its own verify with the
  disk (chunks of ``READ_CHUNK_BYTES`` read on a helper thread of the data
  file, a multithreaded hash); a read among others in flight is one request
  hashed on the caller's thread, so reads overlap each other instead, with
  no extra threads to crowd the cores.

Runs in the sidecar process, on the threads that call ``read_into`` (any
number at once). ``SlotPins`` is guarded by the tier's lock, which the
caller holds for every call; ``read_verified`` takes no lock.
"""

from __future__ import annotations

import logging
import threading

import blake3

from tierstore.ratelog import RateLimitedLog
from tierstore.store.nvme.batch import block_hasher
from tierstore.store.nvme.blockfile import IO_ERRNOS, BlockFile
from tierstore.store.nvme.index import NvmeEntry

_faults = RateLimitedLog(logging.getLogger("tierstore.store.nvme.tier"))
READ_CHUNK_BYTES = 512 << 10
"""Blocks larger than this are read in chunks of it, each hashed while the next
is read (measured ~10% faster than read-then-hash for 2 MiB blocks)."""


class SlotPins:
    """Slot offset -> reads copying it. Every call holds ``lock`` (the tier's)."""

    def __init__(self, lock: threading.Lock) -> None:
        self._counts: dict[int, int] = {}
        self._retired: set[int] = set()  # slots dropped while pinned; freed at unpin
        self._unpinned = threading.Condition(lock)

    def __contains__(self, offset: int) -> bool:
        return offset in self._counts

    def pin(self, offset: int) -> None:
        self._counts[offset] = self._counts.get(offset, 0) + 1

    def retire(self, offset: int) -> None:
        """The pinned slot's block was dropped: free the slot at its last unpin."""
        self._retired.add(offset)

    def unpin(self, offset: int) -> bool:
        """Drop one pin; True when that was the last one of a retired slot,
        which the caller frees now."""
        count = self._counts[offset] - 1
        if count:
            self._counts[offset] = count
            return False
        del self._counts[offset]
        retired = offset in self._retired
        self._retired.discard(offset)
        self._unpinned.notify_all()
        return retired

    def wait_unpinned(self) -> None:
        """Wait until no slot is pinned (releases the lock meanwhile)."""
        while self._counts:
            self._unpinned.wait()


def read_verified(
    file: BlockFile, entry: NvmeEntry, out: memoryview, *, in_parallel: bool
) -> tuple[bool, bool]:
    """Read ``entry``'s block into ``out[:nbytes]`` and hash it meanwhile:
    (read in full, verified), with a warning when not verified. An I/O error
    of the disk is a read not in full; other OSErrors raise."""
    nbytes = entry.nbytes
    hasher = blake3.blake3() if in_parallel else block_hasher(nbytes)
    chunk_bytes = nbytes if in_parallel else READ_CHUNK_BYTES
    try:
        got = file.read_streamed(entry.offset, nbytes, out, hasher.update, chunk_bytes)
    except OSError as e:
        if e.errno not in IO_ERRNOS:
            raise
        got = -1
    in_full = got == nbytes
    verified = in_full and hasher.digest() == entry.digest
    if not verified:
        _faults.warning(
            "read" if not in_full else "verify",
            "NVMe block at offset %d of %s %s; dropped (a miss, never served)",
            entry.offset,
            file.path,
            "failed blake3 verification" if in_full else "could not be read in full",
        )
    return in_full, verified
