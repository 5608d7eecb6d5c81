"""The lookup fast path's client: one connection from the engine process to its
sidecar's fast-path socket (frames in ``tierstore.fastwire``).

Runs in the engine process; one connection per ``StoreClient``, one call at a
time behind a lock.
"""

from __future__ import annotations

import socket
import threading
from pathlib import Path

from tierstore.errors import LayoutError
from tierstore.fastwire import (
    LOOKUP_REP,
    LOOKUP_REQ,
    MAGIC_REP,
    MAGIC_REQ,
    STATUS_OK,
    STATUS_UNKNOWN_LAYOUT,
    FastPathError,
    recv_exact,
)
from tierstore.keys import BlockKey
from tierstore.tiers import TIER_BY_CODE, TierName


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
