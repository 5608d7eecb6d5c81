"""The fast path's client, in the engine process (frames in ``tierstore.fastwire``).

Provides ``FastLookupClient`` (one connection per ``StoreClient``, one
lookup at a time behind a lock) and ``FastCalls`` (the hot calls of
``fastwire.CALL_METHODS``: reserve, commit, abort, acquire, release, on up
to ``CALL_CONNECTIONS`` connections, each used by one call at a time).
``FastCalls.call`` answers None, having sent nothing the sidecar ran, when
it cannot make the call (every connection busy, or a sidecar without the
fast path's calls): the caller makes it over gRPC. Its errors are gRPC's
(``rpc_error``): the sidecar runs the same handler.
"""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.message import Message

from tierstore.client.results import SidecarUnavailable, rpc_error
from tierstore.errors import LayoutError
from tierstore.fastwire import (
    CALL_CODES,
    CALL_CONNECTIONS,
    CALL_REP,
    CALL_REQ,
    LOOKUP_REP,
    LOOKUP_REQ,
    MAGIC_CALL,
    MAGIC_CALL_REP,
    MAGIC_REP,
    MAGIC_REQ,
    MAX_CALL_BYTES,
    STATUS_OK,
    STATUS_UNKNOWN_LAYOUT,
    FastPathError,
    recv_exact,
)
from tierstore.keys import BlockKey
from tierstore.tiers import TIER_BY_CODE, TierName
from tierstore.v1 import local_pb2

REPLY_TYPES: dict[str, type[Message]] = {
    "Reserve": local_pb2.ReserveReply,
    "Commit": local_pb2.FlagsReply,
    "Abort": local_pb2.CountReply,
    "Acquire": local_pb2.AcquireReply,
    "Release": local_pb2.CountReply,
}
_STATUS_BY_CODE = {code.value[0]: code for code in grpc.StatusCode}


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
            if not recv_exact(self._sock, memoryview(self._header)):
                raise ConnectionError("the sidecar closed the fast path")
            magic, status, count = LOOKUP_REP.unpack(self._header)
            if magic != MAGIC_REP or count > max(len(keys), self.MAX_MESSAGE_BYTES):
                raise ConnectionError("malformed fast-path reply")
            body = bytearray(count)
            if count and not recv_exact(self._sock, memoryview(body)):
                raise ConnectionError("the sidecar closed the fast path")
        if status == STATUS_UNKNOWN_LAYOUT:
            raise LayoutError(body.decode(errors="replace"))
        if status != STATUS_OK:
            raise FastPathError(body.decode(errors="replace"))
        return tuple(TIER_BY_CODE[c] for c in body)

    def close(self) -> None:
        self._sock.close()


class _CallStatus(grpc.RpcError):
    """A fast-path call's error status, shaped as gRPC's (for ``rpc_error``)."""

    def __init__(self, status: int, details: str) -> None:
        super().__init__(details)
        self._code = _STATUS_BY_CODE.get(status, grpc.StatusCode.UNKNOWN)
        self._details = details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class _NotServed(Exception):
    """The sidecar refused the frame before running anything (a sidecar
    whose fast path serves lookups only): the call goes over gRPC."""


class FastCalls:
    """See the module docstring. Thread-safe."""

    def __init__(self, path: Path, connect_timeout_s: float) -> None:
        self._path = path
        self._connect_timeout_s = connect_timeout_s
        self._idle: list[socket.socket] = []
        self._open = 0  # connections made and not closed, idle or in a call
        self._lock = threading.Lock()
        self.served = True  # False once the sidecar turned a call away: gRPC from then on

    def call(self, method: str, request: Message, timeout_s: float, what: str) -> Any:
        """``method``'s reply to ``request`` within ``timeout_s``, or None
        (nothing was run: make the call over gRPC). Raises what gRPC's call
        would have (``rpc_error``), ``SidecarUnavailable`` when the
        connection fails or no reply comes in time."""
        sock = self._take()
        if sock is None:
            return None
        body = request.SerializeToString()
        deadline = time.monotonic() + timeout_s
        reused = False
        try:
            sock.settimeout(timeout_s)
            sock.sendall(CALL_REQ.pack(MAGIC_CALL, CALL_CODES[method], len(body)) + body)
            head = bytearray(CALL_REP.size)
            if not recv_exact(sock, memoryview(head), deadline):
                raise ConnectionError("the sidecar closed the fast path")
            magic, status, length = CALL_REP.unpack(head)
            if magic == MAGIC_REP:  # a lookup-only fast path refused the frame
                raise _NotServed
            if magic != MAGIC_CALL_REP or length > MAX_CALL_BYTES:
                raise ConnectionError(f"bad fast-path reply: magic {magic!r}, {length} bytes")
            payload = bytearray(length)
            if length and not recv_exact(sock, memoryview(payload), deadline):
                raise ConnectionError("the sidecar closed the fast path")
            reused = True
        except _NotServed:
            self.served = False
            return None
        except TimeoutError:
            raise SidecarUnavailable(f"{what}: no answer within the deadline") from None
        except (OSError, ConnectionError) as e:
            raise SidecarUnavailable(f"{what}: sidecar unavailable: {e}") from e
        finally:
            self._give_back(sock, reused)
        if status != STATUS_OK:
            raise rpc_error(_CallStatus(status, payload.decode(errors="replace")), what)
        return REPLY_TYPES[method].FromString(bytes(payload))

    def _take(self) -> socket.socket | None:
        """An idle connection, or a new one while under ``CALL_CONNECTIONS``;
        None when all are busy, or the fast path cannot be reached."""
        with self._lock:
            if not self.served:
                return None
            if self._idle:
                return self._idle.pop()
            if self._open >= CALL_CONNECTIONS:
                return None
            self._open += 1
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self._connect_timeout_s)
            sock.connect(str(self._path))
        except OSError:
            sock.close()
            with self._lock:
                self._open -= 1
                self.served = False  # no fast path here: gRPC from now on
            return None
        return sock

    def _give_back(self, sock: socket.socket, reusable: bool) -> None:
        """A connection whose call ended: kept if its stream is in step, else
        closed (a reply cut short or late would answer the next call)."""
        with self._lock:
            if reusable and self.served:
                self._idle.append(sock)
                return
            self._open -= 1
        sock.close()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
            self._open -= len(idle)
            self.served = False
        for sock in idle:
            sock.close()
