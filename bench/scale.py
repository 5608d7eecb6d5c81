"""Cost per block of the store's operations against the number of blocks held.

    python bench/scale.py --json [--sizes 10000,100000,1000000] [--ops 20000]

In-process ``TieredStore`` with 4 KiB blocks (small, so a million fit in
memory). For each size n the store is filled to n blocks held, then each
operation runs ``--ops`` times in batches of 256 keys and is reported in
microseconds per block:

- ``put_evict_us``: ``put`` into a full DRAM tier (no NVMe): every block
  evicts one (reserve, copy, commit, eviction);
- ``lookup_us``: ``lookup`` of held keys (``op_blocks`` distinct ones,
  the same number at every size: a quarter of the smallest);
- ``acquire_us`` / ``release_us``: pinning held keys for a transfer's owner,
  then ``release_owner`` of that owner (how a transfer drops its pins);
- ``promote_us``: ``acquire`` of blocks only on NVMe (n blocks on the NVMe
  tier, page-cached files without O_DIRECT, a DRAM tier of 8192 blocks that
  evicts as it promotes): read, verify, reserve, commit, pin;
- ``stat_us``: one ``stat()`` call (not per block).

``growth`` is each figure at the largest size over the smallest (target:
<= 1.5 for every per-block operation). Each figure is the best of three
repetitions (nine for the short phases); the machines this runs on are
shared, so only the ratios from one run compare. Hashing on commit is on
(the default); the background hasher is drained before each timed phase.
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

from common import emit  # noqa: E402

from tierstore.config import StoreConfig  # noqa: E402
from tierstore.keys import BlockKey, KVLayout  # noqa: E402
from tierstore.store import TieredStore  # noqa: E402
from tierstore.store.nvme import block_digest  # noqa: E402

LAYOUT = KVLayout("scale", 1, 1, 64, "float16", 16)  # 4 KiB blocks
BATCH = 256
FILL_BATCH = 4096
PROMOTE_DRAM_BLOCKS = 8192
REPEATS = 3  # put-with-eviction and promotion (long phases)
QUICK_REPEATS = 9  # lookup, acquire, release, stat: short phases, more exposed to noise
HASH_WAIT_S = 600.0


def key(i: int) -> BlockKey:
    return BlockKey(i.to_bytes(32, "little"))


def per_block_us(ops: int, fn: Callable[[int], None], repeats: int = REPEATS) -> float:
    """Best of ``repeats`` runs of ``fn(rep)`` over ``ops`` blocks, in us per block."""
    best = float("inf")
    for rep in range(repeats):
        gc.collect()
        t0 = time.perf_counter()
        fn(rep)
        best = min(best, time.perf_counter() - t0)
    return best / ops * 1e6


def dram_store(n: int, shm_dir: str) -> TieredStore:
    bb = LAYOUT.block_bytes
    cfg = StoreConfig(
        dram_bytes=n * bb,
        dram_segment_bytes=1 << 20,
        dram_high_watermark=1.0,  # no background demotion: puts evict themselves
        dram_low_watermark=0.99,
        nvme_bytes=0,
        shm_dir=shm_dir,
    )
    return TieredStore(cfg)


def fill(store: TieredStore, start: int, count: int, data: memoryview) -> None:
    for lo in range(start, start + count, FILL_BATCH):
        keys = [key(i) for i in range(lo, min(lo + FILL_BATCH, start + count))]
        store.put(LAYOUT, keys, data[: len(keys) * LAYOUT.block_bytes])


def dram_figures(n: int, ops: int, m: int, shm_dir: str) -> dict[str, float]:
    bb = LAYOUT.block_bytes
    data = memoryview(bytearray(b"\x5a" * (FILL_BATCH * bb)))
    store = dram_store(n, shm_dir)
    try:
        fill(store, 0, n, data)
        held = store.stat()["tiers"]["dram"]["num_blocks"]
        store.wait_hashed(HASH_WAIT_S)
        next_key = [n]

        def put_evict(_: int) -> None:
            for _lo in range(0, ops, BATCH):
                keys = [key(next_key[0] + j) for j in range(BATCH)]
                next_key[0] += BATCH
                store.put(LAYOUT, keys, data[: BATCH * bb])

        out: dict[str, float] = {"held_blocks": held}
        out["put_evict_us"] = per_block_us(ops, put_evict)
        store.wait_hashed(HASH_WAIT_S)
        newest = next_key[0]
        # The same number of distinct held keys at every size (each pinned
        # once per pass), so the sizes differ only in what else is held.
        recent = [key(newest - 1 - j) for j in range(m)]
        batches = [recent[lo : lo + BATCH] for lo in range(0, m, BATCH)]

        passes = max(1, ops // m)

        def lookup(_: int) -> None:
            for _pass in range(passes):
                for batch in batches:
                    store.lookup(LAYOUT, batch)

        out["lookup_us"] = per_block_us(m * passes, lookup, QUICK_REPEATS)
        owner = 1 << 40
        acquire_s, release_s = float("inf"), float("inf")
        for _rep in range(QUICK_REPEATS):
            gc.collect()
            t0 = time.perf_counter()
            acquired = sum(len(store.acquire(LAYOUT, batch, owner)) for batch in batches)
            t1 = time.perf_counter()
            _, pins = store.release_owner(owner)  # how a transfer drops its pins
            t2 = time.perf_counter()
            assert pins == acquired == m, (pins, acquired, m)
            acquire_s, release_s = min(acquire_s, t1 - t0), min(release_s, t2 - t1)
        out["acquire_us"] = acquire_s / m * 1e6
        out["release_us"] = release_s / m * 1e6
        out["op_blocks"] = m
        stat_s = float("inf")
        for _rep in range(QUICK_REPEATS):
            t0 = time.perf_counter()
            store.stat()
            stat_s = min(stat_s, time.perf_counter() - t0)
        out["stat_us"] = stat_s * 1e6
        return out
    finally:
        store.close()


def promote_figures(n: int, ops: int, shm_dir: str, nvme_root: str) -> dict[str, float]:
    bb = LAYOUT.block_bytes
    cfg = StoreConfig(
        dram_bytes=PROMOTE_DRAM_BLOCKS * bb,
        dram_segment_bytes=1 << 20,
        dram_high_watermark=1.0,
        dram_low_watermark=0.99,
        nvme_bytes=(n + PROMOTE_DRAM_BLOCKS) * bb + (64 << 20),
        nvme_segment_bytes=4 << 20,
        nvme_dir=nvme_root,
        nvme_direct_io=False,
        shm_dir=shm_dir,
    )
    store = TieredStore(cfg)
    try:
        assert store.nvme is not None
        block = b"\xa5" * bb
        digest = block_digest(block)
        fp = store.register_layout(LAYOUT)
        for lo in range(0, n, FILL_BATCH):
            keys = [key(i) for i in range(lo, min(lo + FILL_BATCH, n))]
            store.nvme.write_many([(k, fp, block) for k in keys], digests=[digest] * len(keys))
        held = store.stat()["tiers"]["nvme"]["num_blocks"]
        cursor = [0]

        def promote(_: int) -> None:
            for _lo in range(0, ops, BATCH):
                keys = [key((cursor[0] + j) % n) for j in range(BATCH)]
                cursor[0] += BATCH
                got = store.acquire(LAYOUT, keys)
                store.release([e.key for e in got])
                assert len(got) == len(keys), (len(got), len(keys))

        return {"nvme_held_blocks": held, "promote_us": per_block_us(ops, promote)}
    finally:
        store.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--sizes", default="10000,100000,1000000")
    parser.add_argument("--ops", type=int, default=20000)
    parser.add_argument("--promote-ops", type=int, default=8192)
    parser.add_argument("--no-promote", action="store_true", help="skip the NVMe phase")
    args = parser.parse_args()
    sizes = [int(float(s)) for s in args.sizes.split(",")]
    m = min(args.ops, min(sizes) // 4) // BATCH * BATCH
    rows: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="tierstore-scale-", dir="/dev/shm") as shm:
        for n in sizes:
            row = dram_figures(n, args.ops, m, shm)
            if not args.no_promote:
                with tempfile.TemporaryDirectory(prefix="tierstore-scale-nvme-") as root:
                    row.update(promote_figures(n, args.promote_ops, shm, root))
            rows[str(n)] = {k: round(v, 3) for k, v in row.items()}
            print(f"n={n}: {rows[str(n)]}", file=sys.stderr)
    first, last = rows[str(sizes[0])], rows[str(sizes[-1])]
    growth = {
        k: round(last[k] / first[k], 3)
        for k in ("put_evict_us", "lookup_us", "acquire_us", "release_us", "promote_us")
        if k in first and first[k] > 0
    }
    emit(
        {
            "block_bytes": LAYOUT.block_bytes,
            "batch_keys": BATCH,
            "sizes": rows,
            "growth": growth,
            "growth_max": max(growth.values()) if growth else 0.0,
            "target_growth_max": 1.5,
        },
        args.json,
    )


if __name__ == "__main__":
    main()
