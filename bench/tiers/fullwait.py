"""An engine's writes once DRAM is full and the disk is slower than they come.

    python -m bench.tiers.fullwait --json [--seconds 20] [--dram 1GiB] [--batch 8]
                                      [--set KEY=VALUE ...]

One sidecar (``bench_sidecar``: DRAM ``--dram``, NVMe 4 GiB, the default
watermarks 0.9 / 0.75, so its demoter spills in the background) and one
engine client with no HBM tier, storing 8 MiB blocks (an 8B model's KV of
64 tokens) in batches of ``--batch`` with ``client.store`` (reserve, copy,
commit), one batch after another, as fast as it can, for ``--seconds``.
Every batch's keys are new, so every batch is written. It reports:

- ``store_ms`` (p50, p90, p99, max) of the store calls once DRAM had filled,
  and ``store_ms_filling`` for those before (DRAM still had room): what the
  engine's save waits;
- ``offered_gbps``: the bytes the client stored over the run's wall time;
  ``nvme_write_gbps``: the limit, an O_DIRECT write of 1 GiB to the NVMe
  tier's disk right after (``bench.limits.raw_disk_gbps``, best of 2);
- ``full_waits``, ``full_wait_s``, ``full_wait_evicted_blocks``: the
  sidecar's own count of the writes that found DRAM full and made room in
  their call, and how long they waited (``tierstore stat`` shows them);
  ``spilled_blocks``, the blocks written to NVMe in all.

When the client stores faster than the disk writes, the demoter falls
behind. Once DRAM is full, every store call waits for its victims' NVMe
writes: the store's p90 jumps from the copy's milliseconds to the disk's
tens or hundreds. ``full_wait_s`` says how much of the run's time that was.
``--set``: a sidecar setting, e.g. ``demote_batch_bytes`` (``settings`` in
the JSON).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.limits import GB, emit, raw_disk_gbps
from harness.sidecar import bench_sidecar
from tierstore.client import StoreClient
from tierstore.config.parse import parse_bytes
from tierstore.keys import KVLayout, chain_keys

LAYOUT = KVLayout("fullwait", 32, 8, 128, "bfloat16", 64)  # 8 MiB a block
WATERMARKS = ("dram_high_watermark=0.9", "dram_low_watermark=0.75")  # the defaults


def percentiles_ms(seconds: list[float]) -> list[float]:
    if not seconds:
        return []
    p = np.percentile(np.asarray(seconds) * 1e3, [50, 90, 99])
    return [*(round(float(x), 2) for x in p), round(max(seconds) * 1e3, 2)]


def run(
    seconds: float, dram_bytes: int, batch: int, settings: list[str], raw_bytes: int = 1 << 30
) -> dict[str, Any]:
    """See the module docstring; ``raw_bytes``: the size of the raw write."""
    rows = np.random.default_rng(0).integers(0, 255, (batch, LAYOUT.block_bytes), dtype=np.uint8)
    filling: list[float] = []
    full: list[float] = []
    stored = 0
    with tempfile.TemporaryDirectory(prefix="bench-fullwait-") as tmp:
        root = Path(tmp)
        with bench_sidecar(root, dram_bytes, *WATERMARKS, "nvme_bytes=4GiB", *settings) as sock:
            with StoreClient(str(sock), name="bench-fullwait", hbm_bytes=0, device="cpu") as c:
                started = time.perf_counter()
                tokens = 0
                while time.perf_counter() - started < seconds:
                    keys = chain_keys(LAYOUT, np.arange(tokens, tokens + batch * 64))
                    tokens += batch * 64
                    t0 = time.perf_counter()
                    held = c.store(LAYOUT, keys, rows)
                    took = time.perf_counter() - t0
                    if not all(held):
                        raise RuntimeError(f"the sidecar refused {held.count(False)} blocks")
                    stored += batch * LAYOUT.block_bytes
                    (full if stored > dram_bytes else filling).append(took)
                wall = time.perf_counter() - started
                stat = c.stat()
                counters = dict(stat.counters)
                nvme_bytes = next(t.capacity_bytes for t in stat.tiers if t.name == "nvme")
            write_gbps, _ = raw_disk_gbps(str(root), raw_bytes)
    return {
        "settings": settings,
        "block_bytes": LAYOUT.block_bytes,
        "batch_blocks": batch,
        "dram_bytes": dram_bytes,
        "nvme_bytes": nvme_bytes,
        "seconds": round(wall, 2),
        "store_calls": len(filling) + len(full),
        "store_ms_filling": percentiles_ms(filling),
        "store_ms": percentiles_ms(full),
        "offered_gbps": round(stored / wall / GB, 3),
        "nvme_write_gbps": round(write_gbps, 3),
        "full_waits": counters["full_waits"],
        "full_wait_s": round(counters["full_wait_us"] / 1e6, 2),
        "full_wait_evicted_blocks": counters["full_wait_evicted_blocks"],
        "spilled_blocks": counters["spilled_blocks"],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--dram", default="1GiB")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--set", metavar="KEY=VALUE", action="append", default=[])
    args = parser.parse_args(argv)
    emit(run(args.seconds, parse_bytes(args.dram), args.batch, args.set), args.json)


if __name__ == "__main__":
    main()
