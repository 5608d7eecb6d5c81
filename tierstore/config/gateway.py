"""``[gateway]``: the OpenAI-compatible gateway (``tierstore gateway``) in
front of the engines: its port, engines, placement policy, polls and
deadlines.

Provides ``GatewayConfig`` and ``GATEWAY_POLICIES`` (the policies by name).
Read by the gateway only.
"""

from __future__ import annotations

from dataclasses import dataclass

from tierstore.config.common import at_least, positive
from tierstore.errors import ConfigError

GATEWAY_POLICIES = (
    "tierstore",
    "tierstore_no_preposition",
    "prefix_aware",
    "least_loaded",
    "round_robin",
)


@dataclass(frozen=True)
class GatewayConfig:
    """The OpenAI-compatible gateway (``tierstore gateway``) in front of the engines."""

    gateway_host: str = "127.0.0.1"  # address the gateway listens on
    gateway_port: int = 8080  # its HTTP port
    # The engines: URL[;peer=HOST:PORT][;events=tcp://HOST:PORT] each; or none,
    # with [peer] membership: the group's members name their engines.
    gateway_backends: tuple[str, ...] = ()
    gateway_policy: str = "tierstore"  # see GATEWAY_POLICIES
    gateway_tokenizer: str = ""  # the model's tokenizer directory; "" = the engines' /tokenize
    gateway_layout: str = ""  # KV layout for keys when no engine has a sidecar (JSON or file)
    gateway_watch: bool = True  # the cost model reads the sidecars' event streams, not lookups
    gateway_load_poll_s: float = 0.25  # each engine's /metrics scraped this often
    gateway_models_poll_s: float = 5.0  # each engine's /v1/models read this often
    gateway_connect_timeout_s: float = 2.0  # connect (and poll) deadline to an engine
    gateway_first_byte_timeout_s: float = 600.0  # an engine silent this long has failed
    gateway_down_s: float = 5.0  # an engine that failed a request is skipped this long
    gateway_max_body_bytes: int = 32 << 20  # a larger request body is refused (413)
    gateway_prefix_max_waiting: float = 4.0  # prefix_aware: a host with more waiting is full
    gateway_move_margin_s: float = 0.2  # tierstore: a turn moves only to save more TTFT than this
    gateway_foreign_request_s: float = 1.0  # wait counted per request the gateway did not send
    gateway_sessions: int = 65536  # conversations remembered (LRU)

    def __post_init__(self) -> None:
        if not 0 < self.gateway_port < 65536:
            raise ConfigError(f"gateway_port must be in [1, 65535], got {self.gateway_port}")
        if self.gateway_policy not in GATEWAY_POLICIES:
            raise ConfigError(
                f"gateway_policy must be one of {', '.join(GATEWAY_POLICIES)}, "
                f"got {self.gateway_policy!r}"
            )
        positive(
            self,
            "gateway_load_poll_s",
            "gateway_models_poll_s",
            "gateway_connect_timeout_s",
            "gateway_first_byte_timeout_s",
            "gateway_max_body_bytes",
        )
        at_least(
            self,
            0,
            "gateway_down_s",
            "gateway_prefix_max_waiting",
            "gateway_foreign_request_s",
            "gateway_move_margin_s",
        )
        at_least(self, 1, "gateway_sessions")
