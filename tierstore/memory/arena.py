"""The DRAM arena: one fixed-size region of shared memory, mapped by the
sidecar and by every engine process that uses it.

The sidecar ``create``s it as a file under a tmpfs directory (``/dev/shm`` by
default), owner-only, with every page reserved up front (``posix_fallocate``)
so that a full tmpfs is an error at start, not a SIGBUS later. Engines
``attach`` to the same path. With CUDA the engine registers the mapping as
pinned memory (see ``tierstore.client.cuda``); nothing here depends on it.

Not thread-aware: the mapping is shared memory; the slot allocator and the
tier decide who may touch which bytes.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import secrets
from pathlib import Path

import numpy as np

from tierstore.errors import ArenaError

PAGE_BYTES = mmap.PAGESIZE
MADV_POPULATE_WRITE = 23  # linux/mman.h; Python's mmap module names it only on 3.12+


def _mem_available_bytes() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


_ARENA_NAME = re.compile(r"^tierstore-(?:[A-Za-z0-9_]+-)?(\d+)-[0-9a-f]{8}$")


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

    def __init__(self, path: Path, size_bytes: int, fd: int, owner: bool) -> None:
        self.path = path
        self.size_bytes = size_bytes
        self.owner = owner
        self._fd = fd
        try:
            # MAP_POPULATE builds the page tables now: the first copy into a
            # slot then runs at memcpy speed instead of faulting page by page.
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            self._map = mmap.mmap(fd, size_bytes, flags, mmap.PROT_READ | mmap.PROT_WRITE)
            # MAP_POPULATE maps shared pages read-only until their first write;
            # MADV_POPULATE_WRITE (Linux 5.14+) makes them writable now without
            # touching their bytes (15% faster first copies here). Older
            # kernels refuse it, which costs only that.
            with contextlib.suppress(OSError, ValueError):
                self._map.madvise(getattr(mmap, "MADV_POPULATE_WRITE", MADV_POPULATE_WRITE))
        except OSError as e:
            os.close(fd)
            raise ArenaError(f"cannot map arena {path} ({size_bytes} bytes): {e}") from e
        self.buf = memoryview(self._map)
        self.array = np.frombuffer(self._map, dtype=np.uint8)

    @classmethod
    def create(cls, size_bytes: int, directory: str | Path = "/dev/shm", tag: str = "") -> Arena:
        """Create and reserve a new arena file; fails with ArenaError naming why."""
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
        remove_stale_arenas(directory)
        name = f"tierstore-{tag + '-' if tag else ''}{os.getpid()}-{secrets.token_hex(4)}"
        path = directory / name
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except OSError as e:
            raise ArenaError(f"cannot create arena file {path}: {e}") from e
        try:
            os.posix_fallocate(fd, 0, size_bytes)
        except OSError as e:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise ArenaError(
                f"cannot reserve {size_bytes / 2**30:.2f} GiB for the arena in {directory}: {e}"
            ) from e
        return cls(path, size_bytes, fd, owner=True)

    @classmethod
    def attach(cls, path: str | Path, size_bytes: int) -> Arena:
        """Map an existing arena created by another process (an engine's view)."""
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

    def view(self, offset: int, nbytes: int) -> memoryview:
        """A zero-copy view of ``nbytes`` at ``offset``."""
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size_bytes:
            raise ValueError(
                f"arena range [{offset}, {offset + nbytes}) outside [0, {self.size_bytes})"
            )
        return self.buf[offset : offset + nbytes]

    def close(self) -> None:
        """Unmap; the creator also removes the file. Views must be released first."""
        if self._fd < 0:
            return
        del self.array
        self.buf.release()
        try:
            self._map.close()
        except BufferError:
            # A caller still holds a view; the mapping is freed when it goes.
            pass
        os.close(self._fd)
        self._fd = -1
        if self.owner:
            self.path.unlink(missing_ok=True)
