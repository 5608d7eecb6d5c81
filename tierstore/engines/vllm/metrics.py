"""The vLLM connector's figures in vLLM's own stats and ``/metrics``.

Provides:
- ``StatsWindow``: what the connector's side (scheduler or worker) counted
  and timed since vLLM last took its stats; thread-safe (the worker's loader
  thread adds to it too), each list of timings bounded.
- ``TierstoreKVStats``: vLLM's ``KVConnectorStats`` for it. vLLM takes one
  from every worker after each step and one from the scheduler, sums them
  (``aggregate``), sends them to the API server's process and hands them to
  ``TierstorePromMetrics.observe``, which adds them to the Prometheus
  metrics below (``vllm serve``'s ``/metrics``); its log line uses
  ``reduce``.

Metrics (each also carries vLLM's ``model_name`` and ``engine`` labels;
counters get Prometheus's ``_total`` suffix):

- ``vllm:tierstore_hit_tokens{tier}``: prompt tokens vLLM took from the
  store, by the tier that held them (dram, nvme, peer, remote), counted
  when vLLM allocates their blocks (a load that then fails is also in
  ``load_error_blocks``);
- ``vllm:tierstore_queried_tokens``: prompt tokens the connector asked the
  store about (beyond vLLM's own prefix cache hit; its hit share is
  ``hit_tokens / queried_tokens``);
- ``vllm:tierstore_loaded_tokens`` and ``vllm:tierstore_saved_tokens``:
  tokens copied into vLLM's pages and out of them (per tensor-parallel
  rank: a TP=2 engine counts each token twice);
- ``vllm:tierstore_load_error_blocks``: blocks vLLM was told to recompute;
- ``vllm:tierstore_refusals{reason}``: engines and requests not served;
- ``vllm:tierstore_load_seconds`` and ``vllm:tierstore_save_seconds``
  (histograms): one load (a request's blocks, in the step or in the
  background), one step's saves (reserve, copies, commit).

Runs in vLLM's scheduler, worker and API server processes.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

PREFIX = "vllm:tierstore_"
MAX_SAMPLES = 4096  # timings kept per window and histogram (more are counted, not kept)

COUNTERS: dict[str, tuple[str, str]] = {  # name: (label, documentation)
    "hit_tokens": ("tier", "Prompt tokens loaded from tierstore, by the tier that held them."),
    "queried_tokens": ("", "Prompt tokens beyond vLLM's prefix cache asked of tierstore."),
    "loaded_tokens": ("", "Tokens copied from tierstore into vLLM's KV pages (per TP rank)."),
    "saved_tokens": ("", "Tokens copied from vLLM's KV pages into tierstore (per TP rank)."),
    "load_error_blocks": ("", "Blocks tierstore could not load (vLLM recomputed them)."),
    "refusals": ("reason", "Engines and requests tierstore did not serve, by reason."),
}
HISTOGRAMS: dict[str, str] = {
    "load_seconds": "Seconds of one tierstore load (a request's blocks into vLLM's pages).",
    "save_seconds": "Seconds of one step's tierstore saves (reserve, copies, commit).",
}
BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def _key(name: str, label: str = "") -> str:
    return f"{name}|{label}" if label else name


def _empty() -> dict[str, Any]:
    return {"counters": {}, "timings": {}}


@dataclass
class TierstoreKVStats(KVConnectorStats):
    """``data`` = {"counters": {"name" or "name|label": n}, "timings":
    {"name": [seconds, ...]}}: plain types, so that it crosses vLLM's
    process boundaries as it is."""

    data: dict[str, Any] = field(default_factory=_empty)

    def reset(self) -> None:
        self.data = _empty()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        counters, timings = self.data["counters"], self.data["timings"]
        for key, n in other.data.get("counters", {}).items():
            counters[key] = counters.get(key, 0) + n
        for key, samples in other.data.get("timings", {}).items():
            mine = timings.setdefault(key, [])
            mine.extend(samples[: max(0, MAX_SAMPLES - len(mine))])
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = dict(self.data["counters"])
        for key, samples in self.data["timings"].items():
            out[f"{key}_count"] = len(samples)
            out[f"{key}_mean"] = round(sum(samples) / len(samples), 6) if samples else 0.0
        return out

    def is_empty(self) -> bool:
        return not any(self.data["counters"].values()) and not any(self.data["timings"].values())


class StatsWindow:
    """See the module docstring."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data = _empty()

    def count(self, name: str, n: int, label: str = "") -> None:
        if name not in COUNTERS:
            raise KeyError(f"unknown tierstore counter {name!r}")
        if n:
            with self._lock:
                counters = self._data["counters"]
                counters[_key(name, label)] = counters.get(_key(name, label), 0) + n

    def time(self, name: str, seconds: float) -> None:
        if name not in HISTOGRAMS:
            raise KeyError(f"unknown tierstore histogram {name!r}")
        with self._lock:
            samples = self._data["timings"].setdefault(name, [])
            if len(samples) < MAX_SAMPLES:
                samples.append(seconds)

    def take(self) -> TierstoreKVStats | None:
        """What was counted since the last call (None when nothing was)."""
        with self._lock:
            data, self._data = self._data, _empty()
        stats = TierstoreKVStats(data=data)
        return None if stats.is_empty() else stats


class TierstorePromMetrics(KVConnectorPromMetrics):
    """The metrics of the module docstring, per engine, fed by ``observe``."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._metrics: dict[str, Any] = {}
        self._children: dict[tuple[int, str], Any] = {}
        for name, (label, doc) in COUNTERS.items():
            labels = labelnames + ([label] if label else [])
            self._metrics[name] = self._counter_cls(
                name=PREFIX + name, documentation=doc, labelnames=labels
            )
        histogram: Any = self._histogram_cls  # vLLM's type says Gauge | Counter | Histogram
        for name, doc in HISTOGRAMS.items():
            self._metrics[name] = histogram(
                name=PREFIX + name, documentation=doc, labelnames=labelnames, buckets=BUCKETS
            )
        # The unlabeled ones exist from the start (a scrape shows 0, not nothing).
        for idx in per_engine_labelvalues:
            for name, (label, _) in COUNTERS.items():
                if not label:
                    self._child(idx, name)
            for name in HISTOGRAMS:
                self._child(idx, name)

    def _child(self, engine_idx: int, key: str) -> Any:
        child = self._children.get((engine_idx, key))
        if child is None:
            name, _, label = key.partition("|")
            values = list(self.per_engine_labelvalues[engine_idx])
            child = self._metrics[name].labels(*values, *([label] if label else []))
            self._children[(engine_idx, key)] = child
        return child

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, n in transfer_stats_data.get("counters", {}).items():
            if key.partition("|")[0] in COUNTERS and n > 0:
                self._child(engine_idx, key).inc(n)
        for name, samples in transfer_stats_data.get("timings", {}).items():
            if name in HISTOGRAMS:
                child = self._child(engine_idx, name)
                for seconds in samples:
                    child.observe(seconds)
