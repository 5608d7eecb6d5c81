"""``[peer]``: the peer tier (serving and fetching blocks between hosts,
kv_share replicas, streamed pushes), its group secret and TLS, and the
group's membership (a static list, or etcd).

Provides ``PeerConfig``, ``MembershipURL`` and ``parse_membership`` (the
``membership`` setting, ``etcd://host:port[,host:port]/prefix``). Read by
the sidecar, the router, the gateway and membership.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from tierstore.config.common import at_least, check_address, positive
from tierstore.errors import ConfigError

MAX_PUSHES_PER_TARGET = 8  # replicate_per_target: each in flight holds a replicator thread


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
    fetch_stall_s: float = 2.0  # a transfer on which nothing moves this long is cut (0: off)
    slow_pull_s: float = 1.0  # a pull taking longer is counted and logged with its breakdown
    replicate_timeout_s: float = 20.0  # deadline of one replica push (below client timeouts)
    compression: str = "auto"  # auto | none | zstd: transfers over byte-split zstd
    max_transfers: int = 8  # concurrent outgoing transfers served
    replicate_queue_max: int = 64  # replica pushes waiting; more are dropped and counted
    replicate_per_target: int = 1  # end_turn pushes in flight to one target (tierstore.peer.pushq)
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
        at_least(self, 0, "replica_bytes", "fetch_stall_s")
        if self.replicate_policy not in ("headroom", "kv_share"):
            raise ConfigError(
                f"replicate_policy must be headroom or kv_share, got {self.replicate_policy!r}"
            )
        if not 1 <= self.replicate_per_target <= MAX_PUSHES_PER_TARGET:
            raise ConfigError(
                f"replicate_per_target must be 1-{MAX_PUSHES_PER_TARGET} (each is a thread), "
                f"got {self.replicate_per_target}"
            )
        if not 0.0 < self.stream_link_share <= 1.0:
            raise ConfigError(f"stream_link_share must be in (0, 1], got {self.stream_link_share}")
        at_least(self, 0, "stream_max_bytes")
        at_least(
            self,
            1,
            "min_tokens",
            "max_transfers",
            "replicate_queue_max",
            "max_watchers",
            "peer_max_rpcs",
            "peer_rpc_threads",
        )
        positive(
            self,
            "peer_lookup_timeout_s",
            "fetch_timeout_s",
            "slow_pull_s",
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
            check_address(addr, "peers")
        if self.advertise:
            check_address(self.advertise, "advertise")

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
