"""kv_share's sending side: replica pushes of a session's blocks to its spill host.

Provides ``Replicator``, which the peer tier (``tierstore.peer.tier``) makes
and hands ``stream`` and ``end_turn`` to. ``stream`` offers the blocks a
session's running turn commits to the ``ReplicaStreamer``
(``tierstore.peer.stream``), which pushes them as they come; ``end_turn``
remembers a session's keys and queues the push of what its replica still
lacks (``tierstore.peer.pushq``: ``replicate_per_target`` pushes in flight
per target). Whether a session is replicated is the replication policy's decision
(``tierstore.policies``), given the push, the link rate measured to the
target (or the configured default), the bytes already queued and whether
the target rejected blocks on its last push.

Collaborators are explicit (the group's ``PeerClients``, the spill-target
choice, the counters of the peer tier, the workers): it never calls back
into the peer tier.

Threads: RPC threads call ``stream`` and ``end_turn``; pushes run on the
``tierstore-replicator`` threads and the ``tierstore-streamer`` thread. A
push that fails is counted and logged (rate-limited, on the peer tier's
logger), never raised to the engine.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from tierstore.config.peer import PeerConfig
from tierstore.counters import Counters
from tierstore.keys import BlockKey, KVLayout
from tierstore.peer.client import PeerClient, rpc_text
from tierstore.peer.clients import PeerClients
from tierstore.peer.pushq import PushQueue
from tierstore.peer.stream import ReplicaStreamer
from tierstore.policies.replication import ReplicaRequest, make_replication_policy
from tierstore.ratelog import RateLimitedLog
from tierstore.workers import Workers

_faults = RateLimitedLog(logging.getLogger("tierstore.peer.tier"))  # per kind and target

MAX_SESSIONS = 4096  # sessions whose last turn's keys are remembered
REPLICATOR_THREADS = 4  # pushes in flight at once to all targets, with one a target


@dataclass
class Push:
    """One end_turn push; ``done`` is set when it ended, ``reply`` is the
    target's ReplicateReply (None: not sent, or failed)."""

    session: str
    layout: KVLayout
    keys: list[BlockKey]
    target: str
    backlog_bytes: int  # counted in the policy's backlog until the push ends
    done: threading.Event = field(default_factory=threading.Event)
    reply: Any = None


class Replicator:
    """The pushes of this host's sessions to their spill hosts. See the module docstring."""

    def __init__(
        self,
        cfg: PeerConfig,
        address: str,
        peers: PeerClients,
        spill_target: Callable[[str], str | None],
        *,
        counters: Counters,
        workers: Workers,
    ) -> None:
        self.cfg = cfg
        self.address = address
        self._peers = peers
        self._spill_target = spill_target
        self.counters = counters
        self._lock = threading.Lock()
        self._sessions: OrderedDict[str, tuple[KVLayout, list[BlockKey]]] = OrderedDict()
        self._targets: OrderedDict[str, str] = OrderedDict()  # session -> last push target
        self._rejected: dict[str, bool] = {}  # target -> its last reply rejected blocks
        self._push_backlog_bytes = 0  # bytes of end_turn pushes queued or running
        self.policy = make_replication_policy(
            cfg.replicate_policy, cfg.min_tokens, cfg.replicate_headroom_s, cfg.link_bytes_per_s
        )
        # A few pushes in flight per target, oldest first (tierstore.peer.pushq);
        # more workers than that: one slow or dead target must not hold up
        # the pushes to the others.
        self._pushes: PushQueue[Push] = PushQueue(cfg.replicate_queue_max, cfg.replicate_per_target)
        self._replicators = [
            workers.start(f"tierstore-replicator-{i}", self._replicate_loop)
            for i in range(REPLICATOR_THREADS + cfg.replicate_per_target - 1)
        ]
        self.streamer = ReplicaStreamer(
            self._stream_push,
            self.link_bytes_per_s,
            workers=workers,
            counters=counters,
            max_bytes=cfg.stream_max_bytes,
            link_share=cfg.stream_link_share,
            max_sessions=MAX_SESSIONS,
            contended=self._pushes_running,
        )

    def _clients(self) -> dict[str, PeerClient]:
        return self._peers.clients()

    def link_bytes_per_s(self, target: str) -> float:
        """The link rate to ``target``: measured, or the configured default."""
        client = self._clients().get(target)
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
        return target if target is not None else self._spill_target(session)

    def stream(self, session: str, layout: KVLayout, keys: list[BlockKey]) -> None:
        """Blocks just committed for ``session``'s running turn: streamed to
        its spill host (the last turn's push target) if the policy agrees."""
        if not self.cfg.stream_replicas or not keys:
            return
        target = self._target(session)
        if target is None or target not in self._clients():
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
        client = self._clients().get(target)
        if client is None:
            return None
        try:
            reply = client.replicate(
                layout, keys, self.address, session, self.cfg.replicate_timeout_s
            )
        except grpc.RpcError as e:
            _faults.warning(
                f"stream:{target}", "streamed push to %s failed: %s", target, rpc_text(e)
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
    ) -> Push | None:
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
        push = Push(session, layout, keys, target, push_bytes)
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

    def _push(self, push: Push) -> None:
        client = self._clients().get(push.target)
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
                rpc_text(e),
            )
            return
        with self._lock:
            self._rejected[push.target] = push.reply.rejected > 0
        self.counters.add("pushed_blocks", push.reply.imported)

    def close(self) -> None:
        """Stop the streamer, drop the queued pushes, wait for the replicators."""
        self.streamer.close()
        for push in self._pushes.drain():  # dropped: the process is going away
            push.done.set()
        self._pushes.close()
        for t in self._replicators:
            t.join(timeout=self.cfg.replicate_timeout_s + 5)


def _shared_prefix(a: Sequence[BlockKey], b: Sequence[BlockKey]) -> int:
    """Length of the common prefix of two key chains."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
