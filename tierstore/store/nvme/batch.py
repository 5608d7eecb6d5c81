"""The parts of an NVMe write batch that need none of the tier's state.

Provides, for ``NvmeTier`` (``nvme``):
- ``prepare_item``: validate one ``(key, layout fingerprint, bytes)`` item and
  its optional digest (caller errors raise) before anything is changed.
- ``block_digest`` / ``block_hasher``: the blake3 digest every block carries
  (multithreaded for large blocks); reads verify against it with the same
  hasher.
- ``WriteBatch``: one ``write_many`` call: its validated items (keys
  repeated in a batch are written once), the blocks that got a slot
  (``Planned``), the victims evicted for them, and each item's result.
- ``VictimOrder``: the order a batch evicts blocks in: the store's
  ``evict_first`` keys, then the eviction policy's order.
- ``write_and_hash``: write a batch's bytes to the data file, hashing the
  blocks that came without a digest meanwhile; failures are logged
  (rate-limited, on the ``tierstore.store.nvme.tier`` logger) and left out.

Runs in the sidecar process, on the thread that calls ``NvmeTier.write_many``
(``write_and_hash`` under the tier's write lock, with one short-lived hashing
thread for large batches). A WriteBatch belongs to that thread alone.
``block_digest`` is thread-safe and pure; the store uses it too.
"""

from __future__ import annotations

import errno
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import blake3

from tierstore.errors import LayoutError
from tierstore.keys import BlockKey, check_key
from tierstore.policies.eviction import EvictionPolicy
from tierstore.ratelog import RateLimitedLog
from tierstore.store.nvme.blockfile import BlockFile
from tierstore.store.nvme.index import NvmeEntry

if TYPE_CHECKING:
    from typing_extensions import Buffer  # collections.abc.Buffer from Python 3.12

_faults = RateLimitedLog(logging.getLogger("tierstore.store.nvme.tier"))

DIGEST_BYTES = 32
FINGERPRINT_BYTES = 32
PARALLEL_HASH_MIN_BYTES = 1 << 20
"""Blocks at least this large are hashed with blake3's multithreaded mode."""
OVERLAP_HASH_MIN_BYTES = 4 << 20
"""Write batches with at least this many bytes to hash are hashed in a helper
thread while the data is written (below it, a thread costs more than it saves)."""

PreparedItem = tuple[BlockKey, bytes, memoryview, bytes | None]
"""A validated write item: key, layout fingerprint, its bytes, digest if given."""


def block_digest(data: Buffer) -> bytes:
    """blake3 of ``data``; multithreaded for large blocks."""
    hasher = block_hasher(memoryview(data).nbytes)
    hasher.update(data)
    return hasher.digest()


def block_hasher(nbytes: int) -> blake3.blake3:
    """A fresh blake3 hasher for a block of ``nbytes``."""
    if nbytes >= PARALLEL_HASH_MIN_BYTES:
        return blake3.blake3(max_threads=blake3.blake3.AUTO)
    return blake3.blake3()


def prepare_item(item: tuple[BlockKey, bytes, Buffer], digest: bytes | None) -> PreparedItem:
    """Validate one write item (caller errors raise) and view its bytes."""
    key, layout_fp, data = item
    key = check_key(key)
    layout_fp = bytes(layout_fp)
    if len(layout_fp) != FINGERPRINT_BYTES:
        raise LayoutError(
            f"layout fingerprint must be {FINGERPRINT_BYTES} bytes, got {len(layout_fp)}"
        )
    if digest is not None and len(digest) != DIGEST_BYTES:
        raise ValueError(f"block digest must be {DIGEST_BYTES} bytes, got {len(digest)}")
    return key, layout_fp, memoryview(data).cast("B"), bytes(digest) if digest else None


@dataclass(slots=True)
class Planned:
    """One block of a write batch that got a slot."""

    index: int
    entry: NvmeEntry
    data: memoryview


@dataclass(slots=True)
class WriteBatch:
    """One write batch; the tier fills in ``planned``, ``victims`` and ``results``."""

    items: list[PreparedItem]
    results: list[bool]  # per item: whether the tier holds it now
    planned: list[Planned] = field(default_factory=list)
    victims: list[NvmeEntry] = field(default_factory=list)  # evicted to make room
    first_of: dict[int, int] = field(default_factory=dict)  # duplicate item -> its first

    @classmethod
    def prepare(
        cls,
        items: Sequence[tuple[BlockKey, bytes, Buffer]],
        digests: Sequence[bytes | None] | None,
    ) -> WriteBatch:
        """Validate every item; a caller error raises before anything is changed."""
        if digests is not None and len(digests) != len(items):
            raise ValueError(f"got {len(digests)} digests for {len(items)} items")
        prepared = [
            prepare_item(item, digests[i] if digests is not None else None)
            for i, item in enumerate(items)
        ]
        return cls(prepared, [False] * len(items))

    def unique(self) -> Iterator[tuple[int, PreparedItem]]:
        """The items with their positions, each key's first occurrence only."""
        seen: dict[BlockKey, int] = {}
        for i, item in enumerate(self.items):
            if item[0] in seen:
                self.first_of[i] = seen[item[0]]
                continue
            seen[item[0]] = i
            yield i, item

    def outcome(self) -> list[bool]:
        """Per item, whether the tier holds it (a repeated key as its first)."""
        for i, first in self.first_of.items():
            self.results[i] = self.results[first]
        return self.results


class VictimOrder:
    """The blocks a write batch evicts, in order: first the keys of ``first``
    (the store's replicas of other hosts, oldest first; asked for once per
    batch and only if the batch has to evict), then the policy's order.
    Used under the tier's lock."""

    def __init__(self, first: Callable[[], list[BlockKey]] | None, policy: EvictionPolicy) -> None:
        self._first = first
        self._first_keys: Iterator[BlockKey] | None = None
        self._policy = policy

    def next(
        self, entries: dict[BlockKey, NvmeEntry], can_evict: Callable[[BlockKey], bool]
    ) -> BlockKey | None:
        """The next victim, already removed from the policy, or None."""
        victim = self._next_first(entries, can_evict)
        if victim is not None:
            self._policy.remove(victim)
            return victim
        return self._policy.evict(can_evict)

    def _next_first(
        self, entries: dict[BlockKey, NvmeEntry], can_evict: Callable[[BlockKey], bool]
    ) -> BlockKey | None:
        if self._first is None:
            return None
        if self._first_keys is None:
            self._first_keys = iter(self._first())
        for key in self._first_keys:
            if key in entries and can_evict(key):
                return key
        return None


def write_and_hash(file: BlockFile, planned: list[Planned]) -> tuple[list[Planned], bool]:
    """Write the batch's data and hash the blocks that came without a digest
    meanwhile (the digest is needed only for the index commit); returns the
    blocks written and whether a write failed for want of space (ENOSPC).
    The caller serialises writes to ``file``."""
    errors = _write_and_hash(file, planned)
    written = [p for p, err in zip(planned, errors, strict=True) if err is None]
    failed = [err for err in errors if err is not None]
    if failed:
        _faults.warning(
            "write", "NVMe write of %d blocks to %s failed: %s",
            len(failed), file.path, failed[0],
        )  # fmt: skip
    return written, any(err.errno == errno.ENOSPC for err in failed)


def _write_and_hash(file: BlockFile, planned: list[Planned]) -> list[OSError | None]:
    unhashed = [p for p in planned if not p.entry.digest]

    def hash_all() -> None:
        for p in unhashed:
            p.entry.digest = block_digest(p.data)

    if sum(p.data.nbytes for p in unhashed) < OVERLAP_HASH_MIN_BYTES:
        hash_all()
        return file.write_batch([(p.entry.offset, p.data) for p in planned])
    # blake3 and pwritev both release the GIL, so the hash overlaps the
    # disk write (measured on 32 MiB batches of 2 MiB blocks: ~75% of raw
    # O_DIRECT write speed with the hash first, ~90% overlapped).
    hasher = threading.Thread(target=hash_all, name="nvme-hash", daemon=True)
    hasher.start()
    try:
        return file.write_batch([(p.entry.offset, p.data) for p in planned])
    finally:
        hasher.join()
        if any(not p.entry.digest for p in unhashed):
            raise RuntimeError("hashing a write batch failed (see the thread's traceback)")


__all__ = [
    "DIGEST_BYTES",
    "FINGERPRINT_BYTES",
    "Planned",
    "PreparedItem",
    "VictimOrder",
    "WriteBatch",
    "block_digest",
    "block_hasher",
    "prepare_item",
    "write_and_hash",
]
