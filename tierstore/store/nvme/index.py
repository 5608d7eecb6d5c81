"""The NVMe tier's directory and its LMDB index.

Provides:
- ``open_root``: open or create the whole directory for ``NvmeTier``: lock it,
  open the index, fix the data file's geometry, open ``blocks.dat`` and
  rebuild the allocator from the index (``OpenedRoot``), dropping rows that
  do not fit the data file.
- ``prepare_root`` / ``lock_root``: create and probe the tier's directory, and
  hold ``LOCK`` (fcntl.flock, exclusive, with the owner's pid written in it).
- ``NvmeEntry``: what the index holds about one block, and its record format.
- ``NvmeIndex``: the LMDB environment (``index.lmdb/``) with two named
  databases: ``blocks`` (key -> record) and ``meta`` (format version and
  ``segment_bytes``, which fixes where slots are in the data file). It keeps
  ``reserve_bytes`` of disk allocated past the end of ``data.mdb``
  (``fallocate(FALLOC_FL_KEEP_SIZE)``, topped up after each commit that grew
  the file), so that index commits still find room when the data file has
  filled the disk.

Record of one block, 88 bytes, ``<QQ32s32sd``: offset in the data file,
nbytes, blake3 digest of the bytes, layout fingerprint, last access
(seconds since the epoch).

Threads: ``open_root`` runs on the thread constructing the NvmeTier, before
any other thread can see it. The owning NvmeTier serialises every write
transaction (one writer, as LMDB requires). Every transaction is in a
``with``. Never use an environment across ``fork()``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import logging
import os
import struct
from collections.abc import Iterable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lmdb

from tierstore.errors import StorageError
from tierstore.keys import KEY_BYTES, BlockKey
from tierstore.memory.slab import SlabAllocator
from tierstore.store.nvme.blockfile import ALIGN_BYTES, BlockFile, round_up

logger = logging.getLogger("tierstore.store.nvme.tier")

FORMAT_VERSION = 1
_RECORD = struct.Struct("<QQ32s32sd")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_META_FORMAT = b"format_version"
_META_SEGMENT = b"segment_bytes"
_MIN_MAP_BYTES = 1 << 30
_MAP_BYTES_PER_SLOT = 512
"""LMDB map size per smallest possible slot (4 KiB): one row is ~128 bytes in a
leaf page; x4 covers half-full pages, branch pages and copy-on-write space.
The map is a sparse reservation of address space; the file grows as used."""


@dataclass(slots=True)
class NvmeEntry:
    """What the index holds about one block. ``NvmeTier.meta`` hands out copies."""

    key: BlockKey
    layout_fp: bytes
    offset: int
    nbytes: int
    digest: bytes
    last_access_s: float

    def pack(self) -> bytes:
        return _RECORD.pack(
            self.offset, self.nbytes, self.digest, self.layout_fp, self.last_access_s
        )

    @classmethod
    def unpack(cls, key: bytes, record: bytes) -> NvmeEntry:
        offset, nbytes, digest, layout_fp, last_access_s = _RECORD.unpack(record)
        return cls(BlockKey(key), layout_fp, offset, nbytes, digest, last_access_s)


def prepare_root(root: Path) -> None:
    """Create ``root`` and prove it writable with a real write (permission bits
    say nothing when running as root), or raise StorageError naming why."""
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise StorageError(
            f"NVMe tier directory {root} cannot be created: {e.strerror or e}"
        ) from e
    if not root.is_dir():
        raise StorageError(f"NVMe tier directory {root} is not a directory")
    probe = root / f".write-probe-{os.getpid()}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, b"x")
        finally:
            os.close(fd)
        probe.unlink()
    except OSError as e:
        if e.errno == errno.ENOSPC:  # writable, but full: serve what it holds (capped)
            probe.unlink(missing_ok=True)
            logger.warning("NVMe tier directory %s: the disk is full", root)
            return
        raise StorageError(f"NVMe tier directory {root} is not writable: {e.strerror or e}") from e


def lock_root(root: Path) -> int:
    """Hold ``root/LOCK`` exclusively; returns its fd (closing it unlocks).

    flock conflicts between open files, so a second tier on the same directory
    fails in this process as in any other.
    """
    path = root / "LOCK"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise StorageError(f"cannot open {path}: {e.strerror or e}") from e
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        owner = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
        os.close(fd)
        raise StorageError(
            f"NVMe tier directory {root} is in use by another tierstore process (pid {owner})"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode("ascii"), 0)
    return fd


FALLOC_FL_KEEP_SIZE = 1


def _libc_fallocate() -> Any:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = libc.fallocate
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    fn.restype = ctypes.c_int
    return fn


_fallocate = _libc_fallocate()


def derived_index_reserve_bytes(capacity_bytes: int) -> int:
    """The index reserve when none is configured: 1/1024 of the tier's budget
    (an index row is ~128 bytes, a block at least 4 KiB), 1-64 MiB."""
    return min(64 << 20, max(1 << 20, capacity_bytes // 1024))


class NvmeIndex:
    """The LMDB environment of one tier. Raises lmdb.Error from write paths."""

    def __init__(
        self, path: Path, capacity_bytes: int, *, sync: bool, reserve_bytes: int = 0
    ) -> None:
        self.path = path
        self.reserve_bytes = reserve_bytes
        self.reserve_shortfalls = 0  # top-ups the disk could not give in full
        self._data_fd = -1
        self._reserved_at = -1  # data.mdb size the reserve was last topped up at
        map_bytes = max(_MIN_MAP_BYTES, capacity_bytes // ALIGN_BYTES * _MAP_BYTES_PER_SLOT)
        try:
            self._env = lmdb.open(
                str(path),
                map_size=round_up(map_bytes, 1 << 20),
                subdir=True,
                max_dbs=2,
                sync=sync,
                metasync=sync,
                writemap=False,
                lock=True,
                readahead=False,
                meminit=False,
            )
            self._blocks = self._env.open_db(b"blocks")
            self._meta = self._env.open_db(b"meta")
        except lmdb.Error as e:
            raise StorageError(f"cannot open the NVMe index {path}: {e}") from e
        if reserve_bytes > 0:
            try:
                self._data_fd = os.open(path / "data.mdb", os.O_RDWR | os.O_CLOEXEC)
            except OSError as e:
                logger.warning("NVMe index %s: no room reserved (%s)", path, e)
            self.top_up_reserve()

    def top_up_reserve(self) -> bool:
        """Keep ``reserve_bytes`` allocated past the index file's end (a no-op
        unless the file grew). False if the disk could not give it all."""
        if self._data_fd < 0 or _fallocate is None:
            return True
        size = os.fstat(self._data_fd).st_size
        if size == self._reserved_at:
            return True
        if _fallocate(self._data_fd, FALLOC_FL_KEEP_SIZE, size, self.reserve_bytes) == 0:
            self._reserved_at = size
            return True
        err = ctypes.get_errno()
        if err in (errno.EOPNOTSUPP, errno.ENOSYS):
            logger.warning("NVMe index %s: this filesystem cannot reserve room", self.path)
            os.close(self._data_fd)
            self._data_fd = -1
            return True
        self.reserve_shortfalls += 1
        return False

    def segment_bytes(self, requested: int) -> int:
        """The segment size that defines the data file's layout: the recorded
        one while blocks are indexed (with a warning if it differs), else
        ``requested``, which is then recorded."""
        with self._env.begin(db=self._meta) as txn:
            version = txn.get(_META_FORMAT)
            recorded = txn.get(_META_SEGMENT)
            num_rows = txn.stat(self._blocks)["entries"]
        if version is not None and _U32.unpack(version)[0] != FORMAT_VERSION:
            raise StorageError(
                f"NVMe index {self.path} has format version {_U32.unpack(version)[0]}, "
                f"this tierstore reads {FORMAT_VERSION}"
            )
        if recorded is not None and num_rows:
            recorded_bytes = int(_U64.unpack(recorded)[0])
            if recorded_bytes != requested:
                logger.warning(
                    "NVMe tier %s was created with segment_bytes=%d; using it instead of "
                    "the requested %d (it defines where blocks are in blocks.dat)",
                    self.path.parent,
                    recorded_bytes,
                    requested,
                )
            return recorded_bytes
        with self._env.begin(write=True, db=self._meta) as txn:
            txn.put(_META_FORMAT, _U32.pack(FORMAT_VERSION))
            txn.put(_META_SEGMENT, _U64.pack(requested))
        return requested

    def load(self) -> tuple[list[NvmeEntry], list[bytes]]:
        """Every row: (entries, keys of rows that are malformed)."""
        entries: list[NvmeEntry] = []
        bad: list[bytes] = []
        with self._env.begin(db=self._blocks) as txn:
            for key, record in txn.cursor():
                if len(key) != KEY_BYTES or len(record) != _RECORD.size:
                    bad.append(key)
                else:
                    entries.append(NvmeEntry.unpack(key, record))
        return entries, bad

    def commit(
        self,
        put: Iterable[NvmeEntry] = (),
        delete: Iterable[bytes] = (),
        records: Iterable[tuple[bytes, bytes]] = (),
    ) -> None:
        """One write transaction: delete rows, then put entries and raw records."""
        with self._env.begin(write=True, db=self._blocks) as txn:
            for key in delete:
                txn.delete(key)
            for key, record in records:
                txn.put(key, record)
            for entry in put:
                txn.put(entry.key, entry.pack())
        self.top_up_reserve()

    def close(self) -> None:
        self._env.close()
        if self._data_fd >= 0:
            os.close(self._data_fd)
            self._data_fd = -1


@dataclass(slots=True)
class OpenedRoot:
    """A tier directory opened by ``open_root``; its owner closes ``file``,
    ``index`` and ``lock_fd``."""

    lock_fd: int
    index: NvmeIndex
    alloc: SlabAllocator
    file: BlockFile
    entries: list[NvmeEntry]
    """The indexed blocks, each claimed in ``alloc``; least recently used first."""


def open_root(
    root: Path,
    capacity_bytes: int,
    segment_bytes: int,
    *,
    direct_io: bool,
    sync: bool,
    index_reserve_bytes: int = 0,
) -> OpenedRoot:
    """Lock ``root``, open its index and data file, and rebuild the allocator.

    Raises StorageError if ``root`` cannot be created or written, is used by
    another tier, or holds an index of an unknown format; ConfigError (from the
    allocator) if ``capacity_bytes`` is smaller than a segment. Whatever was
    opened is closed again when it raises.
    """
    with ExitStack() as stack:
        prepare_root(root)
        lock_fd = lock_root(root)
        stack.callback(os.close, lock_fd)
        index = NvmeIndex(
            root / "index.lmdb", capacity_bytes, sync=sync, reserve_bytes=index_reserve_bytes
        )
        stack.callback(index.close)
        try:
            alloc = SlabAllocator(capacity_bytes, index.segment_bytes(segment_bytes), ALIGN_BYTES)
            file = _open_file(root / "blocks.dat", alloc.capacity_bytes, direct_io)
            stack.callback(file.close)
            entries = _load_entries(root, index, alloc, file)
        except lmdb.Error as e:
            raise StorageError(f"cannot use the NVMe index in {root}: {e}") from e
        stack.pop_all()
    return OpenedRoot(lock_fd, index, alloc, file, entries)


def _open_file(path: Path, capacity_bytes: int, direct_io: bool) -> BlockFile:
    try:
        return BlockFile(path, capacity_bytes, direct_io=direct_io)
    except OSError as e:
        raise StorageError(f"cannot open NVMe data file {path}: {e.strerror or e}") from e


def _load_entries(
    root: Path, index: NvmeIndex, alloc: SlabAllocator, file: BlockFile
) -> list[NvmeEntry]:
    """Claim each row's slot in ``alloc``; drop rows that cannot be placed
    (geometry change, beyond a shrunk capacity, or a data file that vanished)."""
    loaded, bad = index.load()
    if not file.existed:
        bad.extend(e.key for e in loaded)
        loaded = []
    # Highest offsets first: the allocator hands out (and looks up) free
    # slots from the top of a run, so each claim finds its slot at once.
    loaded.sort(key=lambda e: e.offset, reverse=True)
    kept: list[NvmeEntry] = []
    for entry in loaded:
        if alloc.claim(entry.offset, entry.nbytes):
            kept.append(entry)
        else:
            bad.append(entry.key)
    if bad:
        index.commit(delete=bad)
        logger.warning(
            "NVMe tier %s dropped %d index rows that do not fit its data file",
            root,
            len(bad),
        )
    if file.size_bytes() > alloc.capacity_bytes:
        file.truncate(alloc.capacity_bytes)
    kept.sort(key=lambda e: e.last_access_s)
    return kept
