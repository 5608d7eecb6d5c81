"""Cost per block of the store's operations against the number of blocks held.

    python -m bench.tiers.scale --json [--sizes 10000,100000,1000000] [--ops 8192] [--no-promote]

In-process ``TieredStore``s with 4 KiB blocks (small, so a million fit in
memory), one per size n, all built first and then measured in interleaved
rounds (size after size within a round), so that the drift of a shared
machine hits every size alike. Each operation is reported in microseconds
per block, the best of its rounds:

- ``put_evict_us``: ``put`` of new blocks into a full DRAM tier of n blocks
  (no NVMe): every block evicts one (reserve, copy, commit, eviction, and
  the digest computed in the background after the commit);
- ``lookup_us``: ``lookup`` of held keys (``op_blocks`` distinct ones, the
  same number at every size);
- ``acquire_us`` / ``release_us``: pinning those keys for a transfer's
  owner, then ``release_owner`` of that owner (how a transfer drops its pins);
- ``promote_us``: ``acquire`` of blocks held only on NVMe (n blocks on the
  NVMe tier, page-cached files without O_DIRECT, a DRAM tier of 8192 blocks
  that evicts as it promotes): read, verify, reserve, commit, pin;
- ``stat_us``: one ``stat()`` call (not per block);
- ``index_probe_us``: the floor, one probe per key of a plain dict of the
  n keys held (the store's own key objects): the cache misses any hash
  index of n keys pays, measured in the same round.

Those keys are the ``op_blocks`` most recently put: hot in the CPU caches.
The ``cold_*`` figures are a session's old prefix resumed instead:
``cold_lookup_us``, ``cold_acquire_us``, ``cold_release_us`` and the floor
``cold_index_probe_us`` (the same dict probe, same loop) on ``op_blocks``
keys put one after another about n/2 puts earlier (the middle of the DRAM
tier's entries; other keys every round), each timed right after a cache
flush that reads and writes a scratch buffer of ``cold_flush_bytes`` (4x
the last-level cache, at least 64 MiB: the rest of a host's work between
two turns of a session). The keys asked for are new objects made after the
flush (a request's keys are fresh; the store's tables are what is cold),
as the hot figures' keys are new objects too. ``cold_in_cold_index_probes`` is each cold
operation at the largest size in cold probes of the floor,
``cold_vs_hot`` the cold figure over the hot one, ``cold_growth`` the cold
figure's growth from the smallest size to the largest.

``growth`` is each figure at the largest size over the smallest (target:
<= 1.5 for every per-block operation). ``index_probe_growth`` is the
floor's own growth, and ``added_cost_in_index_probes`` what lookup, acquire
and release add per key from the smallest size to the largest in units of
the floor's added cost (about 1 for a lookup: one probe of the index; a
bounded number for every operation, whatever n is). The machines this runs
on are shared: only the ratios of one run compare.
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench.limits import emit
from tierstore.config.store import StoreConfig
from tierstore.keys import BlockKey, KVLayout
from tierstore.store import TieredStore
from tierstore.store.nvme.tier import block_digest

LAYOUT = KVLayout("scale", 1, 1, 64, "float16", 16)  # 4 KiB blocks
BB = LAYOUT.block_bytes
BATCH = 256
FILL_BATCH = 4096
PROMOTE_DRAM_BLOCKS = 8192
HASH_WAIT_S = 600.0
OWNER = 1 << 40
FLUSH_LLC_MULTIPLE = 4  # the cache flush touches this many times the last-level cache
FLUSH_MIN_BYTES = 64 << 20
PER_BLOCK = ("put_evict_us", "lookup_us", "acquire_us", "release_us", "promote_us")


def key(i: int) -> BlockKey:
    return BlockKey(i.to_bytes(32, "little"))


def timed(fn: Callable[[], Any]) -> float:
    gc.collect()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


@dataclass
class Rig:
    """The stores of one size and where each operation goes on from."""

    n: int
    dram: TieredStore
    nvme: TieredStore | None
    next_key: int
    promote_cursor: int = 0
    promote_short: int = 0  # promotion batches that came back short (misses)
    cold_seen: set[int] = field(default_factory=set)  # ids of the old prefixes resumed so far
    best: dict[str, float] = field(default_factory=dict)

    def keep(self, name: str, seconds: float, blocks: int) -> None:
        us = seconds / blocks * 1e6
        self.best[name] = min(self.best.get(name, float("inf")), us)


def build(n: int, shm: str, nvme_root: str | None, data: memoryview) -> Rig:
    dram = TieredStore(
        StoreConfig(
            dram_bytes=n * BB,
            dram_segment_bytes=1 << 20,
            dram_high_watermark=1.0,  # no background demotion: puts evict themselves
            dram_low_watermark=0.99,
            nvme_bytes=0,
            shm_dir=shm,
        )
    )
    for lo in range(0, n, FILL_BATCH):
        keys = [key(i) for i in range(lo, min(lo + FILL_BATCH, n))]
        dram.put(LAYOUT, keys, data[: len(keys) * BB])
    dram.wait_hashed(HASH_WAIT_S)
    nvme = None
    if nvme_root is not None:
        nvme = TieredStore(
            StoreConfig(
                dram_bytes=PROMOTE_DRAM_BLOCKS * BB,
                dram_segment_bytes=1 << 20,
                dram_high_watermark=1.0,
                dram_low_watermark=0.99,
                nvme_bytes=(n + PROMOTE_DRAM_BLOCKS) * BB + (64 << 20),
                nvme_segment_bytes=4 << 20,
                nvme_dir=nvme_root,
                nvme_direct_io=False,
                shm_dir=shm,
            )
        )
        assert nvme.nvme is not None
        block = bytes(data[:BB])
        digest = block_digest(block)
        fp = nvme.register_layout(LAYOUT)
        for lo in range(0, n, FILL_BATCH):
            keys = [key(i) for i in range(lo, min(lo + FILL_BATCH, n))]
            nvme.nvme.write_many([(k, fp, block) for k in keys], digests=[digest] * len(keys))
    return Rig(n, dram, nvme, next_key=n)


class CacheFlush:
    """Evicts the CPU caches: reads and writes every line of a scratch buffer
    several times the size of the last-level cache (what the other work of a
    serving host does to a store's tables between two turns of a session)."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.scratch = np.zeros(nbytes, dtype=np.uint8)

    def __call__(self) -> None:
        self.scratch += 1


def last_level_cache_bytes() -> int:
    """The largest CPU cache's size from sysfs (0 if the system does not say)."""
    sizes = [0]
    for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = path.read_text().strip().upper()
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        sizes.append(int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text))
    return max(sizes)


def timed_cold(
    flush: CacheFlush, ids: list[int], fn: Callable[[list[list[BlockKey]]], Any]
) -> float:
    """``timed`` of ``fn(batches)`` with the caches flushed after the
    collection; the batches of new key objects for ``ids`` are made after the
    flush, before the clock: the asking side's keys are fresh, as a request's
    keys are, and the store's tables are cold."""
    gc.collect()
    flush()
    batches = [[key(i) for i in ids[lo : lo + BATCH]] for lo in range(0, len(ids), BATCH)]
    t0 = time.perf_counter()
    fn(batches)
    return time.perf_counter() - t0


def old_prefix(store: TieredStore, m: int) -> list[int]:
    """The ids of m held keys put one after another, about n/2 puts ago: the
    middle of the DRAM tier's entries, which are in put order. A new round's
    puts move the middle on by their number, so each round resumes other keys."""
    held = store.dram.held_keys()
    mid = len(held) // 2
    return [int.from_bytes(k, "little") for k in held[mid : mid + m]]


def cold_round(rig: Rig, m: int, flush: CacheFlush) -> None:
    """A session's old prefix resumed: lookup, acquire and release of m keys
    put long ago, each started with the CPU caches flushed, next to the
    floor (one probe per key of a plain dict of the n held keys) flushed the
    same way. Each records how many keys it found: all m, or the bench fails."""
    store = rig.dram
    ids = old_prefix(store, m)
    assert not rig.cold_seen.intersection(ids), "an old prefix resumed twice"
    rig.cold_seen.update(ids)
    index = dict.fromkeys(store.dram.held_keys(), True)
    found: dict[str, int] = {}
    rows: list[list[bool]] = []

    def lookups(batches: list[list[BlockKey]]) -> None:
        found["lookup"] = sum(store.lookup(LAYOUT, b).num_hits for b in batches)

    def probes(batches: list[list[BlockKey]]) -> None:  # the hot floor's loop
        rows.extend([index.get(k, False) for k in b] for b in batches)

    def acquires(batches: list[list[BlockKey]]) -> None:
        found["acquire"] = sum(len(store.acquire(LAYOUT, b, OWNER)) for b in batches)

    def release(_: list[list[BlockKey]]) -> None:
        found["release"] = store.release_owner(OWNER)[1]

    Op = Callable[[list[list[BlockKey]]], None]
    first: list[tuple[str, Op]] = [("lookup", lookups), ("index_probe", probes)]
    for name, fn in first:
        rig.keep(f"cold_{name}_us", timed_cold(flush, ids, fn), m)
    index.clear()
    found["probe"] = sum(map(sum, rows))
    then: list[tuple[str, Op]] = [("acquire", acquires), ("release", release)]
    for name, fn in then:
        rig.keep(f"cold_{name}_us", timed_cold(flush, ids, fn), m)
    assert set(found.values()) == {m}, (found, m)


def one_round(rig: Rig, ops: int, m: int, data: memoryview, flush: CacheFlush) -> None:
    store = rig.dram

    def put_evict() -> None:
        for _ in range(0, ops, BATCH):
            keys = [key(rig.next_key + j) for j in range(BATCH)]
            rig.next_key += BATCH
            store.put(LAYOUT, keys, data[: BATCH * BB])
        store.wait_hashed(HASH_WAIT_S)  # the digests are part of the cost

    rig.keep("put_evict_us", timed(put_evict), ops // BATCH * BATCH)
    # The m most recent blocks: the same number of distinct keys at every size.
    recent = [key(rig.next_key - 1 - j) for j in range(m)]
    batches = [recent[lo : lo + BATCH] for lo in range(0, m, BATCH)]
    passes = max(1, ops // m)

    def lookups() -> None:
        for _ in range(passes):
            for batch in batches:
                store.lookup(LAYOUT, batch)

    rig.keep("lookup_us", timed(lookups), m * passes)
    # The floor: one probe per key of a plain dict of the n keys the store
    # holds (the same key objects). Any hash index pays this cache miss.
    index = dict.fromkeys(store.dram.held_keys(), True)

    def probes() -> None:
        for _ in range(passes):
            for batch in batches:
                [index.get(k, False) for k in batch]

    rig.keep("index_probe_us", timed(probes), m * passes)
    index.clear()
    got: list[int] = []
    rig.keep(
        "acquire_us",
        timed(lambda: got.append(sum(len(store.acquire(LAYOUT, b, OWNER)) for b in batches))),
        m,
    )
    dropped: list[int] = []
    rig.keep("release_us", timed(lambda: dropped.append(store.release_owner(OWNER)[1])), m)
    assert got == dropped == [m], (got, dropped, m)
    cold_round(rig, m, flush)
    rig.keep("stat_us", timed(store.stat), 1)
    if rig.nvme is not None:
        promoting = rig.nvme

        def promote() -> None:
            for _ in range(0, ops, BATCH):
                keys = [key((rig.promote_cursor + j) % rig.n) for j in range(BATCH)]
                rig.promote_cursor += BATCH
                entries = promoting.acquire(LAYOUT, keys)
                promoting.release([e.key for e in entries])
                if len(entries) < len(keys):
                    rig.promote_short += 1  # a counted miss, reported

        rig.keep("promote_us", timed(promote), ops // BATCH * BATCH)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--sizes", default="10000,100000,1000000")
    parser.add_argument("--ops", type=int, default=8192, help="blocks per phase and round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-promote", action="store_true", help="skip the NVMe phase")
    parser.add_argument(
        "--flush-bytes",
        type=int,
        default=0,
        help="scratch bytes that evict the caches before each cold figure (default: "
        f"{FLUSH_LLC_MULTIPLE}x the last-level cache, at least {FLUSH_MIN_BYTES >> 20} MiB)",
    )
    args = parser.parse_args()
    flush = CacheFlush(
        args.flush_bytes or max(FLUSH_LLC_MULTIPLE * last_level_cache_bytes(), FLUSH_MIN_BYTES)
    )
    sizes = [int(float(s)) for s in args.sizes.split(",")]
    m = min(args.ops, min(sizes) // 4) // BATCH * BATCH
    data = memoryview(bytearray(b"\x5a" * (FILL_BATCH * BB)))
    rigs: list[Rig] = []
    with (
        tempfile.TemporaryDirectory(prefix="tierstore-scale-", dir="/dev/shm") as shm,
        tempfile.TemporaryDirectory(prefix="tierstore-scale-nvme-") as nvme_root,
    ):
        try:
            for n in sizes:
                t0 = time.perf_counter()
                root = None if args.no_promote else str(Path(nvme_root) / str(n))
                rigs.append(build(n, shm, root, data))
                print(f"built n={n} in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
            for r in range(args.rounds):
                for rig in rigs:
                    one_round(rig, args.ops, m, data, flush)
                print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
            rows: dict[str, dict[str, Any]] = {}
            for rig in rigs:
                row: dict[str, Any] = {k: round(v, 3) for k, v in rig.best.items()}
                row["dram_held_blocks"] = rig.dram.stat()["tiers"]["dram"]["num_blocks"]
                if rig.nvme is not None:
                    row["nvme_held_blocks"] = rig.nvme.stat()["tiers"]["nvme"]["num_blocks"]
                    row["promote_short_batches"] = rig.promote_short
                rows[str(rig.n)] = row
        finally:
            for rig in rigs:
                rig.dram.close()
                if rig.nvme is not None:
                    rig.nvme.close()
    first, last = rows[str(sizes[0])], rows[str(sizes[-1])]
    growth = {k: round(last[k] / first[k], 3) for k in PER_BLOCK if first.get(k, 0) > 0}
    # What each operation's growth costs in units of the floor's: how many
    # index probes' worth of cache misses per key the larger store adds.
    probe_added = last["index_probe_us"] - first["index_probe_us"]
    added_in_probes = {
        k: round((last[k] - first[k]) / probe_added, 2)
        for k in ("lookup_us", "acquire_us", "release_us")
        if probe_added > 0
    }
    # The old prefix resumed at the largest size, in units of the floor's
    # own cold probe, and against the same operations on hot keys.
    cold_ops = ("lookup_us", "acquire_us", "release_us", "index_probe_us")
    cold_in_probes = {
        k: round(last[f"cold_{k}"] / last["cold_index_probe_us"], 2) for k in cold_ops[:3]
    }
    cold_vs_hot = {k: round(last[f"cold_{k}"] / last[k], 2) for k in cold_ops}
    cold_growth = {k: round(last[f"cold_{k}"] / first[f"cold_{k}"], 3) for k in cold_ops}
    emit(
        {
            "block_bytes": BB,
            "batch_keys": BATCH,
            "op_blocks": m,
            "rounds": args.rounds,
            "sizes": rows,
            "growth": growth,
            "growth_max": max(growth.values()) if growth else 0.0,
            "target_growth_max": 1.5,
            "index_probe_growth": round(last["index_probe_us"] / first["index_probe_us"], 3),
            "added_cost_in_index_probes": added_in_probes,
            "cold_flush_bytes": flush.nbytes,
            "cold_at_largest_us": {k: last[f"cold_{k}"] for k in cold_ops},
            "cold_in_cold_index_probes": cold_in_probes,
            "cold_vs_hot": cold_vs_hot,
            "cold_growth": cold_growth,
        },
        args.json,
    )


if __name__ == "__main__":
    main()
