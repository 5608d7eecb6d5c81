"""A client of one remote sidecar's peer service: lookups, the stream of tier
changes, opening a transfer on the data channel, replica pushes, the layouts
its engines registered.

Every call carries the group token and a deadline. Used by the sidecar's peer
tier and by the router (which needs no store: this module imports none).
The ways a transfer ends early (``TransferError``, ``TransferStalled``) and
the wait of each of its steps (``step_timeout_s``: the deadline, or the stall
limit where sooner) are here too, shared with the data channel.
Thread-safe: gRPC stubs are; ``background_transfers`` is a statistic.
"""

from __future__ import annotations

import socket
import ssl
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc

from tierstore.config.peer import PeerConfig
from tierstore.keys import BlockKey, KVLayout, pack_keys
from tierstore.load import RateMeter
from tierstore.v1 import peer_pb2, peer_pb2_grpc
from tierstore.wire import layout_from_proto, layout_to_proto

RECONNECT_OPTIONS = [  # a restarted peer is seen again within ~2 s (gRPC default: up to 120 s)
    ("grpc.initial_reconnect_backoff_ms", 100),
    # gRPC also takes this as the shortest time a connection attempt is given:
    # at 100 ms, a peer ~200 ms of round trip away could never be connected.
    ("grpc.min_reconnect_backoff_ms", 2000),
    ("grpc.max_reconnect_backoff_ms", 2000),
]
# A connection that stops answering (a partition, a host gone without a FIN)
# is closed after a ping goes unanswered, instead of waiting in TCP's
# retransmission backoff long after the link is back: once a 15 s partition
# healed, a call waited 9 s more on the old connection (bench/reliability/faults.py).
# The peer server accepts pings this often (``KEEPALIVE_SERVER_OPTIONS``).
KEEPALIVE_TIME_MS = 2000
KEEPALIVE_OPTIONS = [
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", 2000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
KEEPALIVE_SERVER_OPTIONS = [
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2),
    ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2),
]
MAX_MESSAGE_BYTES = 4 << 20


class TransferError(Exception):
    """A transfer ended early; the message says why (counted by the caller)."""


class TransferStalled(TransferError):
    """No byte moved (or no answer came) for the transfer's ``stall_s``,
    before its deadline: the peer or the link stalled."""


def step_timeout_s(deadline: float, stall_s: float) -> float:
    """How long one step of a transfer (a call, a socket read or write) may
    block: what is left of the ``deadline`` (``time.monotonic()``), or
    ``stall_s`` where that is shorter (> 0: the stall limit is on)."""
    remaining = max(deadline - time.monotonic(), 0.001)
    return min(remaining, stall_s) if stall_s > 0 else remaining


def rpc_text(e: BaseException) -> str:
    """A failed call's error in one line: its gRPC status and details, or the text."""
    if isinstance(e, grpc.RpcError) and hasattr(e, "code"):
        return f"{e.code().name}: {e.details()}"
    return str(e)


def client_ssl_context(cfg: PeerConfig) -> ssl.SSLContext | None:
    if not cfg.tls_ca_file:
        return None
    ctx = ssl.create_default_context(cafile=cfg.tls_ca_file)
    ctx.check_hostname = False  # peers are addressed by IP; the CA pins who they are
    if cfg.tls_cert_file:
        ctx.load_cert_chain(cfg.tls_cert_file, cfg.tls_key_file)
    return ctx


class PeerClient:
    """One remote sidecar's peer service."""

    def __init__(self, address: str, cfg: PeerConfig, token: str) -> None:
        self.address = address
        self.cfg = cfg
        self._metadata = (("authorization", f"Bearer {token}"),)
        options: list[tuple[str, int | str]] = [
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            *RECONNECT_OPTIONS,
            *KEEPALIVE_OPTIONS,
        ]
        if cfg.tls_ca_file:
            creds = grpc.ssl_channel_credentials(
                root_certificates=Path(cfg.tls_ca_file).read_bytes(),
                private_key=Path(cfg.tls_key_file).read_bytes() if cfg.tls_key_file else None,
                certificate_chain=(
                    Path(cfg.tls_cert_file).read_bytes() if cfg.tls_cert_file else None
                ),
            )
            options.append(("grpc.ssl_target_name_override", "tierstore"))
            self._channel = grpc.secure_channel(address, creds, options=options)
        else:
            self._channel = grpc.insecure_channel(address, options=options)
        self._stub = peer_pb2_grpc.PeerServiceStub(self._channel)
        self._ssl = client_ssl_context(cfg)
        self.link = RateMeter()  # fed by the peer tier with large raw transfers only
        # ... and every compressed one: uncompressed bytes delivered per second
        self.packed = RateMeter()
        self.background_transfers = 0  # replica imports from this peer (the peer tier's probes)

    def lookup_future(self, layout: KVLayout, keys: Sequence[BlockKey], timeout_s: float) -> Any:
        req = peer_pb2.PeerKeysRequest(layout=layout_to_proto(layout), keys=pack_keys(keys))
        return self._stub.Lookup.future(req, timeout=timeout_s, metadata=self._metadata)

    def layouts(self, timeout_s: float) -> list[KVLayout]:
        """The KV layouts registered with the sidecar (its ``PeerStat``)."""
        reply = self._stub.PeerStat(
            peer_pb2.PeerStatRequest(), timeout=timeout_s, metadata=self._metadata
        )
        return [layout_from_proto(m) for m in reply.layouts]

    def preposition_future(
        self, layout: KVLayout, keys: Sequence[BlockKey], timeout_s: float
    ) -> Any:
        """Ask the sidecar to prefetch the prefix into DRAM (a grpc future)."""
        req = peer_pb2.PeerKeysRequest(layout=layout_to_proto(layout), keys=pack_keys(keys))
        return self._stub.Preposition.future(req, timeout=timeout_s, metadata=self._metadata)

    def watch_blocks(self, epoch: int, from_seq: int, timeout_s: float | None = None) -> Any:
        """The sidecar's stream of tier changes (a grpc call: iterate, ``cancel``);
        with ``timeout_s`` it ends with DEADLINE_EXCEEDED after that long."""
        req = peer_pb2.WatchBlocksRequest(epoch=epoch, from_seq=from_seq)
        return self._stub.WatchBlocks(req, timeout=timeout_s, metadata=self._metadata)

    def open_fetch(
        self,
        layout: KVLayout,
        keys: Sequence[BlockKey],
        deadline: float,
        compress: bool,
        stall_s: float = 0.0,
    ) -> tuple[int, socket.socket | None]:
        """Open a transfer of the prefix of ``keys`` the peer holds: the number
        of blocks it will send and the data connection, ticket already sent
        (None when it holds none). The caller reads the frames and closes it.
        ``stall_s`` > 0: the OpenFetch answer and the connection each get at
        most that long (raises ``TransferStalled`` when that, not the
        deadline, ran out): a peer frozen after its lookup answered is cut
        then, not at the deadline."""
        req = peer_pb2.OpenFetchRequest(
            layout=layout_to_proto(layout),
            keys=pack_keys(keys),
            compression=peer_pb2.COMPRESSION_ZSTD_BYTESPLIT
            if compress
            else peer_pb2.COMPRESSION_NONE,
        )
        try:
            reply = self._stub.OpenFetch(
                req, timeout=step_timeout_s(deadline, stall_s), metadata=self._metadata
            )
        except grpc.RpcError as e:
            timed_out = hasattr(e, "code") and e.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            if timed_out and time.monotonic() < deadline:
                raise TransferStalled(f"stalled: OpenFetch unanswered for {stall_s:g} s") from e
            raise
        if reply.num_blocks == 0:
            return 0, None
        host, _, port = reply.data_address.rpartition(":")
        try:
            conn = socket.create_connection(
                (host, int(port)), timeout=step_timeout_s(deadline, stall_s)
            )
        except TimeoutError as e:
            if time.monotonic() < deadline:
                raise TransferStalled(f"stalled: no data connection in {stall_s:g} s") from e
            raise
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if reply.tls:
                if self._ssl is None:
                    raise OSError("the peer's data channel speaks TLS but no tls_ca_file is set")
                conn = self._ssl.wrap_socket(conn)
            conn.sendall(reply.ticket)
        except BaseException:
            conn.close()
            raise
        return min(reply.num_blocks, len(keys)), conn

    def replicate(
        self,
        layout: KVLayout,
        keys: Sequence[BlockKey],
        source: str,
        session: str,
        timeout_s: float,
    ) -> peer_pb2.ReplicateReply:
        req = peer_pb2.ReplicateRequest(
            layout=layout_to_proto(layout),
            keys=pack_keys(keys),
            source=source,
            session=session,
            deadline_s=timeout_s,
        )
        return self._stub.Replicate(req, timeout=timeout_s + 1.0, metadata=self._metadata)

    def close(self) -> None:
        self._channel.close()
