"""``[server]``: the sidecar process: its socket, threads, prefetch deadlines,
metrics endpoint, shutdown and log level.

Provides ``ServerConfig``. Read by the sidecar, and by the engine's client
for the default socket path.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tierstore.config.common import at_least, default_runtime_dir, positive
from tierstore.errors import ConfigError


@dataclass(frozen=True)
class ServerConfig:
    """The sidecar process: sockets, threads, prefetch, metrics."""

    socket_path: str = field(default_factory=lambda: str(default_runtime_dir() / "tierstore.sock"))
    metrics_host: str = "127.0.0.1"  # Prometheus endpoint address
    metrics_port: int = 9477  # Prometheus endpoint port; 0 disables it
    max_clients: int = 64  # engine processes attached at once (one stream thread each)
    rpc_threads: int = 16  # threads serving unary calls
    max_batch_keys: int = 8192  # keys in one control call
    keepalive_s: float = 5.0  # interval of keep-alive events on a client's Attach stream
    prefetch_threads: int = 2  # background promotion workers
    prefetch_queue_max: int = 256  # prefetches waiting to run; more are cancelled
    prefetch_timeout_base_s: float = 0.05  # PREFETCH_TIMEOUT deadline: base ...
    prefetch_timeout_per_1k_tokens_s: float = 0.02  # ... plus this per 1000 tokens
    prefetch_max_wait_s: float = 30.0  # longest a PREFETCH_WAIT call blocks
    shutdown_grace_s: float = 5.0  # in-flight calls get this long to finish on SIGTERM
    shutdown_drain_s: float = 10.0  # then DRAM-only blocks are written to NVMe for this long
    load_ttl_s: float = 10.0  # an engine's load report (ReportLoad) counts this long
    log_level: str = "info"  # debug | info | warning | error

    def __post_init__(self) -> None:
        if self.log_level.lower() not in ("debug", "info", "warning", "error", "critical"):
            raise ConfigError(
                f"log_level must be debug, info, warning, error or critical, got {self.log_level!r}"
            )
        if not 0 <= self.metrics_port < 65536:
            raise ConfigError(f"metrics_port must be in [0, 65535], got {self.metrics_port}")
        at_least(
            self,
            1,
            "max_clients",
            "rpc_threads",
            "max_batch_keys",
            "prefetch_threads",
            "prefetch_queue_max",
        )
        at_least(self, 0, "shutdown_drain_s")
        positive(self, "keepalive_s", "prefetch_max_wait_s", "shutdown_grace_s", "load_ttl_s")
        if len(self.socket_path.encode()) > 100:
            raise ConfigError(
                f"socket_path is {len(self.socket_path.encode())} bytes; Unix sockets allow "
                f"about 100: {self.socket_path}"
            )
