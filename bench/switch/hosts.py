"""The two hosts of bench/switch/run.py: network namespaces joined by a shaped
veth pair (``harness.netns.Network``), one `tierstore serve` in each, and each
host's engine imports.

Provides ``LINKS`` (each link's shaping), ``host_sidecar`` (a sidecar inside
a namespace, its peer port on the namespace address), ``EngineImports`` (one
process per host that loads a switch's reused prefix into preallocated slot
buffers, away from the driver's threads), and ``CLEANUPS``/``cleanup_all``,
which remove whatever is still up when the benchmark ends or is interrupted
(``harness.netns.exit_on_signals`` turns SIGTERM and SIGINT into an exit).
Needs root. Runs in the benchmark's process; each ``EngineImports`` in a
spawned process of its own, one thread per slot.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import sys
import threading
import time
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import torch

from harness.netns import Shape
from harness.sidecar import SidecarProcess, remove_arenas
from tierstore.client import StoreClient
from tierstore.keys import KVLayout
from tierstore.tiers import TierName

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
LINKS = {  # tc tbf on each host's end of the veth
    "1gbit": Shape(rate="1gbit", burst="256kb"),
    "10gbit": Shape(rate="10gbit", burst="2mb"),
    "unshaped": None,
}
LINK_BPS = {"1gbit": 1e9, "10gbit": 1e10, "unshaped": None}
SIDECAR_STOP_S = 20.0


def scaled_bytes(scale1_bytes: int, scale: Fraction) -> int:
    return int(scale1_bytes * scale) // (1 << 20) << 20


# -- sidecars -------------------------------------------------------------------------------


def host_sidecar(
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
) -> SidecarProcess:
    """A host's sidecar in namespace ``ns``, its peer port on ``addr``, the
    other host's at ``peer``; not started."""
    root.mkdir(parents=True)
    host_settings = (
        f"peer_host={addr}", f"peer_port={PEER_PORT}", f"peers={peer}:{PEER_PORT}",
        f"peer_token={TOKEN}", f"min_tokens={min_tokens}", "compression=none",
        f"replica_bytes={replica_bytes}", f"replicate_policy={replicate_policy}",
        f"stream_replicas={str(stream).lower()}", "log_level=warning", "shutdown_grace_s=1",
        *settings,
    )  # fmt: skip
    return SidecarProcess(
        root, dram=str(dram_bytes), nvme=str(nvme_bytes), settings=host_settings, netns=ns
    )


def stop_sidecar(car: SidecarProcess) -> None:
    """SIGTERM (SIGKILL after SIDECAR_STOP_S), and whatever arena it left removed."""
    car.stop(timeout_s=SIDECAR_STOP_S)
    remove_arenas(car.pid)


CLEANUPS: list[Any] = []  # networks, sidecars and engines alive now, for atexit and signals


def cleanup_all() -> None:
    while CLEANUPS:
        obj = CLEANUPS.pop()
        try:
            stop_sidecar(obj) if isinstance(obj, SidecarProcess) else obj.close()
        except Exception as e:
            print(f"cleanup of {obj!r} failed: {e}", file=sys.stderr)


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
