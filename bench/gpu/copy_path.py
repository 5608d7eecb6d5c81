"""GPU figures of the engine's copy path, each next to its limit in the same run.

    python -m bench.gpu.copy_path --json [--quick]

On a CUDA device (one JSON object; ``--quick`` shrinks every size):

- ``copies``: 2 MiB blocks (a Llama-3-8B-shaped layout) between an HBM pool
  (``HbmTier`` on the device) and a pinned arena through ``ArenaCopier``:
  per-block D2H to scattered arena slots (what an eviction writes down),
  per-block H2D into pool slots (a promotion), and merged runs both ways (a
  load into an engine buffer). The limit: torch's copy of the same bytes
  between one device tensor and one ``pin_memory`` host tensor, one call
  each way (target: >= 0.9 of it); torch's own per-block loop is listed too.
- ``client``: the same through ``StoreClient`` and a sidecar: ``flush`` of
  HBM blocks (Reserve, D2H, Commit per batch) and ``load`` from DRAM into a
  device buffer, against the same limit.
- ``register``: ``cudaHostRegister`` / ``cudaHostUnregister`` of a 1 GiB
  arena, next to ``torch.empty(1 GiB, pin_memory=True)`` (cudaHostAlloc).
- ``ttft``: cold vs warm time to first token of the demo's model (Llama,
  hidden 256, 4 layers, random weights, eager attention) on the device, warm
  from the HBM pool and from the sidecar's DRAM; the clock stops when the
  first token's id is on the host (GPU work is asynchronous: the adapter's
  own ``model_s`` is launch time there). ``logits_equal`` compares warm and
  cold.

Without a CUDA device every section is ``{"skipped": why}``; ``--selftest-cpu``
then runs the same code on the CPU with tiny sizes, to check this script
where no GPU is (its numbers are not GPU figures; ``register`` is skipped). Arenas go to
/dev/shm when it has room, else to the temporary directory (``shm_dir``).
"""

from __future__ import annotations

import argparse
import functools
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.limits import GB, emit, ratio
from harness.sidecar import bench_sidecar
from tierstore.client import StoreClient, cuda
from tierstore.client.copier import ArenaCopier
from tierstore.client.hbm import HbmTier
from tierstore.keys import BlockKey, KVLayout, chain_keys
from tierstore.memory.arena import Arena

LAYOUT = KVLayout("bench-gpu-8b", 32, 8, 128, "bfloat16", 16)  # 2 MiB blocks
BLOCK = LAYOUT.block_bytes
REPEATS = 5
TARGET = 0.9
REGISTER_BYTES = 1 << 30
SIDECAR_SEGMENT_BYTES = 64 << 20  # common.sidecar's dram_segment_bytes
# The device under test. ``--selftest-cpu`` runs the same code on the CPU with
# tiny sizes (a check of this script where no GPU is, not a figure).
DEV = torch.device("cuda")


def sync() -> None:
    if DEV.type == "cuda":
        torch.cuda.synchronize()


def no_cuda_reason() -> str | None:
    if not torch.cuda.is_available():
        return f"no CUDA device: torch {torch.__version__} reports torch.cuda.is_available() False"
    return None


def shm_dir(need_bytes: int) -> str:
    """/dev/shm if it has ``need_bytes`` free with a quarter to spare, else tmp."""
    with_margin = need_bytes * 5 // 4
    if os.path.isdir("/dev/shm") and shutil.disk_usage("/dev/shm").free >= with_margin:
        return "/dev/shm"
    return tempfile.gettempdir()


def best_s(repeats: int, fn: Callable[[], Any]) -> float:
    """Shortest of ``repeats`` timed calls, each ended by a device sync."""
    best = float("inf")
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def segments_for(nbytes: int) -> int:
    """A sidecar DRAM size holding ``nbytes`` in whole 64 MiB segments (the
    benchmark sidecar's), plus one segment to spare."""
    seg = SIDECAR_SEGMENT_BYTES
    return -(-nbytes // seg) * seg + seg


def gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / GB, 2)


def torch_limits(n: int) -> dict[str, float]:
    """torch's copies of ``n`` blocks' bytes: one call each way, and a loop of
    per-block calls, between a device tensor and a pinned host tensor."""
    dev = torch.randint(0, 256, (n * BLOCK,), dtype=torch.uint8, device=DEV)
    host = torch.empty(n * BLOCK, dtype=torch.uint8, pin_memory=DEV.type == "cuda")
    dev_rows, host_rows = dev.view(n, BLOCK), host.view(n, BLOCK)

    def per_block(dst: torch.Tensor, src: torch.Tensor) -> None:
        for j in range(n):
            dst[j].copy_(src[j], non_blocking=True)

    out = {
        "torch_d2h_gbps": gbps(n * BLOCK, best_s(REPEATS, lambda: host.copy_(dev, True))),
        "torch_h2d_gbps": gbps(n * BLOCK, best_s(REPEATS, lambda: dev.copy_(host, True))),
        "torch_d2h_blocks_gbps": gbps(
            n * BLOCK, best_s(REPEATS, lambda: per_block(host_rows, dev_rows))
        ),
        "torch_h2d_blocks_gbps": gbps(
            n * BLOCK, best_s(REPEATS, lambda: per_block(dev_rows, host_rows))
        ),
    }
    return out


def copies(n: int, tmp: Path) -> dict[str, Any]:
    """ArenaCopier between HbmTier slots and arena slots (see the docstring)."""
    limits = torch_limits(n)
    directory = shm_dir(2 * n * BLOCK)
    arena = Arena.create(2 * n * BLOCK, directory, tag="benchgpu")
    copier = ArenaCopier(torch.frombuffer(arena.buf, dtype=torch.uint8), DEV)
    hbm = HbmTier(n * BLOCK, DEV, segment_bytes=64 << 20)
    try:
        keys = chain_keys(LAYOUT, list(range(n * LAYOUT.block_tokens)))
        slots = [hbm.allocate(k, LAYOUT.fingerprint, BLOCK, dirty=True) for k in keys]
        assert all(s is not None for s in slots)
        views = [s for s in slots if s is not None]
        for j, v in enumerate(views):
            v.fill_(j % 251)
        # Scattered arena slots (every other 2 MiB, shuffled): nothing merges.
        scattered = [2 * j * BLOCK for j in range(n)]
        random.Random(0).shuffle(scattered)
        arena_slots = [copier.arena_tensor[o : o + BLOCK] for o in scattered]

        def d2h_blocks() -> None:
            for v, a in zip(views, arena_slots):
                copier.copy(a, v)
            copier.sync()

        def h2d_blocks() -> None:
            for v, a in zip(views, arena_slots):
                copier.copy(v, a)
            copier.sync()

        rows = torch.empty((n, BLOCK), dtype=torch.uint8, device=DEV)
        contiguous = [j * BLOCK for j in range(n)]
        arena_run = copier.arena_tensor[: n * BLOCK]

        def runs(to_arena: bool) -> Callable[[], None]:
            def go() -> None:
                if to_arena:  # one copy of the run, as a batch written down back to back
                    copier.copy(arena_run, rows.reshape(-1))
                else:  # a load: copy_runs merges the consecutive slots
                    copier.copy_runs(rows, contiguous, BLOCK)
                copier.sync()

            return go

        result: dict[str, Any] = {
            "blocks": n,
            "block_bytes": BLOCK,
            "shm_dir": directory,
            "arena_pinned": copier.pinned_host,
            "arena_bytes": arena.size_bytes,
            "arena_register_s": round(copier.register_s, 4),
            **limits,
            "d2h_blocks_gbps": gbps(n * BLOCK, best_s(REPEATS, d2h_blocks)),
            "h2d_blocks_gbps": gbps(n * BLOCK, best_s(REPEATS, h2d_blocks)),
        }
        # The figures are of correct copies: every block made the round trip.
        expect = (torch.arange(n, device=DEV) % 251).to(torch.uint8)
        firsts = torch.stack([v[0] for v in views])
        lasts = torch.tensor([int(a[-1]) for a in arena_slots], device=DEV)
        result["bytes_checked"] = bool(torch.equal(firsts, expect)) and bool(
            torch.equal(lasts.to(torch.uint8), expect)
        )
        rows.fill_(1)
        result["d2h_runs_gbps"] = gbps(n * BLOCK, best_s(REPEATS, runs(True)))
        result["h2d_runs_gbps"] = gbps(n * BLOCK, best_s(REPEATS, runs(False)))
        for name in ("d2h_blocks", "h2d_blocks", "d2h_runs", "h2d_runs"):
            direction = name[:3]
            result[f"{name}_vs_torch"] = ratio(
                result[f"{name}_gbps"], limits[f"torch_{direction}_gbps"]
            )
        result["target_vs_torch"] = TARGET
        return result
    finally:
        hbm.close()
        copier.close()  # drops its reference to the mapping
        arena.close()


def client(n: int, tmp: Path) -> dict[str, Any]:
    """flush (D2H write-down) and load (H2D) through a sidecar."""
    limits = torch_limits(n)
    reps = 2
    dram = segments_for((reps + 1) * n * BLOCK)
    directory = shm_dir(dram)
    settings = (f"shm_dir={directory}",)
    out: dict[str, Any] = {"blocks": n, "shm_dir": directory}
    with (
        bench_sidecar(tmp, dram, *settings) as sock,
        StoreClient(str(sock), device=DEV, hbm_bytes=n * BLOCK) as c,
    ):
        assert c.hbm is not None
        data = torch.randint(0, 256, (n, BLOCK), dtype=torch.uint8, device=DEV)
        flush_s = float("inf")
        key_sets: list[list[BlockKey]] = []
        for r in range(reps):  # fresh keys each time: the sidecar must not hold them
            keys = chain_keys(LAYOUT, [r * 1_000_003 + t for t in range(n * LAYOUT.block_tokens)])
            c.store(LAYOUT, keys, data)
            sync()
            t0 = time.perf_counter()
            flushed = c.flush()
            flush_s = min(flush_s, time.perf_counter() - t0)
            assert flushed == n, f"flushed {flushed} of {n}"
            c.hbm.remove(keys)
            key_sets.append(keys)
        buf = torch.empty((n, BLOCK), dtype=torch.uint8, device=DEV)
        keys = key_sets[-1]
        load_s = best_s(3, lambda: c.load(LAYOUT, keys, buf, promote=False))
        got = c.load(LAYOUT, keys, buf, promote=False)
        out.update(
            {
                "arena_pinned": c._copier.pinned_host,
                "arena_register_s": round(c._copier.register_s, 4),
                "arena_bytes": c.arena.size_bytes,
                **limits,
                "flush_d2h_gbps": gbps(n * BLOCK, flush_s),
                "load_h2d_gbps": gbps(n * BLOCK, load_s),
                "loaded_from": sorted({str(t) for t in got.tiers}),
                "bytes_checked": bool(torch.equal(buf, data)),
            }
        )
    out["flush_vs_torch"] = ratio(out["flush_d2h_gbps"], limits["torch_d2h_gbps"])
    out["load_vs_torch"] = ratio(out["load_h2d_gbps"], limits["torch_h2d_gbps"])
    out["target_vs_torch"] = TARGET
    return out


def register(tmp: Path) -> dict[str, Any]:
    directory = shm_dir(REGISTER_BYTES)
    arena = Arena.create(REGISTER_BYTES, directory, tag="benchreg")
    try:
        host = torch.frombuffer(arena.buf, dtype=torch.uint8)
        sync()
        t0 = time.perf_counter()
        ok = cuda.register_host(host)
        register_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        unregistered = cuda.unregister_host(host) if ok else False
        unregister_s = time.perf_counter() - t0
        del host
    finally:
        arena.close()
    t0 = time.perf_counter()
    pinned = torch.empty(REGISTER_BYTES, dtype=torch.uint8, pin_memory=True)
    alloc_s = time.perf_counter() - t0
    del pinned
    return {
        "bytes": REGISTER_BYTES,
        "shm_dir": directory,
        "registered": ok,
        "unregistered": unregistered,
        "register_s": round(register_s, 4),
        "unregister_s": round(unregister_s, 4),
        "torch_pinned_alloc_s": round(alloc_s, 4),
        "register_vs_pinned_alloc": round(register_s / alloc_s, 2) if alloc_s > 0 else None,
    }


def ttft(lengths: list[int], tmp: Path) -> dict[str, Any]:
    from tierstore.cli.demo import build_model
    from tierstore.engines.hf import HFStoreAdapter

    model = build_model(hidden=256, layers=4, seed=0).to(DEV)
    kv_bytes_per_token = 2 * 4 * 2 * 64 * 4  # K,V x layers x KV heads x head dim x fp32
    dram = segments_for(3 * max(lengths) * kv_bytes_per_token)
    directory = shm_dir(dram)
    result: dict[str, Any] = {
        "model": "tierstore demo Llama: hidden 256, 4 layers, eager, float32",
        "shm_dir": directory,
        "runs": 3,
        "statistic": "median",
        "lengths": [],
    }

    def first_token_s(fn: Callable[[], Any]) -> tuple[float, Any]:
        sync()
        t0 = time.perf_counter()
        res = fn()
        int(torch.argmax(res.logits))  # the first token on the host
        return time.perf_counter() - t0, res

    def median(fn: Callable[[], Any]) -> tuple[float, Any]:
        runs = sorted((first_token_s(fn) for _ in range(3)), key=lambda r: r[0])
        return runs[1]

    with bench_sidecar(tmp, dram, f"shm_dir={directory}") as sock:
        hbm_bytes = 2 * max(lengths) * kv_bytes_per_token
        with (
            StoreClient(str(sock), device=DEV, hbm_bytes=hbm_bytes) as with_hbm,
            StoreClient(str(sock), device=DEV) as dram_only,
        ):
            on_hbm, on_dram = HFStoreAdapter(model, with_hbm), HFStoreAdapter(model, dram_only)
            first_token_s(lambda: on_hbm.prefill(torch.arange(64)))  # CUDA and cuBLAS start-up
            for n in lengths:
                ids = torch.randint(0, 8192, (n,), generator=torch.Generator().manual_seed(n))
                cold_s, cold = median(functools.partial(on_hbm.prefill, ids))
                on_hbm.save(ids, cold.cache)  # into the HBM pool (dirty)
                hbm_s, warm_hbm = median(functools.partial(on_hbm.resume, ids))
                with_hbm.flush()  # now in the sidecar's DRAM too
                dram_s, warm_dram = median(functools.partial(on_dram.resume, ids))
                result["lengths"].append(
                    {
                        "tokens": n,
                        "cold_ttft_s": round(cold_s, 4),
                        "warm_hbm_ttft_s": round(hbm_s, 4),
                        "warm_dram_ttft_s": round(dram_s, 4),
                        "speedup_hbm": round(cold_s / hbm_s, 1),
                        "speedup_dram": round(cold_s / dram_s, 1),
                        "reused_tokens": warm_dram.num_reused_tokens,
                        "tiers_hbm": sorted({str(t) for t in warm_hbm.tiers}),
                        "tiers_dram": sorted({str(t) for t in warm_dram.tiers}),
                        "logits_equal": bool(torch.equal(warm_hbm.logits, cold.logits))
                        and bool(torch.equal(warm_dram.logits, cold.logits)),
                        "logits_max_abs_diff": float(
                            max(
                                (warm_hbm.logits - cold.logits).abs().max(),
                                (warm_dram.logits - cold.logits).abs().max(),
                            )
                        ),
                    }
                )
                del cold, warm_hbm, warm_dram
    return result


def section(name: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """One figure group; an exception is reported as the section's error
    (the other sections still run: the GPU run is one shot)."""
    t0 = time.perf_counter()
    try:
        out = fn()
    except Exception as e:  # reported, not hidden: the check marks the run failed
        out = {"error": f"{type(e).__name__}: {e}"}
    out["elapsed_s"] = round(time.perf_counter() - t0, 2)
    print(f"gpu bench: {name} done in {out['elapsed_s']} s", file=sys.stderr, flush=True)
    return out


def main() -> int:
    global DEV
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--json", action="store_true")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--selftest-cpu", action="store_true", help="without a GPU: run on the CPU")
    args = p.parse_args()
    why = no_cuda_reason()
    names = ("copies", "client", "register", "ttft")
    result: dict[str, Any] = {"benchmark": "gpu"}
    if why is not None and not args.selftest_cpu:
        result.update({name: {"skipped": why} for name in names})
        emit(result, args.json)
        return 0
    if why is None:
        result.update(device=torch.cuda.get_device_name(), torch=torch.__version__,
                      cuda=torch.version.cuda)  # fmt: skip
        n, lengths = (32, [2048]) if args.quick else (256, [2048, 8192])
    else:
        DEV = torch.device("cpu")
        result.update(device="cpu", selftest=f"not GPU figures: {why}", torch=torch.__version__)
        n, lengths = 8, [128]
    with tempfile.TemporaryDirectory(prefix="tierstore-benchgpu-") as d:
        tmp = Path(d)
        result["copies"] = section("copies", lambda: copies(n, tmp))
        (tmp / "client").mkdir()
        result["client"] = section("client", lambda: client(max(n // 2, 4), tmp / "client"))
        if DEV.type == "cuda":
            result["register"] = section("register", lambda: register(tmp))
        else:
            result["register"] = {"skipped": f"cudaHostRegister needs CUDA: {why}"}
        (tmp / "ttft").mkdir()
        result["ttft"] = section("ttft", lambda: ttft(lengths, tmp / "ttft"))
    emit(result, args.json)
    return 1 if any("error" in result[name] for name in names) else 0


if __name__ == "__main__":
    sys.exit(main())
