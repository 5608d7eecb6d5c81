"""``[router]``: the KV-aware router (``tierstore router`` / ``tierstore route``):
its candidate hosts, service, event streams and the cost model's speeds.

Provides ``RouterConfig``. Read by the router and the gateway.
"""

from __future__ import annotations

from dataclasses import dataclass

from tierstore.config.common import at_least, check_address, positive
from tierstore.errors import ConfigError


@dataclass(frozen=True)
class RouterConfig:
    """The KV-aware router (``tierstore router`` / ``tierstore route``) and its cost model."""

    router_hosts: tuple[str, ...] = ()  # peer host:port of every candidate host
    router_host: str = "127.0.0.1"  # address the router service listens on
    router_port: int = 7800  # TCP port of the router service
    router_lookup_timeout_s: float = 0.2  # deadline of the lookups of one request
    router_rpc_threads: int = 8  # threads serving the router service's calls
    router_watch: bool = False  # keep an index from the hosts' event streams
    router_stale_s: float = 6.0  # a host's stream silent this long: ask the host directly
    # vLLM's KV events (ZMQ publisher) of each host's engine: HOST=tcp://engine:port
    router_vllm_events: tuple[str, ...] = ()
    router_vllm_layout: str = ""  # the engines' KV layout (JSON, or a file holding it)
    prefill_tokens_per_s: float = 8000.0  # engine prefill speed, unless a host reports one
    dram_load_bytes_per_s: float = 10e9  # host memory -> device
    nvme_load_bytes_per_s: float = 2e9  # NVMe read + verify, unless a host measured it
    peer_load_bytes_per_s: float = 1.25e9  # fetch from another host, unless measured
    turn_s: float = 10.0  # mean time a request holds a slot (queue wait estimate)
    spill_tie_s: float = 5.0  # queue waits this close count as equal for the spill host

    def __post_init__(self) -> None:
        if not 0 < self.router_port < 65536:
            raise ConfigError(f"router_port must be in [1, 65535], got {self.router_port}")
        at_least(self, 1, "router_rpc_threads")
        positive(
            self,
            "router_lookup_timeout_s",
            "router_stale_s",
            "prefill_tokens_per_s",
            "dram_load_bytes_per_s",
            "nvme_load_bytes_per_s",
            "peer_load_bytes_per_s",
            "turn_s",
        )
        at_least(self, 0, "spill_tie_s")
        for addr in self.router_hosts:
            check_address(addr, "router_hosts")
        if self.router_vllm_events and not self.router_vllm_layout:
            raise ConfigError(
                "router_vllm_events needs router_vllm_layout: vLLM's block hashes are "
                "not tierstore keys, the router chains them with the engines' layout"
            )
