"""The vLLM connector's figures for vLLM's stats and ``/metrics``: what the
planner and the worker count, how vLLM sums them, and what Prometheus shows."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vllm (pip install 'tierstore[vllm]')")

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from tierstore.engines.vllm.connector import session_of
from tierstore.engines.vllm.driver import LOAD_SECONDS
from tierstore.engines.vllm.layout import request_salt
from tierstore.engines.vllm.metrics import (
    MAX_SAMPLES,
    StatsWindow,
    TierstoreKVStats,
    TierstorePromMetrics,
)
from tierstore.engines.vllm.plan import Planner
from tierstore.tiers import TierName

from .test_vllm_plan import BT, LAYOUTS, SETTINGS, FakeStore, blocks, request, toks


def test_the_window_counts_times_and_empties_on_take() -> None:
    w = StatsWindow()
    assert w.take() is None  # nothing counted: vLLM gets no stats object
    w.count("hit_tokens", 256, "dram")
    w.count("hit_tokens", 128, "nvme")
    w.count("hit_tokens", 128, "dram")
    w.count("saved_tokens", 0)  # zero counts nothing
    w.time("load_seconds", 0.25)
    stats = w.take()
    assert stats is not None
    assert stats.data["counters"] == {"hit_tokens|dram": 384, "hit_tokens|nvme": 128}
    assert stats.data["timings"] == {"load_seconds": [0.25]}
    assert w.take() is None
    with pytest.raises(KeyError, match="unknown tierstore counter 'hits'"):
        w.count("hits", 1)
    for _ in range(MAX_SAMPLES + 10):
        w.time("save_seconds", 0.001)
    taken = w.take()
    assert taken is not None and len(taken.data["timings"]["save_seconds"]) == MAX_SAMPLES


def test_stats_of_workers_and_scheduler_sum_like_vllm_sums_them() -> None:
    a = TierstoreKVStats(
        data={"counters": {"loaded_tokens": 512}, "timings": {"load_seconds": [0.1]}}
    )
    b = TierstoreKVStats(
        data={
            "counters": {"loaded_tokens": 256, "refusals|request: x": 1},
            "timings": {"load_seconds": [0.3]},
        }
    )
    total = a.aggregate(b)
    assert total.data["counters"] == {"loaded_tokens": 768, "refusals|request: x": 1}
    assert total.reduce() == {
        "loaded_tokens": 768,
        "refusals|request: x": 1,
        "load_seconds_count": 2,
        "load_seconds_mean": 0.2,
    }
    assert TierstoreKVStats().is_empty() and not total.is_empty()
    total.reset()
    assert total.is_empty()


def test_the_planner_counts_queried_and_hit_tokens_by_tier_once_per_request() -> None:
    window = StatsWindow()
    store = FakeStore()
    p = toks(6 * BT)
    store.hold(LAYOUTS[0], p, 4)
    tiers = (TierName.DRAM, TierName.DRAM, TierName.NVME, TierName.PEER)

    def lookup(layout: Any, keys: list[Any]) -> Any:
        return tiers[: len(store.lookup(layout, keys))]

    plan = Planner(
        LAYOUTS, lookup, lambda r: request_salt(SETTINGS, r), session_of, count=window.count
    )
    req = request(p)
    # vLLM holds the first block itself; the store the next three.
    assert plan.matched_tokens(req, BT) == 3 * BT
    plan.after_alloc(req, blocks(list(range(6))).get_block_ids(), 3 * BT)
    plan.after_alloc(req, blocks(list(range(6))).get_block_ids(), 0)  # allocated again
    stats = window.take()
    assert stats is not None
    assert stats.data["counters"] == {
        "queried_tokens": 4 * BT,  # 5 full blocks before the last token, 1 of them vLLM's
        "hit_tokens|dram": BT,
        "hit_tokens|nvme": BT,
        "hit_tokens|peer": BT,
    }
    plan.load_failed({2})  # the block loaded at position 2 (nvme) failed
    stats = window.take()
    assert stats is not None and stats.data["counters"] == {"load_error_blocks": 2}


def test_prometheus_shows_each_metric_under_its_documented_name() -> None:
    registry = CollectorRegistry()

    def on(cls: type) -> type:  # vLLM's metric classes, on a private registry
        class Bound(cls):  # type: ignore[misc, valid-type]
            def __init__(self, *a: Any, **kw: Any) -> None:
                super().__init__(*a, registry=registry, **kw)

        return Bound

    types = {Gauge: on(Gauge), Counter: on(Counter), Histogram: on(Histogram)}

    class Config:
        kv_transfer_config = None

    prom = TierstorePromMetrics(Config(), types, ["model_name", "engine"], {0: ["m", "0"]})
    labels = {"model_name": "m", "engine": "0"}
    assert registry.get_sample_value("vllm:tierstore_loaded_tokens_total", labels) == 0
    stats = TierstoreKVStats(
        data={
            "counters": {"hit_tokens|dram": 384, "loaded_tokens": 384, "refusals|engine: x": 1},
            "timings": {"load_seconds": [0.003, 0.2]},
        }
    )
    prom.observe(stats.data, 0)
    prom.observe(stats.data, 0)
    value = registry.get_sample_value
    assert value("vllm:tierstore_hit_tokens_total", {**labels, "tier": "dram"}) == 768
    assert value("vllm:tierstore_loaded_tokens_total", labels) == 768
    assert value("vllm:tierstore_refusals_total", {**labels, "reason": "engine: x"}) == 2
    assert value(f"{LOAD_SECONDS}_count", labels) == 4  # the name the driver reads
    assert value(f"{LOAD_SECONDS}_bucket", {**labels, "le": "0.005"}) == 2
    assert value("vllm:tierstore_save_seconds_count", labels) == 0


def test_kv_events_are_one_block_stored_per_run_of_held_blocks() -> None:
    from tierstore.engines.vllm.events import TierstoreKVEvents, stored_events
    from tierstore.engines.vllm.plan import SaveSpec

    hashes = tuple(bytes([i]) * 32 for i in range(1, 5))
    spec = SaveSpec("r", "", ((),), ((7, 8, 9, 10),), hashes, b"\x00" * 32, tuple(range(4 * BT)))
    events = stored_events([(spec, [0, 1, 3])], BT)  # position 2 was not stored
    assert len(events) == 2
    first, second = events
    assert len(first.block_hashes) == 2 and len(second.block_hashes) == 1
    assert first.token_ids == list(range(2 * BT))
    assert second.token_ids == list(range(3 * BT, 4 * BT))
    # the second run's parent is the block before it (position 2), not the first run's last
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    assert second.parent_block_hash == maybe_convert_block_hash(hashes[2])
    assert first.parent_block_hash == maybe_convert_block_hash(b"\x00" * 32)
    assert {e.medium for e in events} == {"CPU"} and {e.block_size for e in events} == {BT}
    # vLLM keeps only what every worker emitted: two ranks, one of them with less.
    both = TierstoreKVEvents(1)
    both.add_events(events)
    other = TierstoreKVEvents(1)
    other.add_events(events[:1])
    both.add_events(other.get_all_events())
    both.increment_workers(1)
    assert both.aggregate().get_all_events() == events[:1]
