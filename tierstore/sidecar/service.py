"""The local service (engine <-> sidecar): ``LocalServicer``.

Provides the handlers of ``LocalService`` (attach, layouts, two-phase
writes, lookup, acquire/release, prefetch, end of turn, load reports, stat)
over one TieredStore, with per-client cleanup: a client whose Attach stream
ends, by exit or crash, has its reservations and pins released. The attached
clients are ``tierstore.sidecar.clients``'s table; Stat's reply is built by
``tierstore.sidecar.stat``. The process around it is ``tierstore.sidecar``.

Threads: gRPC's pool runs the handlers (one long-lived thread per attached
client for its Attach stream, plus ``rpc_threads`` for unary calls); the
store's demoter and the prefetch workers run beside them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import grpc

from tierstore import __version__
from tierstore.config import Config
from tierstore.counters import Counters
from tierstore.errors import TierstoreError
from tierstore.keys import KEY_BYTES, BlockKey, KVLayout, unpack_keys
from tierstore.sidecar.clients import ENGINE_TIERS, AttachedClients, ClientSession
from tierstore.sidecar.fastpath import FastLookupServer
from tierstore.sidecar.loadboard import EngineLoad, LoadBoard
from tierstore.sidecar.prefetch import (
    BestEffort,
    Outcome,
    Prefetcher,
    PrefetchPolicy,
    Timeout,
    WaitAll,
)
from tierstore.sidecar.stat import stat_reply
from tierstore.store.tiered import STORE_OWNER, TieredStore
from tierstore.tiers import TIER_CODES, TierName
from tierstore.v1 import common_pb2, local_pb2, local_pb2_grpc
from tierstore.wire import host_load_proto, layout_from_proto

if TYPE_CHECKING:
    from tierstore.peer.service import PeerServer
    from tierstore.peer.tier import PeerTier

log = logging.getLogger(__name__)

SERVICE_NAME = "tierstore.v1.LocalService"
SERVICE_COUNTERS = (
    "bad_requests",
    "clients_attached",
    "clients_detached",
    "clients_refused",
    "leaked_reservations_released",
    "leaked_pins_released",
)
MAX_MESSAGE_BYTES = 4 << 20
# A durable EndTurn answers this long before the client's deadline, so its
# "not durable yet" reply arrives instead of a DEADLINE_EXCEEDED.
DURABLE_REPLY_MARGIN_S = 0.25
_DRAM, _PEER, _REMOTE = (TIER_CODES[t] for t in (TierName.DRAM, TierName.PEER, TierName.REMOTE))


class BadRequest(Exception):
    """A request the servicer refuses; carries the gRPC status to answer with."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def _handler(method: Any) -> Any:
    """Turn BadRequest and tierstore's input errors into gRPC statuses."""

    def wrapped(self: LocalServicer, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return method(self, request, context)
        except BadRequest as e:
            self.count("bad_requests")
            context.abort(e.code, str(e))
        except (TierstoreError, ValueError) as e:
            self.count("bad_requests")
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    wrapped.__name__ = method.__name__
    wrapped.__doc__ = method.__doc__
    return wrapped


class LocalServicer(local_pb2_grpc.LocalServiceServicer):
    """The engine-facing service. Thread-safe: every handler may run at once."""

    def __init__(
        self,
        store: TieredStore,
        config: Config,
        stopping: threading.Event,
        peer_server: PeerServer | None = None,
        loads: LoadBoard | None = None,
    ) -> None:
        self.store = store
        self.loads = loads if loads is not None else LoadBoard(config.server.load_ttl_s)
        self.peer_server = peer_server
        self.peers: PeerTier | None = peer_server.tier if peer_server is not None else None
        self.fast_lookup: FastLookupServer | None = None  # set by the Sidecar
        self.cfg = config.server
        self.config = config
        self.prefetcher = Prefetcher(
            store, self.cfg.prefetch_threads, self.cfg.prefetch_queue_max, store.workers,
            pull_peers=self.peers.pull if self.peers is not None else None,
            peer_fetch_timeout_s=config.peer.fetch_timeout_s,
        )  # fmt: skip
        if peer_server is not None:  # routers' pre-positioning hints run as prefetches
            peer_server.servicer.preposition = self._preposition
        self._stopping = stopping
        self._clients = AttachedClients(self.cfg.max_clients)
        self.counters = Counters(SERVICE_COUNTERS)
        self.started_at = time.time()

    def count(self, name: str, n: int = 1) -> None:
        self.counters.add(name, n)

    # -- sessions -----------------------------------------------------------------

    def Attach(
        self, request: local_pb2.AttachRequest, context: grpc.ServicerContext
    ) -> Iterator[local_pb2.AttachEvent]:
        client_id = self._clients.attach(request.client_name[:128], request.pid)
        if client_id is None:
            self.counters.add("clients_refused")
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{len(self._clients)} clients attached; max_clients is {self.cfg.max_clients}",
            )
            return
        self.counters.add("clients_attached")
        done = threading.Event()
        try:
            # False: the call already ended (cancelled at once), and the
            # callback will never run: detach below instead.
            if not context.add_callback(lambda: self._detach(client_id, done)):
                return
            yield local_pb2.AttachEvent(
                client_id=client_id,
                arena_path=str(self.store.arena.path),
                arena_bytes=self.store.arena.size_bytes,
                server_version=__version__,
                max_batch_keys=self.cfg.max_batch_keys,
            )
            while not done.wait(self.cfg.keepalive_s) and not self._stopping.is_set():
                if not context.is_active():
                    return
                yield local_pb2.AttachEvent()
        finally:
            self._detach(client_id, done)

    def _detach(self, client_id: int, done: threading.Event) -> None:
        done.set()
        if not self._clients.detach(client_id):
            return
        self.counters.add("clients_detached")
        self.loads.forget(client_id)
        aborted, pins = self.store.release_owner(client_id)
        self.count("leaked_reservations_released", aborted)
        self.count("leaked_pins_released", pins)

    def _release_if_detached(self, owner: int) -> None:
        """A client that detached while this call ran: free what the call made
        for it (detach removes the id before it releases, so between that
        release and this check nothing of the call's is missed)."""
        if owner in self._clients:
            return
        aborted, pins = self.store.release_owner(owner)
        self.count("leaked_reservations_released", aborted)
        self.count("leaked_pins_released", pins)
        raise BadRequest(grpc.StatusCode.FAILED_PRECONDITION, f"client {owner} detached")

    def clients(self) -> list[ClientSession]:
        return self._clients.sessions()

    # -- request checks -------------------------------------------------------------

    def _owner(self, client_id: int) -> int:
        if client_id not in self._clients:
            raise BadRequest(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"client id {client_id} is not attached; call Attach first",
            )
        return client_id

    def _layout(self, layout_id: bytes) -> KVLayout:
        if len(layout_id) != 32:
            raise BadRequest(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"layout_id must be 32 bytes, got {len(layout_id)}",
            )
        try:
            return self.store.layout(layout_id)
        except TierstoreError as e:
            raise BadRequest(grpc.StatusCode.NOT_FOUND, str(e)) from e

    def _keys(self, raw: bytes) -> list[BlockKey]:
        if len(raw) % KEY_BYTES:
            raise BadRequest(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"keys field is {len(raw)} bytes, not a multiple of {KEY_BYTES}",
            )
        n = len(raw) // KEY_BYTES
        if n > self.cfg.max_batch_keys:
            raise BadRequest(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{n} keys in one call; max_batch_keys is {self.cfg.max_batch_keys}",
            )
        return unpack_keys(raw)

    def _request(self, request: Any, attached: bool = True) -> tuple[int, KVLayout, list[BlockKey]]:
        owner = self._owner(request.client_id) if attached else STORE_OWNER
        return owner, self._layout(request.layout_id), self._keys(request.keys)

    # -- unary calls ----------------------------------------------------------------

    @_handler
    def RegisterLayout(
        self, request: local_pb2.RegisterLayoutRequest, context: grpc.ServicerContext
    ) -> local_pb2.RegisterLayoutReply:
        if not request.HasField("layout"):
            raise BadRequest(grpc.StatusCode.INVALID_ARGUMENT, "RegisterLayout needs a layout")
        layout = layout_from_proto(request.layout)
        self.store.register_layout(layout)
        return local_pb2.RegisterLayoutReply(
            layout_id=layout.fingerprint, block_bytes=layout.block_bytes
        )

    @_handler
    def Reserve(
        self, request: local_pb2.KeysRequest, context: grpc.ServicerContext
    ) -> local_pb2.ReserveReply:
        owner, layout, keys = self._request(request)
        res = self.store.reserve(layout, keys, owner)
        self._release_if_detached(owner)
        return local_pb2.ReserveReply(
            statuses=bytes(int(r.status) for r in res), offsets=[r.offset for r in res]
        )

    @_handler
    def Commit(
        self, request: local_pb2.KeysRequest, context: grpc.ServicerContext
    ) -> local_pb2.FlagsReply:
        owner, layout, keys = self._request(request)
        if len(request.session) > 256:
            raise BadRequest(grpc.StatusCode.INVALID_ARGUMENT, "session must be 0-256 characters")
        not_owned = self.store.not_reserved_by(keys, owner)
        if not_owned:
            raise BadRequest(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{len(not_owned)} of {len(keys)} keys are not reserved by client {owner} "
                f"(first: {not_owned[0].hex()[:16]}...); nothing was committed",
            )
        flags = self.store.commit(keys, owner)
        if request.session and self.peers is not None:
            # The running turn's blocks: streamed to the session's spill host now.
            self.peers.stream(request.session, layout, [k for k, f in zip(keys, flags) if f])
        return local_pb2.FlagsReply(flags=bytes(flags))

    @_handler
    def Abort(
        self, request: local_pb2.KeysRequest, context: grpc.ServicerContext
    ) -> local_pb2.CountReply:
        owner, _, keys = self._request(request)
        return local_pb2.CountReply(count=self.store.abort(keys, owner))

    @_handler
    def Lookup(
        self, request: local_pb2.KeysRequest, context: grpc.ServicerContext
    ) -> local_pb2.LookupReply:
        _, layout, keys = self._request(request, attached=False)
        res = self.store.lookup(layout, keys)
        tiers = res.codes
        if request.include_peers and self.peers is not None and res.num_hits < len(keys):
            timeout_s = self._peer_deadline(request, self.config.peer.peer_lookup_timeout_s)
            _, more = self.peers.lookup(layout, keys[res.num_hits :], timeout_s)
            tiers += bytes([TIER_CODES[TierName.PEER]]) * more
        if request.include_peers and self.store.has_remote and len(tiers) < len(keys):
            tiers = self._lookup_remote(request, layout, keys, tiers)
        return local_pb2.LookupReply(num_hits=len(tiers), tiers=tiers)

    def _lookup_remote(
        self, request: Any, layout: KVLayout, keys: list[BlockKey], tiers: bytes
    ) -> bytes:
        """Remote tier: after the local tiers and the peers, under the same
        deadline rule; runs in the bucket and runs held here alternate (a
        few times at most), so the prefix spans the tiers."""
        timeout_s = self._peer_deadline(request, self.config.remote.remote_lookup_timeout_s)
        deadline = time.monotonic() + timeout_s
        for _ in range(4):
            left = deadline - time.monotonic()
            if len(tiers) >= len(keys) or left <= 0:
                break
            more = self.store.lookup_remote(layout, keys[len(tiers) :], left)
            if more == 0:
                break
            tiers += bytes([TIER_CODES[TierName.REMOTE]]) * more
            here = self.store.lookup(layout, keys[len(tiers) :])
            tiers += bytes(TIER_CODES[t] for t in here.tiers)
            if here.num_hits == 0:
                break
        return tiers

    def _peer_deadline(self, request: Any, default_s: float) -> float:
        if request.deadline_s < 0:
            raise BadRequest(grpc.StatusCode.INVALID_ARGUMENT, "deadline_s must be >= 0")
        return min(request.deadline_s or default_s, self.config.peer.fetch_timeout_s)

    @_handler
    def Acquire(
        self, request: local_pb2.KeysRequest, context: grpc.ServicerContext
    ) -> local_pb2.AcquireReply:
        owner, layout, keys = self._request(request)
        # Where each block is before promotion: the engine labels its load with
        # it, without a lookup call of its own.
        found = self.store.lookup(layout, keys).codes
        entries = self.store.acquire(layout, keys, owner)
        # Past what the lookup saw: raced into DRAM meanwhile.
        tiers = found[: len(entries)] + bytes([_DRAM]) * max(0, len(entries) - len(found))
        if request.include_peers and self.peers is not None and len(entries) < len(keys):
            # Pull on switch: the rest of the prefix from the peer that holds it.
            timeout_s = self._peer_deadline(request, self.config.peer.fetch_timeout_s)
            if self.peers.pull(layout, keys[len(entries) :], timeout_s):
                entries += self.store.acquire(layout, keys[len(entries) :], owner)
                tiers += bytes([_PEER]) * (len(entries) - len(tiers))
        if request.include_peers and self.store.has_remote and len(entries) < len(keys):
            # Remote tier: pull the rest of the prefix from the bucket, then pin it;
            # the blocks of it held here already are labelled DRAM, the rest REMOTE.
            rest = keys[len(entries) :]
            held = self.store.held(rest)
            timeout_s = self._peer_deadline(request, self.config.remote.remote_fetch_timeout_s)
            if self.store.pull_remote(layout, rest, timeout_s):
                entries += self.store.acquire(layout, rest, owner)
                tiers += bytes(_DRAM if h else _REMOTE for h in held[: len(entries) - len(tiers)])
        self.store.adopt([e.key for e in entries])
        self._release_if_detached(owner)
        return local_pb2.AcquireReply(offsets=[e.offset for e in entries], tiers=tiers)

    @_handler
    def EndTurn(
        self, request: local_pb2.EndTurnRequest, context: grpc.ServicerContext
    ) -> local_pb2.EndTurnReply:
        self._owner(request.client_id)
        layout, keys = self._layout(request.layout_id), self._keys(request.keys)
        if not request.session or len(request.session) > 256:
            raise BadRequest(grpc.StatusCode.INVALID_ARGUMENT, "session must be 1-256 characters")
        if request.durable_timeout_s < 0:
            raise BadRequest(grpc.StatusCode.INVALID_ARGUMENT, "durable_timeout_s must be >= 0")
        self.store.adopt(keys)
        self.store.turn_ended(keys, request.num_tokens)
        if not request.durable:
            self.store.end_turn_remote(layout, keys, request.num_tokens)  # remote: write-through
        if self.peers is None:
            if request.replica_target:
                raise BadRequest(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "replica_target is set but this sidecar has no peers (peer_port is 0)",
                )
            return self._durable(request, context, layout, keys, local_pb2.EndTurnReply())
        target = request.replica_target or self.peers.spill_target(request.session)
        if request.replica_target and request.replica_target not in self.peers.clients:
            raise BadRequest(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"replica_target {request.replica_target!r} is not a peer of this sidecar "
                f"(peers: {', '.join(sorted(self.peers.clients)) or 'none'})",
            )
        push = self.peers.end_turn(
            request.session, layout, keys, request.num_tokens, request.wait, target
        )
        reply = local_pb2.EndTurnReply(replica_target=target or "", replicating=push is not None)
        if push is not None and push.reply is not None:
            reply.pushed = push.reply.imported
            reply.push_s = push.reply.import_s
            reply.push_tail_s = push.reply.tail_s
        return self._durable(request, context, layout, keys, reply)

    def _durable(
        self,
        request: local_pb2.EndTurnRequest,
        context: grpc.ServicerContext,
        layout: KVLayout,
        keys: list[BlockKey],
        reply: local_pb2.EndTurnReply,
    ) -> local_pb2.EndTurnReply:
        """A durable EndTurn: write the turn through, wait for the bucket
        (bounded by the request's wait, at most ``remote_durable_timeout_s``,
        and by the client's own deadline, so a handler thread is never held
        for a client that gave up: the reply then says not durable)."""
        if not request.durable:
            return reply
        most_s = self.config.remote.remote_durable_timeout_s
        timeout_s = min(request.durable_timeout_s or most_s, most_s)
        left_s = context.time_remaining()
        if left_s is not None:
            timeout_s = max(0.0, min(timeout_s, left_s - DURABLE_REPLY_MARGIN_S))
        got = self.store.end_turn_remote_durable(layout, keys, timeout_s)
        reply.durable_blocks = got.durable_blocks
        reply.durable = got.durable
        reply.durable_wait_s = got.wait_s
        reply.not_durable_reason = got.reason
        return reply

    @_handler
    def ReportLoad(
        self, request: local_pb2.ReportLoadRequest, context: grpc.ServicerContext
    ) -> local_pb2.ReportLoadReply:
        owner = self._owner(request.client_id)
        load = EngineLoad(
            request.busy_slots, request.slots, request.queue_len, request.wait_s,
            request.prefill_tokens_per_s,
        )  # fmt: skip
        try:
            self.loads.report(owner, load)
        except ValueError as e:
            raise BadRequest(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        return local_pb2.ReportLoadReply(host=host_load_proto(self.loads.host()))

    @_handler
    def ReportTiers(
        self, request: local_pb2.ReportTiersRequest, context: grpc.ServicerContext
    ) -> local_pb2.ReportTiersReply:
        owner = self._owner(request.client_id)
        names = [t.name for t in request.tiers]
        if any(n not in ENGINE_TIERS for n in names) or len(set(names)) != len(names):
            raise BadRequest(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"engine tiers must be distinct names among {list(ENGINE_TIERS)}, got {names}",
            )
        self._clients.report_tiers(owner, request.tiers)
        return local_pb2.ReportTiersReply()

    def engine_tiers(self) -> list[common_pb2.TierStat]:
        """The engines' tiers, each summed over the clients that reported it."""
        return self._clients.engine_tiers()

    @_handler
    def Release(
        self, request: local_pb2.KeysRequest, context: grpc.ServicerContext
    ) -> local_pb2.CountReply:
        owner, _, keys = self._request(request)
        return local_pb2.CountReply(count=self.store.release(keys, owner))

    @_handler
    def Prefetch(
        self, request: local_pb2.PrefetchRequest, context: grpc.ServicerContext
    ) -> local_pb2.PrefetchReply:
        _, layout, keys = self._request(request)
        if not 0 <= request.timeout_s <= self.cfg.prefetch_max_wait_s:
            raise BadRequest(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"timeout_s must be in [0, {self.cfg.prefetch_max_wait_s}], "
                f"got {request.timeout_s}",
            )
        policy = self._policy(request.policy, request.timeout_s)
        outcome, job = self.prefetcher.run(layout, keys, policy)
        return local_pb2.PrefetchReply(
            outcome=local_pb2.PrefetchOutcome.Value(f"PREFETCH_{outcome.name}"),
            ready_blocks=job.ready_blocks,
            available_blocks=job.available_blocks,
        )

    def _preposition(self, layout: KVLayout, keys: list[BlockKey]) -> tuple[bool, int]:
        outcome, job = self.prefetcher.run(layout, keys, BestEffort())
        return outcome != Outcome.CANCELLED, job.available_blocks

    def _policy(self, code: int, timeout_s: float) -> PrefetchPolicy:
        if code == local_pb2.PREFETCH_BEST_EFFORT:
            return BestEffort()
        if code == local_pb2.PREFETCH_WAIT:
            return WaitAll(self.cfg.prefetch_max_wait_s)
        if code == local_pb2.PREFETCH_TIMEOUT:
            return Timeout(
                self.cfg.prefetch_timeout_base_s,
                self.cfg.prefetch_timeout_per_1k_tokens_s,
                fixed_s=timeout_s,
            )
        raise BadRequest(grpc.StatusCode.INVALID_ARGUMENT, f"unknown prefetch policy {code}")

    @_handler
    def Stat(
        self, request: local_pb2.StatRequest, context: grpc.ServicerContext
    ) -> local_pb2.StatReply:
        return stat_reply(self)
