"""Raw TCP on loopback between two processes, the limit of the peer benchmark
(bench/peer/tier.py), with and without the receiver verifying what it got.

The receiving side (``raw_stream``) runs in the benchmark's process; the
sending side is this file run as a child process (``python -m bench.peer.rawtcp
ADDRESS NBYTES ROUNDS CALL_BYTES CORRUPT_PIECE``), which imports only numpy
and blake3 so that it starts quickly.

How fast a stream is depends on how it is read and checked, so the limit
(``best_stream``) is the fastest of the ways tried in the same run: calls
of ``CALL_SIZES`` bytes on both sides, and (verified) each 2 MiB piece
hashed either on a pool of one thread per core once it is in (``pool``) or
on the receiving thread, call by call, as it arrives (``inline``, what the
peer tier does). Measured on 2 cores, 744 MiB: 512 KiB calls 5-6.5 GB/s
raw against 3.7 with 2 MiB calls; verified, inline 2.9-3.1 against pool
2.0-2.6.
"""

from __future__ import annotations

import math
import mmap
import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import blake3
import numpy as np

from harness import REPO

PIECE_BYTES = 2 << 20  # the unit of each check (a digest per piece)
CALL_SIZES = (512 << 10, 2 << 20)  # bytes per send and per recv_into call, each tried
VERIFY_MODES = ("inline", "pool")
DIGEST_BYTES = 32


def _pieces(view: memoryview) -> list[memoryview]:
    return [view[lo : lo + PIECE_BYTES] for lo in range(0, len(view), PIECE_BYTES)]


def _digest(view: memoryview) -> bytes:
    return blake3.blake3(view).digest()


def raw_sender(address: str, nbytes: int, rounds: int, call_bytes: int, corrupt_piece: int) -> None:
    """Child process: fill a page-aligned buffer with random bytes (no two
    pieces alike), send the blake3 of each 2 MiB piece (computed before any
    stream, as the peer tier's sender hashes a block at commit), then per
    round wait for a go byte and stream the buffer, ``call_bytes`` a
    ``sendall``. ``corrupt_piece`` >= 0
    flips a byte of that piece after its digest was taken: the negative
    control, which the receiver must catch."""
    buf = mmap.mmap(-1, nbytes)
    view = memoryview(buf)
    np.frombuffer(buf, dtype=np.uint8)[:] = np.frombuffer(
        np.random.default_rng(nbytes).bytes(nbytes), dtype=np.uint8
    )
    digests = b"".join(_digest(p) for p in _pieces(view))
    if corrupt_piece >= 0:
        at = corrupt_piece * PIECE_BYTES
        buf[at] ^= 0xFF
    host, _, port = address.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=60) as conn:
        conn.sendall(digests)
        for _ in range(rounds):
            if conn.recv(1) != b"g":
                return
            for lo in range(0, nbytes, call_bytes):
                conn.sendall(view[lo : lo + call_bytes])
    view.release()
    buf.close()


def _recv_exactly(conn: socket.socket, nbytes: int) -> bytes:
    out = bytearray()
    while len(out) < nbytes:
        chunk = conn.recv(nbytes - len(out))
        if not chunk:
            raise RuntimeError("raw sender closed early")
        out += chunk
    return bytes(out)


def raw_stream(
    nbytes: int,
    rounds: int,
    verify: str | None,
    call_bytes: int = PIECE_BYTES,
    corrupt_piece: int = -1,
    host: str = "127.0.0.1",
    sender_prefix: Sequence[str] = (),
) -> tuple[float, list[int]]:
    """Stream ``nbytes`` from a child process ``rounds`` times into a buffer
    zeroed before each round (outside the clock), ``call_bytes`` a call on
    both sides: the shortest round's seconds, and the pieces whose received
    bytes did not hash to the sender's digest (any round; only with
    ``verify``). ``verify`` is how each 2 MiB piece's blake3 is checked:
    ``"pool"``, on a pool of one thread per core, each piece submitted as
    soon as it is in, while the next ones arrive; ``"inline"``, on the
    receiving thread, each call's bytes hashed right after they arrived;
    every piece is checked before the clock stops. The stream and the hash
    measured together on the same cores, with no store around them. The
    receiver listens on ``host``; the sender runs behind ``sender_prefix``
    (``ip netns exec NS``: another namespace, across a shaped link)."""
    if verify not in (None, *VERIFY_MODES):
        raise ValueError(f"verify must be None or one of {VERIFY_MODES}, got {verify!r}")
    buf = mmap.mmap(-1, nbytes)
    view = memoryview(buf)
    zeros = np.frombuffer(buf, dtype=np.uint8)
    pieces = _pieces(view)
    pool = ThreadPoolExecutor(os.cpu_count() or 1) if verify == "pool" else None
    best, bad = math.inf, set[int]()
    with socket.create_server((host, 0)) as server:
        server.settimeout(60)
        address = f"{host}:{server.getsockname()[1]}"
        cmd = [*sender_prefix, sys.executable, "-m", "bench.peer.rawtcp", address, str(nbytes),
               str(rounds), str(call_bytes), str(corrupt_piece)]  # fmt: skip
        child = subprocess.Popen(cmd, cwd=REPO)
        try:
            conn, _ = server.accept()
            with conn:
                conn.settimeout(60)
                sent = _recv_exactly(conn, DIGEST_BYTES * len(pieces))
                want = [sent[DIGEST_BYTES * i : DIGEST_BYTES * (i + 1)] for i in range(len(pieces))]
                for _ in range(rounds):
                    zeros[:] = 0  # what is checked below is what arrived
                    conn.sendall(b"g")
                    t0 = time.perf_counter()
                    digests = _receive(conn, view, pieces, verify, call_bytes, pool)
                    best = min(best, time.perf_counter() - t0)
                    bad |= {i for i, d in enumerate(digests) if d != want[i]}
            child.wait(60)
        finally:
            if pool is not None:
                pool.shutdown()
            if child.poll() is None:
                child.kill()
                child.wait()
    del zeros, pieces
    view.release()
    buf.close()
    return best, sorted(bad)


def _receive(
    conn: socket.socket,
    view: memoryview,
    pieces: list[memoryview],
    verify: str | None,
    call_bytes: int,
    pool: ThreadPoolExecutor | None,
) -> list[bytes]:
    """One round: fill ``view`` from ``conn``; the digest of each piece
    (none without ``verify``)."""
    nbytes = len(view)
    got, checks, digests = 0, list[Future[bytes]](), list[bytes]()
    hasher = blake3.blake3()
    while got < nbytes:
        n = conn.recv_into(view[got : got + call_bytes])
        if n == 0:
            raise RuntimeError("raw sender closed early")
        if verify == "inline":
            while n:  # hash what arrived, piece by piece
                in_piece = min(n, PIECE_BYTES - got % PIECE_BYTES)
                hasher.update(view[got : got + in_piece])
                got += in_piece
                n -= in_piece
                if got % PIECE_BYTES == 0 or got == nbytes:
                    digests.append(hasher.digest())
                    hasher = blake3.blake3()
            continue
        got += n
        while pool is not None and len(checks) < got // PIECE_BYTES:
            checks.append(pool.submit(_digest, pieces[len(checks)]))
    while pool is not None and len(checks) < len(pieces):  # a short last piece
        checks.append(pool.submit(_digest, pieces[len(checks)]))
    return digests if verify == "inline" else [c.result() for c in checks]


def best_stream(
    nbytes: int,
    rounds: int,
    verify: bool,
    host: str = "127.0.0.1",
    sender_prefix: Sequence[str] = (),
) -> tuple[float, str, list[int]]:
    """The fastest way tried of streaming ``nbytes`` (verified with
    ``verify``): its shortest round's seconds, how (``"512 KiB calls,
    inline"``), and the pieces flagged in any of the ways. ``host`` and
    ``sender_prefix``: see ``raw_stream``."""
    best, how, bad = math.inf, "", set[int]()
    for call_bytes in CALL_SIZES:
        for mode in VERIFY_MODES if verify else (None,):
            seconds, flagged = raw_stream(
                nbytes, rounds, mode, call_bytes, host=host, sender_prefix=sender_prefix
            )
            bad |= set(flagged)
            if seconds < best:
                best, how = seconds, f"{call_bytes >> 10} KiB calls" + (f", {mode}" if mode else "")
    return best, how, sorted(bad)


if __name__ == "__main__":
    address, nbytes, rounds, call_bytes, corrupt_piece = sys.argv[1:]
    raw_sender(address, int(nbytes), int(rounds), int(call_bytes), int(corrupt_piece))
