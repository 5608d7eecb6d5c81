"""The peer tier: other sidecars of the group, as seen from this one.

Provides:
- ``PeerClient``: calls to one remote sidecar (lookup, fetch over the data
  channel, replicate), every call authenticated and under a deadline;
- ``PeerTier``: the group. ``lookup`` asks every peer at once and takes the
  longest continuation that answers in time; ``pull`` fetches blocks missing
  here from the peer that holds them; ``stream`` hands the blocks a session's
  running turn commits to the ``ReplicaStreamer`` (``tierstore.peer.stream``),
  which pushes them to the session's spill host as they come; ``end_turn``
  remembers a session's keys and queues the push of what is left;
  ``import_replica`` is the receiving side of a push. Whether a session is
  replicated is the replication policy's decision (``tierstore.policies``:
  kv_share's ``min_tokens`` rule, or that rule as the floor with shorter
  turns replicated while the link and the target's budget have headroom).

Runs in the sidecar: lookups and pulls on RPC threads, pushes on the
``tierstore-replicator`` threads and the ``tierstore-streamer`` thread. A
timeout, refusal or error of a peer is a miss, counted, never an exception
to the engine.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from tierstore.config.peer import PeerConfig
from tierstore.counters import Counters
from tierstore.keys import BlockKey, KVLayout
from tierstore.membership.members import MemberSet, StaticMembers
from tierstore.peer import codec
from tierstore.peer.client import PeerClient
from tierstore.peer.clients import PeerClients
from tierstore.peer.data import ReceiveResult, Verifier, receive_blocks
from tierstore.peer.pushq import PushQueue
from tierstore.peer.stream import STREAM_COUNTERS, ReplicaStreamer
from tierstore.policies.replication import (
    ReplicaRequest,
    make_replication_policy,
    rendezvous_target,
)
from tierstore.ratelog import RateLimitedLog
from tierstore.store.tiered import TieredStore
from tierstore.v1 import peer_pb2

log = logging.getLogger(__name__)
_faults = RateLimitedLog(log)  # per kind and peer: a flapping peer must not flood the log

MAX_SESSIONS = 4096  # sessions whose last turn's keys are remembered
LINK_PROBE_MIN_BYTES = 16 << 20  # raw transfers at least this large measure the link
LINK_REPROBE_EVERY = 8  # with compression on, every 8th transfer goes raw to re-measure
REPLICATOR_THREADS = 4  # replica pushes in flight at once


# A dead peer and a stalled one call for different fixes (restart it; look at
# its load or the link), so their misses are counted apart.
PEER_COUNTERS = (
    "lookups",
    "lookup_errors",  # a peer refused, unreachable or reset (dead)
    "lookup_timeouts",  # a peer that did not answer by the deadline (stalled)
    "fetches",
    "fetched_blocks",
    "fetched_bytes",  # payload bytes on the wire (compressed where it was)
    "fetch_errors",  # transfers that failed before their deadline: refused, reset, bad stream
    "fetch_timeouts",  # transfers cut by their deadline: a peer or link that stalled
    "fetch_verify_failures",
    "pushes",
    "pushed_blocks",
    "push_errors",
    "pushes_dropped",
    "pushes_skipped",  # turns the replication policy did not replicate (link or budget pressure)
    *STREAM_COUNTERS,
    "replicas_imported",
    "replicas_rejected",
    "watchers",  # routers' WatchBlocks streams open now
    "watch_snapshots",  # snapshots sent (new watchers, and resyncs after a gap)
    "watch_refused",  # streams refused: max_watchers reached
    "bad_requests",  # peer calls refused as malformed (INVALID_ARGUMENT)
    "prepositions",  # routers' Preposition hints queued here
    "prepositions_refused",  # ... not queued (prefetch queue full, or no prefetcher)
)


@dataclass
class _Push:
    session: str
    layout: KVLayout
    keys: list[BlockKey]
    target: str
    backlog_bytes: int  # counted in the policy's backlog until the push ends
    done: threading.Event = field(default_factory=threading.Event)
    reply: Any = None


class PeerTier:
    """The group of peers. See the module docstring."""

    def __init__(
        self,
        store: TieredStore,
        cfg: PeerConfig,
        self_address: str,
        members: MemberSet | None = None,
    ) -> None:
        self.store = store
        self.cfg = cfg
        self.address = self_address
        self.counters = Counters(PEER_COUNTERS)
        token = cfg.token()
        # Who the peers are is the member set's business (the static list, or
        # etcd's live group); this tier asks it on every use.
        self._peers = PeerClients(
            members if members is not None else StaticMembers(cfg.peers),
            lambda addr: PeerClient(addr, cfg, token),
            exclude=self_address,
        )
        self._lock = threading.Lock()
        self._sessions: OrderedDict[str, tuple[KVLayout, list[BlockKey]]] = OrderedDict()
        self._targets: OrderedDict[str, str] = OrderedDict()  # session -> last push target
        self._rejected: dict[str, bool] = {}  # target -> its last reply rejected blocks
        self._push_backlog_bytes = 0  # bytes of end_turn pushes queued or running
        self.policy = make_replication_policy(
            cfg.replicate_policy, cfg.min_tokens, cfg.replicate_headroom_s, cfg.link_bytes_per_s
        )
        self._codec_bytes_per_s = _measure_codec()
        self.verifier = Verifier()  # received blocks are verified on every core
        # One push in flight per target, oldest first (tierstore.peer.pushq);
        # several workers: one slow or dead target must not hold up the
        # pushes to the others.
        self._pushes: PushQueue[_Push] = PushQueue(cfg.replicate_queue_max)
        self._replicators = [
            store.workers.start(f"tierstore-replicator-{i}", self._replicate_loop)
            for i in range(REPLICATOR_THREADS)
        ]
        self.streamer = ReplicaStreamer(
            self._stream_push,
            self.link_bytes_per_s,
            workers=store.workers,
            counters=self.counters,
            max_bytes=cfg.stream_max_bytes,
            link_share=cfg.stream_link_share,
            max_sessions=MAX_SESSIONS,
            contended=self._pushes_running,
        )

    @property
    def clients(self) -> dict[str, PeerClient]:
        """address -> client of every live peer (this host excluded), now."""
        return self._peers.clients()

    def members(self) -> list[str]:
        return [self.address, *self.clients]

    # -- lookups and pulls ---------------------------------------------------------

    def lookup(
        self, layout: KVLayout, keys: Sequence[BlockKey], timeout_s: float
    ) -> tuple[PeerClient | None, int]:
        """The peer holding the longest prefix of ``keys``, asked all at once."""
        clients = self.clients  # one view of the group for the whole lookup
        if not keys or not clients:
            return None, 0
        self.counters.add("lookups")
        futures = {addr: c.lookup_future(layout, keys, timeout_s) for addr, c in clients.items()}
        best: tuple[PeerClient | None, int] = (None, 0)
        for addr, fut in futures.items():
            try:
                hits = fut.result().num_hits
            except grpc.RpcError as e:
                stalled = e.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                self.counters.add("lookup_timeouts" if stalled else "lookup_errors")
                continue
            if hits > best[1]:
                best = (clients[addr], hits)
        return best

    def pull(self, layout: KVLayout, keys: Sequence[BlockKey], timeout_s: float) -> int:
        """Fetch as much of the prefix ``keys`` (all missing here) as a peer
        holds, within ``timeout_s``. Returns the blocks now held locally."""
        deadline = time.monotonic() + timeout_s
        peer, hits = self.lookup(layout, keys, min(timeout_s, self.cfg.peer_lookup_timeout_s))
        if peer is None:
            return 0
        result = self._fetch(peer, layout, list(keys[:hits]), deadline)
        return result.received

    def _fetch(
        self, peer: PeerClient, layout: KVLayout, keys: list[BlockKey], deadline: float
    ) -> ReceiveResult:
        self.counters.add("fetches")
        try:
            result = self._receive(peer, layout, keys, deadline, self._compress(peer, layout))
        except (grpc.RpcError, OSError) as e:
            self.counters.add("fetch_timeouts" if _timed_out(e, deadline) else "fetch_errors")
            _faults.warning(
                f"fetch:{peer.address}", "fetch from %s failed: %s", peer.address, _rpc_text(e)
            )
            return ReceiveResult(error=str(e))
        self.counters.add("fetched_blocks", result.received)
        self.counters.add("fetched_bytes", result.bytes)
        if result.verify_failures:
            self.counters.add("fetch_verify_failures", result.verify_failures)
            _faults.warning(
                f"verify:{peer.address}", "fetch from %s: a block failed verification", peer.address
            )
        if result.error:
            self.counters.add("fetch_timeouts" if _timed_out(None, deadline) else "fetch_errors")
            _faults.warning(
                f"early:{peer.address}", "fetch from %s ended early: %s", peer.address, result.error
            )
        return result

    def _receive(
        self,
        peer: PeerClient,
        layout: KVLayout,
        keys: list[BlockKey],
        deadline: float,
        compress: bool,
    ) -> ReceiveResult:
        """Open a transfer from ``peer`` and read it into the store (verified);
        large raw transfers measure the link to it."""
        started = time.monotonic()
        num_blocks, conn = peer.open_fetch(layout, keys, deadline, compress)
        if conn is None:
            return ReceiveResult()
        try:
            result = receive_blocks(
                conn, self.store, layout, keys[:num_blocks], deadline, self.verifier
            )
        finally:
            conn.close()
        # Only large raw transfers say how fast the link is: a small one is
        # mostly connection set-up and would read as a slow link.
        if not compress and result.bytes >= LINK_PROBE_MIN_BYTES:
            peer.link.add(result.bytes, time.monotonic() - started)
        return result

    def _compress(self, peer: PeerClient, layout: KVLayout) -> bool:
        """Compress only when it makes this transfer faster: when the link
        measured to this peer is slower than compression on this host."""
        if self.cfg.compression == "none" or not codec.can_bytesplit(layout):
            return False
        if self.cfg.compression == "zstd":
            return True
        if peer.transfers % LINK_REPROBE_EVERY == LINK_REPROBE_EVERY - 1:
            return False  # keep the link estimate current
        return 0 < peer.link.bytes_per_s < self._codec_bytes_per_s

    # -- kv_share: the sending side ---------------------------------------------------

    def link_bytes_per_s(self, target: str) -> float:
        """The link rate to ``target``: measured, or the configured default."""
        client = self.clients.get(target)
        measured = client.link.bytes_per_s if client is not None else 0.0
        return measured or self.cfg.link_bytes_per_s

    def _decide(self, target: str, num_tokens: int, push_bytes: int) -> bool:
        with self._lock:
            backlog = self._push_backlog_bytes
            rejected = self._rejected.get(target, False)
        request = ReplicaRequest(
            num_tokens=num_tokens,
            push_bytes=push_bytes,
            link_bytes_per_s=self.link_bytes_per_s(target),
            backlog_bytes=backlog + self.streamer.backlog_bytes(),
            target_rejected=rejected,
        )
        return self.policy.replicate(request)

    def _target(self, session: str) -> str | None:
        with self._lock:
            target = self._targets.get(session)
        return target if target is not None else self.spill_target(session)

    def stream(self, session: str, layout: KVLayout, keys: list[BlockKey]) -> None:
        """Blocks just committed for ``session``'s running turn: streamed to
        its spill host (the last turn's push target) if the policy agrees."""
        if not self.cfg.stream_replicas or not keys:
            return
        target = self._target(session)
        if target is None or target not in self.clients:
            return
        with self._lock:
            prev = self._sessions.get(session)
        before = len(prev[1]) if prev is not None and prev[0] == layout else 0
        context_blocks = before + self.streamer.offered_blocks(session) + len(keys)
        ok = self._decide(
            target, context_blocks * layout.block_tokens, len(keys) * layout.block_bytes
        )
        self.streamer.offer(session, target, layout, keys, ok)

    def _stream_push(
        self, target: str, layout: KVLayout, keys: list[BlockKey], session: str
    ) -> int | None:
        client = self.clients.get(target)
        if client is None:
            return None
        try:
            reply = client.replicate(
                layout, keys, self.address, session, self.cfg.replicate_timeout_s
            )
        except grpc.RpcError as e:
            _faults.warning(
                f"stream:{target}", "streamed push to %s failed: %s", target, _rpc_text(e)
            )
            return None
        with self._lock:
            self._rejected[target] = reply.rejected > 0
        return int(reply.imported)

    def end_turn(
        self,
        session: str,
        layout: KVLayout,
        keys: list[BlockKey],
        num_tokens: int,
        wait: bool,
        target: str | None,
    ) -> _Push | None:
        """Remember the session's keys and queue the push of what its
        replica on ``target`` (a router's choice or the rendezvous spill
        host; None: no push) still lacks, if the replication policy agrees.
        Blocks streamed during the turn are held there already: the target
        fetches only the rest."""
        self.streamer.finish(session)
        with self._lock:
            prev = self._sessions.get(session)
            self._sessions[session] = (layout, keys)
            self._sessions.move_to_end(session)
            while len(self._sessions) > MAX_SESSIONS:
                self._sessions.popitem(last=False)
            if target is not None:
                self._targets[session] = target
                self._targets.move_to_end(session)
                while len(self._targets) > MAX_SESSIONS:
                    self._targets.popitem(last=False)
        if target is None or not keys:
            return None
        shared = _shared_prefix(prev[1], keys) if prev is not None and prev[0] == layout else 0
        push_bytes = (len(keys) - shared) * layout.block_bytes
        if not self._decide(target, num_tokens, push_bytes):
            self.counters.add("pushes_skipped")
            return None
        push = _Push(session, layout, keys, target, push_bytes)
        with self._lock:
            self._push_backlog_bytes += push_bytes
        if not self._pushes.put(push):
            with self._lock:
                self._push_backlog_bytes -= push_bytes
            self.counters.add("pushes_dropped")
            return None
        if wait:
            push.done.wait(self.cfg.replicate_timeout_s + 5)
        return push

    def fetch_bytes_per_s(self) -> float:
        """Mean link speed measured to the peers (0: none measured yet)."""
        rates = [r for r in (c.link.bytes_per_s for c in self.clients.values()) if r > 0]
        return sum(rates) / len(rates) if rates else 0.0

    def spill_target(self, session: str) -> str | None:
        return rendezvous_target(session, self.members(), exclude=self.address)

    def _pushes_running(self) -> bool:
        """end_turn pushes are queued or running (the streamer paces then)."""
        with self._lock:
            return self._push_backlog_bytes > 0

    def _replicate_loop(self) -> None:
        while True:
            push = self._pushes.get()
            if push is None:
                return
            try:
                self._push(push)
            finally:
                self._pushes.done(push)
                with self._lock:
                    self._push_backlog_bytes -= push.backlog_bytes
                push.done.set()

    def _push(self, push: _Push) -> None:
        client = self.clients.get(push.target)
        if client is None:
            return
        self.counters.add("pushes")
        try:
            push.reply = client.replicate(
                push.layout, push.keys, self.address, push.session, self.cfg.replicate_timeout_s
            )
        except grpc.RpcError as e:
            self.counters.add("push_errors")
            _faults.warning(
                f"push:{push.target}",
                "replica push of %s to %s failed: %s",
                push.session,
                push.target,
                _rpc_text(e),
            )
            return
        with self._lock:
            self._rejected[push.target] = push.reply.rejected > 0
        self.counters.add("pushed_blocks", push.reply.imported)

    # -- kv_share: the receiving side ---------------------------------------------------

    def import_replica(
        self, layout: KVLayout, keys: list[BlockKey], source: str, timeout_s: float
    ) -> peer_pb2.ReplicateReply:
        """Fetch the blocks of ``keys`` this host lacks from ``source``, within
        the replica budget. Residency is asked of the tiers, never remembered."""
        started = time.monotonic()
        deadline = started + min(timeout_s, self.cfg.replicate_timeout_s)
        held = self.store.held(keys)
        missing = [k for k, h in zip(keys, held) if not h]
        # The session's replica is as fresh as this push, head last: else
        # its head, imported first, stays the oldest replica and is the first
        # dropped for room or evicted, which loses the whole prefix.
        ledger = self.store.replicas
        ledger.refresh(reversed([k for k, h in zip(keys, held) if h]))
        reply = peer_pb2.ReplicateReply(offered=len(keys), missing=len(missing))
        if not missing:
            return reply
        fits = len(missing)
        while fits and not self.store.make_replica_room(
            fits * layout.block_bytes, self.cfg.replica_bytes
        ):
            fits //= 2
        reply.rejected = len(missing) - fits
        self.counters.add("replicas_rejected", reply.rejected)
        peer = self.clients.get(source)
        reserved = fits * layout.block_bytes
        committed: list[BlockKey] = []
        try:
            if peer is None:
                # One kind for every unknown source: the name comes off the wire.
                _faults.warning(
                    "push-unknown",
                    "replica push from %s, which is not in this group's peers",
                    source,
                )
                return reply
            result = self._fetch(peer, layout, missing[:fits], deadline)
            committed = result.keys
            reply.bytes = result.bytes
        finally:
            self.store.finish_replica_import(reserved, layout, committed)
            ledger.refresh(reversed(keys))
        self.counters.add("replicas_imported", len(committed))
        reply.imported = len(committed)
        now = time.monotonic()
        reply.import_s = now - started
        if committed and result.last_byte_at:
            reply.tail_s = now - result.last_byte_at
        return reply

    def close(self) -> None:
        self.streamer.close()
        for push in self._pushes.drain():  # dropped: the process is going away
            push.done.set()
        self._pushes.close()
        for t in self._replicators:
            t.join(timeout=self.cfg.replicate_timeout_s + 5)
        self._peers.close()
        self.verifier.close()


def _shared_prefix(a: Sequence[BlockKey], b: Sequence[BlockKey]) -> int:
    """Length of the common prefix of two key chains."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _timed_out(e: BaseException | None, deadline: float) -> bool:
    """Whether a failed transfer was cut by its deadline rather than refused
    or reset. The stream's reader reports only text, but it ends early for a
    stall only once the deadline has passed (socket timeouts are re-armed with
    what is left of it, rounded up)."""
    if isinstance(e, grpc.RpcError) and hasattr(e, "code"):
        return bool(e.code() == grpc.StatusCode.DEADLINE_EXCEEDED)
    return isinstance(e, TimeoutError) or time.monotonic() >= deadline


def _rpc_text(e: BaseException) -> str:
    if isinstance(e, grpc.RpcError) and hasattr(e, "code"):
        return f"{e.code().name}: {e.details()}"
    return str(e)


def _measure_codec() -> float:
    """Bytes/s of the slower of byte-split zstd compression and decompression
    on fp16-like data on this host (a few ms): a link slower than this gains
    from compression, a faster one loses."""
    import numpy as np

    sample = np.random.default_rng(0).standard_normal(1 << 19).astype(np.float16).tobytes()
    layout = KVLayout("probe", 1, 1, 64, "float16", 16)
    t0 = time.perf_counter()
    packed = codec.compress(memoryview(sample), layout)
    t1 = time.perf_counter()
    if packed is None:
        return 0.0
    codec.decompress_into(memoryview(packed), memoryview(bytearray(len(sample))))
    t2 = time.perf_counter()
    return len(sample) / max(t1 - t0, t2 - t1, 1e-6)
