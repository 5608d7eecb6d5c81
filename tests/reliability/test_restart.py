"""Restarts of a real sidecar on the same NVMe directory: what comes back.

Proved: after a SIGTERM, every block that was in DRAM loads back byte-exact
(write-back: the stop's drain wrote it; write-through: the writer had); a
SIGKILL under write-through load loses at most what the write queue held
(every block served afterwards is byte-exact, checked against bytes derived
from its key); a drain that cannot finish in ``shutdown_drain_s`` still exits
gracefully, logs one line, and the restart serves exactly the part it wrote.
"""

from __future__ import annotations

import re
import threading
from pathlib import Path

import pytest

from harness.reliability import BLOCK, LAYOUT, SETTINGS, blocks_of, chain, count_wrong
from harness.sidecar import SidecarProcess
from tierstore.client import StoreClient
from tierstore.tiers import TierName

CHAIN_BLOCKS = 32


def store_chains(client: StoreClient, seeds: range) -> list[bytes]:
    keys: list[bytes] = []
    for seed in seeds:
        chain_keys = chain(seed, CHAIN_BLOCKS)
        assert all(client.store(LAYOUT, chain_keys, blocks_of(chain_keys)))
        keys += chain_keys
    return keys


def served(client: StoreClient, seeds: range) -> tuple[int, int]:
    """(blocks held, wrong bytes) over the chains, each loaded as far as it is held."""
    held = wrong = 0
    for seed in seeds:
        keys = chain(seed, CHAIN_BLOCKS)
        n = client.lookup(LAYOUT, keys).num_hits  # type: ignore[arg-type]
        res = client.load(LAYOUT, keys[:n])  # type: ignore[arg-type]
        assert res.num_blocks == n, "a block looked up as held did not load"
        wrong += count_wrong(keys, res.blocks, n)
        held += n
    return held, wrong


@pytest.mark.parametrize("policy", ["write_back", "write_through"])
def test_sigterm_then_restart_serves_every_dram_block(tmp_path: Path, policy: str) -> None:
    sidecar = SidecarProcess(
        tmp_path, "--set", f"write_policy={policy}", "--set", "shutdown_drain_s=30",
        settings=SETTINGS, dram="8MiB", nvme="32MiB",
    )  # fmt: skip
    seeds = range(20)  # 5 MiB: all of it fits in DRAM, none spilled by pressure
    sidecar.start()
    try:
        with StoreClient(str(sidecar.socket)) as client:
            store_chains(client, seeds)
            tiers = {t for s in seeds for t in client.lookup(LAYOUT, chain(s, CHAIN_BLOCKS)).tiers}
            assert tiers == {TierName.DRAM}
        sidecar.stop()
        assert sidecar.proc is not None and sidecar.proc.returncode == 0, sidecar.output()[-2000:]
        drain_line = next(ln for ln in sidecar.output().splitlines() if "drain: wrote" in ln)
        sidecar.start()
        with StoreClient(str(sidecar.socket)) as client:
            held, wrong = served(client, seeds)
            c = sidecar.counters()
        assert wrong == 0
        assert held == len(seeds) * CHAIN_BLOCKS, (held, drain_line)
        assert c["last_drain_dropped_blocks"] == 0
        if policy == "write_back":
            assert c["last_drain_blocks"] == len(seeds) * CHAIN_BLOCKS
        print(f"\n{policy}: {held} blocks back after SIGTERM + restart; {drain_line}")
    finally:
        sidecar.stop()


def test_sigkill_under_write_through_loses_at_most_the_queue(tmp_path: Path) -> None:
    queue_bytes = 256 * BLOCK
    sidecar = SidecarProcess(
        tmp_path, "--set", "write_policy=write_through",
        "--set", f"write_queue_bytes={queue_bytes}",
        settings=SETTINGS, dram="16MiB", nvme="64MiB",
    )  # fmt: skip
    sidecar.start()
    seeds = range(40)  # 10 MiB of puts, in DRAM (no pressure spills)
    stored: list[int] = []
    try:
        with StoreClient(str(sidecar.socket)) as client:
            killed = threading.Event()

            def kill_midway() -> None:
                while len(stored) < 25 and not killed.is_set():
                    threading.Event().wait(0.01)
                c = sidecar.counters()
                sidecar.kill()
                killed.set()
                at_kill.update(c)

            at_kill: dict[str, int] = {}
            killer = threading.Thread(target=kill_midway)
            killer.start()
            for seed in seeds:
                keys = chain(seed, CHAIN_BLOCKS)
                try:
                    if not all(client.store(LAYOUT, keys, blocks_of(keys))):
                        break
                except Exception:  # the sidecar died under the call
                    break
                stored.append(seed)
                threading.Event().wait(0.005)  # a put rate the disk sustains (~50 MB/s)
            killed.set()
            killer.join(30)
        assert at_kill, "the sidecar was not killed under load"
        sidecar.start()
        with StoreClient(str(sidecar.socket)) as client:
            held, wrong = served(client, range(len(stored) + 1))
        assert wrong == 0
        # Blocks whose store returned before the stat that preceded the kill:
        # all of them were queued (or dropped and counted) by then.
        committed = at_kill["write_queued"] + at_kill["write_dropped"]
        lost = max(0, min(committed, len(stored) * CHAIN_BLOCKS) - held)
        bound = queue_bytes // BLOCK + at_kill["write_dropped"]
        assert lost <= bound, (lost, bound, at_kill)
        print(
            f"\nSIGKILL under write_through: {len(stored)} chains stored, {held} blocks back, "
            f"lost {lost} <= bound {bound} (queue {queue_bytes // BLOCK} blocks, dropped "
            f"{at_kill['write_dropped']}), 0 wrong"
        )
    finally:
        sidecar.stop()


def test_drain_that_cannot_finish_exits_and_serves_its_part(tmp_path: Path) -> None:
    sidecar = SidecarProcess(
        tmp_path, "--set", "shutdown_drain_s=0.05", "--set", "demote_batch_blocks=8",
        settings=SETTINGS, dram="32MiB", nvme="64MiB",
    )  # fmt: skip
    seeds = range(100)  # 25 MiB in DRAM: 400 batches with an fdatasync each
    sidecar.start()
    try:
        with StoreClient(str(sidecar.socket)) as client:
            store_chains(client, seeds)
        sidecar.stop()
        assert sidecar.proc is not None and sidecar.proc.returncode == 0
        line = next(ln for ln in sidecar.output().splitlines() if "drain: wrote" in ln)
        m = re.search(r"wrote (\d+) DRAM-only blocks .* dropped (\d+)", line)
        assert m is not None, line
        wrote, dropped = int(m.group(1)), int(m.group(2))
        assert dropped > 0 and wrote + dropped == len(seeds) * CHAIN_BLOCKS, line
        sidecar.start()
        with StoreClient(str(sidecar.socket)) as client:
            held, wrong = served(client, seeds)
            c, nvme = sidecar.counters(), sidecar.tier("nvme")
        assert wrong == 0
        assert nvme.num_blocks == wrote
        # Heads of the most recent prefixes were drained first: usable prefixes came back.
        assert held > 0
        assert c["last_drain_blocks"] == wrote and c["last_drain_dropped_blocks"] == dropped
        print(f"\ndrain cut short: {line}; {held} blocks back as prefixes")
    finally:
        sidecar.stop()
