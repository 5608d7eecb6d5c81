"""Benchmark of group membership on a real etcd: how long a dead member
keeps receiving pushes, next to the lease TTL.

    python -m bench.membership.churn --json [--ttl 2] [--rounds 3]

Starts etcd (loopback, temporary data directory) and two sidecars A and B
that register with ``membership_ttl_s = --ttl``. Each round starts a third
sidecar V, waits until A picks V as the spill host of sessions that hash to
it (``join_to_first_push_s``: from V's socket being ready to A's first
EndTurn naming V), then keeps calling EndTurn on A every ``PERIOD_S`` for
such sessions and ends V: SIGKILL in ``kill`` rounds (V's lease must
expire), SIGTERM in ``stop`` rounds (V revokes its lease on the way out).
``*_to_last_push_s`` is from V's end to the last EndTurn on A that still
chose V (a push attempt that fails); ``*_to_left_s`` until A's stat counts
one member fewer. The limit next to them is the TTL itself: a killed
member's lease expires between TTL - TTL/3 (renewed a third of the TTL
before) and TTL after its death, plus etcd's expiry check (every 0.5 s) and
the watch's delivery. ``etcd_put_ms``/``etcd_range_ms``: one etcd round trip
with the client the sidecars use, on this machine.

Prints one JSON object. Needs the ``etcd`` binary (Debian: etcd-server).
"""

from __future__ import annotations

import argparse
import signal
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from bench.limits import emit
from harness.etcd import EtcdProcess, etcd_binary
from harness.sidecar import SidecarProcess, bench_sidecar, remove_arenas
from tierstore.cli.ports import free_port
from tierstore.client import StoreClient
from tierstore.keys import KVLayout, chain_keys
from tierstore.membership.etcd_client import EtcdAuth, EtcdClient
from tierstore.policies.replication import rendezvous_target

LAYOUT = KVLayout("bench-membership", 1, 1, 64, "float16", 16)
TOKEN = "bench-membership"
PERIOD_S = 0.01  # one EndTurn on A this often
AFTER_S = 3.0  # keep calling this many TTLs after V's end
MAX_WAIT_S = 60.0


def settings(url: str, port: int, ttl: int) -> list[str]:
    return [
        f"peer_port={port}", f"peer_token={TOKEN}", f"membership={url}",
        f"membership_ttl_s={ttl}", "membership_timeout_s=0.5", "min_tokens=16",
        "shutdown_grace_s=0.5", "dram_segment_bytes=1MiB",
    ]  # fmt: skip


def start_member(tmp: Path, url: str, ttl: int) -> tuple[SidecarProcess, str]:
    """A new member V (DRAM only), serving; and its peer address."""
    port = free_port()
    member = SidecarProcess(
        tmp, dram=str(64 << 20), nvme="0", settings=tuple(settings(url, port, ttl))
    )
    member.start()
    return member, f"127.0.0.1:{port}"


def members_seen(client: StoreClient) -> int:
    return int(client.stat().counters.get("membership_members", -1))


def wait(cond: Any, what: str) -> None:
    deadline = time.monotonic() + MAX_WAIT_S
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.01)


def one_round(
    tmp: Path, url: str, ttl: int, a: tuple[Path, str], b_addr: str, sig: int
) -> dict[str, float]:
    a_sock, a_addr = a
    member, v = start_member(tmp, url, ttl)
    ready = time.monotonic()
    members = [a_addr, b_addr, v]
    sessions = [f"s-{i}" for i in range(400)]
    sessions = [s for s in sessions if rendezvous_target(s, members, exclude=a_addr) == v][:16]
    keys = chain_keys(LAYOUT, np.arange(4 * LAYOUT.block_tokens))
    blocks = np.zeros((len(keys), LAYOUT.block_bytes), dtype=np.uint8)
    with StoreClient(str(a_sock)) as ca:
        import torch

        ca.store(LAYOUT, keys, torch.from_numpy(blocks))
        i = 0

        def target() -> str:
            nonlocal i
            i += 1
            s = sessions[i % len(sessions)]
            return str(ca.end_turn(s, LAYOUT, keys, 64, wait=False).replica_target)

        wait(lambda: target() == v, "A never chose the new member")
        joined = time.monotonic() - ready
        for _ in range(int(0.5 / PERIOD_S)):  # steady state: V receives pushes
            target()
            time.sleep(PERIOD_S)
        before = members_seen(ca)
        ended = time.monotonic()
        member.proc.send_signal(sig)
        last_v, left = ended, 0.0
        while time.monotonic() - ended < AFTER_S * ttl:
            if target() == v:
                last_v = time.monotonic()
            if not left and members_seen(ca) < before:
                left = time.monotonic() - ended
            time.sleep(PERIOD_S)
    member.proc.wait(30)
    remove_arenas(member.pid)
    return {"join_to_first_push_s": joined, "to_last_push_s": last_v - ended, "to_left_s": left}


def etcd_rtt_ms(endpoint: str) -> tuple[float, float]:
    etcd = EtcdClient(EtcdAuth(endpoints=(endpoint,)), timeout_s=2.0)
    try:
        n = 200
        t0 = time.perf_counter()
        for i in range(n):
            etcd.put(f"/bench/{i}".encode(), b"x" * 200)
        t1 = time.perf_counter()
        for _ in range(n):
            etcd.range_prefix(b"/bench/")
        t2 = time.perf_counter()
        return (t1 - t0) / n * 1e3, (t2 - t1) / n * 1e3
    finally:
        etcd.close()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--ttl", type=int, default=2, help="membership_ttl_s of the sidecars")
    p.add_argument("--rounds", type=int, default=3, help="rounds of each of kill and stop")
    args = p.parse_args(argv)
    if etcd_binary() is None:
        raise SystemExit("bench.membership.churn needs etcd (apt-get install etcd-server)")
    with tempfile.TemporaryDirectory(prefix="tierstore-bench-membership-") as d:
        tmp = Path(d)
        (tmp / "etcd").mkdir()
        etcd = EtcdProcess(tmp / "etcd")
        try:
            url = f"etcd://{etcd.endpoint}/bench-{uuid.uuid4().hex[:8]}"
            put_ms, range_ms = etcd_rtt_ms(etcd.endpoint)
            (tmp / "a").mkdir()
            (tmp / "b").mkdir()
            pa, pb = free_port(), free_port()
            with (
                bench_sidecar(tmp / "a", 64 << 20, *settings(url, pa, args.ttl)) as a_sock,
                bench_sidecar(tmp / "b", 64 << 20, *settings(url, pb, args.ttl)),
            ):
                a = (a_sock, f"127.0.0.1:{pa}")
                with StoreClient(str(a_sock)) as ca:
                    wait(lambda: members_seen(ca) == 2, "A and B never saw each other")
                rounds: dict[str, list[dict[str, float]]] = {"kill": [], "stop": []}
                for r in range(args.rounds):
                    for kind, sig in (("kill", signal.SIGKILL), ("stop", signal.SIGTERM)):
                        root = tmp / f"v-{kind}-{r}"
                        root.mkdir()
                        rounds[kind].append(
                            one_round(root, url, args.ttl, a, f"127.0.0.1:{pb}", sig)
                        )
        finally:
            etcd.stop()
    result: dict[str, Any] = {"ttl_s": args.ttl, "rounds": args.rounds,
                              "etcd_put_ms": put_ms, "etcd_range_ms": range_ms}  # fmt: skip
    for kind, rs in rounds.items():
        for fig in ("to_last_push_s", "to_left_s"):
            values = [x[fig] for x in rs]
            result[f"{kind}_{fig}_max"] = max(values)
            result[f"{kind}_{fig}_mean"] = statistics.fmean(values)
    joins = [x["join_to_first_push_s"] for rs in rounds.values() for x in rs]
    result["join_to_first_push_s_max"] = max(joins)
    result["join_to_first_push_s_mean"] = statistics.fmean(joins)
    result["kill_to_last_push_vs_ttl"] = result["kill_to_last_push_s_max"] / args.ttl
    emit(result, args.json)


if __name__ == "__main__":
    main()
