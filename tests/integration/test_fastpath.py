"""The fast path: lookups and the hot calls answer as gRPC does, hostile
frames are refused, and a client falls back to gRPC."""

from __future__ import annotations

import random
import socket
import struct
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
import torch

from harness.sidecar import SidecarProcess
from tierstore.client import StoreClient
from tierstore.client.fastpath import FastCalls, FastLookupClient
from tierstore.errors import LayoutError, TierstoreError
from tierstore.fastwire import (
    CALL_CODES,
    CALL_CONNECTIONS,
    CALL_METHODS,
    CALL_REP,
    CALL_REQ,
    LOOKUP_REP,
    LOOKUP_REQ,
    MAGIC_CALL,
    MAGIC_CALL_REP,
    MAGIC_REP,
    MAGIC_REQ,
    STATUS_BAD_REQUEST,
    STATUS_OK,
    STATUS_UNKNOWN_LAYOUT,
    fast_socket_path,
)
from tierstore.keys import chain_keys
from tierstore.sidecar.fastpath import CALL_FIELDS_BYTES
from tierstore.tiers import TierName
from tierstore.v1 import local_pb2

from ..conftest import SMALL_LAYOUT, SidecarFactory


@pytest.fixture(scope="module")
def sidecar(module_sidecar_factory: SidecarFactory) -> SidecarProcess:
    return module_sidecar_factory("--set", "max_batch_keys=64")


def _raw(sidecar: SidecarProcess) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(str(fast_socket_path(sidecar.socket)))
    return s


def _reply(
    s: socket.socket, frame: struct.Struct = LOOKUP_REP, want: bytes = MAGIC_REP
) -> tuple[int, bytes]:
    """A reply frame (a lookup's, or with ``frame`` and ``want`` a call's): status, body."""
    head = b""
    while len(head) < frame.size:
        chunk = s.recv(frame.size - len(head))
        assert chunk, "connection closed without a reply"
        head += chunk
    magic, status, count = frame.unpack(head)
    assert magic == want
    body = b""
    while len(body) < count:
        body += s.recv(count - len(body))
    return status, body


def test_fast_lookup_answers_like_grpc(sidecar: SidecarProcess) -> None:
    keys = chain_keys(SMALL_LAYOUT, np.arange(8 * 200))  # more than DRAM: some on NVMe
    with StoreClient(str(sidecar.socket)) as client:
        for lo in range(0, 200, 50):
            assert all(
                client.store(
                    SMALL_LAYOUT,
                    keys[lo : lo + 50],
                    torch.zeros(50, SMALL_LAYOUT.block_bytes, dtype=torch.uint8),
                )
            )
        assert client._reader.fast is not None
        codes = {2: TierName.DRAM, 3: TierName.NVME}

        def grpc_tiers(run: list) -> tuple[TierName, ...]:
            reply = client._stub.Lookup(client._req(SMALL_LAYOUT, run), timeout=10)
            return tuple(codes[c] for c in reply.tiers)

        for lo in (0, 60, 150):
            run = keys[lo : lo + 64]
            # The demoter may still move blocks DRAM -> NVMe: compare the fast
            # answer with gRPC answers taken just before and after it.
            for _ in range(100):
                before = grpc_tiers(run)
                fast = client._reader.lookup(SMALL_LAYOUT, run, include_peers=False)
                if before == grpc_tiers(run):
                    assert fast == before
                    break
            else:
                pytest.fail("the tiers never settled")
        assert TierName.NVME in client.lookup(SMALL_LAYOUT, keys[:64]).tiers
        assert client.stat().counters["fast_lookups"] >= 4
    assert (fast_socket_path(sidecar.socket).stat().st_mode & 0o777) == 0o600


def test_hostile_frames(sidecar: SidecarProcess) -> None:
    keys = b"".join(chain_keys(SMALL_LAYOUT, np.arange(8 * 4)))
    with StoreClient(str(sidecar.socket)) as client:
        client.register(SMALL_LAYOUT)
    with _raw(sidecar) as s:  # unknown layout: an error reply, the connection stays usable
        s.sendall(LOOKUP_REQ.pack(MAGIC_REQ, 4, b"\x07" * 32) + keys)
        status, body = _reply(s)
        assert status == STATUS_UNKNOWN_LAYOUT and b"unknown layout" in body
        s.sendall(LOOKUP_REQ.pack(MAGIC_REQ, 4, SMALL_LAYOUT.fingerprint) + keys)
        assert _reply(s)[0] == STATUS_OK
    with _raw(sidecar) as s:  # more keys than max_batch_keys: refused, connection closed
        s.sendall(LOOKUP_REQ.pack(MAGIC_REQ, 10_000_000, SMALL_LAYOUT.fingerprint))
        status, body = _reply(s)
        assert status == STATUS_BAD_REQUEST and b"max_batch_keys" in body
        assert s.recv(1) == b""
    with _raw(sidecar) as s:  # wrong magic
        s.sendall(b"HTTP" + b"\0" * (LOOKUP_REQ.size - 4))
        assert _reply(s)[0] == STATUS_BAD_REQUEST
    rng = random.Random(5)
    for _ in range(300):  # garbage and truncated frames never crash the sidecar
        with _raw(sidecar) as s:
            try:
                s.sendall(rng.randbytes(rng.randrange(1, 200)))
                s.shutdown(socket.SHUT_WR)
                while s.recv(4096):
                    pass
            except (ConnectionResetError, BrokenPipeError):
                pass  # closed with our garbage unread: fine
    with StoreClient(str(sidecar.socket)) as client:  # still serving, on both paths
        never_stored = chain_keys(SMALL_LAYOUT, np.arange(8) + 5_000_000)
        assert client.lookup(SMALL_LAYOUT, never_stored).num_hits == 0
        assert client.stat().counters["bad_requests"] >= 3


def test_unknown_layout_is_a_layout_error(sidecar: SidecarProcess) -> None:
    fast = FastLookupClient(fast_socket_path(sidecar.socket), timeout_s=10)
    try:
        with pytest.raises(LayoutError, match="unknown layout"):
            fast.lookup(b"\x09" * 32, [b"\x01" * 32])
    finally:
        fast.close()


def test_client_falls_back_to_grpc_without_fast_path(sidecar: SidecarProcess) -> None:
    keys = chain_keys(SMALL_LAYOUT, np.arange(8 * 3) + 99999)
    with StoreClient(str(sidecar.socket)) as client:
        client.store(
            SMALL_LAYOUT, keys, torch.zeros(3, SMALL_LAYOUT.block_bytes, dtype=torch.uint8)
        )
        assert client._reader.fast is not None
        client._reader.fast._sock.close()  # the fast connection breaks
        assert client.lookup(SMALL_LAYOUT, keys).num_hits == 3  # answered over gRPC
        assert client._reader.fast is None


def test_frame_layout_is_stable() -> None:
    """The frames are a wire contract between engine and sidecar versions: the
    bytes of a request and a reply are spelled out here, not derived."""
    key = bytes(range(32))
    layout_id = bytes(range(100, 132))
    request = LOOKUP_REQ.pack(MAGIC_REQ, 3, layout_id) + key
    assert request[:40] == b"TSL1" + b"\x03\x00\x00\x00" + layout_id
    assert len(request) == 72
    reply = LOOKUP_REP.pack(MAGIC_REP, STATUS_OK, 2) + bytes([2, 3])
    assert reply == b"TSR1" + b"\x00" + b"\x02\x00\x00\x00" + b"\x02\x03"
    assert LOOKUP_REP.unpack(b"TSR1\x02\x05\x00\x00\x00") == (b"TSR1", 2, 5)


# -- the hot calls over the fast path -----------------------------------------------------


def _call(s: socket.socket, method: int, body: bytes) -> tuple[int, bytes]:
    """One raw call frame and its reply (status, body)."""
    s.sendall(CALL_REQ.pack(MAGIC_CALL, method, len(body)) + body)
    return _reply(s, CALL_REP, MAGIC_CALL_REP)


def _blocks(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, SMALL_LAYOUT.block_bytes), dtype=torch.uint8, generator=g)


def test_hot_calls_go_over_the_fast_path_and_do_what_grpc_does(sidecar: SidecarProcess) -> None:
    keys = chain_keys(SMALL_LAYOUT, np.arange(8 * 6) + 7_000_000)
    data = _blocks(6, 1)
    with StoreClient(str(sidecar.socket)) as client:
        assert client._control.fast_calls is not None
        before = client.stat().counters["fast_calls"]
        assert all(client.store(SMALL_LAYOUT, keys, data))  # reserve, commit
        res = client.load(SMALL_LAYOUT, keys)  # acquire, release
        assert res.num_blocks == 6 and torch.equal(res.blocks[:6], data)
        with client.acquire(SMALL_LAYOUT, keys[:2]) as pinned:
            assert len(pinned.offsets) == 2
        reserved = client.reserve(SMALL_LAYOUT, chain_keys(SMALL_LAYOUT, np.arange(8) + 8_000_000))
        assert client.abort(SMALL_LAYOUT, list(reserved.keys)) == 1
        made = client.stat().counters["fast_calls"] - before
        assert made >= 7, f"only {made} calls went over the fast path"
        assert sum(c.pins for c in client.stat().clients) == 0  # the releases were made
        # Its errors are gRPC's, word for word: the same handler answered.
        strangers = chain_keys(SMALL_LAYOUT, np.arange(8) + 9_000_000)
        with pytest.raises(TierstoreError) as fast_error:
            client.commit(SMALL_LAYOUT, strangers)
        fast_calls, client._control.fast_calls = client._control.fast_calls, None
        try:
            with pytest.raises(TierstoreError) as grpc_error:
                client.commit(SMALL_LAYOUT, strangers)
            # The control: with the fast path off, the counter stands still.
            counted = client.stat().counters["fast_calls"]
            assert client.load(SMALL_LAYOUT, keys).num_blocks == 6
            assert client.stat().counters["fast_calls"] == counted
        finally:
            client._control.fast_calls = fast_calls
        assert str(fast_error.value) == str(grpc_error.value)
        assert "not reserved by client" in str(fast_error.value)


def test_calls_from_more_threads_than_connections(sidecar: SidecarProcess) -> None:
    """Callers past CALL_CONNECTIONS at once go over gRPC; every block is right."""
    threads, per_thread = 3 * CALL_CONNECTIONS, 10
    with StoreClient(str(sidecar.socket)) as client:
        before = client.stat().counters["fast_calls"]

        def work(t: int) -> int:
            ok = 0
            for i in range(per_thread):
                keys = chain_keys(SMALL_LAYOUT, np.arange(8 * 2) + 10_000_000 + 1000 * (t * 50 + i))
                data = _blocks(2, t * 50 + i)
                assert all(client.store(SMALL_LAYOUT, keys, data))
                res = client.load(SMALL_LAYOUT, keys)
                ok += res.num_blocks == 2 and torch.equal(res.blocks[:2], data)
            return ok

        with ThreadPoolExecutor(threads) as pool:
            assert sum(pool.map(work, range(threads))) == threads * per_thread
        assert client.stat().counters["fast_calls"] - before > 0
        assert sum(c.pins for c in client.stat().clients) == 0


def test_hostile_call_frames(sidecar: SidecarProcess) -> None:
    keys = chain_keys(SMALL_LAYOUT, np.arange(8 * 2) + 11_000_000)
    data = _blocks(2, 2)
    with StoreClient(str(sidecar.socket)) as client:
        assert all(client.store(SMALL_LAYOUT, keys, data))
        request = client._req(SMALL_LAYOUT, keys)
    with _raw(sidecar) as s:
        # An unknown method and a body that is no message: refused by name,
        # the connection stays usable.
        status, body = _call(s, 99, b"")
        assert status == grpc.StatusCode.UNIMPLEMENTED.value[0] and b"method 99" in body
        status, body = _call(s, CALL_CODES["Commit"], b"\xff\xff\xff")
        assert status == grpc.StatusCode.INVALID_ARGUMENT.value[0] and b"Commit" in body
        # A client id nobody attached: the handler's own refusal, nothing done.
        forged = local_pb2.KeysRequest()
        forged.CopyFrom(request)
        forged.client_id = 987654321
        status, body = _call(s, CALL_CODES["Acquire"], forged.SerializeToString())
        assert status != STATUS_OK and b"987654321" in body
        status, body = _call(s, CALL_CODES["Commit"], forged.SerializeToString())
        assert status != STATUS_OK
    # A length past the bound (max_batch_keys keys and the other fields):
    # refused before anything is read or set aside, connection closed.
    bound = 64 * 32 + CALL_FIELDS_BYTES
    for length in (bound + 1, 1 << 30):
        with _raw(sidecar) as s:
            s.sendall(CALL_REQ.pack(MAGIC_CALL, CALL_CODES["Reserve"], length))
            head = s.recv(CALL_REP.size)
            assert CALL_REP.unpack(head)[1] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
            assert f"at most {bound}".encode() in s.recv(4096)
            assert s.recv(1) == b""
    # Seeded fuzz: random bodies behind valid headers, and bodies that are
    # real requests with random bytes flipped; each gets a reply and the
    # connection stays in step.
    rng = random.Random(11)
    raw = request.SerializeToString()
    replies = 0
    with _raw(sidecar) as s:
        for i in range(1000):
            method = rng.choice(list(CALL_METHODS))
            if i % 2:
                body = rng.randbytes(rng.randrange(0, 300))
            else:
                flipped = bytearray(raw)
                for _ in range(rng.randrange(1, 4)):
                    flipped[rng.randrange(len(flipped))] ^= 1 << rng.randrange(8)
                body = bytes(flipped)
            status, _ = _call(s, method, body)
            replies += 1
    assert replies == 1000
    with StoreClient(str(sidecar.socket)) as client:  # nothing stored was touched
        res = client.load(SMALL_LAYOUT, keys)
        assert res.num_blocks == 2 and torch.equal(res.blocks[:2], data)
        assert sum(c.pins for c in client.stat().clients) == 0


def test_a_lookup_only_fast_path_sends_calls_to_grpc(tmp_path) -> None:
    """A sidecar whose fast path serves lookups only refuses the call frame
    before running anything: the call is made over gRPC, and from then on."""
    path = tmp_path / "old.lookup"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(4)
    frames: list[bytes] = []

    def old_sidecar() -> None:
        conn, _ = server.accept()
        with conn:
            frames.append(conn.recv(4096))
            msg = b"bad frame: magic b'TSC1'"
            conn.sendall(LOOKUP_REP.pack(MAGIC_REP, STATUS_BAD_REQUEST, len(msg)) + msg)

    t = threading.Thread(target=old_sidecar)
    t.start()
    calls = FastCalls(path, connect_timeout_s=5)
    try:
        request = local_pb2.KeysRequest(client_id=1, keys=b"\x01" * 32)
        assert calls.call("Reserve", request, 5.0, "reserve") is None
        assert not calls.served
        assert calls.call("Reserve", request, 5.0, "reserve") is None  # no second try
    finally:
        t.join(10)
        server.close()
        calls.close()
    assert len(frames) == 1 and frames[0].startswith(MAGIC_CALL)


def test_call_frame_layout_is_stable() -> None:
    request = CALL_REQ.pack(MAGIC_CALL, CALL_CODES["Acquire"], 5) + b"hello"
    assert request == b"TSC1" + b"\x04" + b"\x05\x00\x00\x00" + b"hello"
    assert CALL_REP.pack(MAGIC_CALL_REP, 5, 2) == b"TSD1" + b"\x05" + b"\x02\x00\x00\x00"
    assert CALL_METHODS == {1: "Reserve", 2: "Commit", 3: "Abort", 4: "Acquire", 5: "Release"}
