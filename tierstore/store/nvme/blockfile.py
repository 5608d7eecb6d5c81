"""Raw aligned I/O on the NVMe tier's data file (``blocks.dat``).

Provides:
- ``BlockFile``: one preallocated-size (sparse) file, opened with O_DIRECT when
  the filesystem allows it, with ``write_batch`` (coalesced ``pwritev`` of
  slot-aligned blocks), ``read`` (into a caller buffer, zero copy when it is
  page-aligned), ``read_streamed`` (the same, handing the data to a consumer
  chunk by chunk while the next chunk is read), ``sync`` (fdatasync) and
  ``truncate``.
- ``AlignedBuffer``: a page-aligned anonymous mapping used as a bounce buffer.
- ``buffer_address``: the address of a contiguous buffer (for alignment checks).

O_DIRECT needs the buffer address, the file offset and the length aligned to
``ALIGN_BYTES``. Callers pass slot offsets (already aligned); this module
writes straight from the caller's memory when it can and copies only what it
must (an unaligned buffer, or the last partial page of a block) into a bounce
buffer. If the filesystem refuses O_DIRECT (EINVAL, e.g. tmpfs), the file is
reopened without it and stays that way: ``direct`` says which mode is in use.

Threads: ``read`` and ``read_streamed`` are safe from many threads at once
(each takes its own bounce buffer from a small pool; streamed reads use a pool
of at most ``max_stream_threads`` helper threads, started on first use and
joined by ``close``). ``write_batch``, ``sync`` and ``truncate`` must be
serialised by the owner (the NVMe tier's write lock). The file descriptor must
not be used across ``fork()``.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import threading
from collections.abc import Callable, Sequence
from concurrent import futures
from pathlib import Path

import numpy as np

ALIGN_BYTES = 4096
"""O_DIRECT alignment: 4 KiB is valid for every logical block size up to 4 KiB."""

_IOV_MAX = max(16, os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024)
_O_DIRECT = getattr(os, "O_DIRECT", 0)

IO_ERRNOS = frozenset({errno.EIO, errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS})
"""Errors the disk can give that are outcomes (count, fail the item), not bugs."""


def round_up(n: int, align: int) -> int:
    return -(-n // align) * align


def buffer_address(view: memoryview) -> int:
    """Address of the first byte of a C-contiguous buffer (read-only ones too)."""
    if view.nbytes == 0:
        return 0
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


class AlignedBuffer:
    """A page-aligned, zero-filled anonymous mapping of ``size_bytes``."""

    __slots__ = ("_map", "size_bytes", "view")

    def __init__(self, size_bytes: int) -> None:
        self.size_bytes = round_up(max(size_bytes, ALIGN_BYTES), ALIGN_BYTES)
        self._map = mmap.mmap(-1, self.size_bytes)
        self.view = memoryview(self._map)

    def close(self) -> None:
        self.view.release()
        # A slice still referenced keeps the mapping open; it goes when the slice does.
        with contextlib.suppress(BufferError):
            self._map.close()


class _BouncePool:
    """Reusable aligned buffers for concurrent readers; keeps at most ``max_kept``."""

    def __init__(self, max_kept: int) -> None:
        self._free: list[AlignedBuffer] = []
        self._lock = threading.Lock()
        self._max_kept = max_kept

    def get(self, size_bytes: int) -> AlignedBuffer:
        with self._lock:
            for i, buf in enumerate(self._free):
                if buf.size_bytes >= size_bytes:
                    return self._free.pop(i)
        return AlignedBuffer(size_bytes)

    def put(self, buf: AlignedBuffer) -> None:
        with self._lock:
            if len(self._free) < self._max_kept:
                self._free.append(buf)
                return
        buf.close()

    def close(self) -> None:
        with self._lock:
            for buf in self._free:
                buf.close()
            self._free.clear()


class BlockFile:
    """The data file: aligned slots written and read with positional I/O."""

    def __init__(
        self,
        path: str | Path,
        size_bytes: int,
        *,
        direct_io: bool = True,
        write_bounce_bytes: int = 8 << 20,
        max_read_bounces: int = 8,
        max_stream_threads: int = 4,
    ) -> None:
        """Open (creating if needed) ``path``, extended (sparse) to ``size_bytes``.

        Raises OSError when the file cannot be opened or sized; the caller
        turns that into a StorageError naming the path.
        """
        self.path = Path(path)
        self.existed = self.path.exists()
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self.direct = False
        self._mode_lock = threading.Lock()
        self._pool: futures.ThreadPoolExecutor | None = None
        self._max_stream_threads = max_stream_threads
        self._retired_fds: list[int] = []
        try:
            # Only grow here: shrinking is the owner's call, after its index
            # no longer points past the new end.
            if os.fstat(self._fd).st_size < size_bytes:
                os.ftruncate(self._fd, size_bytes)
            if direct_io and _O_DIRECT:
                self._try_direct()
        except BaseException:
            os.close(self._fd)
            raise
        self._write_bounce = AlignedBuffer(write_bounce_bytes)
        self._read_bounces = _BouncePool(max_read_bounces)
        self._closed = False

    def _try_direct(self) -> None:
        """Switch to O_DIRECT if the filesystem accepts it for a real aligned read."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC | _O_DIRECT)
        except OSError as e:
            if e.errno == errno.EINVAL:
                return
            raise
        probe = AlignedBuffer(ALIGN_BYTES)
        try:
            os.preadv(fd, [probe.view], 0)
        except OSError as e:
            os.close(fd)
            if e.errno == errno.EINVAL:
                return
            raise
        finally:
            probe.close()
        os.close(self._fd)
        self._fd = fd
        self.direct = True

    def _fall_back_to_buffered(self) -> None:
        """The filesystem refused an O_DIRECT request: use buffered I/O from now on.

        The O_DIRECT descriptor stays open until ``close`` because a concurrent
        reader may still be using it.
        """
        with self._mode_lock:
            if not self.direct:
                return
            fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC)
            self._retired_fds.append(self._fd)
            self._fd = fd
            self.direct = False

    # -- sizing and durability -------------------------------------------------

    def truncate(self, size_bytes: int) -> None:
        os.ftruncate(self._fd, size_bytes)

    def size_bytes(self) -> int:
        return os.fstat(self._fd).st_size

    def sync(self) -> None:
        """fdatasync: every write_batch before this is on stable storage after it."""
        os.fdatasync(self._fd)

    # -- writes ----------------------------------------------------------------

    def write_batch(self, writes: Sequence[tuple[int, memoryview]]) -> list[OSError | None]:
        """Write each ``(offset, data)``; returns the error of each item, or None.

        Offsets must be ALIGN_BYTES-aligned slots, pairwise non-overlapping, and
        ``data`` byte views (``memoryview.cast('B')``). Slots adjacent in the
        file are written by one ``pwritev``. With O_DIRECT the tail of a block
        up to the next page is zero-padded. Only errors in ``IO_ERRNOS`` are
        returned; others (bugs) raise.
        """
        results: list[OSError | None] = [None] * len(writes)
        order = sorted(range(len(writes)), key=lambda i: writes[i][0])
        group: list[int] = []
        group_end = -1
        bounce_used = 0
        for i in order:
            offset, data = writes[i]
            need = self._bounce_need(data)
            if group and (
                offset != group_end
                or bounce_used + need > self._write_bounce.size_bytes
                or len(group) * 2 + 2 > _IOV_MAX
            ):
                self._write_group(writes, group, results)
                group, bounce_used = [], 0
            if need > self._write_bounce.size_bytes:
                self._write_bounce.close()
                self._write_bounce = AlignedBuffer(need)
            group.append(i)
            bounce_used += need
            group_end = offset + self._span(data.nbytes)
        if group:
            self._write_group(writes, group, results)
        return results

    def _span(self, nbytes: int) -> int:
        return round_up(nbytes, ALIGN_BYTES) if self.direct else nbytes

    def _bounce_need(self, data: memoryview) -> int:
        if not self.direct:
            return 0
        if buffer_address(data) % ALIGN_BYTES:
            return round_up(data.nbytes, ALIGN_BYTES)
        return ALIGN_BYTES if data.nbytes % ALIGN_BYTES else 0

    def _write_group(
        self,
        writes: Sequence[tuple[int, memoryview]],
        group: list[int],
        results: list[OSError | None],
    ) -> None:
        """One pwritev for slots that are contiguous in the file."""
        iov: list[memoryview] = []
        pos = 0
        bounce = self._write_bounce.view
        for i in group:
            data = writes[i][1]
            if not self.direct:
                iov.append(data)
                continue
            n = data.nbytes
            if buffer_address(data) % ALIGN_BYTES == 0:
                head = n - n % ALIGN_BYTES
                if head:
                    iov.append(data[:head])
                tail = data[head:]
            else:
                tail = data
            if tail.nbytes:
                padded = round_up(tail.nbytes, ALIGN_BYTES)
                bounce[pos : pos + tail.nbytes] = tail
                bounce[pos + tail.nbytes : pos + padded] = bytes(padded - tail.nbytes)
                iov.append(bounce[pos : pos + padded])
                pos += padded
        try:
            self._pwritev_all(iov, writes[group[0]][0])
        except OSError as e:
            if e.errno == errno.EINVAL and self.direct:
                self._fall_back_to_buffered()
                for i in group:
                    results[i] = self.write_batch([writes[i]])[0]
                return
            if e.errno not in IO_ERRNOS:
                raise
            for i in group:
                results[i] = e

    def _pwritev_all(self, iov: list[memoryview], offset: int) -> None:
        total = sum(v.nbytes for v in iov)
        done = 0
        while done < total:
            n = os.pwritev(self._fd, iov, offset + done)
            if n <= 0:
                raise OSError(errno.EIO, f"pwritev wrote {n} bytes at offset {offset + done}")
            done += n
            iov = _advance(iov, n)

    # -- reads -----------------------------------------------------------------

    def read(self, offset: int, nbytes: int, out: memoryview) -> int:
        """Read ``nbytes`` at ``offset`` into ``out[:nbytes]``; returns bytes read.

        Fewer than ``nbytes`` means the file ends early (truncated). With
        O_DIRECT, an ``out`` that is page-aligned receives the data directly;
        only the part of a page it cannot hold goes through a bounce buffer.
        Safe from several threads. Raises OSError (the caller decides which
        kinds are outcomes).
        """
        if not self.direct:
            return self._preadv_all([out[:nbytes]], offset)
        slot = round_up(nbytes, ALIGN_BYTES)
        if buffer_address(out) % ALIGN_BYTES == 0:
            if out.nbytes >= slot:
                return min(nbytes, self._read_direct([out[:slot]], offset))
            head = nbytes - nbytes % ALIGN_BYTES
        else:
            head = 0
        bounce = self._read_bounces.get(slot - head)
        try:
            iov = [out[:head], bounce.view[: slot - head]] if head else [bounce.view[:slot]]
            got = min(nbytes, self._read_direct(iov, offset))
            if got > head:
                out[head:got] = bounce.view[: got - head]
            return got
        finally:
            self._read_bounces.put(bounce)

    def read_streamed(
        self,
        offset: int,
        nbytes: int,
        out: memoryview,
        consume: Callable[[memoryview], object],
        chunk_bytes: int,
    ) -> int:
        """``read``, handing ``out[:nbytes]`` to ``consume`` in order, in pieces.

        When the data lands in ``out`` without a bounce, a helper thread reads
        chunk i+1 while this thread consumes chunk i (e.g. hashes it while it
        is still in cache), so the consumer's time overlaps the disk's. Returns
        the bytes read; ``consume`` has seen exactly ``out[:returned]``.
        """
        span = nbytes if not self.direct else round_up(nbytes, ALIGN_BYTES)
        if nbytes <= chunk_bytes or not (
            not self.direct or (out.nbytes >= span and buffer_address(out) % ALIGN_BYTES == 0)
        ):
            got = self.read(offset, nbytes, out)
            consume(out[:got])
            return got
        chunks = [(s, min(chunk_bytes, span - s)) for s in range(0, span, chunk_bytes)]
        ready = [threading.Event() for _ in chunks]
        got_of = [0] * len(chunks)
        errors: list[OSError] = []

        def read_chunks() -> None:
            try:
                for i, (start, size) in enumerate(chunks):
                    got_of[i] = self._read_direct([out[start : start + size]], offset + start)
                    ready[i].set()
                    if got_of[i] < size:
                        return
            except OSError as e:
                # A fresh exception: the original's traceback holds views of
                # ``out``, which would stop the caller from closing its buffer.
                errors.append(OSError(e.errno, e.strerror))
            finally:
                for event in ready:
                    event.set()

        reader = self._reader_pool().submit(read_chunks)
        total = 0
        try:
            for i, (start, size) in enumerate(chunks):
                ready[i].wait()
                valid = min(got_of[i], nbytes - start)
                if valid > 0:
                    consume(out[start : start + valid])
                total += got_of[i]
                if got_of[i] < size:
                    break
        finally:
            futures.wait([reader])
        reader.result()  # a bug in the reader, if any
        if errors:
            raise errors.pop()  # popped: this frame must not keep it alive
        return min(total, nbytes)

    def _reader_pool(self) -> futures.ThreadPoolExecutor:
        with self._mode_lock:
            if self._pool is None:
                self._pool = futures.ThreadPoolExecutor(
                    self._max_stream_threads, thread_name_prefix="nvme-read"
                )
            return self._pool

    def _read_direct(self, iov: list[memoryview], offset: int) -> int:
        try:
            return self._preadv_all(iov, offset)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
        self._fall_back_to_buffered()  # buffered reads accept any iovec
        return self._preadv_all(iov, offset)

    def _preadv_all(self, iov: list[memoryview], offset: int) -> int:
        total = sum(v.nbytes for v in iov)
        done = 0
        while done < total:
            n = os.preadv(self._fd, iov, offset + done)
            if n <= 0:
                break
            done += n
            if self.direct and done % ALIGN_BYTES:
                break  # short read at end of file; the rest would be misaligned
            iov = _advance(iov, n)
        return done

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        for fd in [self._fd, *self._retired_fds]:
            os.close(fd)
        self._write_bounce.close()
        self._read_bounces.close()


def _advance(iov: list[memoryview], n: int) -> list[memoryview]:
    """The iovec that is left after ``n`` bytes of it were transferred."""
    out: list[memoryview] = []
    for v in iov:
        if n >= v.nbytes:
            n -= v.nbytes
            continue
        out.append(v[n:] if n else v)
        n = 0
    return out
