"""Crash consistency of the real sidecar: SIGKILL ``tierstore serve`` at random
moments of heavy write and eviction traffic, many times.

Each cycle: a writer client process stores fresh chains into a 1 MiB DRAM
arena (so the demoter and synchronous eviction spill to NVMe all the time)
over a 4 MiB NVMe tier (so NVMe evicts too), a loader client process reads
back chains the writer reported and checks every byte; the sidecar is then
SIGKILLed at a random point. Between kill and restart the test reads the
keys the NVMe index lists; after the restart it measures spawn-to-serving
time, checks the killed process's arena is gone from /dev/shm, and loads every
listed key, comparing it with the bytes derived from the key. Two extra kills
land during start-up (index load) itself.

Proved here (tests/integration/test_nvme_crash.py covers the bare NvmeTier;
this is the whole sidecar with clients attached): every row of the index
verifies after any kill, nothing is served wrong, the sidecar serves again
within SERVE_TIMEOUT_S, and stale arenas are removed.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.reliability import (
    LAYOUT,
    SERVE_TIMEOUT_S,
    SETTINGS,
    count_wrong,
    crash_loader,
    crash_writer,
    index_keys,
    read_events,
    reap,
    stop_forkserver,
    workers,
)
from harness.sidecar import SidecarProcess, arenas_of
from tierstore.client import StoreClient

KILLS = 10  # kills under traffic; STARTUP_KILL_CYCLES add one each during start-up
STARTUP_KILL_CYCLES = (3, 7)
CHAIN_BLOCKS = 32
WORKER_LIFETIME_S = 30.0  # a worker outliving its sidecar this long is stopped anyway
TRAFFIC_WAIT_S = 20.0
VERIFY_BATCH = 64


@pytest.fixture(scope="module", autouse=True)
def _forkserver() -> Iterator[None]:
    yield
    stop_forkserver()


def wait_for_stores(log: Path, count: int, sidecar: SidecarProcess) -> int:
    deadline = time.monotonic() + TRAFFIC_WAIT_S
    while time.monotonic() < deadline:
        stored = sum(1 for e in read_events(log) if e["op"] == "store")
        if stored >= count:
            return stored
        assert sidecar.alive(), sidecar.output()[-2000:]
        time.sleep(0.01)
    pytest.fail(f"writer reported fewer than {count} stores in {TRAFFIC_WAIT_S} s")


def verify_listed(sidecar: SidecarProcess, keys: list[bytes]) -> tuple[int, int, list[bytes]]:
    """Load every listed key: (loaded, wrong, keys that did not load)."""
    loaded = wrong = 0
    missing: list[bytes] = []
    with StoreClient(str(sidecar.socket), name="verifier") as client:
        for lo in range(0, len(keys), VERIFY_BATCH):
            batch = keys[lo : lo + VERIFY_BATCH]
            i = 0
            while i < len(batch):
                res = client.load(LAYOUT, batch[i:])  # type: ignore[arg-type]
                wrong += count_wrong(batch[i:], res.blocks, res.num_blocks)
                loaded += res.num_blocks
                i += res.num_blocks
                if i < len(batch):
                    missing.append(batch[i])
                    i += 1
    return loaded, wrong, missing


def test_sigkill_under_write_and_eviction_traffic(tmp_path: Path) -> None:
    rng = random.Random(20260701)
    sidecar = SidecarProcess(tmp_path, settings=SETTINGS, dram="1MiB", nvme="4MiB")
    ctx = workers()
    procs: list = []
    restart_s: list[float] = []
    kills = startup_kills = verified = loader_loads = loader_blocks = 0
    try:
        restart_s.append(sidecar.start())
        for cycle in range(KILLS):
            wlog, llog = tmp_path / f"writer-{cycle}.jsonl", tmp_path / f"loader-{cycle}.jsonl"
            sock = str(sidecar.socket)
            procs = [
                ctx.Process(
                    target=crash_writer,
                    args=(sock, str(wlog), cycle + 1, WORKER_LIFETIME_S, CHAIN_BLOCKS),
                ),
                ctx.Process(
                    target=crash_loader,
                    args=(sock, str(llog), str(wlog), cycle + 1, WORKER_LIFETIME_S),
                ),
            ]
            for p in procs:
                p.start()
            # 1 MiB of DRAM holds 4 chains: after a few stores every store evicts.
            wait_for_stores(wlog, rng.randint(4, 24), sidecar)
            time.sleep(rng.uniform(0.0, 0.2))
            old_pid = sidecar.kill()
            kills += 1
            reap(procs)
            listed = index_keys(sidecar.nvme_dir)

            if cycle in STARTUP_KILL_CYCLES:  # a kill while the index loads
                sidecar.start(wait=False)
                time.sleep(rng.uniform(0.05, 0.6))
                startup_pid = sidecar.kill()
                startup_kills += 1
                assert index_keys(sidecar.nvme_dir) == listed  # start-up only reads
                restart_s.append(sidecar.start())
                assert not arenas_of(startup_pid)
            else:
                restart_s.append(sidecar.start())
            assert restart_s[-1] < SERVE_TIMEOUT_S
            assert not arenas_of(old_pid), "the killed sidecar's arena is still in /dev/shm"

            loaded, wrong, missing = verify_listed(sidecar, listed)
            assert wrong == 0, f"cycle {cycle}: {wrong} listed blocks served with wrong bytes"
            assert not missing, (
                f"cycle {cycle}: {len(missing)} of {len(listed)} indexed blocks did not load"
            )
            nvme = sidecar.tier("nvme")
            assert nvme.verify_failures == 0 and nvme.read_failures == 0
            verified += loaded

            loads = [e for e in read_events(llog) if e["op"] == "load"]
            assert sum(e["wrong"] for e in loads) == 0, "a loader got wrong bytes"
            loader_loads += len(loads)
            loader_blocks += sum(e["got"] for e in loads)
        stores = sum(
            1
            for c in range(KILLS)
            for e in read_events(tmp_path / f"writer-{c}.jsonl")
            if e["op"] == "store"
        )
        print(
            f"\ncrash: kills survived {kills} under traffic + {startup_kills} during start-up; "
            f"chains stored {stores} (x{CHAIN_BLOCKS} blocks); indexed blocks verified "
            f"after restarts {verified}; loader loads {loader_loads} ({loader_blocks} blocks, "
            f"0 wrong); restart-to-serving s: p50 {sorted(restart_s)[len(restart_s) // 2]:.2f} "
            f"max {max(restart_s):.2f} (bound {SERVE_TIMEOUT_S})"
        )
        assert verified > 0 and stores > KILLS
    finally:
        reap(procs, timeout_s=1.0)
        sidecar.stop()
