"""The gateway's Prometheus metrics, on its own registry (``/metrics``).

Provides ``GatewayMetrics``:
- ``requests``: turns placed, by host and by the reason for the choice
  (``round_robin``, ``least_loaded``, ``prefix``, ``prefix_overloaded``,
  ``cost_new``, ``cost_stay``, ``cost_move``, ``no_keys``, ``no_sidecar``,
  ``failover``);
- ``prepositions``: sidecars told to pull a prefix ahead of its request;
- ``retries``: requests sent on to another host after this one refused or
  failed before its first byte; ``streams_cut``: answers cut after their
  first byte (the client's error, as every gateway of this kind does);
- ``failed``: requests answered with an error, by the error's code;
- ``added_seconds``: the latency the gateway adds before the engine sees
  a request (parse, tokenize, keys, placement), a histogram;
- ``in_flight`` and ``backend_up`` gauges per host.

Updated from the event loop; prometheus_client is thread-safe.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

ADDED_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "tierstore_gateway_requests",
            "Turns placed, by host and reason",
            ("host", "reason"),
            registry=r,
        )
        self.prepositions = Counter(
            "tierstore_gateway_prepositions",
            "Sidecars told to pull a prefix ahead of its request",
            ("host",),
            registry=r,
        )
        self.retries = Counter(
            "tierstore_gateway_retries",
            "Requests sent on after this host failed before the first byte",
            ("host",),
            registry=r,
        )
        self.streams_cut = Counter(
            "tierstore_gateway_streams_cut",
            "Answers cut after their first byte",
            ("host",),
            registry=r,
        )
        self.failed = Counter(
            "tierstore_gateway_failed", "Requests answered with an error", ("code",), registry=r
        )
        self.added_seconds = Histogram(
            "tierstore_gateway_added_seconds",
            "From a request's arrival until it is sent to an engine",
            buckets=ADDED_BUCKETS,
            registry=r,
        )
        self.in_flight = Gauge(
            "tierstore_gateway_in_flight", "Requests in flight, by host", ("host",), registry=r
        )
        self.backend_up = Gauge(
            "tierstore_gateway_backend_up",
            "1 while the host's engine answers its health check",
            ("host",),
            registry=r,
        )

    def text(self) -> bytes:
        return generate_latest(self.registry)
