"""The fleet bench's figures from its samples, and its targets.

Provides ``conversations`` (each user's turns in order), ``turn_figures``
(one run's TTFTs: returning, switched and stayed; ITL; output tokens/s;
switches warm, partly warm and cold as the kv_share write-up counts them),
``failover_figures`` (what a killed engine cost), ``prompt_sources`` (the
engines' own count of where prompt tokens came from), ``summarize`` (each
figure's median, min and max over the repeats) and ``targets`` (issue 38's:
each ratio it names and whether it holds). Pure but for ``prompt_sources``,
which reads the engines' /metrics.
"""

from __future__ import annotations

import itertools
import statistics
from typing import Any

from bench.fleet.topology import BLOCK_TOKENS, Fleet
from harness.chat_load import Sample, parse_metrics, percentile

WARM_SHARE = 0.9  # a switch reusing >= 90% of its last prompt is warm (kv_share's rule)
PARTLY_WARM_SHARE = 0.3  # 30-90%: partly warm; below: cold
FIGURES = (
    "ttft_returning_p50_s",
    "ttft_returning_p90_s",
    "ttft_switched_p50_s",
    "ttft_stayed_p50_s",
    "itl_p90_s",
    "output_tokens_per_s",
    "switched_turns",
    "warm_switch_share",
    "warm_switch_store_share",
    "partly_warm_switch_share",
    "cold_switch_share",
    "requests_failed",
)


def rounded(x: float | None, digits: int = 4) -> float | None:
    return None if x is None else round(x, digits)


def conversations(samples: list[Sample]) -> list[list[Sample]]:
    """Each user's turns, in turn order."""
    by_user: dict[int, list[Sample]] = {}
    for s in samples:
        by_user.setdefault(s.user, []).append(s)
    return [sorted(turns, key=lambda s: s.turn) for turns in by_user.values()]


def turn_figures(samples: list[Sample], host_of: Any) -> dict[str, Any]:
    """One run's figures (see the module docstring)."""
    back, switched, stayed, warm, warm_store, partly = [], [], [], 0, 0, 0
    for turns in conversations(samples):
        visited: set[int] = set()
        for prev, cur in itertools.pairwise(turns):
            if prev.error is None:
                visited.add(host_of(prev.served_by))
            if cur.error is not None or prev.error is not None or cur.ttft_s is None:
                continue
            back.append(cur.ttft_s)
            here = host_of(cur.served_by)
            if here == host_of(prev.served_by):
                stayed.append(cur.ttft_s)
                continue
            switched.append(cur.ttft_s)
            reusable = prev.prompt_tokens // BLOCK_TOKENS * BLOCK_TOKENS
            if (cur.cached_tokens or 0) >= WARM_SHARE * reusable:
                warm += 1
                warm_store += here not in visited
            elif (cur.cached_tokens or 0) >= PARTLY_WARM_SHARE * reusable:
                partly += 1
    ok = [s for s in samples if s.error is None]
    itl = [g for s in ok for g in s.itl_s]
    start = min((s.sent_s for s in samples), default=0.0)
    end = max((s.end_s or 0.0 for s in samples), default=0.0)
    out_tokens = sum(s.output_tokens for s in ok)
    return {
        "ttft_returning_p50_s": rounded(percentile(back, 50)),
        "ttft_returning_p90_s": rounded(percentile(back, 90)),
        "ttft_switched_p50_s": rounded(percentile(switched, 50)),
        "ttft_stayed_p50_s": rounded(percentile(stayed, 50)),
        "itl_p90_s": rounded(percentile(itl, 90), 5),
        "output_tokens_per_s": rounded(out_tokens / (end - start), 2) if end > start else None,
        "returning_turns": len(back),
        "switched_turns": len(switched),
        "warm_switch_share": rounded(warm / len(switched), 3) if switched else None,
        "warm_switch_store_share": rounded(warm_store / warm, 3) if warm else None,
        "partly_warm_switch_share": rounded(partly / len(switched), 3) if switched else None,
        "cold_switch_share": (
            rounded((len(switched) - warm - partly) / len(switched), 3) if switched else None
        ),
        "requests_failed": len(samples) - len(ok),
        "errors": sorted({s.error for s in samples if s.error})[:5],
        "placements": dict(sorted(_count(s.placement for s in samples).items())),
    }


def _count(items: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for x in items:
        out[x] = out.get(x, 0) + 1
    return out


def prompt_sources(fleet: Fleet) -> dict[str, float]:
    """Prompt tokens by where vLLM got them, summed over the engines."""
    out: dict[str, float] = {}
    for i in range(len(fleet.engines)):
        for key, value in parse_metrics(fleet.engine_metrics(i)).items():
            if key.startswith("vllm:prompt_tokens_by_source_total{"):
                source = key.split('source="', 1)[1].split('"', 1)[0]
                out[source] = out.get(source, 0.0) + value
    return out


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per figure: the median over the repeats, with min and max."""
    out: dict[str, Any] = {}
    for name in FIGURES:
        values = [r[name] for r in runs if r.get(name) is not None]
        if values:
            out[name] = rounded(statistics.median(values), 4)
            out[f"{name}_min"], out[f"{name}_max"] = min(values), max(values)
        else:
            out[name] = None
    out["runs"] = runs
    return out


def failover_figures(
    samples: list[Sample], host_of: Any, t0: float, kill_s: float
) -> dict[str, Any]:
    """What the kill of host 0's engine cost: cut streams, requests failed
    before they streamed (must be none), and whether the conversations that
    lived on host 0 resumed warm on host 1."""
    failed = [s for s in samples if s.error is not None]
    not_started = [s for s in failed if s.ttft_s is None]
    moved = warm = 0
    for turns in conversations(samples):
        for prev, cur in itertools.pairwise(turns):
            if prev.error or cur.error or host_of(prev.served_by) != 0 or cur.sent_s < kill_s:
                continue
            moved += 1
            reusable = prev.prompt_tokens // BLOCK_TOKENS * BLOCK_TOKENS
            warm += (cur.cached_tokens or 0) >= WARM_SHARE * reusable
            break  # the first turn after the kill of each of host 0's conversations
    return {
        "kill_at_s": kill_s,
        "requests": len(samples),
        "requests_failed": len(failed),
        "not_started_failed": len(not_started),
        "moved_sessions": moved,
        "warm_share": rounded(warm / moved, 3) if moved else None,
        "errors": sorted({s.error for s in failed if s.error})[:5],
    }


def targets(result: dict[str, Any]) -> dict[str, Any]:
    """The issue's targets: each figure or ratio it names, and whether it holds."""
    m = result["modes"]
    out: dict[str, Any] = {}

    def fig(mode: str, name: str) -> float | None:
        value: float | None = m.get(mode, {}).get(name)
        return value

    def check(key: str, value: float | None, target: str, met: bool) -> None:
        out[key] = {"value": value, "target": target, "met": bool(value is not None and met)}

    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 3) if a is not None and b else None

    if "tierstore" in m:
        for other, name, bound in (
            ("prefix_aware", "ttft_returning_p50_s", 0.5),
            ("round_robin", "ttft_returning_p50_s", 0.2),
            ("prefix_aware", "ttft_returning_p90_s", 0.5),
        ):
            r = ratio(fig("tierstore", name), fig(other, name))
            check(f"{name}_vs_{other}", r, f"<= {bound}", r is not None and r <= bound)
        tps = fig("tierstore", "output_tokens_per_s")
        best = max(
            (fig(k, "output_tokens_per_s") or 0.0 for k in m if k != "tierstore"), default=0.0
        )
        r = ratio(tps, best)
        check("output_tokens_per_s_vs_best_other", r, ">= 1", r is not None and r >= 1)
        ws = fig("tierstore", "warm_switch_share")
        check("warm_switch_share", ws, ">= 0.99", ws is not None and ws >= 0.99)
        r = ratio(fig("tierstore", "ttft_switched_p50_s"), fig("tierstore", "ttft_stayed_p50_s"))
        check("switched_vs_stayed_p50", r, "<= 1.5", r is not None and r <= 1.5)
        failed = fig("tierstore", "requests_failed")
        check("requests_failed", failed, "0", failed == 0)
    if "tierstore" in m and "tierstore_no_preposition" in m:
        r = ratio(
            fig("tierstore", "ttft_switched_p50_s"),
            fig("tierstore_no_preposition", "ttft_switched_p50_s"),
        )
        check("preposition_switched_p50", r, "< 1", r is not None and r < 1)
    if "gateway_overhead_p50_ms" in result:
        v = result["gateway_overhead_p50_ms"]
        check("gateway_overhead_p50_ms", v, "<= 2", v <= 2)
    if "failover" in result:
        f = result["failover"]
        check(
            "failover_not_started_failed",
            f["not_started_failed"],
            "0",
            f["not_started_failed"] == 0,
        )
        w = f["warm_share"]
        check("failover_warm_share", w, ">= 0.9", w is not None and w >= 0.9)
    return out
