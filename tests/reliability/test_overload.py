"""Overload: 16 concurrent client processes (and a peer sidecar) drive one
sidecar with stores, loads, lookups, prefetches and pulls from the peer;
some clients are SIGKILLed midway and replaced.

Proved: the sidecar's memory stays within a bound derived from its config
and the limits its code sets (see ``memory_bounds``: the arena is shared
memory in /dev/shm, so it shows in RSS as RssShmem, at most ``dram_bytes``;
anonymous memory is a base for the interpreter and libraries plus one
largest-accepted message per RPC each gRPC server admits at once),
no committed block is lost while DRAM + NVMe have room (the NVMe budget holds
every block the clients may store, and the test checks that NVMe evicted
nothing: then every block whose store returned held must load byte-exact,
during the run and at the end), killed clients leave no attachment, pin or
reservation behind (not one DRAM slot: the Reserve-vs-detach race is fixed,
see test_reserve_racing_detach_leaks_nothing), and p50/p99 latency of
lookups is reported.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.reliability import (
    BASE_RSS_BOUND_BYTES,
    LAYOUT,
    SETTINGS,
    RssSampler,
    blocks_of,
    chain,
    count_wrong,
    memory_bounds,
    overload_worker,
    read_events,
    reap,
    stop_forkserver,
    summary,
    workers,
)
from harness.sidecar import SidecarProcess
from tierstore.cli.ports import free_port
from tierstore.client import StoreClient

CLIENTS = 16
KILLED = 4  # clients SIGKILLed midway (and replaced)
DURATION_S = 30.0
CHAIN_BLOCKS = 16
MAX_CHAINS = 40  # per client: (16 + 4) x 40 x 16 blocks x 8 KiB = 100 MiB < NVME_BYTES
DRAM_BYTES = 8 << 20
NVME_BYTES = 160 << 20
PEER_CHAINS = [(900_000 + i, 64) for i in range(4)]
MAX_CLIENTS = 32  # server config: 20 live clients at most, plus the verifier
RPC_THREADS = 16
TOKEN = "overload-token"


@pytest.fixture(scope="module", autouse=True)
def _forkserver() -> Iterator[None]:
    yield
    stop_forkserver()


def test_sixteen_clients_and_a_peer(tmp_path: Path) -> None:
    rng = random.Random(424242)
    port_a, port_b = free_port(), free_port()
    common = ("--set", f"peer_token={TOKEN}", "--set", "min_tokens=1000000",
              "--set", "replicate_policy=kv_share",  # no replica push
              "--set", "peer_lookup_timeout_s=2", "--set", f"max_clients={MAX_CLIENTS}",
              "--set", f"rpc_threads={RPC_THREADS}")  # fmt: skip
    a = SidecarProcess(
        tmp_path / "a", "--set", f"peer_port={port_a}", "--set", f"peers=127.0.0.1:{port_b}",
        *common, settings=SETTINGS, dram=str(DRAM_BYTES), nvme=str(NVME_BYTES),
    )  # fmt: skip
    b = SidecarProcess(
        tmp_path / "b", "--set", f"peer_port={port_b}", "--set", f"peers=127.0.0.1:{port_a}",
        *common, settings=SETTINGS, dram="8MiB", nvme="8MiB",
    )  # fmt: skip
    ctx = workers()
    procs: list = []
    sampler = None
    try:
        a.start()
        b.start()
        with StoreClient(str(b.socket), name="peer-seed") as client:
            for cid, n in PEER_CHAINS:
                keys = chain(cid, n)
                assert all(client.store(LAYOUT, keys, blocks_of(keys)))
        idle = a.memory_kib()
        sampler = RssSampler(a)
        logs: list[Path] = []

        def spawn(seed: int, duration_s: float) -> object:
            log = tmp_path / f"worker-{seed}.jsonl"
            logs.append(log)
            p = ctx.Process(
                target=overload_worker,
                args=(str(a.socket), str(log), seed, duration_s, CHAIN_BLOCKS, MAX_CHAINS,
                      PEER_CHAINS),
            )  # fmt: skip
            p.start()
            return p

        started = time.monotonic()
        procs = [spawn(seed, DURATION_S) for seed in range(1, CLIENTS + 1)]
        kill_at = sorted(rng.uniform(0.2, 0.7) * DURATION_S for _ in range(KILLED))
        victims = rng.sample(range(CLIENTS), KILLED)
        for i, (at, victim) in enumerate(zip(kill_at, victims)):
            time.sleep(max(0.0, started + at - time.monotonic()))
            procs[victim].kill()
            procs.append(spawn(100 + i, DURATION_S - (time.monotonic() - started)))
        reap(procs, timeout_s=DURATION_S + 60)
        run_s = time.monotonic() - started
        mem = sampler.stop()

        # Killed clients' attachments, pins and reservations are released.
        deadline = time.monotonic() + 15
        while a.stat().clients and time.monotonic() < deadline:
            time.sleep(0.2)
        stat = a.stat()
        assert not stat.clients, f"{len(stat.clients)} clients still attached"
        counters = dict(stat.counters)
        dram = next(t for t in stat.tiers if t.name == "dram")
        nvme = next(t for t in stat.tiers if t.name == "nvme")
        # Slots reserved and never committed or aborted: a killed client's
        # reservations are aborted when its Attach stream ends, including one
        # whose Reserve was running (fixed in de52ca1).
        leaked_slots = (
            dram.used_bytes - dram.num_blocks * LAYOUT.block_bytes
        ) // LAYOUT.block_bytes
        assert leaked_slots == 0, f"{leaked_slots} DRAM slots stay reserved by killed clients"
        assert nvme.evictions == 0, "the NVMe budget was meant to hold everything"
        assert nvme.verify_failures == 0 and nvme.read_failures == 0

        events = [e for log in logs for e in read_events(log)]
        by_op: dict[str, list[dict]] = {}
        for e in events:
            by_op.setdefault(e["op"], []).append(e)
        assert not by_op.get("error"), by_op.get("error", [])[:3]
        loads = by_op.get("load", [])
        assert all(e["wrong"] == 0 for e in loads + by_op.get("peer_load", []))
        lost = [e for e in loads if e["got"] != e["want"]]
        assert not lost, f"{len(lost)} loads of committed chains came back short: {lost[:3]}"

        committed = [e["chain"] for e in by_op.get("store", []) if e["held"] == e["n"]]
        assert len(committed) > CLIENTS
        missing = wrong = 0
        with StoreClient(str(a.socket), name="verifier") as client:
            for lo in range(0, len(committed), 8):
                keys = [k for cid in committed[lo : lo + 8] for k in chain(cid, CHAIN_BLOCKS)]
                res = client.load(LAYOUT, keys)
                missing += len(keys) - res.num_blocks
                wrong += count_wrong(keys, res.blocks, res.num_blocks)
        assert wrong == 0 and missing == 0, f"{missing} committed blocks lost, {wrong} wrong"

        bounds = memory_bounds(DRAM_BYTES, MAX_CLIENTS, RPC_THREADS, peer_port=True)
        lookups = [e["s"] for e in by_op.get("lookup", [])]
        ops = ", ".join(f"{op} {len(v)}" for op, v in sorted(by_op.items()))
        lines = [
            f"overload: {CLIENTS} clients + {KILLED} SIGKILLed and replaced + 1 peer for "
            f"{run_s:.1f} s; ops {ops}",
            f"  committed chains {len(committed)} ({len(committed) * CHAIN_BLOCKS} blocks), all "
            f"loaded byte-exact; leaked pins released {counters.get('leaked_pins_released')}, "
            f"reservations {counters.get('leaked_reservations_released')}",
            f"  sidecar memory KiB: idle {idle}; max {mem}",
            f"  bounds KiB: VmHWM <= {bounds['rss'] >> 10} (dram {DRAM_BYTES >> 10} + base "
            f"{BASE_RSS_BOUND_BYTES >> 10} + local messages {bounds['local_messages'] >> 10} + "
            f"peer messages {bounds['peer_messages'] >> 10}), RssAnon <= {bounds['anon'] >> 10}, "
            f"RssShmem <= {bounds['shmem'] >> 10}",
            f"  lookup latency {summary(lookups)}",
            f"  store {summary([e['s'] for e in by_op.get('store', [])])}; load "
            f"{summary([e['s'] for e in loads])}; peer load "
            f"{summary([e['s'] for e in by_op.get('peer_load', [])])}",
        ]
        print("\n" + "\n".join(lines))
        assert mem["VmHWM"] * 1024 <= bounds["rss"]
        assert mem["RssAnon"] * 1024 <= bounds["anon"]
        assert mem["RssShmem"] * 1024 <= bounds["shmem"]
    finally:
        if sampler is not None:
            sampler.stop()
        reap(procs, timeout_s=1.0)
        a.stop()
        b.stop()


def test_reserve_racing_detach_leaks_nothing() -> None:
    """Deterministic form of the leak the overload test sees when it kills clients."""
    import threading

    from tierstore.config import Config
    from tierstore.config.store import StoreConfig
    from tierstore.sidecar.service import LocalServicer
    from tierstore.store.tiered import TieredStore
    from tierstore.v1 import local_pb2
    from tierstore.wire import layout_to_proto

    class Context:
        callback = None

        def add_callback(self, cb: object) -> bool:
            self.callback = cb
            return True

        def is_active(self) -> bool:
            return True

        def abort(self, code: object, message: str) -> None:
            raise RuntimeError(message)

    config = Config(
        store=StoreConfig(dram_bytes=1 << 20, dram_segment_bytes=64 << 10, nvme_bytes=0)
    )
    store = TieredStore(config.store)
    try:
        servicer = LocalServicer(store, config, threading.Event())
        ctx = Context()
        stream = servicer.Attach(local_pb2.AttachRequest(client_name="e"), ctx)  # kept open
        client_id = next(stream).client_id
        layout_id = servicer.RegisterLayout(
            local_pb2.RegisterLayoutRequest(layout=layout_to_proto(LAYOUT)), ctx
        ).layout_id
        keys = chain(1, 8)
        reserve, entered, detached = store.reserve, threading.Event(), threading.Event()

        def reserve_after_detach(*args: object, **kwargs: object) -> object:
            entered.set()  # the handler checked the owner; now the client dies
            detached.wait(5)
            return reserve(*args, **kwargs)

        store.reserve = reserve_after_detach  # type: ignore[method-assign]
        request = local_pb2.KeysRequest(
            client_id=client_id, layout_id=layout_id, keys=b"".join(keys)
        )
        refused: list[str] = []

        def call_reserve() -> None:
            try:
                servicer.Reserve(request, ctx)
            except RuntimeError as e:  # the fake context's abort
                refused.append(str(e))

        call = threading.Thread(target=call_reserve)
        call.start()
        assert entered.wait(5)
        ctx.callback()  # gRPC ends the SIGKILLed client's Attach stream
        detached.set()
        call.join(5)
        store.reserve = reserve  # type: ignore[method-assign]
        assert not servicer.clients()
        assert store.dram.used_bytes() == 0, "the dead client's reservation leaked"
        assert refused and "detached" in refused[0]  # the late call is refused, not answered
    finally:
        store.close()
