"""Raw TCP on loopback between two processes, the limit of the peer benchmark
(bench/peer/tier.py), with and without the receiver verifying what it got.

The receiving side (``raw_stream``) runs in the benchmark's process; the
sending side is this file run as a child process (``python -m bench.peer.rawtcp
ADDRESS NBYTES ROUNDS CORRUPT_PIECE``), which imports only numpy and blake3
so that it starts quickly.
"""

from __future__ import annotations

import math
import mmap
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor

import blake3
import numpy as np

from harness import REPO

PIECE_BYTES = 2 << 20  # sendall / recv_into pieces, and the unit of each check
DIGEST_BYTES = 32


def _pieces(view: memoryview) -> list[memoryview]:
    return [view[lo : lo + PIECE_BYTES] for lo in range(0, len(view), PIECE_BYTES)]


def _digest(view: memoryview) -> bytes:
    return blake3.blake3(view).digest()


def raw_sender(address: str, nbytes: int, rounds: int, corrupt_piece: int) -> None:
    """Child process: fill a page-aligned buffer with random bytes (no two
    pieces alike), send the blake3 of each 2 MiB piece (computed before any
    stream, as the peer tier's sender hashes a block at commit), then per
    round wait for a go byte and stream the buffer. ``corrupt_piece`` >= 0
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
            for lo in range(0, nbytes, PIECE_BYTES):
                conn.sendall(view[lo : lo + PIECE_BYTES])
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
    nbytes: int, rounds: int, verify: bool, corrupt_piece: int = -1
) -> tuple[float, list[int]]:
    """Stream ``nbytes`` from a child process ``rounds`` times into a buffer
    zeroed before each round (outside the clock): the shortest round's
    seconds, and the pieces whose received bytes did not hash to the
    sender's digest (any round; only with ``verify``). With ``verify`` the
    receiver checks each 2 MiB piece's blake3 as the peer tier does (a pool
    of one thread per core, each piece submitted as soon as it is in, while
    the next ones arrive; all checked before the clock stops): the stream and
    the hash measured together on the same cores, with no store around
    them."""
    buf = mmap.mmap(-1, nbytes)
    view = memoryview(buf)
    zeros = np.frombuffer(buf, dtype=np.uint8)
    pieces = _pieces(view)
    pool = ThreadPoolExecutor(os.cpu_count() or 1) if verify else None
    best, bad = math.inf, set[int]()
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.settimeout(60)
        address = f"127.0.0.1:{server.getsockname()[1]}"
        cmd = [sys.executable, "-m", "bench.peer.rawtcp", address, str(nbytes), str(rounds),
               str(corrupt_piece)]  # fmt: skip
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
                    got, checks = 0, list[Future[bytes]]()
                    while got < nbytes:
                        n = conn.recv_into(view[got : got + PIECE_BYTES])
                        if n == 0:
                            raise RuntimeError("raw sender closed early")
                        got += n
                        while pool is not None and len(checks) < got // PIECE_BYTES:
                            checks.append(pool.submit(_digest, pieces[len(checks)]))
                    while pool is not None and len(checks) < len(pieces):  # a short last piece
                        checks.append(pool.submit(_digest, pieces[len(checks)]))
                    digests = [c.result() for c in checks]
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


if __name__ == "__main__":
    address, nbytes, rounds, corrupt_piece = sys.argv[1:]
    raw_sender(address, int(nbytes), int(rounds), int(corrupt_piece))
