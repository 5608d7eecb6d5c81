"""Benchmark of the local tiers next to the physical limits of this machine.

    python bench/tiers.py --json [--quick] [--dir DIR]

Prints memcpy_gbps, dram_put_gbps, dram_get_gbps, disk_raw_write_gbps,
disk_raw_read_gbps, nvme_write_gbps, nvme_read_gbps, hash_mtokens_per_s and
the ratios the targets are stated in (DRAM >= 50% of memcpy, NVMe >= 80% of
the raw disk, hashing >= 20 M tokens/s). 2 MiB blocks, batches of 64.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import GB, aligned_buffer, best_of, emit, memcpy_gbps, ratio, raw_disk_gbps

from tierstore.config import StoreConfig
from tierstore.keys import KVLayout, chain_keys
from tierstore.memcopy import STREAMING, copy_into
from tierstore.store import TieredStore
from tierstore.tiers.nvme import NvmeTier

# 2 MiB blocks: 2 x 32 layers x 8 KV heads x 128 dim x 16 tokens x bf16.
LAYOUT = KVLayout("bench-8b", 32, 8, 128, "bfloat16", 16)
BATCH = 64


def bench_dram(total_bytes: int) -> tuple[float, float]:
    n = total_bytes // LAYOUT.block_bytes
    keys = chain_keys(LAYOUT, np.arange(n * LAYOUT.block_tokens))
    src = np.frombuffer(np.random.default_rng(1).bytes(total_bytes), dtype=np.uint8)
    # Page-aligned like the arena: a destination a few bytes past a page
    # boundary halves memcpy speed here (4 KiB aliasing of source and destination).
    dst = np.frombuffer(aligned_buffer(total_bytes), dtype=np.uint8)
    cfg = StoreConfig(
        dram_bytes=2 * total_bytes,
        dram_segment_bytes=64 << 20,
        nvme_bytes=0,
        dram_high_watermark=1.0,
        dram_low_watermark=0.9,
    )
    with TieredStore(cfg) as store:
        t0 = time.perf_counter()
        for i in range(0, n, BATCH):
            batch = keys[i : i + BATCH]
            store.put(
                LAYOUT, batch, src[i * LAYOUT.block_bytes : (i + len(batch)) * LAYOUT.block_bytes]
            )
        put_s = time.perf_counter() - t0

        arena = store.arena.array

        def get_all() -> None:
            for i in range(0, n, BATCH):
                entries = store.acquire(LAYOUT, keys[i : i + BATCH])
                for j, e in enumerate(entries):
                    lo = (i + j) * LAYOUT.block_bytes
                    copy_into(dst[lo : lo + e.nbytes], arena[e.offset : e.offset + e.nbytes])
                store.release([e.key for e in entries])

        get_s = best_of(2, get_all)
        assert np.array_equal(src, dst), "DRAM round trip changed bytes"
    return total_bytes / put_s / GB, total_bytes / get_s / GB


def bench_nvme(directory: str, total_bytes: int) -> tuple[float, float, float, bool]:
    n = total_bytes // LAYOUT.block_bytes
    keys = chain_keys(LAYOUT, np.arange(n * LAYOUT.block_tokens) + 7)
    buf = aligned_buffer(total_bytes)
    view = memoryview(buf)
    size = LAYOUT.block_bytes
    root = Path(directory) / "nvme-bench"
    tier = NvmeTier(root, 2 * total_bytes, segment_bytes=64 << 20)
    try:
        t0 = time.perf_counter()
        for i in range(0, n, BATCH):
            items = [
                (k, LAYOUT.fingerprint, view[(i + j) * size : (i + j + 1) * size])
                for j, k in enumerate(keys[i : i + BATCH])
            ]
            assert all(tier.write_many(items))
        write_s = time.perf_counter() - t0
        out = aligned_buffer(size)
        out_view = memoryview(out)
        t0 = time.perf_counter()
        for k in keys:
            assert tier.read_into(k, out_view) == size
        read_s = time.perf_counter() - t0
        # Two readers, as the sidecar's prefetch workers read: verify of one
        # block overlaps the disk read of the next.
        outs = [memoryview(aligned_buffer(size)) for _ in range(2)]

        def read_half(i: int) -> None:
            for k in keys[i::2]:
                assert tier.read_into(k, outs[i]) == size

        with ThreadPoolExecutor(2) as pool:
            t0 = time.perf_counter()
            list(pool.map(read_half, range(2)))
            read2_s = time.perf_counter() - t0
        direct = tier.direct_io_active
    finally:
        tier.close()
        for p in sorted(root.rglob("*"), reverse=True):
            p.rmdir() if p.is_dir() else p.unlink()
        root.rmdir()
    return (
        total_bytes / write_s / GB,
        total_bytes / read_s / GB,
        total_bytes / read2_s / GB,
        direct,
    )


def bench_hash(num_tokens: int = 200_000) -> float:
    layout = KVLayout("bench-hash", 32, 8, 128, "bfloat16", 16)
    tokens = np.random.default_rng(2).integers(0, 128_000, num_tokens)
    return num_tokens / best_of(3, lambda: chain_keys(layout, tokens)) / 1e6


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quick", action="store_true", help="64 MiB instead of 256 MiB")
    parser.add_argument(
        "--dir",
        default=None,
        help="directory on the disk to measure "
        "(default: a temporary directory under ~/.cache/tierstore)",
    )
    args = parser.parse_args(argv)
    total = (64 if args.quick else 256) << 20
    base = Path(args.dir or os.path.expanduser("~/.cache/tierstore"))
    base.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=base) as tmp:
        memcpy = memcpy_gbps(total)
        put, get = bench_dram(total)
        raw_w, raw_r = raw_disk_gbps(tmp, total)
        nvme_w, nvme_r, nvme_r2, direct = bench_nvme(tmp, total)
        raw_w2, raw_r2 = raw_disk_gbps(tmp, total)  # again, after: the disk drifts
    raw_w, raw_r = max(raw_w, raw_w2), max(raw_r, raw_r2)
    result = {
        "bytes": total,
        "block_bytes": LAYOUT.block_bytes,
        "memcpy_gbps": memcpy,
        "dram_put_gbps": put,
        "dram_get_gbps": get,
        "dram_put_vs_memcpy": ratio(put, memcpy),
        "dram_get_vs_memcpy": ratio(get, memcpy),
        "disk_raw_write_gbps": raw_w,
        "disk_raw_read_gbps": raw_r,
        "nvme_write_gbps": nvme_w,
        "nvme_read_gbps": nvme_r,
        "nvme_read_2threads_gbps": nvme_r2,
        "nvme_write_vs_raw": ratio(nvme_w, raw_w),
        "nvme_read_vs_raw": ratio(nvme_r, raw_r),
        "nvme_read_2threads_vs_raw": ratio(nvme_r2, raw_r),
        "nvme_direct_io": direct,
        "streaming_copy": STREAMING,
        "hash_mtokens_per_s": bench_hash(),
    }
    emit(result, args.json)


if __name__ == "__main__":
    main()
