"""Configuration: frozen dataclasses with units in every name, and a loader
that layers embedded defaults < TOML file < ``TIERSTORE_*`` environment
variables < explicit overrides (CLI flags).

TOML may be flat or grouped in tables (``[store]``, ``[server]``, ...); the
table names are only for reading: every field name is unique across the
sections. Sizes accept integers or strings such as ``"8GiB"`` or ``"512MB"``;
durations accept numbers of seconds.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from tierstore.errors import ConfigError
from tierstore.policies.write import WRITE_POLICIES

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

ENV_PREFIX = "TIERSTORE_"


def _at_least(cfg: object, bound: int, *names: str) -> None:
    """ConfigError naming the first of ``names`` whose value is not >= ``bound``
    (NaN included)."""
    for name in names:
        value = getattr(cfg, name)
        if not value >= bound:
            raise ConfigError(f"{name} must be >= {bound}, got {value}")


def _positive(cfg: object, *names: str) -> None:
    """ConfigError naming the first of ``names`` whose value is not > 0 (NaN included)."""
    for name in names:
        value = getattr(cfg, name)
        if not value > 0:
            raise ConfigError(f"{name} must be > 0, got {value}")


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tierstore"


def default_runtime_dir() -> Path:
    base = os.environ.get("XDG_RUNTIME_DIR")
    if base and os.path.isdir(base):
        return Path(base) / "tierstore"
    return default_cache_dir() / "run"


@dataclass(frozen=True)
class StoreConfig:
    """The tiered store (DRAM arena over NVMe)."""

    dram_bytes: int = 1 << 30  # size of the shared-memory arena
    dram_segment_bytes: int = 16 << 20  # arena unit handed to one block size
    dram_high_watermark: float = 0.90  # share of the arena used that wakes the demoter
    dram_low_watermark: float = 0.75  # the demoter spills until usage is below this share
    shm_dir: str = "/dev/shm"  # tmpfs directory holding the arena file
    nvme_dir: str = field(default_factory=lambda: str(default_cache_dir() / "nvme"))
    nvme_bytes: int = 16 << 30  # budget of the NVMe tier; 0 disables the tier
    nvme_segment_bytes: int = 64 << 20  # block-file unit handed to one block size
    nvme_direct_io: bool = True  # O_DIRECT when the filesystem allows it
    eviction_policy: str = "lru"  # lru | s3fifo, for DRAM and NVMe
    nvme_admission: str = "always"  # always | seen_twice: which evicted blocks are spilled
    demote_batch_blocks: int = 32  # blocks spilled per NVMe write batch (one fsync)
    promote_wait_s: float = 10.0  # longest wait for another thread's promotion of a block
    demoter_poll_s: float = 1.0  # the demoter re-checks DRAM usage at least this often
    nvme_read_depth: int = 4  # NVMe reads in flight while one request promotes blocks
    event_log_keys: int = 1 << 18  # tier changes kept for routers' WatchBlocks streams (keys)
    write_policy: str = "write_back"  # write_back | write_through | write_through_selective
    write_queue_bytes: int = 256 << 20  # bound of the write-through queue (what a crash may lose)
    write_through_min_tokens: int = 8192  # write_through_selective: turns this long are written
    nvme_index_reserve_bytes: int = 0  # disk kept free for the LMDB index; 0: derived
    nvme_full_backoff_s: float = 5.0  # after ENOSPC, re-check the disk this often (doubling)
    dram_populate: str = "background"  # background (serve at once) | upfront (populate first)
    dram_ready_bytes: int = 256 << 20  # background: arena bytes made ready before serving
    dram_huge_pages: bool = True  # ask for transparent huge pages on the arena (madvise)
    hash_queue_blocks: int = 1 << 16  # committed blocks waiting for their digest; 0: hash on use
    replica_live_s: float = 300.0  # replicas pushed this recently keep their LRU place in DRAM

    def __post_init__(self) -> None:
        if self.dram_bytes <= 0:
            raise ConfigError(f"dram_bytes must be positive, got {self.dram_bytes}")
        _at_least(self, 0, "nvme_bytes")
        _at_least(self, 0, "dram_ready_bytes")
        if not 0.0 < self.dram_low_watermark < self.dram_high_watermark <= 1.0:
            raise ConfigError(
                "watermarks must satisfy 0 < dram_low_watermark < dram_high_watermark <= 1, "
                f"got low={self.dram_low_watermark} high={self.dram_high_watermark}"
            )
        _at_least(self, 1, "demote_batch_blocks")
        _at_least(self, 1, "nvme_read_depth")
        _positive(self, "promote_wait_s")
        _positive(self, "demoter_poll_s")
        _at_least(self, 1, "event_log_keys")
        if self.write_policy not in WRITE_POLICIES:
            raise ConfigError(
                f"write_policy must be one of {', '.join(WRITE_POLICIES)}, "
                f"got {self.write_policy!r}"
            )
        _at_least(self, 1, "write_queue_bytes")
        _at_least(self, 1, "write_through_min_tokens")
        _at_least(self, 0, "nvme_index_reserve_bytes")
        _positive(self, "nvme_full_backoff_s")
        if self.dram_populate not in ("background", "upfront"):
            raise ConfigError(
                f"dram_populate must be background or upfront, got {self.dram_populate!r}"
            )
        _at_least(self, 0, "replica_live_s")
        _at_least(self, 0, "hash_queue_blocks")


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
        _at_least(
            self,
            1,
            "max_clients",
            "rpc_threads",
            "max_batch_keys",
            "prefetch_threads",
            "prefetch_queue_max",
        )
        _at_least(self, 0, "shutdown_drain_s")
        _positive(self, "keepalive_s", "prefetch_max_wait_s", "shutdown_grace_s", "load_ttl_s")
        if len(self.socket_path.encode()) > 100:
            raise ConfigError(
                f"socket_path is {len(self.socket_path.encode())} bytes; Unix sockets allow "
                f"about 100: {self.socket_path}"
            )


@dataclass(frozen=True)
class PeerConfig:
    """The peer tier: serving and fetching blocks between hosts, kv_share."""

    peer_host: str = "127.0.0.1"  # address the peer service listens on
    peer_port: int = 0  # TCP port of the peer service; 0 disables peers
    advertise: str = ""  # host:port other sidecars use for this one (default peer_host:peer_port)
    peers: tuple[str, ...] = ()  # host:port of every other sidecar of the group
    group: str = "default"  # name of the group (sidecars that share blocks)
    peer_token: str = ""  # shared secret of the group; required when peer_port is set
    peer_token_file: str = ""  # or read the secret from this file
    tls_cert_file: str = ""  # PEM certificate: TLS on the peer port and data channel
    tls_key_file: str = ""  # PEM key of tls_cert_file
    tls_ca_file: str = ""  # PEM CA: verify peers (and, serving, require client certs: mTLS)
    min_tokens: int = 8192  # turns this long are always replicated (the floor under pressure)
    replicate_policy: str = "headroom"  # headroom | kv_share (only turns of min_tokens)
    replicate_headroom_s: float = 10.0  # headroom: short turns whose push lands within this
    link_bytes_per_s: float = 125e6  # link rate assumed to a peer before one is measured
    stream_replicas: bool = True  # push a session's blocks to its spill host as they are committed
    stream_link_share: float = 0.5  # share of the link the streamed pushes may use
    stream_max_bytes: int = 256 << 20  # streamed bytes queued or in flight; more wait for end_turn
    replica_bytes: int = 4 << 30  # space given to other hosts' replicas (alias: max_gib, in GiB)
    peer_lookup_timeout_s: float = 0.5  # deadline of a lookup across the group
    fetch_timeout_s: float = 30.0  # deadline of one transfer
    replicate_timeout_s: float = 20.0  # deadline of one replica push (below client timeouts)
    compression: str = "auto"  # auto | none | zstd: transfers over byte-split zstd
    max_transfers: int = 8  # concurrent outgoing transfers served
    replicate_queue_max: int = 64  # replica pushes waiting; more are dropped and counted
    max_watchers: int = 4  # routers' WatchBlocks streams at once (one server thread each)
    peer_max_rpcs: int = 64  # peer gRPC calls admitted at once; more get RESOURCE_EXHAUSTED
    peer_rpc_threads: int = 16  # threads serving the peer port's calls
    watch_heartbeat_s: float = 2.0  # a WatchBlocks stream sends the load at least this often
    membership: str = ""  # etcd://host:port[,host:port]/prefix: live group from etcd; "": peers
    membership_ttl_s: float = 10.0  # etcd lease: a dead member leaves within this (whole s, >= 2)
    membership_timeout_s: float = 2.0  # deadline of one etcd call
    membership_refresh_s: float = 5.0  # a member's changed load summary is rewritten this often
    membership_credentials_file: str = ""  # "user:password" of an etcd user (etcd auth on)
    membership_tls_ca_file: str = ""  # PEM CA of etcd's client port: TLS to etcd (or etcds://)
    membership_tls_cert_file: str = ""  # PEM client certificate for etcd (mTLS)
    membership_tls_key_file: str = ""  # PEM key of membership_tls_cert_file
    engine_url: str = ""  # this host's engine (OpenAI server), published for gateways
    engine_events: str = ""  # its vLLM KV-event publisher (tcp://host:port), for gateways

    def __post_init__(self) -> None:
        if not 0 <= self.peer_port < 65536:
            raise ConfigError(f"peer_port must be in [0, 65535], got {self.peer_port}")
        if self.compression not in ("auto", "none", "zstd"):
            raise ConfigError(f"compression must be auto, none or zstd, got {self.compression!r}")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ConfigError("tls_cert_file and tls_key_file must be set together")
        if self.engine_url and not self.engine_url.startswith(("http://", "https://")):
            raise ConfigError(f"engine_url must be http(s)://host:port, got {self.engine_url!r}")
        if self.engine_events and "://" not in self.engine_events:
            raise ConfigError(
                f"engine_events must be tcp://host:port (ZMQ), got {self.engine_events!r}"
            )
        _at_least(self, 0, "replica_bytes")
        if self.replicate_policy not in ("headroom", "kv_share"):
            raise ConfigError(
                f"replicate_policy must be headroom or kv_share, got {self.replicate_policy!r}"
            )
        if not 0.0 < self.stream_link_share <= 1.0:
            raise ConfigError(f"stream_link_share must be in (0, 1], got {self.stream_link_share}")
        _at_least(self, 0, "stream_max_bytes")
        _at_least(
            self,
            1,
            "min_tokens",
            "max_transfers",
            "replicate_queue_max",
            "max_watchers",
            "peer_max_rpcs",
            "peer_rpc_threads",
        )
        _positive(
            self,
            "peer_lookup_timeout_s",
            "fetch_timeout_s",
            "replicate_timeout_s",
            "watch_heartbeat_s",
            "membership_timeout_s",
            "membership_refresh_s",
            "replicate_headroom_s",
            "link_bytes_per_s",
        )
        if self.membership_ttl_s < 2 or self.membership_ttl_s != int(self.membership_ttl_s):
            raise ConfigError(
                f"membership_ttl_s must be a whole number of seconds >= 2 (etcd leases), "
                f"got {self.membership_ttl_s}"
            )
        if self.membership_timeout_s >= self.membership_ttl_s / 2:
            raise ConfigError(
                f"membership_timeout_s ({self.membership_timeout_s}) must be under half of "
                f"membership_ttl_s ({self.membership_ttl_s}): a renewal that hangs that long "
                "would let the lease expire"
            )
        if bool(self.membership_tls_cert_file) != bool(self.membership_tls_key_file):
            raise ConfigError(
                "membership_tls_cert_file and membership_tls_key_file must be set together"
            )
        if self.membership:
            parse_membership(self.membership)
            if not self.group or "/" in self.group:
                raise ConfigError(f"group must be a non-empty name without '/', got {self.group!r}")
            if self.peers:
                raise ConfigError(
                    "set membership or peers, not both: with membership the group is whoever "
                    "holds a live lease in etcd"
                )
        for addr in self.peers:
            _check_address(addr, "peers")
        if self.advertise:
            _check_address(self.advertise, "advertise")

    def token(self) -> str:
        """The group secret, from peer_token or peer_token_file."""
        if self.peer_token:
            return self.peer_token
        if self.peer_token_file:
            try:
                return Path(self.peer_token_file).read_text().strip()
            except OSError as e:
                raise ConfigError(f"cannot read peer_token_file {self.peer_token_file}: {e}") from e
        return ""

    def address(self) -> str:
        return self.advertise or f"{self.peer_host}:{self.peer_port}"

    def membership_url(self) -> MembershipURL | None:
        """The parsed ``membership`` (None: the static ``peers`` list)."""
        return parse_membership(self.membership) if self.membership else None


def _check_address(addr: str, name: str) -> None:
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{name}: {addr!r} is not host:port")


@dataclass(frozen=True)
class MembershipURL:
    scheme: str  # etcd | etcds (TLS)
    endpoints: tuple[str, ...]  # host:port
    prefix: str  # key prefix, no trailing slash: "/tierstore"

    def group_prefix(self, group: str) -> bytes:
        """Every member record of ``group`` is under this key prefix."""
        return f"{self.prefix}/groups/{group}/members/".encode()

    def member_key(self, group: str, address: str) -> bytes:
        return self.group_prefix(group) + address.encode()


def parse_membership(url: str) -> MembershipURL:
    """``etcd://h1:2379,h2:2379/prefix`` -> MembershipURL; ConfigError says what is wrong."""
    parts = urlsplit(url)
    if parts.scheme not in ("etcd", "etcds"):
        raise ConfigError(
            f"membership: {url!r}: expected etcd://host:port[,host:port]/prefix (or etcds://)"
        )
    if parts.query or parts.fragment or "@" in parts.netloc:
        raise ConfigError(
            f"membership: {url!r}: no user, query or fragment in the URL (credentials go in "
            "membership_credentials_file)"
        )
    endpoints = tuple(e.strip() for e in parts.netloc.split(",") if e.strip())
    if not endpoints:
        raise ConfigError(f"membership: {url!r} names no etcd endpoint")
    for e in endpoints:
        host, sep, port = e.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"membership: endpoint {e!r} is not host:port")
    prefix = "/" + parts.path.strip("/") if parts.path.strip("/") else "/tierstore"
    return MembershipURL(parts.scheme, endpoints, prefix)


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
        _at_least(self, 1, "router_rpc_threads")
        _positive(
            self,
            "router_lookup_timeout_s",
            "router_stale_s",
            "prefill_tokens_per_s",
            "dram_load_bytes_per_s",
            "nvme_load_bytes_per_s",
            "peer_load_bytes_per_s",
            "turn_s",
        )
        _at_least(self, 0, "spill_tie_s")
        for addr in self.router_hosts:
            _check_address(addr, "router_hosts")
        if self.router_vllm_events and not self.router_vllm_layout:
            raise ConfigError(
                "router_vllm_events needs router_vllm_layout: vLLM's block hashes are "
                "not tierstore keys, the router chains them with the engines' layout"
            )


@dataclass(frozen=True)
class RemoteConfig:
    """The remote persistent tier: an S3-compatible bucket below NVMe."""

    remote_url: str = ""  # s3://bucket/prefix; empty disables the tier
    remote_endpoint: str = ""  # https://host:port of a non-AWS store (or AWS_ENDPOINT_URL)
    remote_region: str = ""  # region (or AWS_REGION); SeaweedFS/MinIO accept any
    remote_credentials_file: str = ""  # AWS shared-credentials file; else AWS_* variables
    remote_credentials_profile: str = "default"  # section of remote_credentials_file
    remote_bytes: int = 0  # budget; over it the oldest objects are deleted; 0: no GC here
    remote_gc_interval_s: float = 60.0  # how often one host checks the budget
    remote_gc_low_watermark: float = 0.9  # GC deletes down to this share of remote_bytes
    remote_gc_max_objects: int = 1_000_000  # objects listed per GC pass at most
    remote_gc_list_timeout_s: float = 60.0  # deadline of one GC pass's listing of the prefix
    remote_placement: str = "both"  # write_back | write_through | both (see operations.md)
    remote_min_tokens: int = 8192  # turns this long are written through at EndTurn
    remote_upload_queue_bytes: int = 256 << 20  # upload copies waiting or in flight
    remote_upload_concurrency: int = 8  # uploads in flight
    remote_write_through_queue_turns: int = 64  # finished turns waiting to be written through
    remote_read_depth: int = 8  # GETs in flight while one request pulls blocks
    remote_lookup_concurrency: int = 64  # HEADs in flight in one lookup wave
    remote_lookup_window_blocks: int = 64  # blocks probed past the last manifest per wave
    remote_manifest_every_blocks: int = 64  # a write-through chain's manifest spacing
    remote_lookup_timeout_s: float = 1.0  # deadline of a remote prefix lookup
    remote_fetch_timeout_s: float = 30.0  # deadline of pulling a prefix into DRAM
    remote_durable_timeout_s: float = 30.0  # a durable EndTurn waits this long for the bucket
    remote_request_timeout_s: float = 10.0  # one request, its retries included
    remote_connect_timeout_s: float = 2.0  # TCP/TLS connect of one request
    remote_max_retries: int = 3  # retries of one request (5xx, SlowDown, dropped connections)
    remote_retry_backoff_s: float = 0.05  # first retry's backoff; doubles, with jitter
    remote_cache_keys: int = 1 << 16  # remembered answers (present / absent) of lookups
    remote_cache_ttl_s: float = 30.0  # a remembered answer is trusted this long
    remote_upload_give_up_s: float = 300.0  # a failing upload is retried this long
    remote_upload_backoff_s: float = 0.25  # a failed upload's first wait; doubles
    remote_upload_backoff_max_s: float = 5.0  # ... up to this
    remote_flush_on_close_s: float = 10.0  # close waits this long for queued uploads

    def __post_init__(self) -> None:
        if self.remote_url:
            from urllib.parse import urlparse

            if urlparse(self.remote_url).scheme != "s3":
                raise ConfigError(
                    f"remote_url must look like s3://bucket/prefix, got {self.remote_url!r}"
                )
        if self.remote_placement not in ("write_back", "write_through", "both"):
            raise ConfigError(
                "remote_placement must be write_back, write_through or both, "
                f"got {self.remote_placement!r}"
            )
        _at_least(self, 0, "remote_bytes")
        if not 0.0 < self.remote_gc_low_watermark <= 1.0:
            raise ConfigError(
                f"remote_gc_low_watermark must be in (0, 1], got {self.remote_gc_low_watermark}"
            )
        _at_least(
            self,
            1,
            "remote_gc_max_objects",
            "remote_min_tokens",
            "remote_upload_queue_bytes",
            "remote_upload_concurrency",
            "remote_write_through_queue_turns",
            "remote_read_depth",
            "remote_lookup_concurrency",
            "remote_lookup_window_blocks",
            "remote_manifest_every_blocks",
            "remote_cache_keys",
        )
        _at_least(self, 0, "remote_max_retries")
        _positive(
            self,
            "remote_gc_interval_s",
            "remote_lookup_timeout_s",
            "remote_fetch_timeout_s",
            "remote_durable_timeout_s",
            "remote_request_timeout_s",
            "remote_connect_timeout_s",
            "remote_retry_backoff_s",
            "remote_cache_ttl_s",
            "remote_upload_give_up_s",
            "remote_gc_list_timeout_s",
            "remote_upload_backoff_s",
        )
        _at_least(self, 0, "remote_flush_on_close_s")
        if self.remote_upload_backoff_max_s < self.remote_upload_backoff_s:
            raise ConfigError(
                f"remote_upload_backoff_max_s ({self.remote_upload_backoff_max_s}) must be at "
                f"least remote_upload_backoff_s ({self.remote_upload_backoff_s})"
            )


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
        _positive(
            self,
            "gateway_load_poll_s",
            "gateway_models_poll_s",
            "gateway_connect_timeout_s",
            "gateway_first_byte_timeout_s",
            "gateway_max_body_bytes",
        )
        _at_least(
            self, 0, "gateway_down_s", "gateway_prefix_max_waiting", "gateway_foreign_request_s"
        )
        _at_least(self, 1, "gateway_sessions")


SECTIONS: dict[str, type] = {
    "store": StoreConfig,
    "server": ServerConfig,
    "peer": PeerConfig,
    "router": RouterConfig,
    "remote": RemoteConfig,
    "gateway": GatewayConfig,
}


@dataclass(frozen=True)
class Config:
    store: StoreConfig = field(default_factory=StoreConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    peer: PeerConfig = field(default_factory=PeerConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    remote: RemoteConfig = field(default_factory=RemoteConfig)
    gateway: GatewayConfig = field(default_factory=GatewayConfig)


_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: Any, name: str = "size") -> int:
    """``1073741824``, ``"1GiB"``, ``"1.5 GB"`` -> bytes."""
    if isinstance(value, bool):
        raise ConfigError(f"{name}: expected a size, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        if m and m.group(2).lower() in _SIZE_UNITS:
            return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])
    raise ConfigError(f"{name}: cannot read {value!r} as a size (e.g. 4096, '512MiB', '8GB')")


def _coerce(name: str, annotation: str, value: Any) -> Any:
    try:
        if name.endswith("_bytes"):
            return parse_bytes(value, name)
        if annotation == "bool":
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on"):
                return True
            if isinstance(value, str) and value.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        if annotation == "int":
            if isinstance(value, bool):
                raise ValueError(value)
            return int(value)
        if annotation == "float":
            return float(value)
        if annotation.startswith("tuple"):
            if isinstance(value, str):
                return tuple(v.strip() for v in value.split(",") if v.strip())
            return tuple(value)
        if annotation == "str":
            if not isinstance(value, str | int | float) or isinstance(value, bool):
                raise ValueError(value)
            return str(value)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{name}: cannot read {value!r} as {annotation}") from e
    return value


def _gib_to_bytes(name: str, value: Any) -> int:
    """``max_gib = 1.5`` -> 1.5 GiB in bytes."""
    try:
        if isinstance(value, bool):
            raise ValueError(value)
        gib = float(value)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{name}: cannot read {value!r} as GiB (a number, e.g. 4 or 0.5)") from e
    if not 0 <= gib < 2**33:  # also refuses nan and inf
        raise ConfigError(f"{name} must be a number of GiB >= 0, got {value!r}")
    return int(gib * 2**30)


# Other names of settings, as the design names them: alias -> (setting, the
# alias's value in the setting's unit). kv_share's replica budget is
# ``max_gib`` in the design and ``replica_bytes`` here (units in names).
ALIASES: dict[str, tuple[str, Callable[[str, Any], Any]]] = {
    "max_gib": ("replica_bytes", _gib_to_bytes),
}


def _field_index() -> dict[str, tuple[str, str]]:
    index: dict[str, tuple[str, str]] = {}
    for section, cls in SECTIONS.items():
        for f in fields(cls):
            index[f.name] = (section, str(f.type))
    return index


def load_config(
    path: str | Path | None = None,
    env: dict[str, str] | None = None,
    overrides: dict[str, Any] | None = None,
) -> Config:
    """Build the effective Config. Unknown keys are errors, not ignored.
    Without ``path``, the file named by TIERSTORE_CONFIG is read, if set."""
    environ = os.environ if env is None else env
    if path is None and environ.get(ENV_PREFIX + "CONFIG"):
        path = environ[ENV_PREFIX + "CONFIG"]
    index = _field_index()
    values: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
    given: dict[str, str] = {}  # setting -> the name that set it, in the layer being read

    def put(name: str, value: Any, origin: str) -> None:
        if name in ALIASES:
            target, convert = ALIASES[name]
            value = convert(name, value)
        else:
            target = name
        if target not in index:
            known = sorted([*index, *ALIASES])
            raise ConfigError(f"{origin}: unknown setting {name!r}; known: {known}")
        if given.setdefault(target, name) != name:
            raise ConfigError(f"{origin}: {given[target]} and {name} both set {target}; keep one")
        section, annotation = index[target]
        values[section][target] = _coerce(target, annotation, value)

    if path is not None:
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except OSError as e:
            raise ConfigError(f"cannot read config file {path}: {e}") from e
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {path} is not valid TOML: {e}") from e
        for key, value in data.items():
            if isinstance(value, dict):
                if key not in SECTIONS:
                    raise ConfigError(f"{path}: unknown table [{key}]; known: {sorted(SECTIONS)}")
                for name, inner in value.items():
                    put(name, inner, f"{path} [{key}]")
            else:
                put(key, value, str(path))
    given.clear()  # a later layer overrides an earlier one under either name
    for var, value in environ.items():
        if var.startswith(ENV_PREFIX) and var != ENV_PREFIX + "CONFIG":
            put(var[len(ENV_PREFIX) :].lower(), value, f"environment variable {var}")
    given.clear()
    for name, value in (overrides or {}).items():
        if value is not None:
            put(name, value, "command line")
    return Config(**{s: SECTIONS[s](**values[s]) for s in SECTIONS})


def config_to_dict(config: Config) -> dict[str, dict[str, Any]]:
    return {s: dataclasses.asdict(getattr(config, s)) for s in SECTIONS}
