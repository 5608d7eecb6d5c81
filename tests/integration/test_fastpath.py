"""The lookup fast path: same answers as gRPC, hostile frames refused, fallback."""

from __future__ import annotations

import random
import socket

import numpy as np
import pytest
import torch

from harness.sidecar import SidecarProcess
from tierstore.client import StoreClient
from tierstore.client.fastpath import FastLookupClient
from tierstore.errors import LayoutError
from tierstore.fastwire import (
    LOOKUP_REP,
    LOOKUP_REQ,
    MAGIC_REP,
    MAGIC_REQ,
    STATUS_BAD_REQUEST,
    STATUS_OK,
    STATUS_UNKNOWN_LAYOUT,
    fast_socket_path,
)
from tierstore.keys import chain_keys
from tierstore.tiers import TierName

from ..conftest import SMALL_LAYOUT, SidecarFactory


@pytest.fixture(scope="module")
def sidecar(module_sidecar_factory: SidecarFactory) -> SidecarProcess:
    return module_sidecar_factory("--set", "max_batch_keys=64")


def _raw(sidecar: SidecarProcess) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(str(fast_socket_path(sidecar.socket)))
    return s


def _reply(s: socket.socket) -> tuple[int, bytes]:
    head = b""
    while len(head) < LOOKUP_REP.size:
        chunk = s.recv(LOOKUP_REP.size - len(head))
        assert chunk, "connection closed without a reply"
        head += chunk
    magic, status, count = LOOKUP_REP.unpack(head)
    assert magic == MAGIC_REP
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
