"""A fake peer sidecar for integration tests: a PeerService gRPC server (with
the group token) and a data channel that misbehaves on purpose.

``FakePeer`` holds blocks given by the test (``blocks``: key -> bytes) and
answers ``Lookup`` with the held prefix ("I hold all" when the test gave it
every key) and ``OpenFetch`` with a ticket and the address of its own TCP data
server. What the data server sends is chosen by ``mode`` (see ``MODES``): good
frames, one bad digest, a flipped payload byte, an oversize length, frames out
of order, a compressed flag over garbage, half a block then a stall, or a slow
drip of bytes. ``lookup_delay_s`` makes Lookup stall, ``open_delay_s``
OpenFetch (a peer frozen after its lookup answered), ``replicate_delay_s``
Replicate (which otherwise answers at once that it holds every key).

Runs in the test process: one gRPC thread pool and one thread per data
connection. Every wait is bounded and ends at ``close``.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from concurrent import futures
from typing import Any

import blake3
import grpc

from tierstore.peer import codec
from tierstore.peer.auth import TokenAuth
from tierstore.v1 import peer_pb2, peer_pb2_grpc

MODES = (
    "good",  # every frame right, then the end frame
    "bad_digest",  # frame ``bad_index`` carries a wrong digest
    "flip_byte",  # frame ``bad_index``: one payload byte flipped, digest of the original
    "oversize",  # frame ``bad_index`` claims a payload longer than a block
    "huge_block",  # frame ``bad_index`` claims block bytes of 2**62
    "wrong_order",  # frames ``bad_index`` and ``bad_index + 1`` swapped
    "zstd_garbage",  # frame ``bad_index``: compressed flag over random bytes
    "half_stall",  # frame ``bad_index``: header and half its payload, then silence
    "drip",  # frame ``bad_index`` onward: ``drip_bytes`` every ``drip_interval_s``
    "close",  # frame ``bad_index``: header only, then the connection closes
)
MAX_STALL_S = 20.0  # the longest any fake wait lasts, whatever the test forgets


class FakePeer:
    def __init__(self, token: str, host: str = "127.0.0.1") -> None:
        self.blocks: dict[bytes, bytes] = {}
        self.mode = "good"
        self.bad_index = 0
        self.lookup_delay_s = 0.0
        self.open_delay_s = 0.0
        self.replicate_delay_s = 0.0
        self.replicates = 0
        self.drip_bytes = 256
        self.drip_interval_s = 0.2
        self.lookups = 0
        self.fetches = 0  # transfers opened (OpenFetch answered)
        self.opens_asked = 0  # OpenFetch calls received, answered or not
        self.connections = 0
        self._tickets: dict[bytes, list[bytes]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

        self._data = socket.create_server((host, 0))
        self._data.settimeout(0.2)
        self.data_address = f"{host}:{self._data.getsockname()[1]}"
        self._accept = threading.Thread(target=self._accept_loop, daemon=True)
        self._accept.start()

        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=8), interceptors=[TokenAuth(token)]
        )
        peer_pb2_grpc.add_PeerServiceServicer_to_server(_Servicer(self), self.server)
        self.port = self.server.add_insecure_port(f"{host}:0")
        self.address = f"{host}:{self.port}"
        self.server.start()

    def configure(
        self,
        mode: str = "good",
        bad_index: int = 0,
        lookup_delay_s: float = 0.0,
        replicate_delay_s: float = 0.0,
        open_delay_s: float = 0.0,
    ) -> None:
        assert mode in MODES, mode
        self.mode, self.bad_index = mode, bad_index
        self.lookup_delay_s, self.replicate_delay_s = lookup_delay_s, replicate_delay_s
        self.open_delay_s = open_delay_s

    def held_prefix(self, keys: list[bytes]) -> int:
        n = 0
        while n < len(keys) and keys[n] in self.blocks:
            n += 1
        return n

    def open(self, keys: list[bytes]) -> bytes:
        ticket = os.urandom(codec.TICKET_BYTES)
        with self._lock:
            self._tickets[ticket] = keys
            self.fetches += 1
        return ticket

    # -- data channel ------------------------------------------------------------

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._data.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.connections += 1
            t = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self._threads.append(t)
            t.start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(MAX_STALL_S)
            ticket = _recv_exact(conn, codec.TICKET_BYTES)
            with self._lock:
                keys = self._tickets.pop(ticket, None)
            if keys is None:
                return
            self._send(conn, keys)
        except OSError:
            pass  # the receiver hung up: what the tests expect of a hostile stream
        finally:
            conn.close()

    def _send(self, conn: socket.socket, keys: list[bytes]) -> None:
        mode, bad = self.mode, self.bad_index
        order = list(range(len(keys)))
        if mode == "wrong_order" and bad + 1 < len(order):
            order[bad], order[bad + 1] = order[bad + 1], order[bad]
        for pos, i in enumerate(order):
            key, data = keys[i], self.blocks[keys[i]]
            digest = blake3.blake3(data).digest()
            size = len(data)
            if pos != bad or mode in ("good", "wrong_order"):
                conn.sendall(codec.FRAME.pack(key, digest, size, size, 0) + data)
                continue
            if mode == "bad_digest":
                conn.sendall(codec.FRAME.pack(key, bytes(32), size, size, 0) + data)
            elif mode == "flip_byte":
                flipped = bytearray(data)
                flipped[size // 2] ^= 0x01
                conn.sendall(codec.FRAME.pack(key, digest, size, size, 0) + bytes(flipped))
            elif mode == "oversize":
                conn.sendall(codec.FRAME.pack(key, digest, size + 1, size, 0) + data + b"\0")
            elif mode == "huge_block":
                conn.sendall(codec.FRAME.pack(key, digest, size, 1 << 62, 0) + data)
            elif mode == "zstd_garbage":
                garbage = os.urandom(1000)
                flags = codec.FLAG_ZSTD_BYTESPLIT
                conn.sendall(codec.FRAME.pack(key, digest, len(garbage), size, flags) + garbage)
            elif mode == "half_stall":
                conn.sendall(codec.FRAME.pack(key, digest, size, size, 0) + data[: size // 2])
                self._stop.wait(MAX_STALL_S)
                return
            elif mode == "drip":
                conn.sendall(codec.FRAME.pack(key, digest, size, size, 0))
                self._drip(conn, data)
                return
            elif mode == "close":
                conn.sendall(codec.FRAME.pack(key, digest, size, size, 0))
                return
        conn.sendall(codec.end_frame())

    def _drip(self, conn: socket.socket, data: bytes) -> None:
        """A few bytes at a time, each well inside any socket timeout."""
        ends = time.monotonic() + MAX_STALL_S
        for lo in range(0, len(data), self.drip_bytes):
            if self._stop.wait(self.drip_interval_s) or time.monotonic() > ends:
                return
            conn.sendall(data[lo : lo + self.drip_bytes])

    def close(self) -> None:
        self._stop.set()
        self.server.stop(0).wait(5)
        self._data.close()
        self._accept.join(5)
        for t in self._threads:
            t.join(5)


class _Servicer(peer_pb2_grpc.PeerServiceServicer):
    def __init__(self, fake: FakePeer) -> None:
        self.fake = fake

    def Lookup(self, request: Any, context: Any) -> peer_pb2.PeerLookupReply:
        self.fake.lookups += 1
        if self.fake.lookup_delay_s:
            self.fake._stop.wait(min(self.fake.lookup_delay_s, MAX_STALL_S))
        n = self.fake.held_prefix(_keys(request.keys))
        return peer_pb2.PeerLookupReply(num_hits=n, tiers=bytes([2]) * n)

    def OpenFetch(self, request: Any, context: Any) -> peer_pb2.OpenFetchReply:
        self.fake.opens_asked += 1
        if self.fake.open_delay_s:
            self.fake._stop.wait(min(self.fake.open_delay_s, MAX_STALL_S))
        keys = _keys(request.keys)
        keys = keys[: self.fake.held_prefix(keys)]
        return peer_pb2.OpenFetchReply(
            ticket=self.fake.open(keys),
            data_address=self.fake.data_address,
            num_blocks=len(keys),
        )

    def Replicate(self, request: Any, context: Any) -> peer_pb2.ReplicateReply:
        self.fake.replicates += 1
        if self.fake.replicate_delay_s:
            self.fake._stop.wait(min(self.fake.replicate_delay_s, MAX_STALL_S))
        return peer_pb2.ReplicateReply(offered=len(request.keys) // 32)


def _keys(raw: bytes) -> list[bytes]:
    return [raw[i : i + 32] for i in range(0, len(raw), 32)]


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("closed")
        buf += chunk
    return bytes(buf)
