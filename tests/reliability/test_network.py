"""Network faults between real sidecars in two network namespaces joined by
a veth pair (10.201.0.1 <-> 10.201.0.2, namespaces this module creates and
deletes): a link shaped very slow (tc tbf 8 mbit), a link taken down in the
middle of a large pull, random packet loss on both ends of the link (5% and
30%: a classic BPF program on clsact ingress drops packets, see harness/relay.py;
this kernel has no netem and the machine no nft or iptables), and added
round-trip time (100 ms each way, 200 ms RTT: a second pair of sidecars, A2
in A's namespace and B2 at 10.201.0.4 in a third namespace whose only link to
A is a delay line of two TUN devices, see harness/relay.py ``DelayLine``; it delays
IP packets, not the bytes of a relayed connection, so the sidecars' own TCP
stacks see the RTT, and the test checks that both B2's gRPC port and its
data channel's port had connections across it and that the kernel's RTT
estimate of those connections includes the delay).

Sidecar A (the host the session moved to) pulls a 4 MiB prefix that only
sidecar B holds; the client runs in the root namespace and talks to A over
its Unix socket. Proved for each fault: ``load(..., include_peers=True,
deadline_s=...)`` returns within its deadline (plus a small slack for the
last local call) and a lookup across the link within ``peer_lookup_timeout_s``;
what a load returns is exactly the prefix that verified, byte for byte (the
rest is a miss), and is held on A afterwards (the turn prefills only the
rest); no pin or reservation is left on A; the sender's pins are released (B
evicts the blocks it was sending once fresh stores need the room); and after
the fault is gone the same pull completes. Under loss, the test also checks
that TCP really retransmitted (the fault was injected); under latency alone,
that the whole pull and the lookup still succeed within generous deadlines.

Needs root, ip(8) and tc(8) (skipped without them); the loss test skips if
the kernel refuses the clsact/cls_bpf filter, with tc's message. The latency
tests also need /dev/net/tun and ss(8) (iproute2), and fail without them. Killed
peers, peers that never answer and hostile streams are covered on loopback by
tests/integration/test_peers.py.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from harness import REPO, child_env
from harness.netns import Network, Shape, add_namespace, delete_namespace, ip
from harness.relay import DelayLine, drop_random, listening_ports, stop_dropping, tcp_retransmits
from harness.reliability import BLOCK, LAYOUT, SETTINGS, blocks_of, chain, count_wrong
from harness.sidecar import SidecarProcess
from tierstore.client import StoreClient
from tierstore.tiers import TierName

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not (shutil.which("ip") and shutil.which("tc")),
    reason="creates network namespaces and shapes links: needs root, ip(8) and tc(8)",
)

TOKEN = "reliability-net-token"
SUBNET = "10.201.0"
ADDR_A, ADDR_B = f"{SUBNET}.1", f"{SUBNET}.2"
ADDR_B2 = f"{SUBNET}.4"  # B2's own namespace: reached from A only over the delay line
TUN_A, TUN_B2 = "tsdly0", "tsdly1"  # the delay line's ends in A's and B2's namespaces
PORT, PORT2 = 7700, 7701  # peer ports of A/B and of A2/B2
PULL_BLOCKS = 512  # 4 MiB
SENDER_TTL_S = 4.0  # B's fetch_timeout_s: how long its sender may block on a dead link
LOOKUP_TIMEOUT_S = 3.0  # peer_lookup_timeout_s of the sidecars
SLACK_S = 1.5  # a call may end this long after its deadline (its last local calls)
STALL_S = 2.0  # fetch_stall_s: a transfer on which nothing moves this long is cut
B_DRAM_BLOCKS = 1024  # 8 MiB
DELAY_S = 0.1  # added one-way latency of the delay line (a round trip pays it twice)


@dataclass
class Pair:
    net: Network  # host 0 is A, host 1 is B
    a: SidecarProcess
    b: SidecarProcess

    @property
    def ns_a(self) -> str:
        return self.net.ns[0]

    @property
    def ns_b(self) -> str:
        return self.net.ns[1]


@dataclass
class Delayed:
    a: SidecarProcess
    b: SidecarProcess
    line: DelayLine
    ns_a: str
    data_port: int  # B2's data channel (its other listening port)


def _sidecar(
    root: Path, ns: str, me: str, peer: str, ttl_s: float, dram: str, port: int, *extra: str
) -> SidecarProcess:
    return SidecarProcess(
        root,
        "--set", f"peer_host={me}", "--set", f"peer_port={port}",
        "--set", f"peers={peer}", "--set", f"peer_token={TOKEN}",
        "--set", f"peer_lookup_timeout_s={LOOKUP_TIMEOUT_S}", "--set", f"fetch_timeout_s={ttl_s}",
        "--set", f"fetch_stall_s={STALL_S}",
        "--set", "compression=none", "--set", "min_tokens=1000000", *extra,
        dram=dram, nvme="64MiB", netns=ns, settings=SETTINGS,
    )  # fmt: skip


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    with Network(2, subnet=SUBNET, prefix="tsrel") as net:  # removed on every exit path
        ns_a, ns_b = net.ns
        root = tmp_path_factory.mktemp("net")
        a = _sidecar(root / "a", ns_a, ADDR_A, f"{ADDR_B}:{PORT}", 10.0, "16MiB", PORT)
        b = _sidecar(root / "b", ns_b, ADDR_B, f"{ADDR_A}:{PORT}", SENDER_TTL_S,
                     f"{B_DRAM_BLOCKS * BLOCK}", PORT)  # fmt: skip
        try:
            a.start()
            b.start()
            yield Pair(net, a, b)
        finally:
            a.stop()
            b.stop()


@pytest.fixture(scope="module")
def delayed(pair: Pair, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Delayed]:
    """A2 (in A's namespace) peers with B2, whose namespace reaches A's only
    over the delay line: all of B2's traffic, gRPC and data channel both ways,
    crosses it."""
    ns_b2 = f"tsrel-b2-{os.getpid()}"
    line = None
    sidecars: list[SidecarProcess] = []
    try:
        add_namespace(ns_b2)
        for ns, dev in ((pair.ns_a, TUN_A), (ns_b2, TUN_B2)):
            ip("-n", ns, "tuntap", "add", "dev", dev, "mode", "tun")
            ip("-n", ns, "link", "set", dev, "up")
        ip("-n", ns_b2, "addr", "add", f"{ADDR_B2}/32", "dev", TUN_B2)
        ip("-n", ns_b2, "route", "add", f"{ADDR_A}/32", "dev", TUN_B2, "src", ADDR_B2)
        ip("-n", pair.ns_a, "route", "add", f"{ADDR_B2}/32", "dev", TUN_A, "src", ADDR_A)
        line = DelayLine([(pair.ns_a, TUN_A), (ns_b2, TUN_B2)], 0.0)
        root = tmp_path_factory.mktemp("delayed")
        a = _sidecar(root / "a", pair.ns_a, ADDR_A, f"{ADDR_B2}:{PORT2}", 10.0, "16MiB", PORT2)
        b = _sidecar(root / "b", ns_b2, ADDR_B2, f"{ADDR_A}:{PORT2}", SENDER_TTL_S,
                     f"{B_DRAM_BLOCKS * BLOCK}", PORT2)  # fmt: skip
        sidecars = [b, a]
        b.start()
        ports = listening_ports(b.pid, ADDR_B2)
        assert PORT2 in ports and len(ports) == 2, f"B2 should listen on 2 ports: {ports}"
        a.start()
        yield Delayed(a, b, line, pair.ns_a, max(ports - {PORT2}))
    finally:
        for s in sidecars:
            s.stop()
        if line is not None:
            line.close()
        ip("-n", pair.ns_a, "link", "del", TUN_A, check=False)
        delete_namespace(ns_b2)


def tcp_rtts_ms(ns: str, addr: str) -> dict[int, list[float]]:
    """The kernel's smoothed RTT of each established TCP connection from
    namespace ``ns`` to ``addr`` (IPv4, or v4-mapped on gRPC's IPv6 sockets),
    by remote port (``ss -ti``)."""
    out = subprocess.run(
        ["ip", "netns", "exec", ns, "ss", "-tinH", "state", "established"],
        check=True, capture_output=True, text=True, timeout=20,
    ).stdout  # fmt: skip
    peer = re.compile(rf"^\[?(?:::ffff:)?{re.escape(addr)}\]?:(\d+)$")
    rtts: dict[int, list[float]] = {}
    port = None
    for line in out.splitlines():
        fields = line.split()
        if len(fields) >= 4 and not line[0].isspace():  # Recv-Q Send-Q local peer
            m = peer.match(fields[3])
            port = int(m.group(1)) if m else None
        elif port is not None and (rtt := re.search(r"\brtt:([\d.]+)/", line)):
            rtts.setdefault(port, []).append(float(rtt.group(1)))
            port = None
    return rtts


class RttSampler:
    """Samples ``tcp_rtts_ms`` every ``interval_s`` on a thread while in its
    ``with`` block (the data channel's connection lives only for its fetch)."""

    def __init__(self, ns: str, addr: str, interval_s: float = 0.1) -> None:
        self.rtts_ms: dict[int, list[float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ns, addr, interval_s))

    def _run(self, ns: str, addr: str, interval_s: float) -> None:
        while True:
            for port, values in tcp_rtts_ms(ns, addr).items():
                self.rtts_ms.setdefault(port, []).extend(values)
            if self._stop.wait(interval_s):
                return

    def __enter__(self) -> RttSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)


def put_on(sidecar: SidecarProcess, seed: int, n: int) -> list[bytes]:
    keys = chain(seed, n)
    with StoreClient(str(sidecar.socket), name="seed-b") as client:
        for lo in range(0, n, 256):
            assert all(client.store(LAYOUT, keys[lo : lo + 256], blocks_of(keys[lo : lo + 256])))
        assert client.lookup(LAYOUT, keys).tiers == (TierName.DRAM,) * n
    return keys  # type: ignore[return-value]


def assert_sender_released(b: SidecarProcess, keys: list[bytes], filler_seed: int) -> None:
    """B's sender pins end by its deadline: fresh stores then evict every block
    it was sending (a pinned block cannot leave DRAM)."""
    time.sleep(SENDER_TTL_S + 1.0)
    filler = chain(filler_seed, B_DRAM_BLOCKS + 256)
    with StoreClient(str(b.socket), name="filler-b") as client:
        for lo in range(0, len(filler), 256):
            client.store(LAYOUT, filler[lo : lo + 256], blocks_of(filler[lo : lo + 256]))
        tiers = client.lookup(LAYOUT, keys).tiers  # type: ignore[arg-type]
    assert len(tiers) == len(keys)
    stuck = tiers.count(TierName.DRAM)
    assert stuck == 0, f"{stuck} blocks stay in B's DRAM: the aborted transfer still pins them"
    assert b.pins() == 0


def timed_pull(client: StoreClient, keys: list[bytes], deadline_s: float) -> tuple[int, float, int]:
    """(blocks loaded, seconds, wrong blocks) of a pull-on-switch load."""
    t0 = time.monotonic()
    res = client.load(LAYOUT, keys, include_peers=True, deadline_s=deadline_s)  # type: ignore[arg-type]
    elapsed = time.monotonic() - t0
    return res.num_blocks, elapsed, count_wrong(keys, res.blocks, res.num_blocks)


def timed_lookup(client: StoreClient, keys: list[bytes]) -> tuple[int, float]:
    """(hits, seconds) of a lookup across the group."""
    t0 = time.monotonic()
    hits = client.lookup(LAYOUT, keys, include_peers=True).num_hits  # type: ignore[arg-type]
    return hits, time.monotonic() - t0


def assert_a_clean(a: SidecarProcess, client: StoreClient, keys: list[bytes], got: int) -> None:
    # The loading client's next call comes after its releases (they are sent
    # without waiting for the reply): ask through it.
    assert sum(c.pins for c in client.stat().clients) == 0, "pins left on A after the load"
    dram = a.tier("dram")
    assert dram.used_bytes == dram.num_blocks * BLOCK, "reserved slots leaked on A"
    # What verified is held here now: the turn prefills only the rest.
    if got:
        assert client.lookup(LAYOUT, keys[:got]).num_hits == got  # type: ignore[arg-type]


def recover(a: SidecarProcess, keys: list[bytes]) -> tuple[int, float]:
    """After the fault is gone, the whole pull completes (gRPC reconnects within ~2 s)."""
    deadline = time.monotonic() + 20
    with StoreClient(str(a.socket), name="engine-a") as client:
        while True:
            got, elapsed, wrong = timed_pull(client, keys, 10.0)
            assert wrong == 0
            if got == len(keys) or time.monotonic() > deadline:
                return got, elapsed
            time.sleep(0.5)


def test_very_slow_link(pair: Pair) -> None:
    keys = put_on(pair.b, 1, PULL_BLOCKS)
    pair.net.shape(1, Shape(rate="8mbit", burst="32kb", latency="400ms"))
    try:
        with StoreClient(str(pair.a.socket), name="engine-a") as client:
            deadline_s = 3.0
            got, elapsed, wrong = timed_pull(client, keys, deadline_s)
            assert elapsed <= deadline_s + SLACK_S, f"load took {elapsed:.2f} s"
            assert wrong == 0
            assert got < PULL_BLOCKS  # 4 MiB at 1 MB/s cannot arrive in 3 s: the rest is prefilled
            assert_a_clean(pair.a, client, keys, got)
            t0 = time.monotonic()
            client.lookup(LAYOUT, keys, include_peers=True)  # type: ignore[arg-type]
            lookup_s = time.monotonic() - t0
            assert lookup_s <= LOOKUP_TIMEOUT_S + SLACK_S
            errors = pair.a.counters()
    finally:
        pair.net.shape(1, None)
    assert_sender_released(pair.b, keys, 1001)
    full, full_s = recover(pair.a, keys)
    assert full == PULL_BLOCKS
    print(
        f"\nslow link (tbf 8mbit): pull of {PULL_BLOCKS} blocks with deadline {deadline_s} s "
        f"returned {got} verified blocks in {elapsed:.2f} s; lookup across it {lookup_s:.2f} s; "
        f"A fetch timeouts {errors.get('peer_fetch_timeouts')}, errors "
        f"{errors.get('peer_fetch_errors')}; after the link recovered: "
        f"{full} blocks in {full_s:.2f} s"
    )


def test_link_down_mid_transfer(pair: Pair) -> None:
    keys = put_on(pair.b, 2, PULL_BLOCKS)
    # 16 mbit: the 4 MiB pull takes ~2 s, so the link goes down in its middle.
    pair.net.shape(1, Shape(rate="16mbit", burst="32kb", latency="400ms"))
    outcome: dict[str, tuple[int, float, int]] = {}
    try:
        with StoreClient(str(pair.a.socket), name="engine-a") as client:
            # Far beyond the link's going down: the stall limit, not the
            # deadline, ends the transfer.
            deadline_s, down_at_s = 8.0, 0.8
            before = pair.a.counters()
            t = threading.Thread(
                target=lambda: outcome.setdefault("pull", timed_pull(client, keys, deadline_s))
            )
            t.start()
            time.sleep(down_at_s)
            pair.net.set_up(1, False)
            t.join(deadline_s + 10)
            assert not t.is_alive(), "the load did not return"
            got, elapsed, wrong = outcome["pull"]
            assert elapsed <= down_at_s + STALL_S + SLACK_S, f"load took {elapsed:.2f} s"
            after = pair.a.counters()
            assert after["peer_fetch_stalls"] - before.get("peer_fetch_stalls", 0) == 1
            assert wrong == 0 and got < PULL_BLOCKS
            assert_a_clean(pair.a, client, keys, got)
            t0 = time.monotonic()
            assert client.lookup(LAYOUT, keys[got:], include_peers=True).num_hits == 0  # type: ignore[arg-type]
            lookup_s = time.monotonic() - t0
            assert lookup_s <= LOOKUP_TIMEOUT_S + SLACK_S
    finally:
        pair.net.set_up(1, True)
        pair.net.set_up(0, True)
        pair.net.shape(1, None)
    assert_sender_released(pair.b, keys, 2002)
    full, full_s = recover(pair.a, keys)
    assert full == PULL_BLOCKS
    print(
        f"\nlink down mid-transfer: pull with deadline {deadline_s} s, link down at "
        f"{down_at_s} s, returned {got} verified blocks in {elapsed:.2f} s (cut by the "
        f"{STALL_S} s stall limit); lookup across the dead link {lookup_s:.2f} s; after the "
        f"link came back: {full} blocks in {full_s:.2f} s"
    )


def wait_peer_reachable(client: StoreClient, keys: list[bytes], timeout_s: float) -> int:
    """Look ``keys`` up across the group until the peer answers with all of
    them; returns the lookups that came back short first. Each lookup must end
    within its own deadline."""
    deadline = time.monotonic() + timeout_s
    short = 0
    while True:
        hits, lookup_s = timed_lookup(client, keys)
        assert lookup_s <= LOOKUP_TIMEOUT_S + SLACK_S, f"lookup took {lookup_s:.2f} s"
        if hits == len(keys):
            return short
        short += 1
        assert time.monotonic() < deadline, f"the peer stayed unreachable for {timeout_s} s"
        time.sleep(0.1)


@pytest.mark.parametrize("loss_percent", [5, 30])
def test_packet_loss(pair: Pair, loss_percent: int) -> None:
    keys = put_on(pair.b, 10 + loss_percent, PULL_BLOCKS)
    others = put_on(pair.b, 20 + loss_percent, 64)  # looked up across the lossy link
    with StoreClient(str(pair.a.socket), name="engine-a") as client:
        wait_peer_reachable(client, others, 20.0)  # loss hits a running group, not its start
    retransmits = sum(tcp_retransmits(s.pid) for s in (pair.a, pair.b))
    try:
        for ns, dev in zip(pair.net.ns, pair.net.dev):
            added = drop_random(ns, dev, loss_percent)
            if added.returncode != 0:
                pytest.skip(f"cannot drop packets here (tc clsact + cls_bpf): {added.stderr}")
        with StoreClient(str(pair.a.socket), name="engine-a") as client:
            deadline_s = 3.0
            got, elapsed, wrong = timed_pull(client, keys, deadline_s)
            assert elapsed <= deadline_s + SLACK_S, f"load took {elapsed:.2f} s"
            assert wrong == 0, f"{wrong} of {got} blocks served wrong"
            assert_a_clean(pair.a, client, keys, got)
            hits, lookup_s = timed_lookup(client, others)
            assert lookup_s <= LOOKUP_TIMEOUT_S + SLACK_S, f"lookup took {lookup_s:.2f} s"
        retransmitted = sum(tcp_retransmits(s.pid) for s in (pair.a, pair.b)) - retransmits
        assert retransmitted > 0, "no TCP segment was retransmitted: nothing was dropped"
    finally:
        for ns, dev in zip(pair.net.ns, pair.net.dev):
            stop_dropping(ns, dev)
    assert_sender_released(pair.b, keys, 3000 + loss_percent)
    full, full_s = recover(pair.a, keys)
    assert full == PULL_BLOCKS
    print(
        f"\n{loss_percent}% packet loss both ways: pull of {PULL_BLOCKS} blocks with deadline "
        f"{deadline_s} s returned {got} verified blocks in {elapsed:.2f} s; lookup across it "
        f"{lookup_s:.2f} s ({hits} of {len(others)} hits); TCP segments retransmitted "
        f"{retransmitted}; after the loss stopped: {full} blocks in {full_s:.2f} s"
    )


def test_added_latency(delayed: Delayed) -> None:
    """200 ms of round-trip time (100 ms each way, on packets: see harness/relay.py
    ``DelayLine``): a load whose deadline is shorter than a round trip gives up
    in time, and latency alone breaks nothing (lookups and the whole pull
    succeed within generous deadlines). Proved to be on the path: B2's gRPC
    port and its data channel's port each had a TCP connection opened across
    the line, and the kernel's RTT estimate of A2's connections to both is at
    least the added round trip. Not modelled: bandwidth limits, jitter,
    reordering and loss (the other tests here)."""
    keys = put_on(delayed.b, 30, PULL_BLOCKS)
    others = put_on(delayed.b, 31, 64)
    delayed.line.delay_s = DELAY_S
    try:
        with StoreClient(str(delayed.a.socket), name="engine-a2") as client:
            short_lookups = wait_peer_reachable(client, others, 20.0)
            # A deadline shorter than a round trip: the load gives up in time.
            short_s = DELAY_S
            got, elapsed, wrong = timed_pull(client, keys, short_s)
            assert elapsed <= short_s + SLACK_S, f"load took {elapsed:.2f} s"
            assert wrong == 0
            assert_a_clean(delayed.a, client, keys, got)
            # Latency alone breaks nothing: lookups find what the peer holds
            # and the whole pull arrives, within generous deadlines.
            hits, lookup_s = timed_lookup(client, others)
            assert lookup_s <= LOOKUP_TIMEOUT_S + SLACK_S, f"lookup took {lookup_s:.2f} s"
            assert 2 * DELAY_S <= lookup_s, f"a lookup across the line took {lookup_s:.3f} s"
            assert hits == len(others)
            full_deadline_s = 10.0
            with RttSampler(delayed.ns_a, ADDR_B2) as sampler:
                full, full_s, wrong = timed_pull(client, keys, full_deadline_s)
            rtts = sampler.rtts_ms
            assert full_s <= full_deadline_s + SLACK_S, f"load took {full_s:.2f} s"
            assert wrong == 0 and full == PULL_BLOCKS
            assert_a_clean(delayed.a, client, keys, full)
    finally:
        delayed.line.delay_s = 0.0
    grpc_conns = delayed.line.connections(PORT2)
    data_conns = delayed.line.connections(delayed.data_port)
    assert grpc_conns >= 1, "no connection to B2's gRPC port crossed the delay line"
    assert data_conns >= 1, "no connection to B2's data channel crossed the delay line"
    for port in (PORT2, delayed.data_port):
        assert port in rtts, f"no connection to {ADDR_B2}:{port} seen during the pulls: {rtts}"
        assert max(rtts[port]) >= 2000 * DELAY_S, f"TCP's RTT to port {port} (ms): {rtts}"
    assert_sender_released(delayed.b, keys, 4000)
    print(
        f"\n{1000 * DELAY_S:.0f} ms added each way ({2000 * DELAY_S:.0f} ms RTT): "
        f"{short_lookups} lookups came back short before the peer was reachable; pull with "
        f"deadline {short_s} s returned {got} verified blocks in {elapsed:.2f} s; lookup "
        f"{lookup_s:.2f} s ({hits} hits); full pull of {PULL_BLOCKS} blocks in {full_s:.2f} s; "
        f"connections across the line: gRPC port {grpc_conns}, data port {data_conns}; "
        f"kernel's smoothed RTT, most seen (ms): gRPC {max(rtts[PORT2])}, "
        f"data {max(rtts[delayed.data_port])}"
    )


FIRST_LOOKUP = """
import sys, time, grpc
from tierstore.config.peer import PeerConfig
from tierstore.peer.client import PeerClient
from harness.reliability import LAYOUT, chain
client = PeerClient(sys.argv[1], PeerConfig(), sys.argv[2])
t0 = time.monotonic()
try:
    print(client.lookup_future(LAYOUT, chain(int(sys.argv[3]), 64), 3.0).result().num_hits)
except grpc.RpcError as e:
    print(e.code().name)
print(round(time.monotonic() - t0, 2))
"""


def test_first_connect_over_slow_link(pair: Pair, delayed: Delayed) -> None:
    """A new PeerClient (the sidecar's, with its channel options) in A's
    namespace finds a peer's blocks with its first lookup across the 200 ms
    RTT line (gRPC takes min_reconnect_backoff_ms as the shortest connect
    attempt: at 100 ms such a peer could never be connected)."""
    put_on(delayed.b, 40, 64)
    before = delayed.line.connections(PORT2)
    delayed.line.delay_s = DELAY_S
    try:
        out = subprocess.run(
            ["ip", "netns", "exec", pair.ns_a, sys.executable, "-c", FIRST_LOOKUP,
             f"{ADDR_B2}:{PORT2}", TOKEN, "40"],
            capture_output=True, text=True, timeout=60, env=child_env(), cwd=REPO,
        )  # fmt: skip
    finally:
        delayed.line.delay_s = 0.0
    assert out.returncode == 0, out.stderr[-2000:]
    assert delayed.line.connections(PORT2) > before, "the new client did not cross the line"
    answer, seconds = out.stdout.split()
    assert float(seconds) <= LOOKUP_TIMEOUT_S + SLACK_S
    assert answer == "64", f"first lookup answered {answer} after {seconds} s"
