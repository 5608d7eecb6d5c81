"""The peer data channel: blocks streamed over plain TCP (or TLS).

``DataServer`` (sending side) listens on an ephemeral port next to the peer
gRPC service. ``open`` registers a transfer and returns a single-use ticket;
a receiver connects, sends the ticket, and gets one frame per block of the
held prefix. The sender pins a few blocks at a time (promoting them from NVMe
as it goes, one chunk ahead of the socket) and sends straight from the arena:
no copy in user space.

The sender never hashes: every block carries the digest computed once after
its commit (``tierstore.store.hasher``) or verified when it came up from NVMe;
only a block the hasher has not reached yet is hashed here (counted in
``send_hashes``).

``receive_blocks`` (receiving side) reads frames into reserved arena slots
(``recv_into``: no copy) and verifies blake3 as the bytes arrive: each
``WIRE_PIECE_BYTES`` piece is hashed on the receiving thread right after it
was read, while it is still in the core's cache, and the block is checked
once its last piece is in. It commits the verified blocks in order, with
their digests (the receiving store does not hash them again), a batch of at
least ``COMMIT_BATCH_BYTES`` at a time, so they are resident while the rest
still arrives. A bad digest, a wrong key, an oversize length, a closed
socket or a passed deadline ends the transfer: what was verified is kept,
the rest is a miss.

A transfer that stops moving is cut before its deadline: with ``stall_s``,
the receiver ends a transfer on which no byte has come for that long
(``TransferStalled``). A peer frozen mid-transfer, or a link that went dark,
then costs ``stall_s`` rather than the whole deadline; a slow link still
moving bytes is left to its deadline. The sender keeps to its deadline
alone: a receiver still reserving its slots (evicting to make room) reads
nothing meanwhile, and must not lose the transfer for it; a receiver that
gives up closes the connection, which ends the send at once.

Why pieces, measured on loopback between two processes on 2 cores (bench
``bench.peer.rawtcp``, 744 MiB of 12 MiB blocks): sending and reading in
12 MiB calls moved 2.5 GB/s, in 2 MiB calls 3.7 and in 512 KiB calls 5-6.5;
with every block verified, hashing each block after it arrived (on a pool
of one thread per core, the earlier design) gave 2.0-2.2 GB/s, hashing each
512 KiB piece on the receiving thread as it arrives 2.9-3.1, and handing
the pieces to pool threads in order 2.3-2.6 (the handoff costs more than
the parallel hash gains when the sender shares the cores). One transfer is
bounded by one core's read and hash, about 3 GB/s here; concurrent
transfers run on their own threads.

Threads: one accept thread, one thread per transfer (at most
``max_transfers``; more connections are closed at once), and a read-ahead
pool of ``max_transfers`` threads shared by the transfers.
"""

from __future__ import annotations

import contextlib
import hmac
import itertools
import logging
import os
import socket
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import blake3

from tierstore.counters import Counters
from tierstore.keys import BlockKey, KVLayout
from tierstore.peer import codec
from tierstore.peer.client import TransferError, TransferStalled, step_timeout_s
from tierstore.store.dram import ReserveStatus
from tierstore.store.tiered import TieredStore

log = logging.getLogger(__name__)

SEND_CHUNK_BLOCKS = 8
WIRE_PIECE_BYTES = 512 << 10  # bytes per send and per receive call, each hashed as it arrives
COMMIT_BATCH_BYTES = 8 << 20  # verified blocks are committed once this many are waiting
HANDSHAKE_TIMEOUT_S = 2.0  # a connection must present its ticket this fast
MAX_HANDSHAKES = 64  # connections waiting to present a ticket; more are closed
TRANSFER_OWNER_BASE = 1 << 48  # owner ids of transfers, apart from engine clients
_owner_ids = itertools.count(TRANSFER_OWNER_BASE)


@dataclass
class _Transfer:
    layout: KVLayout
    keys: list[BlockKey]
    compress: bool
    expires: float


SEND_COUNTERS = (
    "transfers",
    "blocks_sent",
    "bytes_sent",
    "bad_tickets",
    "refused_busy",
    "send_errors",
    "send_hashes",  # blocks the sender had to hash (no digest yet): 0 when hashing keeps up
)


class DataServer:
    """Serves transfers opened by the peer service. See the module docstring."""

    def __init__(
        self,
        store: TieredStore,
        host: str,
        max_transfers: int,
        ticket_ttl_s: float,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.store = store
        self.ticket_ttl_s = ticket_ttl_s
        self.ssl_context = ssl_context
        self.counters = Counters(SEND_COUNTERS)
        self._sock = socket.create_server((host, 0), backlog=64)
        self.address = f"{host}:{self._sock.getsockname()[1]}"
        self._tickets: dict[bytes, _Transfer] = {}
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(max_transfers)
        self._handshakes = threading.BoundedSemaphore(MAX_HANDSHAKES)
        # One read-ahead per sending transfer at a time: max_transfers threads never wait.
        self._ahead = ThreadPoolExecutor(max_transfers, thread_name_prefix="tierstore-data-read")
        self._closing = False
        self._accept_thread = store.workers.start("tierstore-data-accept", self._accept_loop)

    def open(self, layout: KVLayout, keys: list[BlockKey], compress: bool) -> tuple[bytes, int]:
        """Register a transfer of the held prefix of ``keys``: (ticket, blocks)."""
        num = self.store.lookup(layout, keys).num_hits
        ticket = os.urandom(codec.TICKET_BYTES)
        now = time.monotonic()
        with self._lock:
            for t in [t for t, tr in self._tickets.items() if tr.expires < now]:
                del self._tickets[t]
            self._tickets[ticket] = _Transfer(layout, keys[:num], compress, now + self.ticket_ttl_s)
        return ticket, num

    def _take_ticket(self, ticket: bytes) -> _Transfer | None:
        with self._lock:
            for known in self._tickets:
                if hmac.compare_digest(known, ticket):
                    transfer = self._tickets.pop(known)
                    return transfer if transfer.expires >= time.monotonic() else None
        return None

    def _accept_loop(self) -> None:
        while not self._closing:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            # Only connections that present a valid ticket in time take a
            # transfer slot: idle connects cannot block fetches.
            if not self._handshakes.acquire(blocking=False):
                self.counters.add("refused_busy")
                conn.close()
                continue
            threading.Thread(
                target=self._serve, args=(conn,), name="tierstore-data-send", daemon=True
            ).start()

    def _serve(self, conn: socket.socket) -> None:
        handshaking, sending = True, False
        try:
            deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S
            conn.settimeout(HANDSHAKE_TIMEOUT_S)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.ssl_context is not None:
                conn = self.ssl_context.wrap_socket(conn, server_side=True)
            ticket = bytearray(codec.TICKET_BYTES)
            recv_into_exact(conn, memoryview(ticket), deadline)
            handshaking = False
            self._handshakes.release()
            transfer = self._take_ticket(bytes(ticket))
            if transfer is None:
                self.counters.add("bad_tickets")
                return
            if not self._slots.acquire(blocking=False):
                self.counters.add("refused_busy")
                return
            sending = True
            self.counters.add("transfers")
            self._send(conn, transfer, time.monotonic() + self.ticket_ttl_s)
        except (OSError, TransferError, ssl.SSLError) as e:
            self.counters.add("send_errors")
            log.debug("data channel send ended: %s", e)
        finally:
            conn.close()
            if handshaking:
                self._handshakes.release()
            if sending:
                self._slots.release()

    def _pin_chunk(self, layout: KVLayout, chunk: list[BlockKey], owner: int) -> list[Any]:
        """Pin a chunk (promoting from NVMe): runs one chunk ahead of the
        socket, so the NVMe read does not hold up ``sendall``. A block
        without a digest yet (the hasher behind) is hashed here, once."""
        entries = self.store.acquire(layout, chunk, owner)
        late = [e for e in entries if e.digest is None]
        for entry in late:
            self.store.digest(entry)
        if late:
            self.counters.add("send_hashes", len(late))
        return entries

    def _send(self, conn: socket.socket, transfer: _Transfer, deadline: float) -> None:
        owner = next(_owner_ids)
        layout, keys = transfer.layout, transfer.keys
        chunks = [keys[i : i + SEND_CHUNK_BLOCKS] for i in range(0, len(keys), SEND_CHUNK_BLOCKS)]
        ahead = self._ahead
        pending: Future | None = (
            ahead.submit(self._pin_chunk, layout, chunks[0], owner) if chunks else None
        )
        try:
            for i, chunk in enumerate(chunks):
                assert pending is not None
                entries = pending.result()
                pending = (
                    ahead.submit(self._pin_chunk, layout, chunks[i + 1], owner)
                    if i + 1 < len(chunks) and len(entries) == len(chunk)
                    else None
                )
                try:
                    sent = 0
                    for entry in entries:
                        view = self.store.view(entry)
                        payload = codec.compress(view, layout) if transfer.compress else None
                        flags = codec.FLAG_ZSTD_BYTESPLIT if payload is not None else 0
                        body = payload if payload is not None else view
                        header = codec.FRAME.pack(
                            entry.key, entry.digest, len(body), entry.nbytes, flags
                        )
                        send_all(conn, [header, body], deadline)
                        sent += len(body)
                    self.counters.add_many({"blocks_sent": len(entries), "bytes_sent": sent})
                finally:
                    self.store.release([e.key for e in entries], owner)
                if len(entries) < len(chunk):
                    break  # a block left this host meanwhile: the prefix ends here
        finally:
            # Wait for the read-ahead, so no acquire of this transfer still
            # runs: then drop every pin it holds (the read-ahead chunk after an
            # error or a gap too).
            if pending is not None:
                with contextlib.suppress(Exception):  # its error, if any, is not ours to raise
                    pending.result()
            self.store.release_owner(owner)
        send_all(conn, [codec.end_frame()], deadline)

    def close(self) -> None:
        self._closing = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
        self._sock.close()
        self._accept_thread.join(timeout=5)
        self._ahead.shutdown(wait=True)


def send_all(conn: socket.socket, parts: list[Any], deadline: float) -> None:
    """Send every byte of ``parts`` by ``deadline``, at most
    ``WIRE_PIECE_BYTES`` a call (one sendmsg may carry several small parts)."""
    views = [memoryview(p).cast("B") for p in parts]
    while views:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TransferError("send deadline passed")
        conn.settimeout(remaining)
        if isinstance(conn, ssl.SSLSocket):
            sent = conn.send(views[0][:WIRE_PIECE_BYTES])
        else:
            sent = conn.sendmsg(_first_bytes(views, WIRE_PIECE_BYTES))
        while sent and views:
            if sent >= len(views[0]):
                sent -= len(views[0])
                views.pop(0)
            else:
                views[0] = views[0][sent:]
                sent = 0


def _first_bytes(views: list[memoryview], limit: int) -> list[memoryview]:
    """The leading views of ``views`` cut to ``limit`` bytes in all."""
    out: list[memoryview] = []
    for view in views:
        if len(view) >= limit:
            out.append(view[:limit])
            break
        out.append(view)
        limit -= len(view)
    return out


def recv_into_exact(
    conn: socket.socket, view: memoryview, deadline: float, stall_s: float = 0.0
) -> None:
    """Fill ``view`` from ``conn`` by the absolute ``deadline`` (a peer that
    drips bytes cannot stretch it: the timeout is re-armed with what is left).
    ``stall_s`` > 0: raise ``TransferStalled`` once no byte has come for
    that long (each byte that comes re-arms it)."""
    got = 0
    while got < len(view):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TransferError(f"deadline passed after {got} of {len(view)} bytes")
        conn.settimeout(step_timeout_s(deadline, stall_s))
        try:
            n = conn.recv_into(view[got:])
        except TimeoutError as e:
            if stall_s > 0 and time.monotonic() < deadline:  # the stall limit, not the deadline
                raise TransferStalled(
                    f"stalled: no byte for {stall_s:g} s, after {got} of {len(view)} bytes"
                ) from e
            raise
        if n == 0:
            raise TransferError(f"connection closed after {got} of {len(view)} bytes")
        got += n


@dataclass
class ReceiveResult:
    received: int = 0  # blocks verified and committed
    keys: list[BlockKey] = field(default_factory=list)  # those blocks, in order
    bytes: int = 0  # payload bytes read from the wire
    last_byte_at: float = 0.0  # time.monotonic() when the last payload byte arrived
    reserve_s: float = 0.0  # reserving the arena slots (evicting to make room) before reading
    verify_failures: int = 0
    error: str = ""
    stalled: bool = False  # ended by ``stall_s``: no byte came for that long


def receive_blocks(
    conn: socket.socket,
    store: TieredStore,
    layout: KVLayout,
    keys: Sequence[BlockKey],
    deadline: float,
    on_commit: Callable[[list[BlockKey]], None] | None = None,
    stall_s: float = 0.0,
) -> ReceiveResult:
    """Read frames for ``keys`` (in order) into reserved slots, verifying
    each piece as it arrives, and commit the verified blocks with their
    digests (``on_commit`` is told of each batch committed). Blocks the
    store already holds are read and discarded. ``stall_s`` > 0: end the
    transfer once no byte has come for that long. See the module docstring."""
    owner = next(_owner_ids)
    result = ReceiveResult()
    started = time.monotonic()
    reservations = {r.key: r for r in store.reserve(layout, keys, owner)}
    result.reserve_s = time.monotonic() - started
    size = layout.block_bytes
    scratch: memoryview | None = None  # for blocks read and discarded: made on first use
    verified: list[BlockKey] = []  # not committed yet
    digests: list[bytes | None] = []
    committed: list[BlockKey] = []

    def commit() -> None:
        if verified:
            store.commit(verified, owner, digests=digests)
            committed.extend(verified)
            if on_commit is not None:
                on_commit(list(verified))
            verified.clear()
            digests.clear()

    header = bytearray(codec.FRAME.size)
    try:
        for key in keys:
            recv_into_exact(conn, memoryview(header), deadline, stall_s)
            got_key, digest, payload_bytes, block_bytes, flags = codec.FRAME.unpack(header)
            if flags & codec.FLAG_END:
                break  # the sender holds no more of the prefix
            if got_key != key or block_bytes != size or payload_bytes > size:
                raise TransferError(
                    f"bad frame: key {'ok' if got_key == key else 'unexpected'}, "
                    f"block {block_bytes} (want {size}), payload {payload_bytes}"
                )
            res = reservations.get(key)
            if res is not None and res.status == ReserveStatus.OK:
                slot, keep = store.reserved_view(res, size), True
            else:  # held already or no room: read past it
                scratch = scratch if scratch is not None else memoryview(bytearray(size))
                slot, keep = scratch, False
            hasher = blake3.blake3() if keep else None
            if flags & codec.FLAG_ZSTD_BYTESPLIT:
                payload = memoryview(bytearray(payload_bytes))
                recv_into_exact(conn, payload, deadline, stall_s)
                try:
                    codec.decompress_into(payload, slot)
                except ValueError as e:  # the codec's one error for a bad payload
                    raise TransferError(f"bad compressed payload: {e}") from e
                if hasher is not None:
                    hasher.update(slot)
            elif payload_bytes != size:
                raise TransferError(f"raw payload of {payload_bytes} bytes, want {size}")
            else:
                for lo in range(0, size, WIRE_PIECE_BYTES):
                    piece = slot[lo : lo + WIRE_PIECE_BYTES]
                    recv_into_exact(conn, piece, deadline, stall_s)
                    if hasher is not None:
                        hasher.update(piece)  # still in cache: the cheapest time to hash it
            result.bytes += payload_bytes
            result.last_byte_at = time.monotonic()
            if hasher is None:
                continue
            if not hmac.compare_digest(hasher.digest(), digest):
                result.verify_failures += 1
                break
            verified.append(key)
            digests.append(digest)
            if len(verified) * size >= COMMIT_BATCH_BYTES:
                commit()
    except (OSError, TransferError) as e:
        result.error = str(e)
        result.stalled = isinstance(e, TransferStalled)
    commit()  # what was verified before the end or the error
    done = set(committed)
    store.abort([k for k in keys if k not in done], owner)
    result.received = len(committed)
    result.keys = committed
    return result
