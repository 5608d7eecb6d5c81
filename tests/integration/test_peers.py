"""The peer tier between real sidecars on loopback: replica push (kv_share),
pull on switch, residency answered by the tiers (HBM, DRAM, NVMe, peer),
replica budget, token authentication, the plaintext warning, transfers with
compression forced on, and a peer that lies, stalls, drips or dies (each
counted apart: errors for dead, timeouts for stalled).

Sidecars are real `tierstore serve` processes (harness/sidecar.py);
the lying peer is tests/integration/fakepeer.py, in this process. Every wait
is bounded; every process and arena this file starts is gone when it ends.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from harness import REPO
from harness.sidecar import SidecarProcess, remove_arenas, start_sidecar
from tierstore.cli.ports import free_port
from tierstore.client import StoreClient
from tierstore.keys import BlockKey, KVLayout, chain_keys
from tierstore.peer import codec
from tierstore.policies.replication import rendezvous_target
from tierstore.tiers import TierName
from tierstore.v1 import peer_pb2, peer_pb2_grpc
from tierstore.wire import layout_to_proto

from ..conftest import SMALL_LAYOUT
from .fakepeer import FakePeer

L: KVLayout = SMALL_LAYOUT  # 8 KiB blocks of 8 tokens
BLOCK = L.block_bytes
TOKEN = "peer-test-token"
MIN_TOKENS = 64
PEER, DRAM, NVME, HBM = TierName.PEER, TierName.DRAM, TierName.NVME, TierName.HBM
COMMON = (
    "--set",
    f"peer_token={TOKEN}",
    "--set",
    f"min_tokens={MIN_TOKENS}",
    "--set",
    "shutdown_grace_s=0.5",
)
REPLICA_BUDGET_BLOCKS = 64
# A wait bounded by a deadline ends within this past it (CI runs two test modules at once on
# two cores); each stall the tests set up would hold it far longer.
SLACK_S = 1.5
STALL_S = 2.0  # the fake group's fetch_stall_s
HBM_BLOCKS = 32  # the engine's device pool in the residency test
PLAINTEXT_WARNING = "listens beyond loopback without TLS"


# -- helpers -----------------------------------------------------------------------


def addr(port: int) -> str:
    return f"127.0.0.1:{port}"


def start(
    root: Path, port: int, peers: list[int], *extra: str, dram: str = "4MiB", nvme: str = "8MiB"
) -> SidecarProcess:
    root.mkdir(parents=True, exist_ok=True)
    args = ["--set", f"peer_port={port}", *COMMON, *extra]
    if peers:
        args += ["--set", "peers=" + ",".join(addr(p) for p in peers)]
    return start_sidecar(root, *args, dram=dram, nvme=nvme)


def restart(proc: SidecarProcess) -> SidecarProcess:
    proc.start()  # the same command line, on the same files
    return proc


def stop_all(*procs: SidecarProcess) -> None:
    """SIGTERM every sidecar at once, then reap each (and any arena a kill left)."""
    for p in procs:
        if p.proc.poll() is None:
            p.proc.send_signal(signal.SIGTERM)
    for p in procs:
        p.stop(timeout_s=20)
        remove_arenas(p.proc.pid)


_STOPPING: list[SidecarProcess] = []


def stop_later(*procs: SidecarProcess) -> None:
    """SIGTERM now, reap when the module ends: sidecars stop in parallel."""
    for p in procs:
        if p.proc.poll() is None:
            p.proc.send_signal(signal.SIGTERM)
    _STOPPING.extend(procs)


@pytest.fixture(scope="module", autouse=True)
def _reap_sidecars() -> Iterator[None]:
    """Set up first, torn down last: waits for every sidecar stop_later signalled."""
    yield
    try:
        stop_all(*_STOPPING)
    finally:
        _STOPPING.clear()


def kill(proc: SidecarProcess) -> None:
    proc.proc.kill()
    proc.proc.wait(10)
    remove_arenas(proc.proc.pid)
    proc.socket.unlink(missing_ok=True)  # else the next sidecar looks ready before it is


def tokens(n_blocks: int, base: int) -> np.ndarray:
    return np.arange(base, base + L.block_tokens * n_blocks)


def keys_of(toks: np.ndarray) -> list[BlockKey]:
    return chain_keys(L, toks)


def fp16_blocks(n: int, seed: int) -> torch.Tensor:
    """KV-like bytes: normal values as float16, one row per block."""
    rng = np.random.default_rng(seed)
    arr = rng.standard_normal((n, BLOCK // 2)).astype(np.float16)
    return torch.from_numpy(arr.view(np.uint8).copy())


def counters(client: StoreClient) -> dict[str, int]:
    return dict(client.stat().counters)


def dram_stat(client: StoreClient) -> tuple[int, int]:
    """(used bytes, readable blocks) of the sidecar's DRAM tier."""
    for t in client.stat().tiers:
        if t.name == "dram":
            return t.used_bytes, t.num_blocks
    raise AssertionError("no dram tier in stat")


def cli_stat(sidecar: SidecarProcess, *flags: str) -> str:
    """What `tierstore stat` prints for ``sidecar``."""
    out = subprocess.run(
        [sys.executable, "-m", "tierstore.cli", "stat", "--socket", str(sidecar.socket), *flags],
        capture_output=True,
        text=True,
        timeout=30,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        check=True,
    )
    return out.stdout


def cli_pins(sidecar: SidecarProcess) -> list[int]:
    return [int(c.get("pins", 0)) for c in json.loads(cli_stat(sidecar, "--json"))["clients"]]


def scrape(port: int) -> dict[str, float]:
    """The sidecar's /metrics, as name -> value (unlabelled series only)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {m[1]: float(m[2]) for m in re.finditer(r"^([a-z_]+) (\S+)$", text, re.M)}


def peer_stub(port: int) -> tuple[grpc.Channel, peer_pb2_grpc.PeerServiceStub]:
    channel = grpc.insecure_channel(addr(port))
    return channel, peer_pb2_grpc.PeerServiceStub(channel)


def session_for(target: str, members: list[str], source: str, prefix: str) -> str:
    """A session id whose rendezvous spill host (seen from ``source``) is ``target``."""
    for i in range(200):
        name = f"{prefix}-{i}"
        if rendezvous_target(name, members, exclude=source) == target:
            return name
    raise AssertionError("no session id hashes to the target in 200 tries")


# -- three sidecars: A, B, C, each the others' peer -------------------------------------


class Trio:
    def __init__(self, root: Path) -> None:
        self.ports = [free_port() for _ in range(3)]
        self.addrs = [addr(p) for p in self.ports]
        self.procs: list[SidecarProcess] = []
        budget = f"replica_bytes={REPLICA_BUDGET_BLOCKS * BLOCK}"
        rule = "replicate_policy=kv_share"  # these tests pin kv_share's min_tokens rule
        try:
            for i, name in enumerate("abc"):
                others = [p for j, p in enumerate(self.ports) if j != i]
                self.procs.append(
                    start(root / name, self.ports[i], others, "--set", budget, "--set", rule)
                )
        except BaseException:
            stop_all(*self.procs)
            raise

    def client(self, i: int) -> StoreClient:
        return StoreClient(str(self.procs[i].socket))


@pytest.fixture(scope="module")
def trio(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Trio]:
    t = Trio(tmp_path_factory.mktemp("trio"))
    yield t
    stop_later(*t.procs)


def test_replica_push_goes_to_the_rendezvous_host_only(trio: Trio) -> None:
    n = 24
    toks = tokens(n, 1_000_000)
    keys, data = keys_of(toks), fp16_blocks(n, 1)
    session = "push-session"
    target = rendezvous_target(session, trio.addrs, exclude=trio.addrs[0])
    assert target is not None
    t = trio.addrs.index(target)
    other = 3 - t  # the third sidecar: neither A (0) nor the target
    with trio.client(0) as a, trio.client(t) as tc, trio.client(other) as oc:
        before_other = counters(oc)["peer_replicas_imported"]
        assert all(a.store(L, keys, data))
        reply = a.end_turn(session, L, keys, len(toks), wait=True)
        assert reply.replica_target == target and reply.replicating
        assert reply.pushed == n
        assert 0 < reply.push_s < 10
        assert 0 < reply.push_tail_s <= reply.push_s  # the target's work after the last byte
        found = tc.lookup(L, keys)
        assert found.num_hits == n and set(found.tiers) == {DRAM}
        assert n * BLOCK <= counters(tc)["replica_bytes"] <= REPLICA_BUDGET_BLOCKS * BLOCK
        res = tc.load(L, keys)
        assert res.num_blocks == n and torch.equal(res.blocks, data)
        # Only the rendezvous host received it.
        assert oc.lookup(L, keys).num_hits == 0
        assert counters(oc)["peer_replicas_imported"] == before_other
        assert counters(a)["peer_pushed_blocks"] >= n


def test_short_turn_is_not_replicated(trio: Trio) -> None:
    toks = tokens(4, 1_500_000)  # 32 tokens < min_tokens
    keys = keys_of(toks)
    with trio.client(0) as a:
        a.store(L, keys, fp16_blocks(4, 15))
        reply = a.end_turn("short-session", L, keys, len(toks), wait=True)
        assert not reply.replicating and reply.pushed == 0


def test_second_session_pushes_only_its_delta(trio: Trio) -> None:
    shared, new = 16, 8
    toks1 = tokens(shared, 2_000_000)
    toks2 = np.concatenate([toks1, tokens(new, 2_500_000)])
    keys1, keys2 = keys_of(toks1), keys_of(toks2)
    assert keys2[:shared] == keys1
    data2 = fp16_blocks(shared + new, 2)
    target = trio.addrs[1]
    s1 = session_for(target, trio.addrs, trio.addrs[0], "dedup-a")
    s2 = session_for(target, trio.addrs, trio.addrs[0], "dedup-b")
    with trio.client(0) as a, trio.client(1) as b:
        a.store(L, keys2, data2)
        r1 = a.end_turn(s1, L, keys1, len(toks1), wait=True)
        assert r1.replica_target == target and r1.pushed == shared
        imported = counters(b)["peer_replicas_imported"]
        r2 = a.end_turn(s2, L, keys2, len(toks2), wait=True)
        assert r2.replica_target == target and r2.pushed == new
        assert counters(b)["peer_replicas_imported"] - imported == new
        res = b.load(L, keys2)
        assert res.num_blocks == shared + new and torch.equal(res.blocks, data2)


def test_pull_on_switch(trio: Trio) -> None:
    n_local, n_remote = 6, 18
    keys = keys_of(tokens(n_local + n_remote, 3_000_000))
    data = fp16_blocks(n_local + n_remote, 3)
    with trio.client(0) as a, trio.client(1) as b:
        a.store(L, keys, data)  # A holds all; B holds only the first blocks
        b.store(L, keys[:n_local], data[:n_local])
        assert b.lookup(L, keys).num_hits == n_local
        found = b.lookup(L, keys, include_peers=True)
        assert found.num_hits == n_local + n_remote
        assert found.tiers == (DRAM,) * n_local + (PEER,) * n_remote
        fetched = counters(b)["peer_fetched_blocks"]
        res = b.load(L, keys, include_peers=True, deadline_s=5.0)
        assert res.num_blocks == n_local + n_remote
        assert torch.equal(res.blocks, data)
        assert res.tiers == (DRAM,) * n_local + (PEER,) * n_remote
        assert counters(b)["peer_fetched_blocks"] - fetched == n_remote
        local = b.lookup(L, keys)  # B holds them now, and says so without peers
        assert local.num_hits == n_local + n_remote and PEER not in local.tiers


def test_evicted_replica_is_fetched_again(trio: Trio) -> None:
    """The import-once bug: an imported, later evicted replica is not held.
    Evicted from the engine's HBM and C's DRAM, it is reloaded from C's NVMe;
    evicted from NVMe too, it is fetched from the peer again."""
    n = 16
    toks = tokens(n, 4_000_000)
    keys, data = keys_of(toks), fp16_blocks(n, 4)
    target = trio.addrs[2]
    session = session_for(target, trio.addrs, trio.addrs[0], "evict")
    junk = torch.zeros((200, BLOCK), dtype=torch.uint8)
    with trio.client(0) as a, trio.client(2) as c:
        a.store(L, keys, data)
        assert a.end_turn(session, L, keys, len(toks), wait=True).pushed == n
        assert c.lookup(L, keys).num_hits == n
        # The session's turn on C: its engine loads the replica into HBM.
        socket_c = str(trio.procs[2].socket)
        with StoreClient(socket_c, hbm_bytes=HBM_BLOCKS * BLOCK, device="cpu") as engine:
            res = engine.load(L, keys)
            assert res.num_blocks == n and torch.equal(res.blocks, data)
            assert engine.lookup(L, keys).tiers == (HBM,) * n
            # The engine's own blocks push the replica out of HBM ...
            own = keys_of(tokens(HBM_BLOCKS, 4_200_000))
            assert all(engine.store(L, own, torch.ones((HBM_BLOCKS, BLOCK), dtype=torch.uint8)))
            assert engine.hbm is not None and not any(engine.hbm.contains(keys))
            # ... and C's own blocks push it out of DRAM (512 blocks) into NVMe (1024).
            filler = keys_of(tokens(600, 4_300_000))
            for lo in range(0, len(filler), 200):
                c.store(L, filler[lo : lo + 200], junk)
            # The session returns: NVMe is reported, and the load reads it from
            # there, neither skipped as "imported" nor fetched from A again.
            fetched = counters(c)["peer_fetched_blocks"]
            assert engine.lookup(L, keys).tiers == (NVME,) * n
            assert engine.lookup(L, keys, include_peers=True).tiers == (NVME,) * n
            res = engine.load(L, keys, include_peers=True, deadline_s=5.0)
            assert res.num_blocks == n and torch.equal(res.blocks, data)
            assert res.tiers == (NVME,) * n
            assert counters(c)["peer_fetched_blocks"] == fetched
        # Fill C's DRAM (4 MiB) and NVMe (8 MiB) with its own blocks.
        filler = keys_of(tokens(1800, 4_500_000))
        for lo in range(0, len(filler), 200):
            c.store(L, filler[lo : lo + 200], junk)
        assert c.lookup(L, keys).num_hits == 0
        found = c.lookup(L, keys, include_peers=True)
        assert found.num_hits == n and set(found.tiers) == {PEER}
        fetched = counters(c)["peer_fetched_blocks"]
        res = c.load(L, keys, include_peers=True, deadline_s=5.0)
        assert res.num_blocks == n and torch.equal(res.blocks, data)
        assert counters(c)["peer_fetched_blocks"] - fetched == n
        # Evicted again, the next turn's push imports it all again: nothing is
        # skipped because of an import remembered from before.
        filler = keys_of(tokens(1800, 4_700_000))
        for lo in range(0, len(filler), 200):
            c.store(L, filler[lo : lo + 200], junk)
        assert c.lookup(L, keys).num_hits == 0
        assert a.end_turn(session, L, keys, len(toks), wait=True).pushed == n
        assert torch.equal(c.load(L, keys).blocks, data)


def test_replica_budget_is_never_exceeded(trio: Trio) -> None:
    n = REPLICA_BUDGET_BLOCKS + 36
    toks = tokens(n, 5_000_000)
    keys = keys_of(toks)
    target = trio.addrs[1]
    session = session_for(target, trio.addrs, trio.addrs[0], "budget")
    with trio.client(0) as a, trio.client(1) as b:
        a.store(L, keys, fp16_blocks(n, 5))
        rejected = counters(b)["peer_replicas_rejected"]
        reply = a.end_turn(session, L, keys, len(toks), wait=True)
        assert 0 < reply.pushed <= REPLICA_BUDGET_BLOCKS
        assert counters(b)["peer_replicas_rejected"] - rejected == n - reply.pushed > 0
        assert counters(b)["replica_bytes"] <= REPLICA_BUDGET_BLOCKS * BLOCK
        assert b.lookup(L, keys).num_hits == reply.pushed


def test_replica_budget_holds_under_concurrent_pushes(trio: Trio) -> None:
    n = 48  # each fits the budget of 64 blocks; both together do not
    ka, kc = keys_of(tokens(n, 5_500_000)), keys_of(tokens(n, 5_600_000))
    sa = session_for(trio.addrs[1], trio.addrs, trio.addrs[0], "race-a")
    sc = session_for(trio.addrs[1], trio.addrs, trio.addrs[2], "race-c")
    with trio.client(0) as a, trio.client(1) as b, trio.client(2) as c:
        a.store(L, ka, fp16_blocks(n, 55))
        c.store(L, kc, fp16_blocks(n, 56))
        with ThreadPoolExecutor(2) as pool:
            ra = pool.submit(a.end_turn, sa, L, ka, 8 * n, wait=True)
            rc = pool.submit(c.end_turn, sc, L, kc, 8 * n, wait=True)
            pushed = ra.result(timeout=30).pushed + rc.result(timeout=30).pushed
        assert pushed > 0
        assert counters(b)["replica_bytes"] <= REPLICA_BUDGET_BLOCKS * BLOCK


def test_room_for_a_delta_comes_from_the_least_recently_pushed_replica(trio: Trio) -> None:
    """X (24 blocks) then Y (40) fill B's budget of 64; X's next turn adds 8
    blocks. Room for them must come from Y, pushed less recently, not from
    X's head, the oldest import: losing a head loses the whole prefix."""
    old, grown = 24, 32
    toks_x = tokens(grown, 5_700_000)
    keys_x, keys_y = keys_of(toks_x), keys_of(tokens(40, 5_800_000))
    sx = session_for(trio.addrs[1], trio.addrs, trio.addrs[0], "fresh-x")
    sy = session_for(trio.addrs[1], trio.addrs, trio.addrs[0], "fresh-y")
    with trio.client(0) as a, trio.client(1) as b:
        a.store(L, keys_x, fp16_blocks(grown, 57))
        a.store(L, keys_y, fp16_blocks(40, 58))
        assert a.end_turn(sx, L, keys_x[:old], 8 * old, wait=True).pushed == old
        assert a.end_turn(sy, L, keys_y, 8 * 40, wait=True).pushed == 40
        assert b.lookup(L, keys_x[:old]).num_hits == old
        assert a.end_turn(sx, L, keys_x, len(toks_x), wait=True).pushed == grown - old
        assert b.lookup(L, keys_x).num_hits == grown
        assert b.lookup(L, keys_y).num_hits < 40
        assert counters(b)["replica_bytes"] <= REPLICA_BUDGET_BLOCKS * BLOCK


def test_peer_port_refuses_missing_and_wrong_tokens(trio: Trio) -> None:
    keys = keys_of(tokens(2, 6_000_000))
    req = peer_pb2.PeerKeysRequest(layout=layout_to_proto(L), keys=b"".join(keys))
    channel, stub = peer_stub(trio.ports[0])
    with channel:
        for metadata in ((), (("authorization", "Bearer wrong"),), (("authorization", TOKEN),)):
            with pytest.raises(grpc.RpcError) as e:
                stub.Lookup(req, timeout=5, metadata=metadata)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as e:
            stub.OpenFetch(peer_pb2.OpenFetchRequest(layout=req.layout, keys=req.keys), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        ok = stub.Lookup(req, timeout=5, metadata=(("authorization", f"Bearer {TOKEN}"),))
        assert ok.num_hits == 0


def test_data_channel_refuses_a_wrong_ticket(trio: Trio) -> None:
    keys = keys_of(tokens(2, 6_500_000))
    with trio.client(0) as a:
        a.store(L, keys, fp16_blocks(2, 65))
    channel, stub = peer_stub(trio.ports[0])
    with channel:
        reply = stub.OpenFetch(
            peer_pb2.OpenFetchRequest(layout=layout_to_proto(L), keys=b"".join(keys)),
            timeout=5,
            metadata=(("authorization", f"Bearer {TOKEN}"),),
        )
    assert reply.num_blocks == 2
    host, _, port = reply.data_address.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=5) as conn:
        conn.sendall(bytes(a ^ 1 for a in reply.ticket))  # a wrong ticket
        assert conn.recv(1) == b""  # closed, nothing sent


def test_idle_connections_do_not_block_fetches(trio: Trio) -> None:
    keys = keys_of(tokens(4, 6_700_000))
    data = fp16_blocks(4, 67)
    with trio.client(0) as a:
        a.store(L, keys, data)
    channel, stub = peer_stub(trio.ports[0])
    with channel:
        reply = stub.OpenFetch(
            peer_pb2.OpenFetchRequest(layout=layout_to_proto(L), keys=b"".join(keys)),
            timeout=5,
            metadata=(("authorization", f"Bearer {TOKEN}"),),
        )
    host, _, port = reply.data_address.rpartition(":")
    idle = [socket.create_connection((host, int(port)), timeout=5) for _ in range(8)]
    try:
        time.sleep(0.2)
        with trio.client(1) as b:
            res = b.load(L, keys, include_peers=True, deadline_s=3.0)
        assert res.num_blocks == 4
    finally:
        for s in idle:
            s.close()


def test_receiver_hanging_up_leaks_no_pins_on_the_sender(trio: Trio) -> None:
    """The read-ahead chunk's pins were once kept after a send error (fixed in bc2c0bc)."""
    # 8 MB: more than A's send buffer (tcp_wmem max 4 MiB) and the receiver's
    # small one hold, so the sender is mid-stream when the receiver resets.
    n = 1000
    keys, data = keys_of(tokens(n, 6_800_000)), fp16_blocks(n, 68)
    with trio.client(0) as a:
        for lo in range(0, n, 100):  # a batch is reserved whole: keep it under DRAM's size
            assert all(a.store(L, keys[lo : lo + 100], data[lo : lo + 100]))
        send_errors = counters(a)["peer_send_errors"]
        channel, stub = peer_stub(trio.ports[0])
        with channel:
            reply = stub.OpenFetch(
                peer_pb2.OpenFetchRequest(layout=layout_to_proto(L), keys=b"".join(keys)),
                timeout=5,
                metadata=(("authorization", f"Bearer {TOKEN}"),),
            )
        assert reply.num_blocks == n
        host, _, port = reply.data_address.rpartition(":")
        with socket.socket() as conn:
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 << 10)
            conn.settimeout(5)
            conn.connect((host, int(port)))
            conn.sendall(reply.ticket)
            assert len(conn.recv(codec.FRAME.size + BLOCK)) > 0
            time.sleep(0.3)  # the sender fills the buffers and blocks
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\1\0\0\0\0\0\0\0")
        for _ in range(50):  # the sender meets the reset
            if counters(a)["peer_send_errors"] > send_errors:
                break
            time.sleep(0.05)
        assert counters(a)["peer_send_errors"] == send_errors + 1
        # Push every block of the transfer out of A's DRAM (4 MiB): pinned ones cannot go.
        filler = keys_of(tokens(600, 6_900_000))
        junk = torch.zeros((100, BLOCK), dtype=torch.uint8)
        for lo in range(0, len(filler), 100):
            a.store(L, filler[lo : lo + 100], junk)
        stuck = sum(1 for k in keys if a.lookup(L, [k]).tiers[:1] == (DRAM,))
        assert stuck == 0, f"{stuck} blocks of the aborted transfer stay pinned in DRAM"


def test_plaintext_peer_port_beyond_loopback_warns(trio: Trio, tmp_path: Path) -> None:
    """Not refused (tests and benchmarks use plaintext), but said once at
    start, and peer_tls is 0 in the stat and in /metrics."""
    port, metrics_port = free_port(), free_port()
    wide = start(
        tmp_path, port, [], "--set", "peer_host=0.0.0.0", "--set", f"advertise=127.0.0.1:{port}",
        "--set", f"metrics_port={metrics_port}",
    )  # fmt: skip
    try:
        assert wide.output().count(PLAINTEXT_WARNING) == 1
        with StoreClient(str(wide.socket)) as w:
            assert counters(w)["peer_tls"] == 0
        assert scrape(metrics_port)["tierstore_peer_tls"] == 0
    finally:
        stop_later(wide)
    # On loopback the same plaintext port stays quiet.
    assert PLAINTEXT_WARNING not in trio.procs[0].output()
    with trio.client(0) as a:
        assert counters(a)["peer_tls"] == 0


def test_peer_port_without_token_refuses_to_start(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError) as e:
        start_sidecar(tmp_path, "--set", f"peer_port={free_port()}")
    assert "no peer_token" in str(e.value)


# -- two sidecars that lose state: a restart with NVMe wiped, a SIGKILL ---------------


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[SidecarProcess]]:
    """A and B, shared by the tests below in file order: the last one kills A."""
    tmp_path = tmp_path_factory.mktemp("pair")
    pa, pb = free_port(), free_port()
    procs = [start(tmp_path / "a", pa, [pb])]
    try:
        procs.append(start(tmp_path / "b", pb, [pa]))
        yield procs
    finally:
        stop_later(*procs)


def test_auto_compression_does_not_latch_on_after_a_small_fetch(
    pair: list[SidecarProcess],
) -> None:
    a_proc, b_proc = pair
    n = 64
    keys, data = keys_of(tokens(1 + n, 9_000_000)), fp16_blocks(1 + n, 9)
    with StoreClient(str(a_proc.socket)) as a, StoreClient(str(b_proc.socket)) as b:
        a.store(L, keys, data)
        assert b.load(L, keys[:1], include_peers=True, deadline_s=5.0).num_blocks == 1
        payload = counters(b)["peer_fetched_bytes"]
        res = b.load(L, keys, include_peers=True, deadline_s=5.0)
        assert res.num_blocks == 1 + n and torch.equal(res.blocks, data)
        # Loopback carries GB/s; byte-split zstd runs at a fraction of that.
        assert counters(b)["peer_fetched_bytes"] - payload == n * BLOCK


def test_forced_compression_is_byte_exact_in_fewer_wire_bytes(tmp_path: Path) -> None:
    """compression=zstd: the fetching sidecar asks for byte-split zstd on
    every transfer. KV-like fp16 blocks arrive byte-exact in exactly the bytes
    the codec makes of them (fewer than raw); blocks that do not shrink travel
    raw, byte-exact too."""
    pa, pb = free_port(), free_port()
    zstd = ("--set", "compression=zstd")
    procs = [start(tmp_path / "a", pa, [pb], *zstd)]
    try:
        procs.append(start(tmp_path / "b", pb, [pa], *zstd))
        n = 32
        kv_keys, kv = keys_of(tokens(n, 11_000_000)), fp16_blocks(n, 11)
        noise_keys = keys_of(tokens(n, 11_500_000))
        noise = torch.from_numpy(np.random.default_rng(12).integers(0, 256, (n, BLOCK), np.uint8))
        packed = [codec.compress(memoryview(row.numpy()), L) for row in kv]
        assert all(p is not None for p in packed)
        kv_wire = sum(len(p) for p in packed if p is not None)
        assert kv_wire < 0.95 * n * BLOCK
        with StoreClient(str(procs[0].socket)) as a, StoreClient(str(procs[1].socket)) as b:
            assert all(a.store(L, kv_keys, kv)) and all(a.store(L, noise_keys, noise))
            sent, got = counters(a), counters(b)
            res = b.load(L, kv_keys, include_peers=True, deadline_s=10.0)
            assert res.num_blocks == n and torch.equal(res.blocks, kv)
            assert res.tiers == (PEER,) * n
            assert counters(b)["peer_fetched_blocks"] - got["peer_fetched_blocks"] == n
            assert counters(b)["peer_fetched_bytes"] - got["peer_fetched_bytes"] == kv_wire
            assert counters(a)["peer_bytes_sent"] - sent["peer_bytes_sent"] == kv_wire
            got = counters(b)
            res = b.load(L, noise_keys, include_peers=True, deadline_s=10.0)
            assert res.num_blocks == n and torch.equal(res.blocks, noise)
            assert counters(b)["peer_fetched_bytes"] - got["peer_fetched_bytes"] == n * BLOCK
            assert counters(b)["peer_fetch_verify_failures"] == 0
    finally:
        stop_later(*procs)


def test_restarted_host_answers_what_it_holds(pair: list[SidecarProcess]) -> None:
    a_proc, b_proc = pair
    n = 12
    toks = tokens(n, 7_000_000)
    keys, data = keys_of(toks), fp16_blocks(n, 7)
    with StoreClient(str(a_proc.socket)) as a:
        a.store(L, keys, data)
        assert a.end_turn("restart", L, keys, len(toks), wait=True).pushed == n
    with StoreClient(str(b_proc.socket)) as b:
        assert b.lookup(L, keys).num_hits == n
    kill(b_proc)  # B loses DRAM with the process and NVMe with its directory
    shutil.rmtree(b_proc.nvme_dir)
    pair[1] = b_proc = restart(b_proc)
    with StoreClient(str(b_proc.socket)) as b:
        assert b.lookup(L, keys).num_hits == 0
        found = b.lookup(L, keys, include_peers=True)
        assert found.num_hits == n and set(found.tiers) == {PEER}
        res = b.load(L, keys, include_peers=True, deadline_s=5.0)
        assert res.num_blocks == n and torch.equal(res.blocks, data)
        assert counters(b)["peer_fetched_blocks"] == n


def test_killed_peer_is_a_miss_within_the_deadline(pair: list[SidecarProcess]) -> None:
    a_proc, b_proc = pair
    n_local, n = 5, 20
    keys, data = keys_of(tokens(n, 8_000_000)), fp16_blocks(n, 8)
    with StoreClient(str(a_proc.socket)) as a:
        a.store(L, keys, data)
    with StoreClient(str(b_proc.socket)) as b:
        before = counters(b)
    kill(a_proc)
    deadline_s = 2.0
    with StoreClient(str(b_proc.socket)) as b:
        b.store(L, keys[:n_local], data[:n_local])
        for _ in range(3):  # the first call and those after the channel saw the failure
            t0 = time.monotonic()
            found = b.lookup(L, keys, include_peers=True)
            assert time.monotonic() - t0 < 0.5 + 1.0
            assert found.num_hits == n_local
            t0 = time.monotonic()
            res = b.load(L, keys, include_peers=True, deadline_s=deadline_s)
            assert time.monotonic() - t0 < deadline_s + 1.0
            assert res.num_blocks == n_local
            assert torch.equal(res.blocks[:n_local], data[:n_local])
        # A dead peer refuses at once: errors, not timeouts.
        after = counters(b)
        assert after["peer_lookup_errors"] - before["peer_lookup_errors"] >= 3
        assert after["peer_lookup_timeouts"] == before["peer_lookup_timeouts"]
        assert after["peer_fetch_timeouts"] == before["peer_fetch_timeouts"]
        # A turn that ends now cannot push: counted, and the reply says nothing was pushed.
        reply = b.end_turn("after-kill", L, keys[:n_local], 8 * n_local + 64, wait=True)
        assert reply.pushed == 0
        assert counters(b)["peer_push_errors"] >= 1


# -- a lying, stalling peer --------------------------------------------------------------


class FakeGroup:
    """Sidecar B with two fake peers: ``fake`` (holds what tests give it) and
    ``quiet`` (holds nothing; answers Replicate at once)."""

    def __init__(self, root: Path) -> None:
        self.fake = FakePeer(TOKEN)
        self.quiet = FakePeer(TOKEN)
        self.port = free_port()
        self.metrics_port = free_port()
        try:
            self.b = start(
                root,
                self.port,
                [],
                "--set",
                f"peers={self.fake.address},{self.quiet.address}",
                "--set",
                "fetch_timeout_s=10",
                "--set",
                f"fetch_stall_s={STALL_S}",
                "--set",
                f"metrics_port={self.metrics_port}",
            )
        except BaseException:
            self.fake.close()
            self.quiet.close()
            raise
        self.members = [addr(self.port), self.fake.address, self.quiet.address]

    def close(self) -> None:
        stop_later(self.b)
        self.fake.close()
        self.quiet.close()


@pytest.fixture(scope="module")
def fake_group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeGroup]:
    g = FakeGroup(tmp_path_factory.mktemp("fake"))
    yield g
    g.close()


@pytest.fixture
def fake(fake_group: FakeGroup) -> Iterator[FakePeer]:
    yield fake_group.fake
    fake_group.fake.configure("good")


_BASE = iter(range(10_000_000, 90_000_000, 1_000_000))


def give_fake(fake: FakePeer, n: int) -> tuple[list[BlockKey], torch.Tensor]:
    keys, data = keys_of(tokens(n, next(_BASE))), fp16_blocks(n, n)
    for key, row in zip(keys, data):
        fake.blocks[key] = row.numpy().tobytes()
    return keys, data


def assert_b_still_serves(b: StoreClient) -> None:
    keys, data = keys_of(tokens(3, next(_BASE))), fp16_blocks(3, 99)
    assert all(b.store(L, keys, data))
    assert torch.equal(b.load(L, keys).blocks, data)


def test_fake_peer_good_stream_is_loaded(fake_group: FakeGroup, fake: FakePeer) -> None:
    keys, data = give_fake(fake, 10)
    with StoreClient(str(fake_group.b.socket)) as b:
        res = b.load(L, keys, include_peers=True, deadline_s=5.0)
        assert res.num_blocks == 10 and torch.equal(res.blocks, data)


@pytest.mark.parametrize(
    ("mode", "bad_index", "verify_failure"),
    [
        ("bad_digest", 3, True),
        ("flip_byte", 3, True),
        ("bad_digest", 0, True),
        ("oversize", 2, False),
        ("huge_block", 2, False),
        ("wrong_order", 1, False),
        ("zstd_garbage", 2, False),
        ("close", 4, False),
    ],
)
def test_hostile_stream_keeps_only_verified_blocks(
    fake_group: FakeGroup, fake: FakePeer, mode: str, bad_index: int, verify_failure: bool
) -> None:
    n = 8
    keys, data = give_fake(fake, n)
    fake.configure(mode, bad_index)
    with StoreClient(str(fake_group.b.socket)) as b:
        before = counters(b)
        used, num = dram_stat(b)
        res = b.load(L, keys, include_peers=True, deadline_s=5.0)
        assert res.num_blocks == bad_index
        assert torch.equal(res.blocks[:bad_index], data[:bad_index])
        assert b.lookup(L, keys).num_hits == bad_index  # the rest is a miss, not wrong data
        after = counters(b)
        failures = after["peer_fetch_verify_failures"] - before["peer_fetch_verify_failures"]
        assert (failures > 0) == verify_failure
        errors = after["peer_fetch_errors"] - before["peer_fetch_errors"]
        assert verify_failure or errors > 0
        # The stream ended or lied before its deadline: an error, not a timeout.
        assert after["peer_fetch_timeouts"] == before["peer_fetch_timeouts"]
        # Nothing reserved or pinned is left over: only the kept blocks use DRAM.
        assert dram_stat(b) == (used + bad_index * BLOCK, num + bad_index)
        assert cli_pins(fake_group.b) == [0]
        assert_b_still_serves(b)


def test_stalled_lookup_is_a_miss_within_the_deadline(
    fake_group: FakeGroup, fake: FakePeer
) -> None:
    keys, _ = give_fake(fake, 6)
    fake.configure("good", lookup_delay_s=10)
    with StoreClient(str(fake_group.b.socket)) as b:
        before = counters(b)
        t0 = time.monotonic()
        assert b.lookup(L, keys, include_peers=True).num_hits == 0
        assert time.monotonic() - t0 < 0.5 + 0.5  # peer_lookup_timeout_s
        deadline_s = 1.0
        t0 = time.monotonic()
        assert b.load(L, keys, include_peers=True, deadline_s=deadline_s).num_blocks == 0
        assert time.monotonic() - t0 < deadline_s + 1.0
        # A stalled peer is counted as a timeout, not as a dead one.
        after = counters(b)
        assert after["peer_lookup_timeouts"] - before["peer_lookup_timeouts"] >= 2
        assert after["peer_lookup_errors"] == before["peer_lookup_errors"]
        assert_b_still_serves(b)


class MuteListener:
    """A TCP port that accepts connections and never sends a byte (a peer
    process wedged after accept, or the wrong service on that port)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0), backlog=16)
        self.sock.settimeout(0.2)
        self.address = addr(self.sock.getsockname()[1])
        self.held: list[socket.socket] = []
        self.closing = threading.Event()
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while not self.closing.is_set() and len(self.held) < 64:
            with contextlib.suppress(TimeoutError, OSError):
                self.held.append(self.sock.accept()[0])

    def close(self) -> None:
        self.closing.set()
        self.thread.join(timeout=5)
        for conn in [*self.held, self.sock]:
            conn.close()


def test_peer_that_accepts_and_never_answers(tmp_path: Path) -> None:
    mute = MuteListener()
    b = start(tmp_path / "b", free_port(), [], "--set", f"peers={mute.address}")
    try:
        keys = keys_of(tokens(6, next(_BASE)))
        with StoreClient(str(b.socket)) as client:
            before = counters(client)
            t0 = time.monotonic()
            assert client.lookup(L, keys, include_peers=True).num_hits == 0
            lookup_s = time.monotonic() - t0
            deadline_s = 1.0
            t0 = time.monotonic()
            assert client.load(L, keys, include_peers=True, deadline_s=deadline_s).num_blocks == 0
            load_s = time.monotonic() - t0
            after = counters(client)
            assert_b_still_serves(client)
        assert mute.held, "the sidecar never connected to the listener"
        assert lookup_s < 0.5 + SLACK_S, lookup_s  # peer_lookup_timeout_s 0.5
        assert load_s < deadline_s + SLACK_S, load_s
        lost = sum(after[k] - before[k] for k in ("peer_lookup_timeouts", "peer_lookup_errors"))
        assert lost >= 2, (before, after)
    finally:
        stop_later(b)
        mute.close()


def test_load_deadline_bounds_the_whole_load(fake_group: FakeGroup, fake: FakePeer) -> None:
    keys, _ = give_fake(fake, 6)
    fake.configure("good", lookup_delay_s=10)
    with StoreClient(str(fake_group.b.socket)) as b:
        deadline_s = 1.0
        t0 = time.monotonic()
        assert b.load(L, keys, include_peers=True, deadline_s=deadline_s).num_blocks == 0
        took = time.monotonic() - t0
    assert took < deadline_s + SLACK_S, f"load with deadline_s={deadline_s} took {took:.2f}s"


@pytest.mark.parametrize(("deadline_s", "cut_by"), [(1.5, "timeouts"), (8.0, "stalls")])
def test_stalled_data_channel_keeps_what_verified(
    fake_group: FakeGroup, fake: FakePeer, deadline_s: float, cut_by: str
) -> None:
    """Half a block, then silence. A deadline sooner than fetch_stall_s cuts
    the transfer (a timeout); with the deadline far off, the stall limit
    does, before it (a stall). Either way what verified is kept."""
    keys, data = give_fake(fake, 8)
    fake.configure("half_stall", bad_index=3)
    with StoreClient(str(fake_group.b.socket)) as b:
        used, num = dram_stat(b)
        before = counters(b)
        t0 = time.monotonic()
        res = b.load(L, keys, include_peers=True, deadline_s=deadline_s)
        took = time.monotonic() - t0
        ends_s = STALL_S if cut_by == "stalls" else deadline_s
        assert ends_s - 0.3 <= took < ends_s + SLACK_S, f"load took {took:.2f} s"
        assert res.num_blocks == 3 and torch.equal(res.blocks[:3], data[:3])
        assert dram_stat(b) == (used + 3 * BLOCK, num + 3)
        assert cli_pins(fake_group.b) == [0]
        # Counted as what cut it, not as an error: in the stat, in `tierstore
        # stat` and in /metrics.
        after = counters(b)
        other = "timeouts" if cut_by == "stalls" else "stalls"
        assert after[f"peer_fetch_{cut_by}"] - before[f"peer_fetch_{cut_by}"] == 1
        assert after[f"peer_fetch_{other}"] == before[f"peer_fetch_{other}"]
        assert after["peer_fetch_errors"] == before["peer_fetch_errors"]
        line = next(x for x in cli_stat(fake_group.b).splitlines() if x.startswith("peers"))
        timeouts, stalls = after["peer_fetch_timeouts"], after["peer_fetch_stalls"]
        assert f"timeouts {timeouts}, stalls {stalls}, bad blocks" in line
        metrics = scrape(fake_group.metrics_port)
        assert metrics["tierstore_peer_fetch_timeouts_total"] == timeouts
        assert metrics["tierstore_peer_fetch_stalls_total"] == stalls
        assert metrics["tierstore_peer_fetch_errors_total"] == after["peer_fetch_errors"]
        assert_b_still_serves(b)


@pytest.mark.parametrize("deadline_s", [1.0, STALL_S + 1.0])
def test_dripping_data_channel_ends_at_the_deadline(
    fake_group: FakeGroup, fake: FakePeer, deadline_s: float
) -> None:
    """A few bytes every 0.2 s: the deadline ends the transfer, however far
    off. Past fetch_stall_s too, the control of the stall limit: bytes that
    keep coming, however few, re-arm it."""
    keys, data = give_fake(fake, 4)
    fake.configure("drip", bad_index=1)
    fake.drip_bytes, fake.drip_interval_s = 512, 0.2  # a block takes 3.2 s: past either deadline
    with StoreClient(str(fake_group.b.socket)) as b:
        before = counters(b)
        t0 = time.monotonic()
        res = b.load(L, keys, include_peers=True, deadline_s=deadline_s)
        took = time.monotonic() - t0
        assert deadline_s - 0.3 <= took < deadline_s + SLACK_S, f"load took {took:.2f} s"
        assert res.num_blocks <= 1 and torch.equal(res.blocks[:1], data[:1])
        after = counters(b)
        assert after["peer_fetch_timeouts"] - before["peer_fetch_timeouts"] == 1
        assert after["peer_fetch_stalls"] == before["peer_fetch_stalls"]


def test_peer_frozen_after_its_lookup_is_cut_before_the_deadline(
    fake_group: FakeGroup, fake: FakePeer
) -> None:
    """The lookup answers, then OpenFetch never does (a peer frozen between
    the two): the load gives up after fetch_stall_s, a miss."""
    keys, _ = give_fake(fake, 6)
    fake.configure("good", open_delay_s=30)
    asked = fake.opens_asked
    with StoreClient(str(fake_group.b.socket)) as b:
        before = counters(b)
        deadline_s = 8.0
        t0 = time.monotonic()
        res = b.load(L, keys, include_peers=True, deadline_s=deadline_s)
        took = time.monotonic() - t0
        assert fake.opens_asked > asked, "the load never asked the peer to open a transfer"
        assert STALL_S <= took < STALL_S + SLACK_S, f"load took {took:.2f} s"
        assert res.num_blocks == 0
        after = counters(b)
        assert after["peer_fetch_stalls"] - before["peer_fetch_stalls"] == 1
        assert after["peer_fetch_timeouts"] == before["peer_fetch_timeouts"]
        assert cli_pins(fake_group.b) == [0]
        assert_b_still_serves(b)


def test_slow_push_target_does_not_hold_back_other_pushes(
    fake_group: FakeGroup, fake: FakePeer
) -> None:
    keys = keys_of(tokens(8, next(_BASE)))
    me = addr(fake_group.port)
    slow = session_for(fake.address, fake_group.members, me, "slow")
    quick = session_for(fake_group.quiet.address, fake_group.members, me, "quick")
    fake.configure("good", replicate_delay_s=3.0)
    with StoreClient(str(fake_group.b.socket)) as b:
        b.store(L, keys, fp16_blocks(8, 77))
        assert b.end_turn(slow, L, keys, 64, wait=False).replicating
        time.sleep(0.2)
        t0 = time.monotonic()
        reply = b.end_turn(quick, L, keys, 64, wait=True)
        took = time.monotonic() - t0
    assert reply.replica_target == fake_group.quiet.address
    assert took < 2.0, f"a push to a healthy host waited {took:.2f}s behind a slow one (3 s)"
