"""The lookup fast path's frames, shared by its server (the sidecar) and its client
(the engine).


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

Server: ``tierstore.sidecar.fastpath``; client: ``tierstore.client.fastpath``.
"""

from __future__ import annotations

import socket
import struct
from pathlib import Path

from tierstore.errors import TierstoreError

MAGIC_REQ = b"TSL1"
MAGIC_REP = b"TSR1"
LOOKUP_REQ = struct.Struct("<4sI32s")
LOOKUP_REP = struct.Struct("<4sBI")
STATUS_OK, STATUS_BAD_REQUEST, STATUS_UNKNOWN_LAYOUT = 0, 1, 2


def fast_socket_path(socket_path: str | Path) -> Path:
    return Path(str(socket_path) + ".lookup")


class FastPathError(TierstoreError):
    """The sidecar refused a fast-path lookup; the message says why."""


def recv_exact(conn: socket.socket, view: memoryview) -> bool:
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
