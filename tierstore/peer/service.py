"""The peer service (sidecar <-> sidecar, TCP): lookup, open a transfer,
replicate, stat, and the stream of tier changes for routers (WatchBlocks);
with token authentication and optional TLS/mTLS.

Runs in the sidecar on its own gRPC server (so the engine's Unix socket
never shares a port with the network). Every call must carry the group token
(``authorization: Bearer <token>``); others get UNAUTHENTICATED before any
handler runs. Sizes are bounded: keys per call, message size, transfers.
Without a TLS certificate the port speaks plaintext (loopback tests and
benchmarks need that); off loopback that sends the token in the clear, so
the sidecar says so once at start, and its stat shows ``peer_tls``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc

from tierstore import __version__
from tierstore.config.peer import PeerConfig
from tierstore.errors import TierstoreError
from tierstore.keys import KEY_BYTES, BlockKey, KVLayout, unpack_keys
from tierstore.membership.etcd import EtcdMembers, describe_host
from tierstore.peer.auth import TokenAuth, is_loopback, server_ssl_context
from tierstore.peer.client import KEEPALIVE_SERVER_OPTIONS
from tierstore.peer.data import DataServer
from tierstore.peer.tier import PeerTier
from tierstore.sidecar.loadboard import LoadBoard
from tierstore.store.tiered import TieredStore
from tierstore.tiers import TIER_CODES
from tierstore.v1 import common_pb2, peer_pb2, peer_pb2_grpc
from tierstore.wire import host_load_proto, layout_from_proto, layout_to_proto

log = logging.getLogger(__name__)

MAX_PEER_KEYS = 65536  # keys in one peer call (2 MiB of keys)
MAX_MESSAGE_BYTES = 4 << 20
WATCH_CHUNK_KEYS = 32768  # keys per snapshot message (1 MiB)
WIRE_TIERS = {tier: common_pb2.Tier.Name(code) for tier, code in TIER_CODES.items()}


class PeerServicer(peer_pb2_grpc.PeerServiceServicer):
    def __init__(
        self,
        store: TieredStore,
        tier: PeerTier,
        data: DataServer,
        cfg: PeerConfig,
        loads: LoadBoard,
    ) -> None:
        self.store = store
        self.tier = tier
        self.data = data
        self.cfg = cfg
        self.loads = loads
        self.stopping = threading.Event()
        self._watch_lock = threading.Lock()
        # Set by the local service: queue a best-effort prefetch of (layout, keys);
        # returns (queued, blocks available here when asked).
        self.preposition: Callable[[KVLayout, list[BlockKey]], tuple[bool, int]] | None = None

    def _parse(
        self, layout_msg: common_pb2.Layout, raw: bytes, context: Any
    ) -> tuple[KVLayout, list[BlockKey]]:
        try:
            layout = layout_from_proto(layout_msg)
        except TierstoreError as e:
            self.tier.counters.add("bad_requests")
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if len(raw) % KEY_BYTES or len(raw) // KEY_BYTES > MAX_PEER_KEYS:
            self.tier.counters.add("bad_requests")
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"keys must be a multiple of {KEY_BYTES} bytes and at most {MAX_PEER_KEYS} keys",
            )
        self.store.register_layout(layout)
        return layout, unpack_keys(raw)

    def Lookup(self, request: peer_pb2.PeerKeysRequest, context: Any) -> peer_pb2.PeerLookupReply:
        layout, keys = self._parse(request.layout, request.keys, context)
        res = self.store.lookup(layout, keys)
        return peer_pb2.PeerLookupReply(
            num_hits=res.num_hits,
            tiers=res.codes,
            load=host_load_proto(self.loads.host()),
            nvme_read_bytes_per_s=self.store.nvme_read_bytes_per_s(),
            peer_fetch_bytes_per_s=self.tier.fetch_bytes_per_s(),
        )

    def Preposition(
        self, request: peer_pb2.PeerKeysRequest, context: Any
    ) -> peer_pb2.PrepositionReply:
        """A router's hint: bring this prefix into DRAM before the request comes."""
        layout, keys = self._parse(request.layout, request.keys, context)
        queued, available = self.preposition(layout, keys) if self.preposition else (False, 0)
        self.tier.counters.add("prepositions" if queued else "prepositions_refused")
        return peer_pb2.PrepositionReply(queued=queued, available_blocks=available)

    def OpenFetch(
        self, request: peer_pb2.OpenFetchRequest, context: Any
    ) -> peer_pb2.OpenFetchReply:
        layout, keys = self._parse(request.layout, request.keys, context)
        compress = request.compression == peer_pb2.COMPRESSION_ZSTD_BYTESPLIT
        ticket, num = self.data.open(layout, keys, compress)
        return peer_pb2.OpenFetchReply(
            ticket=ticket,
            data_address=self.data_address,
            num_blocks=num,
            tls=self.data.ssl_context is not None,
        )

    @property
    def data_address(self) -> str:
        advertised_host = self.cfg.address().rpartition(":")[0]
        return f"{advertised_host}:{self.data.address.rpartition(':')[2]}"

    def Replicate(
        self, request: peer_pb2.ReplicateRequest, context: Any
    ) -> peer_pb2.ReplicateReply:
        layout, keys = self._parse(request.layout, request.keys, context)
        if not 0 < request.deadline_s <= self.cfg.replicate_timeout_s:
            self.tier.counters.add("bad_requests")
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"deadline_s must be in (0, {self.cfg.replicate_timeout_s}], "
                f"got {request.deadline_s}",
            )
        return self.tier.import_replica(layout, keys, request.source, request.deadline_s)

    def PeerStat(self, request: peer_pb2.PeerStatRequest, context: Any) -> peer_pb2.PeerStatReply:
        return peer_pb2.PeerStatReply(
            group=self.cfg.group,
            address=self.cfg.address(),
            replica_bytes=self.store.replica_bytes(),
            replica_budget_bytes=self.cfg.replica_bytes,
            layouts=[layout_to_proto(lo) for lo in self.store.layouts()],
        )

    def WatchBlocks(
        self, request: peer_pb2.WatchBlocksRequest, context: Any
    ) -> Iterator[peer_pb2.BlockEvents]:
        with self._watch_lock:
            if self.tier.counters.watchers >= self.cfg.max_watchers:
                self.tier.counters.add("watch_refused")
                context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"{self.tier.counters.watchers} WatchBlocks streams open; "
                    f"max_watchers is {self.cfg.max_watchers}",
                )
            self.tier.counters.add("watchers")
        try:
            yield from self._watch(request.epoch, request.from_seq, context)
        finally:
            self.tier.counters.add("watchers", -1)

    def _watch(self, epoch: int, seq: int, context: Any) -> Iterator[peer_pb2.BlockEvents]:
        log_ = self.store.events
        synced = epoch == log_.epoch and seq <= log_.seq
        while context.is_active() and not self.stopping.is_set():
            if not synced:
                self.tier.counters.add("watch_snapshots")
                yield peer_pb2.BlockEvents(epoch=log_.epoch, op=peer_pb2.BLOCK_OP_RESET)
                seq, held = self.store.snapshot()
                for tier, keys in held.items():
                    for i in range(0, len(keys), WATCH_CHUNK_KEYS):
                        yield peer_pb2.BlockEvents(
                            epoch=log_.epoch,
                            op=peer_pb2.BLOCK_OP_SNAPSHOT,
                            tier=WIRE_TIERS[tier],
                            keys=b"".join(keys[i : i + WATCH_CHUNK_KEYS]),
                        )
                yield self._marker(peer_pb2.BLOCK_OP_SYNCED, seq)
                synced = True
                continue
            batches = log_.after(seq, self.cfg.watch_heartbeat_s)
            if batches is None:  # this watcher fell behind the retained log
                synced = False
                continue
            if not batches:
                yield self._marker(peer_pb2.BLOCK_OP_HEARTBEAT, seq)
                continue
            for b in batches:
                yield peer_pb2.BlockEvents(
                    epoch=log_.epoch,
                    seq=b.seq,
                    op=peer_pb2.BLOCK_OP_ADD if b.added else peer_pb2.BLOCK_OP_REMOVE,
                    tier=WIRE_TIERS[b.tier],
                    keys=b.keys,
                )
            seq = batches[-1].seq

    def _marker(self, op: Any, seq: int) -> peer_pb2.BlockEvents:
        return peer_pb2.BlockEvents(
            epoch=self.store.events.epoch, seq=seq, op=op, load=host_load_proto(self.loads.host())
        )


class PeerServer:
    """The peer gRPC server, its data channel and the peer tier."""

    def __init__(self, store: TieredStore, cfg: PeerConfig, loads: LoadBoard) -> None:
        token = cfg.token()
        if not token:
            raise TierstoreError(
                "peer_port is set but no peer_token (or peer_token_file): the peer port "
                "never runs without authentication"
            )
        self.tls = bool(cfg.tls_cert_file)  # the gRPC port and the data channel alike
        self.data = DataServer(
            store, cfg.peer_host, cfg.max_transfers, cfg.fetch_timeout_s, server_ssl_context(cfg)
        )
        self.members: EtcdMembers | None = None
        if cfg.membership:
            self.members = _join_group(store, cfg, loads)
        self.tier = PeerTier(store, cfg, cfg.address(), self.members)
        self.servicer = PeerServicer(store, self.tier, self.data, cfg, loads)
        self.server = grpc.server(
            futures.ThreadPoolExecutor(cfg.peer_rpc_threads, thread_name_prefix="tierstore-peer"),
            interceptors=[TokenAuth(token)],
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                *KEEPALIVE_SERVER_OPTIONS,
            ],
            maximum_concurrent_rpcs=cfg.peer_max_rpcs,
        )
        peer_pb2_grpc.add_PeerServiceServicer_to_server(self.servicer, self.server)
        bind = f"{cfg.peer_host}:{cfg.peer_port}"
        if cfg.tls_cert_file:
            with open(cfg.tls_key_file, "rb") as k, open(cfg.tls_cert_file, "rb") as c:
                pair = [(k.read(), c.read())]
            root = Path(cfg.tls_ca_file).read_bytes() if cfg.tls_ca_file else None
            creds = grpc.ssl_server_credentials(
                pair, root_certificates=root, require_client_auth=root is not None
            )
            port = self.server.add_secure_port(bind, creds)
        else:
            port = self.server.add_insecure_port(bind)
        if port == 0:
            self.data.close()
            if self.members is not None:
                self.members.close()
            raise TierstoreError(f"cannot listen for peers on {bind} (in use?)")
        self.server.start()
        if self.members is not None:  # joins only now that the others can reach it
            self.members.start()
            self.members.wait_synced(cfg.membership_timeout_s)  # bounded: etcd may be down
            source = f"live from {cfg.membership}"
        else:
            source = "static"
        log.info("peer service on %s (group %s, %d peers, %s)", bind, cfg.group,
                 len(self.tier.clients), source)  # fmt: skip
        if not self.tls and not is_loopback(cfg.peer_host):
            log.warning(
                "peer port %s listens beyond loopback without TLS: the group token and "
                "every block cross the network in plaintext; set tls_cert_file and "
                "tls_key_file (and tls_ca_file for mTLS)",
                bind,
            )

    def leave(self) -> None:
        """Leave the group now (the etcd lease is revoked): the others stop
        choosing this host for pushes while it finishes in-flight calls."""
        if self.members is not None:
            self.members.close()

    def stop(self, grace_s: float) -> None:
        self.leave()
        self.servicer.stopping.set()  # watch streams end at their next heartbeat
        self.server.stop(grace_s).wait()
        self.tier.close()
        self.data.close()


def _join_group(store: TieredStore, cfg: PeerConfig, loads: LoadBoard) -> EtcdMembers:
    """Register this sidecar in etcd (address, tiers, capacity, load; no secret)."""

    def load() -> dict[str, int]:
        h = loads.host()
        return {"busy_slots": h.busy_slots, "slots": h.slots, "queue_len": h.queue_len}

    tiers = ("dram", "nvme") if store.nvme is not None else ("dram",)
    nvme_bytes = store.config.nvme_bytes if store.nvme is not None else 0
    describe = describe_host(
        cfg.address(), cfg.group, tiers, store.config.dram_bytes, nvme_bytes,
        cfg.replica_bytes, load, __version__, cfg.engine_url, cfg.engine_events,
    )  # fmt: skip
    return EtcdMembers(cfg, describe=describe, workers=store.workers)
