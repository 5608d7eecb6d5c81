"""Reliability harness shared by ``tests/reliability/test_*.py`` and the soak
(``bench/reliability/soak.py``).

Provides:
- ``LAYOUT`` (8 KiB blocks), ``chain`` (deterministic key chains from a seed)
  and ``block_of`` (a block's bytes derived from its key alone with blake3's
  XOF), so any process can check any block it gets back, including blocks
  another process wrote before a crash;
- ``SETTINGS``: the settings of every reliability sidecar
  (``harness.sidecar.SidecarProcess``: SIGKILL, restart-to-serving timing,
  memory and log);
- ``index_keys``: the keys an NVMe tier's LMDB index lists (read while no
  sidecar holds the directory);
- ``memory_bounds``: a sidecar's memory bound from its config and the limits
  its code sets (``RssSampler`` measures against it);
- worker functions run in client processes (``workers()`` gives a forkserver
  context that imports torch and tierstore once, so 16 clients start in
  milliseconds instead of 4 s of imports each). Workers report one JSON line
  per operation to their own file, so a SIGKILLed worker loses nothing it
  already reported.

Runs in the test's (or the soak's) process, ``RssSampler`` on a thread of its
own, the workers in forkserver children. Every wait here is bounded; every
process started is stopped by its owner.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import random
import statistics
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import blake3
import lmdb
import numpy as np

from tierstore.config.peer import PeerConfig
from tierstore.keys import BlockKey, KVLayout, chain_keys
from tierstore.peer import service as peer_service
from tierstore.sidecar import service as local_service

from .sidecar import SMALL_SEGMENTS, SidecarProcess

LAYOUT = KVLayout("reliability", 2, 2, 64, "float16", 8)  # 8 KiB blocks of 8 tokens
BLOCK = LAYOUT.block_bytes
SERVE_TIMEOUT_S = 20.0  # restart-to-serving bound asserted by the tests
SETTINGS = (*SMALL_SEGMENTS, "shutdown_grace_s=1")  # every reliability sidecar's


# -- deterministic data ------------------------------------------------------------


def chain(seed: int, n: int) -> list[BlockKey]:
    """``n`` chained block keys of a prompt whose tokens come from ``seed``."""
    tokens = np.random.default_rng(seed).integers(0, 2**31 - 1, n * LAYOUT.block_tokens)
    return chain_keys(LAYOUT, tokens)


def block_of(key: bytes) -> bytes:
    """The bytes every writer stores under ``key``: derived from the key only."""
    return blake3.blake3(bytes(key)).digest(length=BLOCK)


def blocks_of(keys: Sequence[bytes]) -> Any:
    import torch

    buf = bytearray(b"".join(block_of(k) for k in keys))
    return torch.frombuffer(buf, dtype=torch.uint8).view(len(keys), BLOCK)


def count_wrong(keys: Sequence[bytes], rows: Any, n: int) -> int:
    """How many of the first ``n`` loaded rows differ from their key's bytes."""
    return sum(1 for i in range(n) if rows[i].numpy().tobytes() != block_of(keys[i]))


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# -- a sidecar's files and memory ------------------------------------------------------


def index_keys(nvme_dir: Path) -> list[bytes]:
    """Keys of every row of the NVMe index; call only while no sidecar runs on it."""
    path = nvme_dir / "index.lmdb"
    if not path.exists():
        return []
    env = lmdb.open(str(path), readonly=True, lock=False, subdir=True, max_dbs=2)
    try:
        blocks = env.open_db(b"blocks", create=False)
        with env.begin(db=blocks) as txn:
            return [bytes(k) for k, _ in txn.cursor()]
    finally:
        env.close()


class RssSampler:
    """Samples a sidecar's memory every ``interval_s`` in a thread."""

    def __init__(self, sidecar: SidecarProcess, interval_s: float = 0.25) -> None:
        self.sidecar = sidecar
        self.samples: list[dict[str, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval_s,), daemon=True)
        self._thread.start()

    def _run(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            if self.sidecar.alive():
                mem = self.sidecar.memory_kib()
                if mem:
                    self.samples.append(mem)

    def stop(self) -> dict[str, int]:
        self._stop.set()
        self._thread.join(5)
        keys = ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem")
        return {k: max((s.get(k, 0) for s in self.samples), default=0) for k in keys}


# Interpreter, grpc, numpy, lmdb, blake3, code pages and rpc thread stacks: an
# idle sidecar here is ~75 MiB RSS (~35 anonymous, ~32 file-backed); the rest
# is room for heap growth under load.
BASE_RSS_BOUND_BYTES = 256 << 20
# The peer service admits this many RPCs at once (PeerConfig.peer_max_rpcs).
PEER_MAX_CONCURRENT_RPCS = PeerConfig().peer_max_rpcs


def memory_bounds(
    dram_bytes: int, max_clients: int, rpc_threads: int, peer_port: bool
) -> dict[str, int]:
    """The sidecar's memory bound (bytes) from its config and code limits.

    Every RPC a gRPC server admits may hold one received message of the
    largest size it accepts while its handler runs (larger ones are refused
    before they are read whole). The local service admits ``max_clients + 4 *
    rpc_threads`` RPCs (tierstore/sidecar/process.py) of at most
    ``server.MAX_MESSAGE_BYTES``; the peer service PEER_MAX_CONCURRENT_RPCS of
    ``peer.service.MAX_MESSAGE_BYTES`` (with ``peer_port`` set). Replies are built from at most
    ``max_batch_keys`` keys, far below either. Block bytes never travel in
    messages: they live in the arena (and the peer data channel reads frames
    straight into arena slots).
    """
    local = (max_clients + 4 * rpc_threads) * local_service.MAX_MESSAGE_BYTES
    peer = PEER_MAX_CONCURRENT_RPCS * peer_service.MAX_MESSAGE_BYTES if peer_port else 0
    anon = BASE_RSS_BOUND_BYTES + local + peer
    return {"local_messages": local, "peer_messages": peer, "anon": anon,
            "shmem": dram_bytes, "rss": dram_bytes + anon}  # fmt: skip


# -- client worker processes ----------------------------------------------------------


def workers() -> Any:
    """A forkserver context whose server has imported tierstore.client (torch)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["harness.reliability", "tierstore.client", "torch"])
    return ctx


def stop_forkserver() -> None:
    from multiprocessing import forkserver

    stop = getattr(forkserver._forkserver, "_stop", None)
    if stop is not None:
        with contextlib.suppress(Exception):
            stop()


def reap(procs: Sequence[Any], timeout_s: float = 15.0) -> None:
    """Join worker processes; SIGKILL any still running at the deadline."""
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)


class EventLog:
    """Appends one JSON line per event to ``path``, line-buffered: a worker
    SIGKILLed keeps every event it reported."""

    def __init__(self, path: str) -> None:
        self.f = open(path, "a", buffering=1)

    def __call__(self, **event: Any) -> None:
        self.f.write(json.dumps(event) + "\n")


def read_events(path: Path) -> list[dict[str, Any]]:
    events = []
    with contextlib.suppress(FileNotFoundError), open(path) as f:
        for line in f:
            with contextlib.suppress(json.JSONDecodeError):  # a kill mid-line
                events.append(json.loads(line))
    return events


def _client(socket: str, name: str) -> Any:
    from tierstore.client import StoreClient

    return StoreClient(socket, name=name, connect_timeout_s=5.0, call_timeout_s=15.0)


def crash_writer(
    socket: str, log_path: str, seed: int, duration_s: float, chain_blocks: int
) -> None:
    """Store fresh chains until the sidecar dies or ``duration_s`` passes."""
    from tierstore.errors import TierstoreError

    log = EventLog(log_path)
    end = time.monotonic() + duration_s
    try:
        with _client(socket, f"writer-{seed}") as client:
            i = 0
            while time.monotonic() < end:
                cid = seed * 100_000 + i
                keys = chain(cid, chain_blocks)
                held = client.store(LAYOUT, keys, blocks_of(keys))
                log(op="store", chain=cid, n=chain_blocks, held=sum(held))
                i += 1
    except TierstoreError as e:
        log(op="error", error=str(e)[:200])


def crash_loader(socket: str, log_path: str, writer_log: str, seed: int, duration_s: float) -> None:
    """Load chains the writer reported, checking every byte that comes back."""
    from tierstore.errors import TierstoreError

    log = EventLog(log_path)
    rng = random.Random(seed)
    end = time.monotonic() + duration_s
    try:
        with _client(socket, f"loader-{seed}") as client:
            while time.monotonic() < end:
                stored = [e for e in read_events(Path(writer_log))[-40:] if e["op"] == "store"]
                if not stored:
                    time.sleep(0.02)
                    continue
                e = rng.choice(stored)
                keys = chain(e["chain"], e["n"])
                res = client.load(LAYOUT, keys)
                log(
                    op="load",
                    got=res.num_blocks,
                    wrong=count_wrong(keys, res.blocks, res.num_blocks),
                )
    except TierstoreError as e:
        log(op="error", error=str(e)[:200])


def overload_worker(
    socket: str,
    log_path: str,
    seed: int,
    duration_s: float,
    chain_blocks: int,
    max_chains: int,
    peer_chains: list[tuple[int, int]],
) -> None:
    """Mixed traffic: stores (each committed chain reported), loads that must
    return every committed block byte-exact, timed lookups, prefetches, and
    loads of chains only the peer holds (include_peers, within a deadline)."""
    from tierstore.errors import TierstoreError

    log = EventLog(log_path)
    rng = random.Random(seed)
    own: list[int] = []
    end = time.monotonic() + duration_s
    try:
        with _client(socket, f"overload-{seed}") as client:
            while time.monotonic() < end:
                r = rng.random()
                if r < 0.3 and len(own) < max_chains:
                    cid = seed * 100_000 + len(own)
                    keys = chain(cid, chain_blocks)
                    t0 = time.monotonic()
                    held = client.store(LAYOUT, keys, blocks_of(keys))
                    log(
                        op="store",
                        chain=cid,
                        n=chain_blocks,
                        held=sum(held),
                        s=time.monotonic() - t0,
                    )
                    if all(held):
                        own.append(cid)
                elif r < 0.5 and own:
                    cid = rng.choice(own)
                    keys = chain(cid, chain_blocks)
                    t0 = time.monotonic()
                    res = client.load(LAYOUT, keys)
                    wrong = count_wrong(keys, res.blocks, res.num_blocks)
                    log(
                        op="load",
                        chain=cid,
                        got=res.num_blocks,
                        want=len(keys),
                        wrong=wrong,
                        s=time.monotonic() - t0,
                    )
                elif r < 0.8:
                    cid = rng.choice(own) if own and rng.random() < 0.8 else seed * 100_000 + 99_999
                    keys = chain(cid, chain_blocks)
                    t0 = time.monotonic()
                    hit = client.lookup(LAYOUT, keys)
                    log(op="lookup", hits=hit.num_hits, s=time.monotonic() - t0)
                elif r < 0.92 and own:
                    keys = chain(rng.choice(own), chain_blocks)
                    policy = rng.choice(["best_effort", "timeout", "wait"])
                    t0 = time.monotonic()
                    out = client.prefetch(
                        LAYOUT, keys, policy, timeout_s=0.5 if policy == "timeout" else 0.0
                    )
                    if isinstance(out, Future):
                        out = out.result(timeout=30)
                    log(op="prefetch", policy=policy, outcome=out.outcome, s=time.monotonic() - t0)
                elif peer_chains:
                    cid, n = rng.choice(peer_chains)
                    keys = chain(cid, n)
                    t0 = time.monotonic()
                    res = client.load(LAYOUT, keys, include_peers=True, deadline_s=5.0)
                    wrong = count_wrong(keys, res.blocks, res.num_blocks)
                    log(
                        op="peer_load",
                        got=res.num_blocks,
                        want=n,
                        wrong=wrong,
                        s=time.monotonic() - t0,
                    )
    except TierstoreError as e:
        log(op="error", error=str(e)[:200])


def summary(values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {"n": 0}
    return {
        "n": len(values),
        "p50_ms": round(1000 * statistics.median(values), 2),
        "p99_ms": round(1000 * percentile(values, 0.99), 2),
        "max_ms": round(1000 * max(values), 2),
    }
