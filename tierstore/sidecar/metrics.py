"""Prometheus metrics of a sidecar, read from the store's counters at scrape
time (no per-operation cost on the hot paths).

Runs in the sidecar: ``start_metrics_server`` serves ``/metrics`` from a
background HTTP thread; the collector reads a stat snapshot per scrape
(``tierstore.sidecar.stat.stat_reply`` of the local service it is given,
the same reply ``tierstore stat`` reads).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.registry import Collector

from tierstore.errors import TierstoreError
from tierstore.sidecar.stat import StatSource, stat_reply
from tierstore.store.remote.tier import GAUGES as REMOTE_GAUGES
from tierstore.store.tiered import STORE_GAUGES

TIER_GAUGES = ("capacity_bytes", "used_bytes", "num_blocks")
TIER_COUNTERS = (
    "hits",
    "misses",
    "bytes_in",
    "bytes_out",
    "evictions",
    "verify_failures",
    "write_failures",
    "read_failures",
)
# Counters that go down too, and flags.
GAUGE_COUNTERS = {
    "peer_watchers", "peer_tls", "replica_bytes", "worker_failures",
    "membership_members", "membership_etcd_up", "membership_registered",
} | STORE_GAUGES | REMOTE_GAUGES  # fmt: skip


class SidecarCollector(Collector):
    def __init__(self, source: StatSource) -> None:
        self.source = source

    def collect(self) -> Iterator[Any]:
        stat = stat_reply(self.source)
        for name in TIER_GAUGES:
            g = GaugeMetricFamily(f"tierstore_tier_{name}", f"Tier {name}", labels=["tier"])
            for t in stat.tiers:
                g.add_metric([t.name], getattr(t, name))
            yield g
        for name in TIER_COUNTERS:
            c = CounterMetricFamily(f"tierstore_tier_{name}", f"Tier {name}", labels=["tier"])
            for t in stat.tiers:
                c.add_metric([t.name], getattr(t, name))
            yield c
        for name, value in sorted(stat.counters.items()):
            if name in GAUGE_COUNTERS:
                yield GaugeMetricFamily(f"tierstore_{name}", f"Store gauge {name}", value=value)
            else:
                yield CounterMetricFamily(f"tierstore_{name}", f"Store counter {name}", value=value)
        info = InfoMetricFamily("tierstore_settings", "Settings in words (write policy, pages)")
        info.add_metric([], dict(stat.info))
        yield info
        yield GaugeMetricFamily(
            "tierstore_clients", "Attached engine clients", value=len(stat.clients)
        )
        load = self.source.loads.host()  # what the host's engines last reported
        for name in ("busy_slots", "slots", "queue_len"):
            yield GaugeMetricFamily(
                f"tierstore_engine_{name}", f"Engines' reported {name}", value=getattr(load, name)
            )


def start_metrics_server(source: StatSource, host: str, port: int) -> Any:
    """Serve ``/metrics`` of ``source`` (the local service) on ``host:port``."""
    registry = CollectorRegistry()
    registry.register(SidecarCollector(source))
    try:
        server, _thread = start_http_server(port, addr=host, registry=registry)
    except OSError as e:
        raise TierstoreError(
            f"cannot serve metrics on {host}:{port}: {e}; set metrics_port to a free port or 0"
        ) from e
    return server
