"""The two hosts of bench/switch.py: network namespaces joined by a shaped
veth pair, one `tierstore serve` in each, and each host's engine imports.

Provides ``Net`` (namespaces, veth, ``tc tbf``; removed by ``close``),
``Sidecar`` (a sidecar inside a namespace, its peer port on the namespace
address), ``EngineImports`` (one process per host that loads a switch's
reused prefix into preallocated slot buffers, away from the driver's
threads), and ``cleanup_all``/``on_signal``, which remove whatever is still
up when the benchmark ends or is interrupted. Needs root.
"""

from __future__ import annotations

import contextlib
import glob
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from common import spawn_logged, wait_for_socket  # noqa: E402

from tierstore.client import StoreClient  # noqa: E402
from tierstore.keys import KVLayout  # noqa: E402
from tierstore.tiers import TierName  # noqa: E402

SUBNET = "10.200.0"
PEER_PORT = 7700
TOKEN = "bench-switch-token"
SLOTS_PER_HOST = 4
# Per sidecar at scale 1, multiplied by the scale like every byte (4 GiB and
# 16 GiB at 1/32): DRAM holds every live conversation and its replica; NVMe
# holds what DRAM evicts over a whole run (the public hosts kept replicas on
# disk), so no live block is lost for room.
DRAM_BYTES_SCALE1 = 128 << 30
NVME_BYTES_SCALE1 = 512 << 30
REPLICA_BYTES_SCALE1 = 256 << 30  # replica budget: never the limit in these runs
LINKS = {"1gbit": ("1gbit", "256kb"), "10gbit": ("10gbit", "2mb"), "unshaped": None}
LINK_BPS = {"1gbit": 1e9, "10gbit": 1e10, "unshaped": None}
LINKS = {"1gbit": ("1gbit", "256kb"), "10gbit": ("10gbit", "2mb"), "unshaped": None}
LINK_BPS = {"1gbit": 1e9, "10gbit": 1e10, "unshaped": None}


def scaled_bytes(scale1_bytes: int, scale: Fraction) -> int:
    return int(scale1_bytes * scale) // (1 << 20) << 20


# -- namespaces and sidecars ----------------------------------------------------------------


class Net:
    """Two namespaces and a veth pair between them; removed by ``close`` (idempotent)."""

    def __init__(self, link: str) -> None:
        tag = f"{os.getpid() % 100000}"
        self.ns = [f"tsw{tag}a", f"tsw{tag}b"]
        self.dev = [f"tsw{tag}va", f"tsw{tag}vb"]
        self.addr = [f"{SUBNET}.1", f"{SUBNET}.2"]
        self.created: list[str] = []
        for ns in self.ns:
            _sh("ip", "netns", "add", ns)
            self.created.append(ns)
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
        _sh(
            "ip", "link", "add", self.dev[0], "netns", self.ns[0],
            "type", "veth", "peer", "name", self.dev[1], "netns", self.ns[1],
        )  # fmt: skip
        for ns, dev, addr in zip(self.ns, self.dev, self.addr):
            _sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _sh("ip", "-n", ns, "link", "set", dev, "up")
            if LINKS[link] is not None:
                rate, burst = LINKS[link]
                _sh(
                    "ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root",
                    "tbf", "rate", rate, "burst", burst, "latency", "50ms",
                )  # fmt: skip

    def tx_bytes(self, i: int) -> int:
        out = _sh("ip", "netns", "exec", self.ns[i], "cat",
                  f"/sys/class/net/{self.dev[i]}/statistics/tx_bytes")  # fmt: skip
        return int(out)

    def close(self) -> None:
        while self.created:
            subprocess.run(["ip", "netns", "del", self.created.pop()], check=False)


def _sh(*cmd: str) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)}: {done.stderr.strip()}")
    return done.stdout.strip()


class Sidecar:
    def __init__(
        self,
        root: Path,
        ns: str,
        addr: str,
        peer: str,
        min_tokens: int,
        dram_bytes: int,
        nvme_bytes: int,
        replica_bytes: int,
        replicate_policy: str = "headroom",
        stream: bool = True,
        settings: tuple[str, ...] = (),  # more KEY=VALUE for `serve --set`
    ) -> None:
        root.mkdir(parents=True)
        self.root, self.socket = root, root / "s.sock"
        cmd = [
            "ip", "netns", "exec", ns, sys.executable, "-m", "tierstore.cli", "serve",
            "--socket", str(self.socket), "--nvme-dir", str(root / "nvme"),
            "--dram-bytes", str(dram_bytes), "--nvme-bytes", str(nvme_bytes), "--metrics-port", "0",
            "--set", f"peer_host={addr}", "--set", f"peer_port={PEER_PORT}",
            "--set", f"peers={peer}:{PEER_PORT}", "--set", f"peer_token={TOKEN}",
            "--set", f"min_tokens={min_tokens}", "--set", "compression=none",
            "--set", f"replica_bytes={replica_bytes}",
            "--set", f"replicate_policy={replicate_policy}",
            "--set", f"stream_replicas={str(stream).lower()}",
            "--set", "log_level=warning", "--set", "shutdown_grace_s=1",
            *(arg for kv in settings for arg in ("--set", kv)),
        ]  # fmt: skip
        # `ip netns exec` execs the command: this pid is the sidecar's.
        self.proc = spawn_logged(cmd, root / "sidecar.log")

    def wait_ready(self) -> None:
        wait_for_socket(self.proc, self.socket, self.root / "sidecar.log")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for leftover in glob.glob(f"/dev/shm/tierstore-{self.proc.pid}-*"):
            os.unlink(leftover)


CLEANUPS: list[Any] = []  # Net and Sidecar objects alive now, for atexit and signals


def cleanup_all() -> None:
    while CLEANUPS:
        obj = CLEANUPS.pop()
        try:
            obj.stop() if isinstance(obj, Sidecar) else obj.close()
        except Exception as e:
            print(f"cleanup of {obj!r} failed: {e}", file=sys.stderr)


def on_signal(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


# -- the engines' imports -------------------------------------------------------------------


def _engine_main(socket_path: str, layout: KVLayout, slot_blocks: int, conns: list[Any]) -> None:
    """A host's engine process: one preallocated, touched KV buffer per slot
    (like an engine's cache pool) and one thread per slot that loads the keys
    it is sent into that buffer and answers (blocks, seconds, blocks that
    came from DRAM, seconds of a memcpy of the same bytes, seconds the
    loading thread was on a CPU). The memcpy is the
    mean of one right before and one right after the load, in the same
    thread, between touched buffers (two sources taken in turn, so neither
    is still in the cache from the copy before): it sees the machine load
    the load saw, whichever way that load drifted."""
    client = StoreClient(socket_path, name="engine-import")
    copy_lock = threading.Lock()
    copy_srcs = [np.ones(slot_blocks * layout.block_bytes, dtype=np.uint8) for _ in range(2)]
    copy_dst = np.ones(slot_blocks * layout.block_bytes, dtype=np.uint8)
    turn = [0]

    def memcpy_s(nbytes: int) -> float:
        with copy_lock:
            turn[0] ^= 1
            src = copy_srcs[turn[0]]
            t0 = time.perf_counter()
            np.copyto(copy_dst[:nbytes], src[:nbytes])
            return time.perf_counter() - t0

    def serve(conn: Any) -> None:
        buf = torch.from_numpy(np.ones((slot_blocks, layout.block_bytes), dtype=np.uint8))
        conn.send("ready")
        while (keys := conn.recv()) is not None:
            before_s = memcpy_s(len(keys) * layout.block_bytes)
            t0, cpu0 = time.perf_counter(), time.thread_time()
            got = client.load(layout, keys, out=buf[: len(keys)])
            load_s, cpu_s = time.perf_counter() - t0, time.thread_time() - cpu0
            after_s = memcpy_s(got.num_blocks * layout.block_bytes)
            # The before copy moved len(keys) blocks; scale it to what was loaded.
            before_s *= got.num_blocks / len(keys) if keys else 0.0
            dram = sum(t == TierName.DRAM for t in got.tiers)
            conn.send((got.num_blocks, load_s, dram, (before_s + after_s) / 2, cpu_s))

    threads = [threading.Thread(target=serve, args=(c,)) for c in conns]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    client.close()


class EngineImports:
    """The import side of one host's engine, in its own process. In the
    driver, 16 session threads share one interpreter lock, and a load
    (one copy per run of adjacent arena slots, each giving the lock up and
    waiting for it again) ran 10-100x slower than memcpy; an engine process
    per host does not share its lock with the other host and the sessions."""

    def __init__(self, socket_path: str, layout: KVLayout, slot_blocks: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        pairs = [ctx.Pipe() for _ in range(SLOTS_PER_HOST)]
        self.conns = [a for a, _ in pairs]
        self.proc = ctx.Process(
            target=_engine_main,
            args=(socket_path, layout, slot_blocks, [b for _, b in pairs]),
            daemon=True,
        )
        self.proc.start()
        for _, b in pairs:
            b.close()

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        for c in self.conns:
            if not c.poll(timeout_s) or c.recv() != "ready":
                raise RuntimeError("an engine import process did not start")

    def close(self) -> None:
        for c in self.conns:
            with contextlib.suppress(OSError):
                c.send(None)
        self.proc.join(timeout=20)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
