"""Soak: the long form of tests/reliability/test_crash.py and test_overload.py.

Alternates, until ``--minutes`` pass, a crash phase (a writer and a loader
client drive a sidecar with a 1 MiB arena over a 4 MiB NVMe tier; the sidecar
is SIGKILLed at a random moment, restarted, and every block its NVMe index
lists is loaded and compared with the bytes derived from its key) and an
overload phase (``--clients`` client processes doing stores, loads, lookups,
prefetches and pulls of chains only a peer sidecar holds, against one sidecar
for ``--phase-s`` seconds, some SIGKILLed and replaced; every committed block
must load byte-exact afterwards). The sidecar's memory is sampled throughout
and compared with the bound derived from its config
(``harness.reliability.memory_bounds``).

Prints one JSON object: kills survived, restart-to-serving p50/max, faults
injected by kind, operations done, max RSS against the configured bounds
(``rss_within_bound``), p50/p99 latencies, and any violation found (empty
when all held).

    python -m bench.reliability.soak --minutes 10
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from harness.reliability import (
    LAYOUT,
    SETTINGS,
    RssSampler,
    blocks_of,
    chain,
    count_wrong,
    crash_loader,
    crash_writer,
    index_keys,
    memory_bounds,
    overload_worker,
    percentile,
    read_events,
    reap,
    stop_forkserver,
    summary,
    workers,
)
from harness.sidecar import SidecarProcess, arenas_of
from tierstore.client import StoreClient

CRASH_DRAM, CRASH_NVME = 1 << 20, 4 << 20
LOAD_DRAM, LOAD_NVME = 8 << 20, 256 << 20
CHAIN_BLOCKS = 16
MAX_CLIENTS, RPC_THREADS = 64, 16  # server config of every soak sidecar (the defaults)
SERVER_ARGS = ("--set", f"max_clients={MAX_CLIENTS}", "--set", f"rpc_threads={RPC_THREADS}")
PEER_DRAM = 8 << 20
PEER_CHAIN_BLOCKS = 64
PEER_TOKEN = "soak-token"
BOUNDS = {
    "crash": memory_bounds(CRASH_DRAM, MAX_CLIENTS, RPC_THREADS, peer_port=False),
    "overload": memory_bounds(LOAD_DRAM, MAX_CLIENTS, RPC_THREADS, peer_port=True),
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def memory_report(out: dict) -> tuple[dict, bool]:
    """Max memory of each phase's sidecar next to its bound (KiB), and whether all held."""
    report, ok = {}, True
    for phase, mem in out["max_rss_kib"].items():
        bound = BOUNDS[phase]
        checks = {"VmHWM": bound["rss"], "RssAnon": bound["anon"], "RssShmem": bound["shmem"]}
        within = all(mem.get(k, 0) * 1024 <= v for k, v in checks.items())
        report[phase] = {
            "max_kib": mem,
            "bound_kib": {k: v >> 10 for k, v in checks.items()},
            "within_bound": within,
        }
        ok = ok and within
    return report, ok


def merge_max(out: dict, phase: str, mem: dict) -> None:
    prev = out["max_rss_kib"].get(phase, {})
    out["max_rss_kib"][phase] = {k: max(v, prev.get(k, 0)) for k, v in mem.items()}


def verify_listed(sidecar: SidecarProcess, keys: list[bytes]) -> tuple[int, int, int]:
    """(loaded, wrong, missing) over every listed key."""
    loaded = wrong = missing = 0
    with StoreClient(str(sidecar.socket), name="soak-verifier") as client:
        for lo in range(0, len(keys), 64):
            batch, i = keys[lo : lo + 64], 0
            while i < len(batch):
                res = client.load(LAYOUT, batch[i:])  # type: ignore[arg-type]
                wrong += count_wrong(batch[i:], res.blocks, res.num_blocks)
                loaded += res.num_blocks
                i += res.num_blocks
                if i < len(batch):
                    missing += 1
                    i += 1
    return loaded, wrong, missing


def crash_phase(root: Path, ctx, rng: random.Random, cycles: int, out: dict) -> None:
    sidecar = SidecarProcess(
        root, *SERVER_ARGS, settings=SETTINGS, dram=str(CRASH_DRAM), nvme=str(CRASH_NVME)
    )
    procs: list = []
    sampler = None
    try:
        out["restart_s"].append(sidecar.start())
        sampler = RssSampler(sidecar)
        for _ in range(cycles):
            n = out["faults"]["sigkill_sidecar"]
            wlog, llog = root / f"w{n}.jsonl", root / f"l{n}.jsonl"
            sock = str(sidecar.socket)
            procs = [
                ctx.Process(target=crash_writer, args=(sock, str(wlog), n + 1, 60.0, 32)),
                ctx.Process(target=crash_loader, args=(sock, str(llog), str(wlog), n + 1, 60.0)),
            ]
            for p in procs:
                p.start()
            want, deadline = rng.randint(4, 40), time.monotonic() + 30
            while time.monotonic() < deadline:
                if sum(1 for e in read_events(wlog) if e["op"] == "store") >= want:
                    break
                time.sleep(0.01)
            time.sleep(rng.uniform(0, 0.2))
            old = sidecar.kill()
            out["faults"]["sigkill_sidecar"] += 1
            reap(procs)
            listed = index_keys(sidecar.nvme_dir)
            if rng.random() < 0.2:
                sidecar.start(wait=False)
                time.sleep(rng.uniform(0.05, 0.6))
                sidecar.kill()
                out["faults"]["sigkill_sidecar_at_startup"] += 1
            out["restart_s"].append(sidecar.start())
            if arenas_of(old):
                out["violations"].append(f"arena of killed pid {old} left in /dev/shm")
            loaded, wrong, missing = verify_listed(sidecar, listed)
            out["ops"]["indexed_blocks_verified"] += loaded
            if wrong or missing:
                out["violations"].append(f"after kill: {wrong} wrong, {missing} missing")
            for e in read_events(wlog):
                out["ops"]["crash_stores"] += e["op"] == "store"
            for e in read_events(llog):
                if e["op"] == "load":
                    out["ops"]["crash_loads"] += 1
                    if e["wrong"]:
                        out["violations"].append("loader got wrong bytes")
    finally:
        if sampler is not None:
            merge_max(out, "crash", sampler.stop())
        reap(procs, timeout_s=1.0)
        sidecar.stop()


def seed_peer(peer: SidecarProcess, base: int) -> list[tuple[int, int]]:
    """Chains only the peer holds (half its DRAM), for the clients' pulls."""
    chains = [(base + 900 + i, PEER_CHAIN_BLOCKS) for i in range(4)]
    with StoreClient(str(peer.socket), name="soak-peer-seed") as client:
        for cid, n in chains:
            keys = chain(cid, n)
            client.store(LAYOUT, keys, blocks_of(keys))
    return chains


def overload_phase(root: Path, ctx, rng: random.Random, args, out: dict) -> None:
    port, peer_port = free_port(), free_port()
    common = (*SERVER_ARGS, "--set", f"peer_token={PEER_TOKEN}", "--set", "min_tokens=1000000",
              "--set", "replicate_policy=kv_share",  # no replica push
              "--set", "peer_lookup_timeout_s=2")  # fmt: skip
    sidecar = SidecarProcess(
        root / "a", "--set", f"peer_port={port}", "--set", f"peers=127.0.0.1:{peer_port}",
        *common, settings=SETTINGS, dram=str(LOAD_DRAM), nvme=str(LOAD_NVME),
    )  # fmt: skip
    peer = SidecarProcess(
        root / "b", "--set", f"peer_port={peer_port}", "--set", f"peers=127.0.0.1:{port}",
        *common, settings=SETTINGS, dram=str(PEER_DRAM), nvme="8MiB",
    )  # fmt: skip
    procs: list = []
    logs: list[Path] = []
    sampler = None
    # Each phase has a fresh sidecar; chains stay within the NVMe budget.
    max_chains = LOAD_NVME // 2 // (CHAIN_BLOCKS * LAYOUT.block_bytes) // (args.clients + 8)
    try:
        sidecar.start()
        peer.start()
        base = 1000 * (out["phases"] + 1)
        peer_chains = seed_peer(peer, base)
        sampler = RssSampler(sidecar)

        def spawn(seed: int, duration_s: float):
            log = root / f"o{seed}.jsonl"
            logs.append(log)
            p = ctx.Process(
                target=overload_worker,
                args=(
                    str(sidecar.socket),
                    str(log),
                    seed,
                    duration_s,
                    CHAIN_BLOCKS,
                    max_chains,
                    peer_chains,
                ),
            )
            p.start()
            return p

        started = time.monotonic()
        procs = [spawn(base + i, args.phase_s) for i in range(args.clients)]
        for j in range(8):
            time.sleep(args.phase_s / 10)
            victim = rng.randrange(len(procs))
            if procs[victim].is_alive():
                procs[victim].kill()
                out["faults"]["sigkill_client"] += 1
                remaining = args.phase_s - (time.monotonic() - started)
                procs.append(spawn(base + 500 + j, max(1.0, remaining)))
        reap(procs, timeout_s=args.phase_s + 60)
        events = [e for log in logs for e in read_events(log)]
        committed = []
        for e in events:
            out["ops"][e["op"]] += 1
            if "s" in e and e["op"] in out["latency_s"]:
                out["latency_s"][e["op"]].append(e["s"])
            if e.get("wrong"):
                out["violations"].append(f"{e['op']} returned wrong bytes")
            if e["op"] == "load" and e["got"] != e["want"]:
                out["violations"].append("a committed chain came back short")
            if e["op"] == "store" and e["held"] == e["n"]:
                committed.append(e["chain"])
        with StoreClient(str(sidecar.socket), name="soak-verifier") as client:
            for lo in range(0, len(committed), 8):
                keys = [k for c in committed[lo : lo + 8] for k in chain(c, CHAIN_BLOCKS)]
                res = client.load(LAYOUT, keys)
                if res.num_blocks != len(keys) or count_wrong(keys, res.blocks, res.num_blocks):
                    out["violations"].append("a committed block was lost or wrong at the end")
        dram = sidecar.tier("dram")
        leaked = (dram.used_bytes - dram.num_blocks * LAYOUT.block_bytes) // LAYOUT.block_bytes
        out["leaked_reserved_slots"] += leaked
        out["ops"]["committed_blocks_verified"] += len(committed) * CHAIN_BLOCKS
    finally:
        if sampler is not None:
            merge_max(out, "overload", sampler.stop())
        reap(procs, timeout_s=1.0)
        sidecar.stop()
        peer.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--phase-s", type=float, default=60.0)
    parser.add_argument("--kills-per-phase", type=int, default=10)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    out: dict = {
        "restart_s": [],
        "faults": Counter(),
        "ops": Counter(),
        "latency_s": {"lookup": [], "load": [], "store": [], "prefetch": [], "peer_load": []},
        "max_rss_kib": {},
        "violations": [],
        "leaked_reserved_slots": 0,
        "phases": 0,
    }
    ctx = workers()
    end = time.monotonic() + 60 * args.minutes
    try:
        with tempfile.TemporaryDirectory(prefix="tierstore-soak-") as tmp:
            while time.monotonic() < end:
                root = Path(tmp) / f"phase-{out['phases']}"
                crash_phase(root / "crash", ctx, rng, args.kills_per_phase, out)
                if time.monotonic() < end:
                    overload_phase(root / "overload", ctx, rng, args, out)
                out["phases"] += 1
    finally:
        stop_forkserver()
    restart = out["restart_s"]
    memory, rss_ok = memory_report(out)
    if not rss_ok:
        out["violations"].append("sidecar memory beyond its configured bound")
    print(
        json.dumps(
            {
                "minutes": args.minutes,
                "phases": out["phases"],
                "kills_survived": out["faults"]["sigkill_sidecar"]
                + out["faults"]["sigkill_sidecar_at_startup"],
                "restart_to_serving_s": {
                    "p50": round(percentile(restart, 0.5), 3),
                    "max": round(max(restart), 3) if restart else None,
                },
                "faults_injected": dict(out["faults"]),
                "ops": dict(out["ops"]),
                "latency": {op: summary(v) for op, v in out["latency_s"].items()},
                "rss_within_bound": rss_ok,
                "memory": memory,
                "leaked_reserved_slots": out["leaked_reserved_slots"],
                "violations": out["violations"][:20],
            },
            indent=2,
        )
    )
    return 1 if out["violations"] else 0


if __name__ == "__main__":
    sys.exit(main())
