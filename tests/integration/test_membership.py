"""Group membership on a real etcd: real `tierstore serve` sidecars register
under 2 s leases and watch their group.

Three sidecars join and see each other; a fourth joins and gets replicas
without a restart anywhere; a SIGKILLed one leaves (its lease expires) and
pushes go elsewhere without a hang; a lease lost (revoked behind the
sidecar's back) is replaced and drops nothing stored; etcd killed and
restarted: serving goes on over the last known group, and membership
recovers; the router ranks the live set (in process, and `tierstore route
--membership`, and the `tierstore router --membership` service, which
ranks a host that joins without a restart). Skipped when etcd is not
installed. Every wait is bounded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from harness import REPO
from harness.etcd import MISSING, EtcdProcess, etcd_binary
from harness.sidecar import SidecarProcess, start_sidecar
from tierstore.cli.ports import free_port
from tierstore.client import StoreClient
from tierstore.config.peer import PeerConfig, parse_membership
from tierstore.config.router import RouterConfig
from tierstore.keys import BlockKey, chain_keys
from tierstore.membership.etcd_client import EtcdAuth, EtcdClient
from tierstore.membership.members import decode_member
from tierstore.policies.replication import rendezvous_target
from tierstore.router.router import Router
from tierstore.v1 import router_pb2, router_pb2_grpc
from tierstore.wire import layout_to_proto

from ..conftest import SMALL_LAYOUT
from .test_peers import fp16_blocks, kill, stop_all

pytestmark = pytest.mark.skipif(etcd_binary() is None, reason=MISSING)

L = SMALL_LAYOUT
TOKEN = "membership-test-token"
TTL_S = 2
WAIT_S = 30.0  # bound of every wait for the group to settle (a few TTLs on a busy host)


def wait_for(what: str, cond: Callable[[], bool], timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        time.sleep(0.05)


def counters(sock: Path) -> dict[str, int]:
    with StoreClient(str(sock)) as c:
        return dict(c.stat().counters)


def cli_stat(sock: Path) -> str:
    return subprocess.run(
        [sys.executable, "-m", "tierstore.cli", "stat", "--socket", str(sock)],
        capture_output=True, text=True, timeout=30, check=True,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    ).stdout  # fmt: skip


class Fleet:
    """etcd and the sidecars of one group, by peer address."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.etcd = EtcdProcess(root)
        self.url = f"etcd://{self.etcd.endpoint}/test-{uuid.uuid4().hex[:8]}"
        self.hosts: dict[str, SidecarProcess] = {}

    def start(self, name: str) -> str:
        port = free_port()
        address = f"127.0.0.1:{port}"
        root = self.root / name
        root.mkdir()
        self.hosts[address] = start_sidecar(
            root,
            "--set", f"peer_port={port}", "--set", f"peer_token={TOKEN}",
            "--set", "min_tokens=64", "--set", "shutdown_grace_s=0.5",
            "--set", f"membership={self.url}", "--set", f"membership_ttl_s={TTL_S}",
            "--set", "membership_timeout_s=0.5",
            dram="4MiB",
        )  # fmt: skip
        return address

    def sock(self, address: str) -> Path:
        return self.hosts[address].socket

    def live(self) -> list[str]:
        return [a for a, p in self.hosts.items() if p.proc.poll() is None]

    def members_seen(self, address: str) -> int:
        return counters(self.sock(address)).get("membership_members", -1)

    def wait_settled(self, expected: list[str]) -> None:
        for a in expected:
            wait_for(
                f"{a} sees {len(expected)} members",
                lambda a=a: self.members_seen(a) == len(expected),  # type: ignore[misc]
            )

    def etcd_client(self) -> EtcdClient:
        return EtcdClient(EtcdAuth(endpoints=(self.etcd.endpoint,)), timeout_s=2.0)

    def records(self) -> dict[str, bytes]:
        prefix = parse_membership(self.url).group_prefix("default")
        etcd = self.etcd_client()
        try:
            kvs = etcd.range_prefix(prefix).kvs
        finally:
            etcd.close()
        return {kv.key[len(prefix) :].decode(): kv.value for kv in kvs}

    def close(self) -> None:
        procs = list(self.hosts.values())
        try:
            stop_all(*procs)
        finally:
            self.etcd.stop()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    f = Fleet(tmp_path_factory.mktemp("membership"))
    try:
        for name in "abc":
            f.start(name)
        yield f
    finally:
        f.close()


def session_for(target: str, members: list[str], source: str, prefix: str) -> str:
    for i in range(500):
        name = f"{prefix}-{i}"
        if rendezvous_target(name, members, exclude=source) == target:
            return name
    raise AssertionError("no session id hashes to the target in 500 tries")


def turn(n: int, base: int) -> tuple[list[BlockKey], torch.Tensor]:
    return chain_keys(L, np.arange(base, base + L.block_tokens * n)), fp16_blocks(n, base % 97)


def test_three_sidecars_join_and_see_each_other(fleet: Fleet) -> None:
    members = fleet.live()
    fleet.wait_settled(members)
    records = fleet.records()
    assert sorted(records) == sorted(members)
    prefix = parse_membership(fleet.url).group_prefix("default")
    for address, value in records.items():
        m = decode_member(prefix + address.encode(), value, prefix)
        assert m is not None and m.address == address and m.group == "default"
        assert "dram" in m.tiers and m.dram_bytes == 4 << 20
        assert TOKEN.encode() not in value  # nothing secret goes into etcd
    c = counters(fleet.sock(members[0]))
    assert c["membership_etcd_up"] == 1 and c["membership_registered"] == 1
    assert "group     3 members (etcd: up)" in cli_stat(fleet.sock(members[0]))


def test_fourth_joins_and_gets_replicas(fleet: Fleet) -> None:
    first = fleet.live()
    fleet.wait_settled(first)
    d = fleet.start("d")
    members = [*first, d]
    fleet.wait_settled(members)  # no restart of a, b or c
    a = first[0]
    session = session_for(d, members, a, "join")
    keys, data = turn(16, 2_000_000)
    with StoreClient(str(fleet.sock(a))) as ca, StoreClient(str(fleet.sock(d))) as cd:
        assert all(ca.store(L, keys, data))
        reply = ca.end_turn(session, L, keys, 8 * 16, wait=True)
        assert reply.replica_target == d and reply.pushed == 16
        assert cd.lookup(L, keys).num_hits == 16


def test_killed_member_leaves_and_pushes_go_elsewhere(fleet: Fleet) -> None:
    if len(fleet.live()) < 4:
        fleet.wait_settled(fleet.live())
        fleet.start("d2")
    members = fleet.live()
    fleet.wait_settled(members)
    victim = members[-1]
    a = members[0]
    session = session_for(victim, members, a, "kill")
    kill(fleet.hosts[victim])  # SIGKILL: no revoke; the lease has to expire
    rest = [m for m in members if m != victim]
    fleet.wait_settled(rest)
    assert victim not in fleet.records()
    keys, data = turn(12, 3_000_000)
    with StoreClient(str(fleet.sock(a))) as ca:
        assert all(ca.store(L, keys, data))
        reply = ca.end_turn(session, L, keys, 8 * 12, wait=True)  # returns: no hang
        assert reply.replica_target in rest and reply.replica_target != a
        assert reply.pushed == 12
        assert counters(fleet.sock(a))["membership_leaves"] >= 1
    with StoreClient(str(fleet.sock(reply.replica_target))) as ct:
        assert ct.lookup(L, keys).num_hits == 12


def test_lost_lease_rejoins_and_drops_nothing(fleet: Fleet) -> None:
    members = fleet.live()
    fleet.wait_settled(members)
    a = members[0]
    keys, data = turn(10, 4_000_000)
    with StoreClient(str(fleet.sock(a))) as ca:
        assert all(ca.store(L, keys, data))
        before = counters(fleet.sock(a))
        prefix = parse_membership(fleet.url).group_prefix("default")
        etcd = fleet.etcd_client()
        try:
            lease = etcd.range_prefix(prefix + a.encode()).kvs[0].lease
            etcd.revoke(lease)  # what an expiry while partitioned does
        finally:
            etcd.close()
        wait_for(
            "a registered again under a new lease",
            lambda: (
                counters(fleet.sock(a))["membership_registrations"]
                > before["membership_registrations"]
            ),
        )
        fleet.wait_settled(members)
        assert a in fleet.records()
        found = ca.lookup(L, keys)
        assert found.num_hits == 10
        res = ca.load(L, keys)
        assert res.num_blocks == 10 and torch.equal(res.blocks, data)


def test_etcd_down_keeps_serving_and_membership_recovers(fleet: Fleet) -> None:
    members = fleet.live()
    fleet.wait_settled(members)
    a, b = members[0], members[1]
    fleet.etcd.kill()
    try:
        wait_for(
            "a notices etcd is down", lambda: counters(fleet.sock(a))["membership_etcd_up"] == 0
        )
        c = counters(fleet.sock(a))
        assert c["membership_members"] == len(members)  # the last known group is kept
        assert c["membership_etcd_outages"] >= 1
        assert "etcd: UNREACHABLE: last known group kept" in cli_stat(fleet.sock(a))
        session = session_for(b, members, a, "outage")
        keys, data = turn(8, 5_000_000)
        with StoreClient(str(fleet.sock(a))) as ca, StoreClient(str(fleet.sock(b))) as cb:
            assert all(ca.store(L, keys, data))
            reply = ca.end_turn(session, L, keys, 8 * 8, wait=True)
            assert reply.replica_target == b and reply.pushed == 8
            assert cb.lookup(L, keys).num_hits == 8
    finally:
        fleet.etcd.start()
    for m in members:
        wait_for(
            f"{m} sees etcd again", lambda m=m: counters(fleet.sock(m))["membership_etcd_up"] == 1
        )  # type: ignore[misc]
    fleet.wait_settled(members)
    wait_for("every member is in etcd again", lambda: sorted(fleet.records()) == sorted(members))


def test_router_routes_over_the_live_set(fleet: Fleet) -> None:
    members = fleet.live()
    fleet.wait_settled(members)
    holder = members[1]
    keys, data = turn(20, 6_000_000)
    with StoreClient(str(fleet.sock(holder))) as c:
        assert all(c.store(L, keys, data))
    peer = PeerConfig(
        peer_token=TOKEN, membership=fleet.url, membership_ttl_s=TTL_S, membership_timeout_s=0.5
    )
    for watch in (False, True):
        router = Router(RouterConfig(router_watch=watch), peer)
        try:
            wait_for(
                "the router sees the group",
                lambda r=router: sorted(r.clients) == sorted(members),  # type: ignore[misc]
            )
            plan = router.route(L, keys, 8 * 20 + 5)
            assert sorted(h.host for h in plan.ranked) == sorted(members)
            assert plan.best is not None and plan.best.host == holder
        finally:
            router.close()
    out = subprocess.run(
        [sys.executable, "-m", "tierstore.cli", "route", "--json",
         "--layout", json.dumps(L.to_dict()), "--random-tokens", "64",
         "--membership", fleet.url, "--set", f"peer_token={TOKEN}"],
        capture_output=True, text=True, timeout=60, check=True,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    ).stdout  # fmt: skip
    assert sorted(h["host"] for h in json.loads(out)["hosts"]) == sorted(members)


def test_router_service_follows_the_group_without_a_restart(fleet: Fleet) -> None:
    members = fleet.live()
    fleet.wait_settled(members)
    port = free_port()
    log = open(fleet.root / "router.log", "ab")
    proc = subprocess.Popen(
        [sys.executable, "-m", "tierstore.cli", "router", "--membership", fleet.url,
         "--port", str(port), "--set", f"peer_token={TOKEN}",
         "--set", f"membership_ttl_s={TTL_S}", "--set", "membership_timeout_s=0.5"],
        stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONPATH=str(REPO)),
    )  # fmt: skip
    log.close()
    request = router_pb2.RouteRequest(
        layout=layout_to_proto(L), token_ids=list(range(8 * 4)), session="router-follows"
    )
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = router_pb2_grpc.RouterServiceStub(channel)

    def ranked() -> list[str]:
        try:
            reply = stub.Route(request, timeout=5, metadata=(("authorization", f"Bearer {TOKEN}"),))
        except grpc.RpcError:
            return []  # not listening yet
        return sorted(h.host for h in reply.hosts)

    try:
        wait_for("the router service ranks the group", lambda: ranked() == sorted(members))
        e = fleet.start("e")
        fleet.wait_settled([*members, e])
        wait_for("the router ranks the new host", lambda: ranked() == sorted([*members, e]))
        assert proc.poll() is None  # the same process: no restart
    finally:
        channel.close()
        proc.terminate()
        proc.wait(15)
