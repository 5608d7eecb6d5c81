"""The DRAM arena: one fixed-size region of shared memory, mapped by the
sidecar and by every engine process that uses it.

The sidecar ``create``s it as a file under a tmpfs directory (``/dev/shm`` by
default, or a hugetlbfs / ``huge=`` tmpfs mount), owner-only. Engines
``attach`` to the same path. With CUDA the engine registers the mapping as
pinned memory (see ``tierstore.client.cuda``); nothing here depends on it.

Creating and attaching cost nothing per byte: the file is sized, not
filled, and mapped without MAP_POPULATE. Memory is made ready in *units* of
``UNIT_BYTES`` (2 MiB, or the huge page): ``ensure_ready`` reserves a range's
pages in the file (``posix_fallocate``: a full tmpfs is a refused slot, never
a SIGBUS) and builds this process's page tables for it
(``MADV_POPULATE_WRITE``), one call per run of units, so the first copy into
it runs at memcpy speed. The sidecar calls it before it hands out a slot (and
for the arena's first units before it serves) and populates the rest in the
background (``populate``, a unit at a time, from past the last range a first
use prepared); an engine calls it (page tables only) before its first copy
into a unit. Transparent huge pages are asked for with ``MADV_HUGEPAGE``;
``page_bytes`` / ``page_kind`` say what the kernel should give, ``huge_bytes``
how much of this process's mapping it maps with huge pages now.

Thread-safe: the lock guards only which units are ready or claimed; the
system calls run outside it, so a first use never waits for the populator (a
unit both prepare at once is prepared twice, harmlessly), and ``close``
waits for those under way. The bytes are shared memory and the slot
allocator and the tier decide who may touch which of them.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import mmap
import os
import re
import secrets
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np

from tierstore.errors import ArenaError

log = logging.getLogger(__name__)

PAGE_BYTES = mmap.PAGESIZE
UNIT_BYTES = 2 << 20  # preparation unit: one x86-64 huge page (larger huge pages: one page)
MADV_POPULATE_WRITE = 23  # linux/mman.h; Python's mmap module names it only on 3.12+
MADV_HUGEPAGE = 14
MLOCK_ONFAULT = 1  # linux/mman.h: lock each page as it is faulted in, not all at once
# /proc/PID/smaps fields of a mapping's memory mapped with huge pages: THP of
# tmpfs (Shmem; File on kernels that count it so) and hugetlbfs pages.
_SMAPS_HUGE = (b"ShmemPmdMapped:", b"FilePmdMapped:", b"Shared_Hugetlb:", b"Private_Hugetlb:")
_HEX_DIGITS = b"0123456789abcdef"  # a VMA's header starts with its address, a field with a capital


def _libc(name: str, flags: Any) -> Any:
    """libc's ``name``(address, length, flags) through ctypes, which releases
    the GIL while it runs (Python's mmap.madvise holds it: a populator would
    stall every thread); None where this C library lacks it."""
    try:
        fn = getattr(ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, flags]
    fn.restype = ctypes.c_int
    return fn


_madvise = _libc("madvise", ctypes.c_int)
_mlock2 = _libc("mlock2", ctypes.c_uint)


def _kib_line(path: str, name: str) -> int | None:
    """The ``name: N kB`` figure of a /proc file, in bytes; None if absent."""
    try:
        with open(path, encoding="ascii") as f:
            for line in f:
                if line.startswith(name + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def smaps_bytes(start: int, end: int, names: tuple[bytes, ...]) -> dict[bytes, int]:
    """The ``name: N kB`` fields ``names`` (e.g. ``b"Rss:"``), in bytes,
    summed over this process's mappings that overlap ``[start, end)``
    (/proc/self/smaps); every one 0 if unreadable."""
    total = dict.fromkeys(names, 0)
    inside = False
    try:
        with open("/proc/self/smaps", "rb") as f:
            for line in f:
                if line[0] in _HEX_DIGITS:
                    low, _, high = line.partition(b" ")[0].partition(b"-")
                    inside = int(low, 16) < end and int(high, 16) > start
                elif inside and line.startswith(names):
                    name = line.split()[0]
                    total[name] += int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return dict.fromkeys(names, 0)
    return total


def locked_bytes() -> int:
    """Memory this process has locked (VmLck), in bytes; 0 if unknown."""
    return _kib_line("/proc/self/status", "VmLck") or 0


def memlock_limit() -> int:
    """RLIMIT_MEMLOCK's soft limit in bytes (-1: unlimited)."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return -1 if soft == resource.RLIM_INFINITY else soft


def _mount_of(directory: Path) -> tuple[str, str]:
    """(filesystem type, options) of the mount holding ``directory``."""
    best, fstype, options = "", "", ""
    target = str(directory.resolve())
    try:
        with open("/proc/mounts", encoding="utf-8") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 4:
                    continue
                mnt = parts[1]
                inside = target == mnt or target.startswith(mnt.rstrip("/") + "/")
                if inside and len(mnt) >= len(best):
                    best, fstype, options = mnt, parts[2], parts[3]
    except OSError:
        pass
    return fstype, options


def _mem_available_bytes() -> int | None:
    return _kib_line("/proc/meminfo", "MemAvailable")


def _hugetlb_pool_free_bytes(page_bytes: int) -> int | None:
    """Bytes of the kernel's pool of ``page_bytes`` huge pages that are free
    and not promised to a mapping already; None if unreadable."""
    pool = Path(f"/sys/kernel/mm/hugepages/hugepages-{page_bytes >> 10}kB")
    try:
        free = int((pool / "free_hugepages").read_text())
        reserved = int((pool / "resv_hugepages").read_text())
    except (OSError, ValueError):
        return None
    return max(free - reserved, 0) * page_bytes


def _check_tmpfs_room(directory: Path, st: os.statvfs_result, size_bytes: int) -> None:
    free = st.f_bavail * st.f_frsize
    if size_bytes > free:
        raise ArenaError(
            f"arena of {size_bytes / 2**30:.2f} GiB does not fit in {directory}: "
            f"{free / 2**30:.2f} GiB free; lower dram_bytes or grow the tmpfs"
        )
    available = _mem_available_bytes()
    if available is not None and size_bytes > available:
        raise ArenaError(
            f"arena of {size_bytes / 2**30:.2f} GiB exceeds the machine's available "
            f"memory ({available / 2**30:.2f} GiB); lower dram_bytes"
        )


def _check_hugetlbfs_room(directory: Path, st: os.statvfs_result, size_bytes: int) -> None:
    """A hugetlbfs arena takes whole huge pages from the kernel's pool, which
    MemAvailable does not count. A mount without ``size=`` (the usual
    /dev/hugepages) reports no blocks at all: then the pool is the limit."""
    huge = st.f_bsize
    if size_bytes % huge:
        raise ArenaError(
            f"arena size {size_bytes} is not a multiple of {directory}'s huge page "
            f"({huge} bytes); round dram_bytes to it"
        )
    limits = [st.f_bavail * st.f_frsize] if st.f_blocks else []
    pool = _hugetlb_pool_free_bytes(huge)
    if pool is not None:
        limits.append(pool)
    free = min(limits, default=None)
    if free is not None and size_bytes > free:
        raise ArenaError(
            f"arena of {size_bytes / 2**30:.2f} GiB does not fit in {directory}: "
            f"{free / 2**30:.2f} GiB of free {huge >> 20} MiB huge pages; reserve more "
            f"(sysctl vm.nr_hugepages) or lower dram_bytes"
        )


_ARENA_NAME = re.compile(r"^tierstore-(?:[A-Za-z0-9_]+-)?(\d+)-[0-9a-f]{8}$")


def _runs(units: list[int]) -> list[tuple[int, int]]:
    """Ascending unit numbers as ``[first, end)`` runs of consecutive ones."""
    runs: list[tuple[int, int]] = []
    for u in units:
        if runs and runs[-1][1] == u:
            runs[-1] = (runs[-1][0], u + 1)
        else:
            runs.append((u, u + 1))
    return runs


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_arenas(directory: Path) -> list[Path]:
    """Unlink arena files whose creating process is gone (a sidecar that was
    killed cannot unlink its own; tmpfs would keep the memory until reboot).
    Only files of this user are touched."""
    removed: list[Path] = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return removed
    for entry in entries:
        m = _ARENA_NAME.match(entry.name)
        if m is None or _alive(int(m.group(1))):
            continue
        try:
            if entry.stat(follow_symlinks=False).st_uid != os.getuid():
                continue
            os.unlink(entry.path)
            removed.append(Path(entry.path))
        except OSError:
            continue
    return removed


class Arena:
    """A shared, page-aligned byte region. Use ``create`` or ``attach``."""

    def __init__(
        self, path: Path, size_bytes: int, fd: int, owner: bool, huge_pages: bool = True
    ) -> None:
        self.path = path
        self.size_bytes = size_bytes
        self.owner = owner
        self._fd = fd
        try:
            self._map = mmap.mmap(fd, size_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as e:
            os.close(fd)
            raise ArenaError(f"cannot map arena {path} ({size_bytes} bytes): {e}") from e
        self.huge_advised = False
        self.locked = False
        if huge_pages:  # THP on a tmpfs mounted huge=advise; others ignore or refuse it
            with contextlib.suppress(OSError, ValueError):
                self._map.madvise(getattr(mmap, "MADV_HUGEPAGE", MADV_HUGEPAGE))
                self.huge_advised = True
        self.page_bytes, self.page_kind = self._page_size()
        self.unit_bytes = max(UNIT_BYTES, self.page_bytes)
        self._units = -(-size_bytes // self.unit_bytes)
        self._ready = bytearray(self._units)  # 1: fallocated (owner) and in our page tables
        self._claimed = bytearray(self._units)  # 1: ready, or a thread is preparing it
        self._ready_units = 0
        self._next_unit = 0  # where the populator looks first (past what first uses took)
        self._preparing = 0  # preparations running outside the lock (close waits for them)
        self._unit_lock = threading.Condition(threading.Lock())
        self.buf = memoryview(self._map)
        self.array = np.frombuffer(self._map, dtype=np.uint8)
        self._address = self.array.ctypes.data  # for madvise without the GIL

    def _page_size(self) -> tuple[int, str]:
        """The page size the kernel maps this file with, and how it got it."""
        fstype, options = _mount_of(self.path.parent)
        blksize = os.fstat(self._fd).st_blksize
        if fstype == "hugetlbfs":
            return blksize, "hugetlbfs"
        opts = dict(o.partition("=")[::2] for o in options.split(","))
        huge = opts.get("huge", "never")
        if blksize > PAGE_BYTES or huge in ("always", "within_size"):
            return max(blksize, UNIT_BYTES), f"thp (tmpfs huge={huge})"
        if huge == "advise" and self.huge_advised:
            return UNIT_BYTES, "thp (tmpfs huge=advise, madvised)"
        return PAGE_BYTES, "base (no huge pages on this mount)"

    # -- preparing memory -----------------------------------------------------------

    @property
    def populated_bytes(self) -> int:
        return min(self._ready_units * self.unit_bytes, self.size_bytes)

    def ensure_ready(self, offset: int, nbytes: int) -> bool:
        """Make ``[offset, offset + nbytes)`` ready for copies at memory speed:
        its pages reserved in the file (creator only) and in this process's
        page tables. False if the file cannot hold them (a full tmpfs): the
        range must not be written then. Cheap once ready (a bytearray scan).

        Never waits for the populator: a unit it is preparing right now is
        prepared here too (both calls are idempotent), so a put is not paced
        by a niced thread on a busy host; the populator then moves on past
        this range instead of walking the same units behind the caller."""
        if nbytes <= 0:
            return True
        first, last = offset // self.unit_bytes, (offset + nbytes - 1) // self.unit_bytes
        if self._ready.find(0, first, last + 1) < 0:
            return True
        with self._unit_lock:
            if self._fd < 0:
                return False
            todo = [u for u in range(first, last + 1) if not self._ready[u]]
            for u in todo:
                self._claimed[u] = 1
            self._next_unit = max(self._next_unit, last + 1)
            self._preparing += 1
        ok = False
        try:
            ok = all(self._prepare(a, b) for a, b in _runs(todo))
        finally:
            self._done_preparing(todo if not ok else ())
        return ok

    def populate(self, stop: Callable[[], bool] | None = None) -> bool:
        """Prepare every unit (the sidecar's background populator, or
        ``dram_populate = "upfront"``), one unit per step, in order from past
        the last range a first use prepared, then the units it skipped;
        returns False if stopped or the file could not hold a unit (then
        slots there are refused as they come)."""
        while True:
            if stop is not None and stop():
                return False
            with self._unit_lock:
                if self._fd < 0:
                    return False
                unit = self._claimed.find(0, self._next_unit)
                if unit < 0:
                    unit = self._claimed.find(0)
                if unit < 0:  # every unit ready, or being prepared by a first use
                    return True
                self._claimed[unit] = 1
                self._next_unit = unit + 1
                self._preparing += 1
            ok = False
            try:
                ok = self._prepare(unit, unit + 1)
            finally:
                self._done_preparing([unit] if not ok else ())
            if not ok:
                return False

    def _done_preparing(self, failed: Iterable[int]) -> None:
        """End a preparation; units of ``failed`` that are still not ready
        are unclaimed (tried again when a slot there is wanted)."""
        with self._unit_lock:
            for u in failed:
                if not self._ready[u]:
                    self._claimed[u] = 0
            self._preparing -= 1
            if not self._preparing:
                self._unit_lock.notify_all()

    def _prepare(self, first: int, end: int) -> bool:
        """Prepare units ``[first, end)`` in one call each (no lock held: the
        kernel serialises what it must; ``close`` waits for this)."""
        start = first * self.unit_bytes
        length = min(end * self.unit_bytes, self.size_bytes) - start
        fd = self._fd
        if fd < 0:  # closing
            return False
        if self.owner:
            try:
                os.posix_fallocate(fd, start, length)
            except OSError as e:
                log.warning(
                    "arena %s: cannot reserve %d bytes at %d: %s", self.path, length, start, e
                )
                return False
        # Page tables now, without touching the bytes (Linux 5.14+; an
        # older kernel refuses it, and first copies fault page by page).
        if _madvise is not None:
            _madvise(self._address + start, length, MADV_POPULATE_WRITE)
        else:
            with contextlib.suppress(OSError, ValueError):
                self._map.madvise(MADV_POPULATE_WRITE, start, length)
        with self._unit_lock:
            for u in range(first, end):
                if not self._ready[u]:
                    self._ready[u] = 1
                    self._ready_units += 1
        return True

    @classmethod
    def create(
        cls,
        size_bytes: int,
        directory: str | Path = "/dev/shm",
        tag: str = "",
        *,
        upfront: bool = True,
        huge_pages: bool = True,
    ) -> Arena:
        """Create a new arena file; fails with ArenaError naming why. With
        ``upfront`` every page is reserved and populated before it returns
        (small arenas, tests); else nothing is: call ``ensure_ready`` before
        handing out a range and ``populate`` in the background."""
        directory = Path(directory)
        if size_bytes <= 0 or size_bytes % PAGE_BYTES:
            raise ArenaError(
                f"arena size must be a positive multiple of {PAGE_BYTES} bytes, got {size_bytes}"
            )
        if not directory.is_dir():
            raise ArenaError(f"arena directory {directory} does not exist")
        try:
            st = os.statvfs(directory)
        except OSError as e:
            raise ArenaError(f"cannot stat arena directory {directory}: {e}") from e
        fstype, _ = _mount_of(directory)
        if fstype == "hugetlbfs":
            _check_hugetlbfs_room(directory, st, size_bytes)
        else:
            _check_tmpfs_room(directory, st, size_bytes)
        remove_stale_arenas(directory)
        name = f"tierstore-{tag + '-' if tag else ''}{os.getpid()}-{secrets.token_hex(4)}"
        path = directory / name
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except OSError as e:
            raise ArenaError(f"cannot create arena file {path}: {e}") from e
        try:
            os.ftruncate(fd, size_bytes)
            if upfront:
                os.posix_fallocate(fd, 0, size_bytes)
        except OSError as e:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise ArenaError(
                f"cannot reserve {size_bytes / 2**30:.2f} GiB for the arena in {directory}: {e}"
            ) from e
        arena = cls(path, size_bytes, fd, owner=True, huge_pages=huge_pages)
        if upfront:
            arena.populate()
        return arena

    @classmethod
    def attach(cls, path: str | Path, size_bytes: int) -> Arena:
        """Map an existing arena created by another process (an engine's view).
        Nothing is populated: ``ensure_ready`` before the first copy into a range."""
        path = Path(path)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as e:
            raise ArenaError(f"cannot open arena {path}: {e}") from e
        actual = os.fstat(fd).st_size
        if actual != size_bytes:
            os.close(fd)
            raise ArenaError(f"arena {path} is {actual} bytes, expected {size_bytes}")
        return cls(path, size_bytes, fd, owner=False)

    def lock(self) -> str:
        """Lock the arena's pages in memory as they are faulted in
        (``mlock2(MLOCK_ONFAULT)``): populating stays as cheap as before, and
        no page once in memory is paged out, however long it sits idle.
        Returns "" when locked, else why not (the memory-lock limit, most
        often: the caller says what to do about it)."""
        if _mlock2 is None:
            return "this C library has no mlock2"
        if _mlock2(self._address, self.size_bytes, MLOCK_ONFAULT) != 0:
            err = ctypes.get_errno()
            limit = memlock_limit()
            shown = "unlimited" if limit < 0 else f"{limit >> 10} KiB"
            return f"mlock2 failed: {os.strerror(err)} (the memory-lock limit is {shown})"
        self.locked = True
        return ""

    def huge_bytes(self) -> int:
        """Bytes of this process's mapping of the arena that the kernel maps
        with huge pages now (from /proc/self/smaps; 0 if unreadable). Reads
        the whole file, the kernel walking every mapping's page tables: for
        stat and scrapes, not per operation."""
        if self._fd < 0:  # closed: the address may hold another mapping now
            return 0
        if self.page_bytes == PAGE_BYTES:
            # A mount that gives base pages: none to count, and reading would
            # walk every page table entry (53 ms a call at 8 GiB of 4 KiB pages).
            return 0
        start = self._address
        return sum(smaps_bytes(start, start + self.size_bytes, _SMAPS_HUGE).values())

    def view(self, offset: int, nbytes: int) -> memoryview:
        """A zero-copy view of ``nbytes`` at ``offset``."""
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size_bytes:
            raise ValueError(
                f"arena range [{offset}, {offset + nbytes}) outside [0, {self.size_bytes})"
            )
        return self.buf[offset : offset + nbytes]

    def close(self) -> None:
        """Unmap; the creator also removes the file. Views must be released first."""
        with self._unit_lock:  # a populator between two units stops here
            if self._fd < 0:
                return
            fd, self._fd = self._fd, -1
            # Preparations under way finish first: their fd and addresses
            # must not be closed or unmapped (and reused) beneath them.
            while self._preparing:
                self._unit_lock.wait()
        del self.array
        self.buf.release()
        try:
            self._map.close()
        except BufferError:
            # A caller still holds a view; the mapping is freed when it goes.
            pass
        os.close(fd)
        if self.owner:
            self.path.unlink(missing_ok=True)
