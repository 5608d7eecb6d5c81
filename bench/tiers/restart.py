"""Restart benchmark: a store warm and quick after a restart (issue 16).

Measures, each next to the limit measured in the same run:
- ``serve_ready_s`` / ``attach_s`` at 1, 4 and 8 GiB arenas: a real
  ``tierstore serve`` from spawn until its first Stat RPC is answered, and a
  ``StoreClient`` attach (``dram_populate = "background"``, the arena locked
  as it is faulted in: ``dram_lock = "auto"``, the default); the same at the
  smallest size with ``upfront`` (what start-up cost before) and at the
  largest with the arena not locked (``*_unlocked``: what locking costs);
  ``populated_s`` until the background populator has faulted in the whole
  arena, and ``locked_bytes`` then. Every mode is started the same number
  of times (``--start-runs``, 3), interleaved round by round; each figure
  is the median, every run is in ``*_runs``;
- ``fresh_put_gbps``: DRAM puts into units nobody touched yet (the store
  prepares each on first use) and an engine-side copy into a fresh unit of
  its own mapping, against memcpy and against a plain first-touch copy;
- ``put_gbps`` with each write policy in the same run (the cost of
  write-through), with the writer's queued/written/dropped figures, and the
  raw disk write rate they compete for;
- ``drain_gbps`` of a graceful stop's drain against the raw write of the
  same run, and ``restart_warm_share``: blocks held before the stop that the
  restarted store serves (byte-exact).

Usage: ``python -m bench.tiers.restart [--json] [--quick] [--sizes-gib 1,4,8]
[--start-runs 3] [--starts-only]``.
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from bench.limits import GB, emit, memcpy_gbps, ratio, raw_disk_gbps, raw_disk_once
from harness.sidecar import BENCH_SETTINGS, SidecarProcess, remove_arenas
from tierstore.config.store import StoreConfig
from tierstore.keys import BlockKey, KVLayout, chain_keys
from tierstore.memory.arena import Arena
from tierstore.store.nvme.writer import BATCH_BYTES
from tierstore.store.tiered import TieredStore

LAYOUT = KVLayout("bench-restart", 16, 8, 128, "float16", 16)  # 1 MiB blocks


def blocks(n: int, seed: int) -> tuple[list[BlockKey], np.ndarray]:
    keys = chain_keys(LAYOUT, np.arange(seed * 10**6, seed * 10**6 + n * LAYOUT.block_tokens))
    data = np.random.default_rng(seed).integers(0, 255, (n, LAYOUT.block_bytes), np.uint8)
    return list(keys), data


def bench_start(
    tmp: Path, size: int, populate: str, lock: str = "auto"
) -> tuple[float, float, float, int]:
    """One sidecar start: (serve_ready_s, attach_s, populated_s,
    locked_bytes). serve_ready_s runs from the spawn until the first Stat
    RPC has been answered (the attach, and any retry of it while the sidecar
    is still coming up, included); attach_s is an engine's
    ``StoreClient(...)`` once it serves; populated_s from the spawn until the
    sidecar's Stat shows the whole arena populated (its background
    populator done), when ``locked_bytes`` is its ``arena_locked_bytes``
    (``dram_lock = lock``: ``auto`` locks pages as they are faulted in)."""
    from tierstore.client import StoreClient

    settings = (*BENCH_SETTINGS, f"dram_populate={populate}", "nvme_bytes=0", f"dram_lock={lock}")
    sidecar = SidecarProcess(
        tmp, dram=str(size), nvme="1GiB", settings=settings, die_with_parent=True
    )
    started = time.monotonic()
    sidecar.start(wait=False)  # ready is this loop's first answered Stat, not the harness's
    try:
        deadline = started + 120
        while True:
            try:
                with StoreClient(str(sidecar.socket)) as client:
                    client.stat()
                    ready = time.monotonic() - started
                break
            except Exception:
                if time.monotonic() > deadline or not sidecar.alive():
                    raise
                time.sleep(0.02)
        t0 = time.monotonic()
        with StoreClient(str(sidecar.socket)) as client:  # an engine attaching to it now
            attach = time.monotonic() - t0
        while True:
            counters = sidecar.stat().counters
            if counters["arena_populated_bytes"] >= size:
                populated = time.monotonic() - started
                locked = int(counters["arena_locked_bytes"])
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the arena of {size} bytes was not populated within 120 s")
            time.sleep(0.05)
    finally:
        sidecar.stop(timeout_s=20.0)
        remove_arenas(sidecar.pid)
    return ready, attach, populated, locked


def bench_starts(tmp: Path, sizes: list[int], runs: int) -> dict[str, object]:
    """``runs`` rounds, each one start per size with ``background`` and one at
    the smallest size with ``upfront``, and one at the largest with the arena
    not locked (``dram_lock = off``: what locking costs), interleaved (the
    drift of a shared machine hits every mode alike). Every run is reported
    (``*_runs``) and each figure is the median of its runs."""
    cases = [(gib, "background", "auto", f"{gib}gib") for gib in sizes]
    cases.append((sizes[0], "upfront", "auto", f"{sizes[0]}gib_upfront"))
    cases.append((sizes[-1], "background", "off", f"{sizes[-1]}gib_unlocked"))
    figures = ("serve_ready_s", "attach_s", "populated_s", "locked_bytes")
    runs_of: dict[str, dict[str, list[float]]] = {
        name: {f: [] for f in figures} for *_, name in cases
    }
    for r in range(runs):
        for gib, populate, lock, name in cases:
            d = tmp / f"start-{name}-{r}"
            d.mkdir()
            for f, x in zip(figures, bench_start(d, gib << 30, populate, lock)):
                runs_of[name][f].append(x)
    out: dict[str, object] = {"starts_per_case": runs}
    for *_, name in cases:
        for f in figures:
            xs = runs_of[name][f]
            out[f"{f}_{name}"] = statistics.median(xs)
            out[f"{f}_{name}_runs"] = [round(x, 4) if f != "locked_bytes" else x for x in xs]
    return out


def bench_fresh_put(total: int, shm_dir: str, repeats: int = 3) -> dict[str, float]:
    """Puts into fresh units right at start (prepared on first use, racing
    the populator), into fresh segments once the populator has finished,
    and into segments used before (the same put path, nothing fresh: the
    like-for-like limit); an engine's first copy into units it never mapped.
    Best of ``repeats`` rounds each (this machine is shared and noisy)."""
    rounds = 2 * repeats + 1
    cfg = StoreConfig(dram_bytes=rounds * total, shm_dir=shm_dir, nvme_bytes=0)
    n = total // LAYOUT.block_bytes
    out: dict[str, float] = {}
    _, data = blocks(n, 1)
    seeds = iter(range(100, 200))

    def put_fresh() -> float:
        ks = chain_keys(LAYOUT, np.arange(n * LAYOUT.block_tokens) + next(seeds) * 10**7)
        t0 = time.perf_counter()
        assert all(store.put(LAYOUT, ks, data))
        return total / (time.perf_counter() - t0) / GB

    with TieredStore(cfg) as store:
        out["arena_page_bytes"] = store.arena.page_bytes
        out["fresh_put_at_start_gbps"] = max(put_fresh() for _ in range(repeats))
        deadline = time.monotonic() + 300
        while store.arena.populated_bytes < store.arena.size_bytes:
            if time.monotonic() > deadline:
                raise RuntimeError("the arena's populator did not finish in 300 s")
            time.sleep(0.05)
        out["fresh_put_gbps"] = max(put_fresh() for _ in range(repeats))
        store.drop(store.dram.held_keys())
        best = 0.0
        for _ in range(repeats):
            best = max(best, put_fresh())
            store.drop(store.dram.held_keys())
        out["reused_put_gbps"] = best
        engine = Arena.attach(store.arena.path, store.arena.size_bytes)
        try:
            src = data.reshape(-1)
            best = 0.0
            size = total // repeats // (2 << 20) * (2 << 20)
            for r in range(repeats):  # units the store prepared, never mapped by this process
                off = (rounds - 1) * total + r * size
                t0 = time.perf_counter()
                engine.ensure_ready(off, size)
                np.copyto(engine.array[off : off + size], src[:size])
                best = max(best, size / (time.perf_counter() - t0) / GB)
            out["engine_fresh_copy_gbps"] = best
        finally:
            engine.close()
    # The same copy into a fresh shared mapping that faults page by page.
    path = Path(shm_dir) / f"bench-restart-{os.getpid()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, total)
        with mmap.mmap(fd, total) as m:
            dst = np.frombuffer(m, np.uint8)
            t0 = time.perf_counter()
            np.copyto(dst, data.reshape(-1))
            out["first_touch_copy_gbps"] = total / (time.perf_counter() - t0) / GB
            del dst
    finally:
        os.close(fd)
        path.unlink()
    return out


def _put_all(store: TieredStore, keys: list[BlockKey], data: np.ndarray, took: list[float]) -> None:
    t0 = time.perf_counter()
    for i in range(0, len(keys), 16):
        store.put(LAYOUT, keys[i : i + 16], data[i : i + 16])
    took.append(time.perf_counter() - t0)


def bench_policies(tmp: Path, total: int) -> dict[str, object]:
    """Per write policy, in the same run: puts of ``total`` bytes through a
    DRAM tier half that size (evictions all along), and promotions of
    another ``total`` bytes from NVMe while those puts run (what a turn's
    prefetch competes with)."""
    out: dict[str, object] = {}
    n = total // LAYOUT.block_bytes
    for policy in ("write_back", "write_through"):
        cfg = StoreConfig(
            dram_bytes=total // 2, nvme_dir=str(tmp / policy), nvme_bytes=4 * total,
            write_policy=policy, dram_populate="upfront",
        )  # fmt: skip
        old_keys, old = blocks(n, 5)
        keys, data = blocks(n, 2)
        with TieredStore(cfg) as store:
            for i in range(0, n, 16):  # the NVMe-resident set to promote later
                store.put(LAYOUT, old_keys[i : i + 16], old[i : i + 16])
                store.demote(old_keys[i : i + 16])
            put_s: list[float] = []
            putter = threading.Thread(target=_put_all, args=(store, keys, data, put_s))
            putter.start()
            t0 = time.perf_counter()
            promoted = 0
            for i in range(0, n, 16):
                promoted += len(store.get(LAYOUT, old_keys[i : i + 16]))
            promote_s = time.perf_counter() - t0
            putter.join()
            out[f"put_{policy}_gbps"] = total / put_s[0] / GB
            out[f"promote_during_puts_{policy}_gbps"] = (
                promoted * LAYOUT.block_bytes / promote_s / GB
            )
            c = store.stat()["store"]
            out[f"{policy}_spilled_blocks"] = c["spilled_blocks"]
            if policy == "write_through":
                out["write_through_counters"] = {
                    k: c[k] for k in ("write_queued", "write_written", "write_dropped")
                }
    return out


def raw_write_like_drain(directory: Path, arena: Arena, nbytes: int, batch_bytes: int) -> float:
    """The drain's I/O without the tier: the same arena bytes, O_DIRECT, in
    batches of the drain's size with one fdatasync each (the like-for-like limit)."""
    path = directory / f".rawdrain-{os.getpid()}"
    flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC
    try:
        fd = os.open(path, flags | getattr(os, "O_DIRECT", 0), 0o600)
    except OSError:
        fd = os.open(path, flags, 0o600)
    size = LAYOUT.block_bytes
    try:
        t0 = time.perf_counter()
        for off in range(0, nbytes, batch_bytes):
            iov = [arena.view(o, size) for o in range(off, min(off + batch_bytes, nbytes), size)]
            os.pwritev(fd, iov, off)
            os.fdatasync(fd)
        return nbytes / (time.perf_counter() - t0) / GB
    finally:
        os.close(fd)
        path.unlink()


def bench_drain(tmp: Path, total: int) -> dict[str, float]:
    n = total // LAYOUT.block_bytes
    cfg = StoreConfig(
        dram_bytes=2 * total, nvme_dir=str(tmp / "drain"), nvme_bytes=2 * total,
        dram_populate="upfront",
    )  # fmt: skip
    keys, data = blocks(n, 3)
    with TieredStore(cfg) as store:
        store.put(LAYOUT, keys, data)
        held = store.lookup(LAYOUT, keys).num_hits
        batch = max(cfg.demote_batch_blocks * LAYOUT.block_bytes, BATCH_BYTES)
        raw_before = raw_write_like_drain(tmp, store.arena, total, batch)
        report = store.drain(60.0)
        raw_after = raw_write_like_drain(tmp, store.arena, total, batch)
    with TieredStore(cfg) as store:
        got = store.get(LAYOUT, keys)
        exact = sum(1 for g, row in zip(got, data) if g == row.tobytes())
    return {"drain_gbps": report.gbps, "drain_s": report.seconds,
            "disk_raw_write_like_drain_gbps": max(raw_before, raw_after),
            "restart_warm_share": exact / held if held else 0.0}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--quick", action="store_true", help="128 MiB data, 1 GiB arena only")
    parser.add_argument("--sizes-gib", default="1,4,8")
    parser.add_argument(
        "--start-runs", type=int, default=3, help="starts per size and populate mode (>= 3)"
    )
    parser.add_argument(
        "--starts-only", action="store_true", help="only the serve_ready_s / attach_s figures"
    )
    parser.add_argument("--dir", default=None, help="directory on the disk to measure")
    parser.add_argument(
        "--huge-shm-dir",
        default=None,
        help="also measure fresh puts on this hugetlbfs or huge= tmpfs mount",
    )
    args = parser.parse_args(argv)
    total = (128 if args.quick else 512) << 20
    sizes = [1] if args.quick else [int(s) for s in args.sizes_gib.split(",")]
    base = Path(args.dir or os.path.expanduser("~/.cache/tierstore"))
    base.mkdir(parents=True, exist_ok=True)
    result: dict[str, object] = {"block_bytes": LAYOUT.block_bytes, "data_bytes": total}
    with tempfile.TemporaryDirectory(dir=base) as tmp_s:
        tmp = Path(tmp_s)
        result.update(bench_starts(tmp, sizes, args.start_runs))
        if len(sizes) > 1:
            for what in ("serve_ready_s", "attach_s"):
                first, last = result[f"{what}_{sizes[0]}gib"], result[f"{what}_{sizes[-1]}gib"]
                result[f"{what}_growth"] = ratio(float(last), float(first))  # type: ignore[arg-type]
        if args.starts_only:
            emit(result, args.json)
            return
        result["memcpy_gbps"] = memcpy = memcpy_gbps(total)
        shm_dirs = {"": "/dev/shm"}
        if args.huge_shm_dir:
            shm_dirs["huge_"] = args.huge_shm_dir
        for prefix, shm_dir in shm_dirs.items():
            fresh = bench_fresh_put(total, shm_dir)
            for key in ("fresh_put", "fresh_put_at_start", "engine_fresh_copy", "first_touch_copy"):
                fresh[f"{key}_vs_memcpy"] = ratio(fresh[f"{key}_gbps"], memcpy)
            fresh["fresh_put_vs_reused_put"] = ratio(
                fresh["fresh_put_gbps"], fresh["reused_put_gbps"]
            )
            result.update({prefix + k: v for k, v in fresh.items()})
        raw_w, _ = raw_disk_gbps(str(tmp), total)
        result["disk_raw_write_gbps"] = raw_w
        result.update(bench_policies(tmp, total))
        result["promote_during_puts_write_through_vs_write_back"] = ratio(
            float(result["promote_during_puts_write_through_gbps"]),  # type: ignore[arg-type]
            float(result["promote_during_puts_write_back_gbps"]),  # type: ignore[arg-type]
        )
        result["put_write_through_vs_write_back"] = ratio(
            float(result["put_write_through_gbps"]),  # type: ignore[arg-type]
            float(result["put_write_back_gbps"]),  # type: ignore[arg-type]
        )
        adjacent, _ = raw_disk_once(str(tmp), total)  # the disk drifts within seconds
        drain = bench_drain(tmp, total)
        raw_w2, _ = raw_disk_gbps(str(tmp), total)
        raw = max(raw_w, raw_w2, adjacent)
        result["disk_raw_write_gbps"] = raw
        result["disk_raw_write_adjacent_gbps"] = adjacent
        result.update(drain)
        result["drain_vs_raw_write"] = ratio(drain["drain_gbps"], raw)
        result["drain_vs_adjacent_raw_write"] = ratio(drain["drain_gbps"], adjacent)
        result["drain_vs_raw_write_like_drain"] = ratio(
            drain["drain_gbps"], drain["disk_raw_write_like_drain_gbps"]
        )
    emit(result, args.json)


if __name__ == "__main__":
    main()
