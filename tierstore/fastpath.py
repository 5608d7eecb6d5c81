"""The lookup fast path: the engine's most frequent call without gRPC.

A gRPC-Python unary call costs 0.6-0.8 ms on a small VM, almost all of it
inside grpcio; an engine looks up every request's prefix. This is the same
Lookup over a plain Unix socket next to the gRPC one (``<socket>.lookup``,
owner-only), with fixed binary frames:

    request:  LOOKUP_REQ (magic, num_keys, layout_id) + num_keys * 32 key bytes
    reply:    LOOKUP_REP (magic, status, num_hits or message length) +
              num_hits tier bytes (status OK) or a UTF-8 message (otherwise)

It is read-only (what gRPC's Lookup answers without attaching), so it needs
no client id. Every length is checked before it is read; a bad request gets
an error reply naming the problem and the connection stays usable; a
malformed frame header closes the connection.

Runs in the sidecar: one accept thread and one thread per connection (at
most ``max_connections``; more are closed at once). ``FastLookupClient`` runs
in the engine process, one connection per client, behind a lock.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import struct
import threading
from pathlib import Path

from tierstore.errors import LayoutError, TierstoreError
from tierstore.keys import KEY_BYTES, BlockKey
from tierstore.store import TieredStore
from tierstore.tiers.base import TIER_BY_CODE, TIER_CODES, TierName

log = logging.getLogger(__name__)

MAGIC_REQ = b"TSL1"
MAGIC_REP = b"TSR1"
LOOKUP_REQ = struct.Struct("<4sI32s")
LOOKUP_REP = struct.Struct("<4sBI")
STATUS_OK, STATUS_BAD_REQUEST, STATUS_UNKNOWN_LAYOUT = 0, 1, 2


def fast_socket_path(socket_path: str | Path) -> Path:
    return Path(str(socket_path) + ".lookup")


class FastPathError(TierstoreError):
    """The sidecar refused a fast-path lookup; the message says why."""


def _recv_exact(conn: socket.socket, view: memoryview) -> bool:
    """Fill ``view``; False on a clean EOF before the first byte."""
    got = 0
    while got < len(view):
        n = conn.recv_into(view[got:])
        if n == 0:
            if got == 0:
                return False
            raise ConnectionError(f"connection closed after {got} of {len(view)} bytes")
        got += n
    return True


class FastLookupServer:
    """Serves fast-path lookups from ``store``. See the module docstring."""

    def __init__(self, path: Path, store: TieredStore, max_keys: int, max_connections: int) -> None:
        self.path = path
        self.store = store
        self.max_keys = max_keys
        self.lookups = 0
        self.bad_requests = 0
        self._slots = threading.BoundedSemaphore(max_connections)
        self._closing = False
        path.unlink(missing_ok=True)  # stale: the sidecar's socket lock says nobody serves it
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)
        try:
            self._sock.bind(str(path))
        finally:
            os.umask(old_umask)
        self._sock.listen(64)
        self._thread = threading.Thread(
            target=self._accept_loop, name="tierstore-fastpath", daemon=True
        )
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._closing:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            if not self._slots.acquire(blocking=False):
                conn.close()
                continue
            threading.Thread(
                target=self._serve, args=(conn,), name="tierstore-fastpath-conn", daemon=True
            ).start()

    def _serve(self, conn: socket.socket) -> None:
        header = bytearray(LOOKUP_REQ.size)
        keys_buf = bytearray(self.max_keys * KEY_BYTES)
        try:
            while _recv_exact(conn, memoryview(header)):
                magic, num_keys, layout_id = LOOKUP_REQ.unpack(header)
                if magic != MAGIC_REQ or num_keys > self.max_keys:
                    # The stream cannot be resynchronised: answer, then close.
                    self.bad_requests += 1
                    self._error(conn, STATUS_BAD_REQUEST,
                                f"bad frame: magic {magic!r}, {num_keys} keys "
                                f"(max_batch_keys is {self.max_keys})")  # fmt: skip
                    return
                view = memoryview(keys_buf)[: num_keys * KEY_BYTES]
                if not _recv_exact(conn, view) and num_keys:
                    return
                conn.sendall(self._lookup(layout_id, bytes(view)))
        except (OSError, ConnectionError) as e:
            log.debug("fast path connection ended: %s", e)
        finally:
            conn.close()
            self._slots.release()

    def _lookup(self, layout_id: bytes, raw: bytes) -> bytes:
        try:
            layout = self.store.layout(layout_id)
        except LayoutError as e:
            self.bad_requests += 1
            msg = str(e).encode()
            return LOOKUP_REP.pack(MAGIC_REP, STATUS_UNKNOWN_LAYOUT, len(msg)) + msg
        keys: list[BlockKey] = [raw[i : i + KEY_BYTES] for i in range(0, len(raw), KEY_BYTES)]  # type: ignore[misc]
        res = self.store.lookup(layout, keys)
        self.lookups += 1
        tiers = bytes(TIER_CODES[t] for t in res.tiers)
        return LOOKUP_REP.pack(MAGIC_REP, STATUS_OK, res.num_hits) + tiers

    @staticmethod
    def _error(conn: socket.socket, status: int, message: str) -> None:
        msg = message.encode()
        with contextlib.suppress(OSError):
            conn.sendall(LOOKUP_REP.pack(MAGIC_REP, status, len(msg)) + msg)

    def close(self) -> None:
        self._closing = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        self._thread.join(timeout=5)
        self.path.unlink(missing_ok=True)


class FastLookupClient:
    """One connection to a sidecar's fast path. Thread-safe (one call at a time)."""

    MAX_MESSAGE_BYTES = 4096

    def __init__(self, path: Path, timeout_s: float) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout_s)
        self._sock.connect(str(path))
        self._lock = threading.Lock()
        self._header = bytearray(LOOKUP_REP.size)

    def lookup(self, layout_id: bytes, keys: list[BlockKey]) -> tuple[TierName, ...]:
        """The tiers of the longest held prefix of ``keys`` (this host only)."""
        with self._lock:
            self._sock.sendall(LOOKUP_REQ.pack(MAGIC_REQ, len(keys), layout_id) + b"".join(keys))
            if not _recv_exact(self._sock, memoryview(self._header)):
                raise ConnectionError("the sidecar closed the fast path")
            magic, status, count = LOOKUP_REP.unpack(self._header)
            if magic != MAGIC_REP or count > max(len(keys), self.MAX_MESSAGE_BYTES):
                raise ConnectionError("malformed fast-path reply")
            body = bytearray(count)
            if count and not _recv_exact(self._sock, memoryview(body)):
                raise ConnectionError("the sidecar closed the fast path")
        if status == STATUS_UNKNOWN_LAYOUT:
            raise LayoutError(body.decode(errors="replace"))
        if status != STATUS_OK:
            raise FastPathError(body.decode(errors="replace"))
        return tuple(TIER_BY_CODE[c] for c in body)

    def close(self) -> None:
        self._sock.close()
