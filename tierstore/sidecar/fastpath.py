"""The fast path's server: the engine's most frequent calls without gRPC.

A gRPC-Python unary call costs 0.6-0.8 ms on a small VM, almost all of it
inside grpcio; an engine looks up every request's prefix, and each backup or
load takes two or three calls. This serves Lookup, and the hot calls of
``fastwire.CALL_METHODS`` (reserve, commit, abort, acquire, release), over a
plain Unix socket next to the gRPC one (frames in ``tierstore.fastwire``).
A lookup is read-only (what gRPC's Lookup answers without attaching), so it
needs no client id; a call runs the local service's own handler
(``LocalServicer``), so its checks, its errors and what it does are gRPC's.
Every length is checked before it is read; a bad request gets an error reply
naming the problem and the connection stays usable; a malformed frame header
closes the connection.

Runs in the sidecar: one accept thread and one thread per connection (at
most ``max_connections``; more are closed at once).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
from google.protobuf.message import DecodeError

from tierstore.counters import Counters
from tierstore.errors import LayoutError
from tierstore.fastwire import (
    CALL_METHODS,
    CALL_REP,
    CALL_REQ,
    LOOKUP_REP,
    LOOKUP_REQ,
    MAGIC_BYTES,
    MAGIC_CALL,
    MAGIC_CALL_REP,
    MAGIC_REP,
    MAGIC_REQ,
    MAX_CALL_BYTES,
    STATUS_BAD_REQUEST,
    STATUS_OK,
    STATUS_UNKNOWN_LAYOUT,
    recv_exact,
)
from tierstore.keys import KEY_BYTES, unpack_keys
from tierstore.store import TieredStore
from tierstore.v1 import local_pb2
from tierstore.workers import Workers

if TYPE_CHECKING:
    from tierstore.sidecar.service import LocalServicer

log = logging.getLogger(__name__)

CALL_FIELDS_BYTES = 4096  # a request's fields besides its keys (ids, deadline, session)


class _Aborted(Exception):
    """A handler's ``context.abort``: the status and message to answer with."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code


class _CallContext:
    """What the local service's unary handlers use of a gRPC context: abort."""

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise _Aborted(code, details)


class FastLookupServer:
    """Serves fast-path lookups from ``store``, and calls through
    ``servicer`` (the local service; None: lookups only). See the module
    docstring."""

    def __init__(
        self, path: Path, store: TieredStore, max_keys: int, max_connections: int,
        workers: Workers, servicer: LocalServicer | None = None,
    ) -> None:  # fmt: skip
        self.path = path
        self.store = store
        self.max_keys = max_keys
        self.servicer = servicer
        # A call's request: at most max_keys keys and a few small fields.
        self.max_call_bytes = min(MAX_CALL_BYTES, max_keys * KEY_BYTES + CALL_FIELDS_BYTES)
        self.counters = Counters(("lookups", "calls", "bad_requests"))
        self._slots = threading.BoundedSemaphore(max_connections)
        self._closing = False
        self._conns: dict[socket.socket, threading.Thread] = {}  # open connections, their threads
        self._conns_lock = threading.Lock()
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
            thread = threading.Thread(
                target=self._serve, args=(conn,), name="tierstore-fastpath-conn", daemon=True
            )
            with self._conns_lock:
                self._conns[conn] = thread
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        header = bytearray(max(LOOKUP_REQ.size, CALL_REQ.size))
        keys_buf = bytearray(self.max_keys * KEY_BYTES)
        try:
            while recv_exact(conn, memoryview(header)[:MAGIC_BYTES]):
                magic = bytes(header[:MAGIC_BYTES])
                if magic == MAGIC_CALL and self.servicer is not None:
                    if not self._serve_call(conn, header):
                        return
                    continue
                if magic != MAGIC_REQ:
                    # The stream cannot be resynchronised: answer, then close.
                    self.counters.add("bad_requests")
                    self._error(conn, STATUS_BAD_REQUEST, f"bad frame: magic {magic!r}")
                    return
                if not recv_exact(conn, memoryview(header)[MAGIC_BYTES : LOOKUP_REQ.size]):
                    return
                _, num_keys, layout_id = LOOKUP_REQ.unpack_from(header)
                if num_keys > self.max_keys:
                    self.counters.add("bad_requests")
                    self._error(conn, STATUS_BAD_REQUEST,
                                f"bad frame: {num_keys} keys "
                                f"(max_batch_keys is {self.max_keys})")  # fmt: skip
                    return
                view = memoryview(keys_buf)[: num_keys * KEY_BYTES]
                if not recv_exact(conn, view) and num_keys:
                    return
                conn.sendall(self._lookup(layout_id, bytes(view)))
        except (OSError, ConnectionError) as e:
            log.debug("fast path connection ended: %s", e)
        finally:
            with self._conns_lock:
                self._conns.pop(conn, None)
            conn.close()
            self._slots.release()

    def _serve_call(self, conn: socket.socket, header: bytearray) -> bool:
        """One call whose magic is read: the rest of its frame, the handler,
        the reply. False when the connection must close (a bad header)."""
        if not recv_exact(conn, memoryview(header)[MAGIC_BYTES : CALL_REQ.size]):
            return False
        _, method, length = CALL_REQ.unpack_from(header)
        if length > self.max_call_bytes:
            self.counters.add("bad_requests")
            message = f"bad frame: {length} bytes (at most {self.max_call_bytes})"
            self._call_reply(conn, grpc.StatusCode.INVALID_ARGUMENT.value[0], message.encode())
            return False
        body = bytearray(length)
        if length and not recv_exact(conn, memoryview(body)):
            return False
        status, reply = self._call(method, bytes(body))
        self._call_reply(conn, status, reply)
        return True

    def _call(self, method: int, body: bytes) -> tuple[int, bytes]:
        """Run ``method``'s handler on ``body``: (0, the reply message) or
        (the gRPC status code, its message)."""
        name = CALL_METHODS.get(method)
        if name is None:
            self.counters.add("bad_requests")
            return grpc.StatusCode.UNIMPLEMENTED.value[0], f"no fast-path method {method}".encode()
        try:
            request = local_pb2.KeysRequest.FromString(body)
        except DecodeError as e:
            self.counters.add("bad_requests")
            return grpc.StatusCode.INVALID_ARGUMENT.value[0], f"{name}: {e}".encode()
        handler: Any = getattr(self.servicer, name)
        try:
            reply = handler(request, _CallContext())
        except _Aborted as e:
            return e.code.value[0], str(e).encode()
        except Exception as e:  # a handler bug: answered as gRPC would (UNKNOWN), and logged
            log.exception("fast-path %s failed", name)
            return grpc.StatusCode.UNKNOWN.value[0], f"{name}: {e}".encode()
        self.counters.add("calls")
        return STATUS_OK, reply.SerializeToString()

    @staticmethod
    def _call_reply(conn: socket.socket, status: int, body: bytes) -> None:
        conn.sendall(CALL_REP.pack(MAGIC_CALL_REP, status, len(body)) + body)

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

    def close(self, grace_s: float = 5.0) -> None:
        """Take no more connections or requests; a call in flight gets its
        answer, within ``grace_s`` for all of them (the sidecar then closes
        the store). Idempotent."""
        self._closing = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        self._thread.join(timeout=5)
        with self._conns_lock:
            conns = dict(self._conns)
        for conn in conns:  # each thread's next read ends; a reply being written still goes
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RD)
        deadline = time.monotonic() + grace_s
        for thread in conns.values():
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        self.path.unlink(missing_ok=True)
