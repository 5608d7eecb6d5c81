"""The fast path's frames, shared by its server (the sidecar) and its client
(the engine).

A gRPC-Python unary call costs 0.6-0.8 ms on a small VM, almost all of it
inside grpcio and its thread hand-offs; an engine looks up every request's
prefix, and each backup or load takes two or three calls. The fast path
serves them over a plain Unix socket next to the gRPC one
(``<socket>.lookup``, owner-only), with fixed binary headers. Each frame
starts with a 4-byte magic that says which kind it is:

    lookup request:  LOOKUP_REQ (MAGIC_REQ, num_keys, layout_id) + num_keys * 32 key bytes
    lookup reply:    LOOKUP_REP (MAGIC_REP, status, num_hits or message length) +
                     num_hits tier bytes (status OK) or a UTF-8 message (otherwise)

    call request:    CALL_REQ (MAGIC_CALL, method, body length) + the method's
                     request message (protobuf, as over gRPC)
    call reply:      CALL_REP (MAGIC_CALL_REP, status, body length) + the
                     method's reply message (status 0) or a UTF-8 message
                     (status: the gRPC status code it would have had)

A lookup is read-only (what gRPC's Lookup answers without attaching), so it
needs no client id. A call is one of ``CALL_METHODS``, the local service's
hot unary calls; its request carries the client id, and the sidecar runs the
same handler gRPC runs, with the same checks and errors. Every length is
checked before it is read; a bad request gets an error reply naming the
problem and the connection stays usable; a malformed frame header closes the
connection.

Server: ``tierstore.sidecar.fastpath``; client: ``tierstore.client.fastpath``.
"""

from __future__ import annotations

import socket
import struct
import time
from pathlib import Path

from tierstore.errors import TierstoreError

MAGIC_REQ = b"TSL1"
MAGIC_REP = b"TSR1"
MAGIC_CALL = b"TSC1"
MAGIC_CALL_REP = b"TSD1"
MAGIC_BYTES = 4
LOOKUP_REQ = struct.Struct("<4sI32s")
LOOKUP_REP = struct.Struct("<4sBI")
CALL_REQ = struct.Struct("<4sBI")  # magic, method, body bytes
CALL_REP = struct.Struct("<4sBI")  # magic, status (0 or a gRPC status code), body bytes
STATUS_OK, STATUS_BAD_REQUEST, STATUS_UNKNOWN_LAYOUT = 0, 1, 2
# Method codes: the local service's calls the fast path serves (by their gRPC names).
CALL_METHODS = {1: "Reserve", 2: "Commit", 3: "Abort", 4: "Acquire", 5: "Release"}
CALL_CODES = {name: code for code, name in CALL_METHODS.items()}
MAX_CALL_BYTES = 4 << 20  # a call's request or reply, as gRPC's control messages
# Call connections one client keeps open (its lookup connection apart); a
# caller finding them all busy makes its call over gRPC.
CALL_CONNECTIONS = 2


def fast_socket_path(socket_path: str | Path) -> Path:
    return Path(str(socket_path) + ".lookup")


class FastPathError(TierstoreError):
    """The sidecar refused a fast-path lookup; the message says why."""


def recv_exact(conn: socket.socket, view: memoryview, deadline: float | None = None) -> bool:
    """Fill ``view``; False on a clean EOF before the first byte. With
    ``deadline`` (``time.monotonic()``), ``TimeoutError`` once it passes
    (each read waits what is left of it)."""
    got = 0
    while got < len(view):
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"{got} of {len(view)} bytes by the deadline")
            conn.settimeout(remaining)
        n = conn.recv_into(view[got:])
        if n == 0:
            if got == 0:
                return False
            raise ConnectionError(f"connection closed after {got} of {len(view)} bytes")
        got += n
    return True
