"""The DRAM arena at the edge of full, every byte checked.

A ``TieredStore`` whose arena holds a few dozen blocks, over an NVMe tier a
few times larger, over a working set larger than both, driven by threads at
once:

- writers store chains two ways: ``put``, and the engine client's two phases
  (``reserve``, write into the slot, ``commit``), where some reservations are
  aborted and some owners released as a dead client's are, so slots are freed
  and taken again at once;
- readers ``acquire`` chains (pinning DRAM hits, promoting NVMe ones into
  slots that eviction just freed), hold some pins a while, compare every
  block with the bytes derived from its key, and release;
- the demoter spills past the watermarks, and a caller that finds the arena
  full evicts at once; the NVMe tier evicts for the demoter's spills;
- two layouts of different block sizes share the arena, so its segments also
  pass from one block size to the other.

``checked`` counts every block a reader got and compared, ``wrong`` those
whose bytes, key or size differ. When the threads stop, every key a tier
lists is read once more and checked (``swept``). Prints one JSON object with
``arena_edge_checked`` and ``arena_edge_wrong`` and what ran (puts, two-phase
commits, aborts, owners released, refusals for a full arena, promotions,
spills, evictions), so a run that never reached the edge shows it.

    python -m bench.reliability.arena_edge --json [--checks 1000000]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import blake3
import numpy as np

from tierstore.config.store import StoreConfig
from tierstore.keys import BlockKey, KVLayout, chain_keys
from tierstore.store.dram import ReserveStatus
from tierstore.store.tiered import TieredStore

# Two block sizes in one arena: 8 KiB and 4 KiB.
LAYOUTS = (
    KVLayout("edge-a", 2, 2, 64, "float16", 8),
    KVLayout("edge-b", 1, 2, 64, "float16", 8),
)
SEGMENT_BYTES = 64 << 10  # 8 or 16 slots a segment: segments change hands often
DRAM_BYTES = 8 * SEGMENT_BYTES  # 64 blocks of 8 KiB
NVME_BYTES = 64 * SEGMENT_BYTES  # 8x the arena
CHAIN_BLOCKS = 8
CHAINS_PER_LAYOUT = 48  # 4.5 MiB of blocks in all: more than DRAM and NVMe hold together
HOLD_S = 0.002  # a reader that holds its pins holds them this long
FIRST_OWNER = 1000  # owners of the two-phase writers and readers (the store's own is 0)
CHECK_TALLIES = ("checked", "wrong", "swept", "swept_wrong")


def block_of(layout: KVLayout, key: bytes) -> bytes:
    """The bytes every writer stores under ``key``: derived from the key only."""
    return blake3.blake3(bytes(key)).digest(length=layout.block_bytes)


@dataclass(frozen=True)
class Chain:
    layout: KVLayout
    keys: list[BlockKey]
    blocks: list[bytes]  # block_of each key, computed once


def make_chains(seed: int) -> list[Chain]:
    rng = np.random.default_rng(seed)
    chains = []
    for layout in LAYOUTS:
        for _ in range(CHAINS_PER_LAYOUT):
            tokens = rng.integers(0, 2**31 - 1, CHAIN_BLOCKS * layout.block_tokens)
            keys = chain_keys(layout, tokens)
            chains.append(Chain(layout, keys, [block_of(layout, k) for k in keys]))
    return chains


def check_entries(store: TieredStore, chain: Chain, entries: list[Any]) -> tuple[int, int]:
    """(blocks compared, blocks wrong) for what ``acquire`` returned on ``chain``:
    the prefix of its keys, each of the layout's size, with its key's bytes."""
    wrong = 0
    for i, entry in enumerate(entries):
        if (
            i >= len(chain.keys)
            or entry.key != chain.keys[i]
            or entry.nbytes != chain.layout.block_bytes
            or bytes(store.view(entry)) != chain.blocks[i]
        ):
            wrong += 1
    return len(entries), wrong


class Stress:
    """The threads and their tallies. Each thread keeps its own Counter;
    ``totals`` sums them once the threads are joined."""

    def __init__(self, store: TieredStore, chains: list[Chain], checks: int, seed: int) -> None:
        self.store = store
        self.chains = chains
        self.checks = checks
        self.seed = seed
        self.stop = threading.Event()
        self.tallies: list[Counter[str]] = []
        self.errors: list[str] = []
        self._checked = 0  # rough total across readers, to know when to stop
        self._lock = threading.Lock()

    def _tally(self) -> Counter[str]:
        tally: Counter[str] = Counter()
        with self._lock:
            self.tallies.append(tally)
        return tally

    def guard(self, body: Any, *args: Any) -> None:
        try:
            body(*args)
        except Exception as e:  # a thread that dies fails the run, with why
            with self._lock:
                self.errors.append(f"{body.__name__}: {type(e).__name__}: {e}")
            self.stop.set()

    def put_writer(self, n: int) -> None:
        rng, tally = random.Random(self.seed * 101 + n), self._tally()
        while not self.stop.is_set():
            chain = rng.choice(self.chains)
            held = self.store.put(chain.layout, chain.keys, chain.blocks)
            tally["puts"] += 1
            tally["put_refused"] += held.count(False)

    def two_phase_writer(self, n: int) -> None:
        rng, tally = random.Random(self.seed * 103 + n), self._tally()
        owner = FIRST_OWNER + n
        store = self.store
        while not self.stop.is_set():
            chain = rng.choice(self.chains)
            nbytes = chain.layout.block_bytes
            reservations = store.reserve(chain.layout, chain.keys, owner)
            ok = [r for r in reservations if r.status == ReserveStatus.OK]
            tally["reserve_full"] += sum(r.status == ReserveStatus.FULL for r in reservations)
            for r in ok:
                store.reserved_view(r, nbytes)[:] = chain.blocks[chain.keys.index(r.key)]
            fate = rng.random()
            if fate < 0.1:
                tally["aborted"] += store.abort([r.key for r in ok], owner)
            elif fate < 0.15:
                aborted, _ = store.release_owner(owner)  # as for a client that died
                tally["owner_released"] += aborted
            else:
                tally["committed"] += sum(store.commit([r.key for r in ok], owner))

    def reader(self, n: int) -> None:
        rng, tally = random.Random(self.seed * 107 + n), self._tally()
        owner = FIRST_OWNER + 100 + n
        store = self.store
        while not self.stop.is_set():
            chain = rng.choice(self.chains)
            entries = store.acquire(chain.layout, chain.keys, owner)
            try:
                if entries and rng.random() < 0.05:
                    time.sleep(HOLD_S)  # pinned while writers and eviction go on
                compared, wrong = check_entries(store, chain, entries)
            finally:
                store.release([e.key for e in entries], owner)
            tally["acquires"] += 1
            tally["checked"] += compared
            tally["wrong"] += wrong
            with self._lock:
                self._checked += compared
                if self._checked >= self.checks:
                    self.stop.set()

    def sweep(self) -> Counter[str]:
        """Read every key a tier lists and check it (the state left behind)."""
        tally: Counter[str] = Counter()
        _, held = self.store.snapshot()
        listed = {k for keys in held.values() for k in keys}
        for chain in self.chains:
            for i, key in enumerate(chain.keys):
                if key not in listed:
                    continue
                entries = self.store.acquire(chain.layout, [key])
                try:
                    if entries:
                        got = bytes(self.store.view(entries[0]))
                        tally["swept"] += 1
                        tally["swept_wrong"] += got != chain.blocks[i]
                finally:
                    self.store.release([e.key for e in entries])
        return tally


def run(checks: int, max_s: float, seed: int, workdir: Path, readers: int = 3) -> dict[str, Any]:
    """Drive one store until ``checks`` blocks are compared or ``max_s`` pass."""
    config = StoreConfig(
        dram_bytes=DRAM_BYTES,
        dram_segment_bytes=SEGMENT_BYTES,
        dram_ready_bytes=DRAM_BYTES,
        nvme_dir=str(workdir / "nvme"),
        nvme_bytes=NVME_BYTES,
        nvme_segment_bytes=SEGMENT_BYTES,
        demote_batch_blocks=8,
        demoter_poll_s=0.05,
    )
    chains = make_chains(seed)
    t0 = time.monotonic()
    with TieredStore(config) as store:
        stress = Stress(store, chains, checks, seed)
        bodies = [stress.put_writer, stress.two_phase_writer] + [stress.reader] * readers
        threads = [
            threading.Thread(target=stress.guard, args=(body, i), name=f"edge-{i}", daemon=True)
            for i, body in enumerate(bodies)
        ]
        for t in threads:
            t.start()
        stress.stop.wait(max_s)
        stress.stop.set()
        for t in threads:
            t.join(30.0)
        alive = [t.name for t in threads if t.is_alive()]
        elapsed = time.monotonic() - t0
        total: Counter[str] = Counter()
        for tally in stress.tallies:
            total.update(tally)
        total.update(stress.sweep())
        stat = store.stat()
        failed_workers = store.workers.failed()
    return {
        "arena_edge_checked": total["checked"] + total["swept"],
        "arena_edge_wrong": total["wrong"] + total["swept_wrong"],
        "checked_by_readers": total["checked"],
        "swept": total["swept"],
        "seconds": round(elapsed, 1),
        "checks_per_s": round(total["checked"] / elapsed),
        "ops": {k: n for k, n in sorted(total.items()) if k not in CHECK_TALLIES},
        "store": {k: stat["store"].get(k, 0) for k in STORE_FIGURES},
        "tiers": {name: {k: tier[k] for k in TIER_FIGURES} for name, tier in stat["tiers"].items()},
        "thread_errors": stress.errors,
        "threads_alive": alive,
        "workers_failed": failed_workers,
    }


# What shows the run reached the edge: promotions, spills, evictions, per tier.
STORE_FIGURES = ("promotions", "promotion_failures", "spilled_blocks", "spill_failures",
                 "dropped_blocks")  # fmt: skip
TIER_FIGURES = ("num_blocks", "evictions", "verify_failures", "read_failures", "write_failures")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checks", type=int, default=1_000_000)
    parser.add_argument("--max-s", type=float, default=1800.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", action="store_true", help="one JSON object (the default)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="arena-edge-") as tmp:
        out = run(args.checks, args.max_s, args.seed, Path(tmp))
    print(json.dumps(out, indent=2))
    failed = out["arena_edge_wrong"] or out["thread_errors"] or out["threads_alive"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
