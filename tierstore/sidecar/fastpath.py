"""The lookup fast path's server: the engine's most frequent call without gRPC.

A gRPC-Python unary call costs 0.6-0.8 ms on a small VM, almost all of it
inside grpcio; an engine looks up every request's prefix. This serves the
same Lookup over a plain Unix socket next to the gRPC one (frames in
``tierstore.fastwire``). It is read-only (what gRPC's Lookup answers without
attaching), so it needs no client id. Every length is checked before it is
read; a bad request gets an error reply naming the problem and the connection
stays usable; a malformed frame header closes the connection.

Runs in the sidecar: one accept thread and one thread per connection (at
most ``max_connections``; more are closed at once).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from pathlib import Path

from tierstore.counters import Counters
from tierstore.errors import LayoutError
from tierstore.fastwire import (
    LOOKUP_REP,
    LOOKUP_REQ,
    MAGIC_REP,
    MAGIC_REQ,
    STATUS_BAD_REQUEST,
    STATUS_OK,
    STATUS_UNKNOWN_LAYOUT,
    recv_exact,
)
from tierstore.keys import KEY_BYTES, unpack_keys
from tierstore.store import TieredStore
from tierstore.workers import Workers

log = logging.getLogger(__name__)


class FastLookupServer:
    """Serves fast-path lookups from ``store``. See the module docstring."""

    def __init__(
        self, path: Path, store: TieredStore, max_keys: int, max_connections: int,
        workers: Workers,
    ) -> None:  # fmt: skip
        self.path = path
        self.store = store
        self.max_keys = max_keys
        self.counters = Counters(("lookups", "bad_requests"))
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
        self._thread = workers.start("tierstore-fastpath", self._accept_loop)

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
            while recv_exact(conn, memoryview(header)):
                magic, num_keys, layout_id = LOOKUP_REQ.unpack(header)
                if magic != MAGIC_REQ or num_keys > self.max_keys:
                    # The stream cannot be resynchronised: answer, then close.
                    self.counters.add("bad_requests")
                    self._error(conn, STATUS_BAD_REQUEST,
                                f"bad frame: magic {magic!r}, {num_keys} keys "
                                f"(max_batch_keys is {self.max_keys})")  # fmt: skip
                    return
                view = memoryview(keys_buf)[: num_keys * KEY_BYTES]
                if not recv_exact(conn, view) and num_keys:
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
            self.counters.add("bad_requests")
            msg = str(e).encode()
            return LOOKUP_REP.pack(MAGIC_REP, STATUS_UNKNOWN_LAYOUT, len(msg)) + msg
        keys = unpack_keys(raw)
        res = self.store.lookup(layout, keys)
        self.counters.add("lookups")
        tiers = res.codes
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
