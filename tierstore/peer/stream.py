"""Streaming replicas: a session's blocks go to its spill host while its turn runs.

Provides ``ReplicaStreamer``. The sidecar's Commit handler offers the blocks
an engine committed for a session (``offer``); the streamer pushes them to
the session's spill host in chunks, as they come, so that when the turn
ends (``finish``) the replica is nearly current and ``end_turn``'s push
carries only what is left. kv_share pushed everything after the turn: a next
turn landing on the other host before that push finished found it cold.

Bounds: the bytes queued or in flight over all sessions are at most
``max_bytes`` (blocks beyond wait for ``end_turn``: counted in
``stream_deferred_blocks``), and while other pushes of this host are
running (``contended``: end_turn's), streamed pushes are paced to
``link_share`` of the link rate to the target (measured, or the configured
default), so those are not starved; with the link to themselves they run at
its full rate (pacing an idle link only made replicas late). Whether a
session is streamed at all is the replication policy's decision (the
caller's ``offer`` says so).

Order: the oldest stream first, each chunk of it before the next session's.
When the link cannot carry every session's turn before its next one (the
start of a fleet, a burst of long prompts), sending the sessions one after
the other leaves only the last ones late; sharing it round robin made them
all late together.

Threads: any Commit thread offers; one "tierstore-streamer" thread pushes
(each push is a replicate call: the target fetches the blocks it lacks over
the data channel, verifying them).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from tierstore.counters import Counters
from tierstore.keys import BlockKey, KVLayout
from tierstore.workers import Workers

STREAM_CHUNK_BLOCKS = 64  # blocks per streamed push
STREAM_COUNTERS = (
    "stream_pushes",
    "streamed_blocks",  # blocks the targets imported from streamed pushes
    "stream_offered_blocks",
    "stream_deferred_blocks",  # over stream_max_bytes: left for end_turn's push
    "stream_skipped_blocks",  # the replication policy said no (link or budget pressure)
    "stream_errors",
)

# push(target, layout, keys, session) -> blocks the target imported, or None on an error
PushFn = Callable[[str, KVLayout, list[BlockKey], str], "int | None"]


@dataclass(slots=True)
class _Stream:
    target: str
    layout: KVLayout
    keys: deque[BlockKey] = field(default_factory=deque)
    offered_blocks: int = 0  # this turn's blocks offered so far


class ReplicaStreamer:
    """See the module docstring."""

    def __init__(
        self,
        push: PushFn,
        link_bytes_per_s: Callable[[str], float],
        *,
        contended: Callable[[], bool] = lambda: True,
        workers: Workers,
        counters: Counters,
        max_bytes: int,
        link_share: float,
        max_sessions: int,
    ) -> None:
        self._push = push
        self._link_bytes_per_s = link_bytes_per_s
        self._contended = contended
        self._counters = counters
        self._max_bytes = max_bytes
        self._link_share = link_share
        self._max_sessions = max_sessions
        self._streams: OrderedDict[str, _Stream] = OrderedDict()
        self._queued_bytes = 0
        self._in_flight_bytes = 0
        self._next_send_at: dict[str, float] = {}  # target -> pacing: not before this
        self._closing = False
        self._cond = threading.Condition()
        self._thread = workers.start("tierstore-streamer", self._loop)

    def offered_blocks(self, session: str) -> int:
        """Blocks of this session's running turn offered so far."""
        with self._cond:
            stream = self._streams.get(session)
            return stream.offered_blocks if stream is not None else 0

    def backlog_bytes(self) -> int:
        """Streamed bytes queued or in flight now."""
        with self._cond:
            return self._queued_bytes + self._in_flight_bytes

    def offer(
        self, session: str, target: str, layout: KVLayout, keys: list[BlockKey], stream: bool
    ) -> None:
        """Blocks committed for ``session``'s running turn; queued for
        ``target`` when ``stream`` (the policy's decision), else only counted."""
        size = layout.block_bytes
        with self._cond:
            state = self._streams.get(session)
            if state is None or state.target != target or state.layout != layout:
                if state is not None:
                    self._queued_bytes -= len(state.keys) * size
                state = _Stream(target, layout, offered_blocks=state.offered_blocks if state else 0)
                self._streams[session] = state
                self._evict_sessions()
            state.offered_blocks += len(keys)
            if not stream:
                self._counters.add("stream_skipped_blocks", len(keys))
                return
            room = max(0, (self._max_bytes - self._queued_bytes - self._in_flight_bytes) // size)
            take = keys[:room]
            state.keys.extend(take)
            self._queued_bytes += len(take) * size
            self._cond.notify()
        self._counters.add_many(
            {"stream_offered_blocks": len(keys), "stream_deferred_blocks": len(keys) - len(take)}
        )

    def finish(self, session: str) -> None:
        """The turn ended: what is still queued is left to ``end_turn``'s push."""
        with self._cond:
            state = self._streams.pop(session, None)
            if state is not None:
                self._queued_bytes -= len(state.keys) * state.layout.block_bytes

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until nothing is queued or in flight (tests, benchmarks)."""
        with self._cond:
            return self._cond.wait_for(
                lambda: self._queued_bytes == 0 and self._in_flight_bytes == 0, timeout_s
            )

    def _evict_sessions(self) -> None:
        while len(self._streams) > self._max_sessions:
            _, old = self._streams.popitem(last=False)
            self._queued_bytes -= len(old.keys) * old.layout.block_bytes

    def _next_chunk(self) -> tuple[str, _Stream, list[BlockKey]] | None:
        """The oldest session's chunk whose target's pacing allows a send now.
        Holds the lock."""
        now = time.monotonic()
        for session, state in self._streams.items():
            if state.keys and self._next_send_at.get(state.target, 0.0) <= now:
                chunk = [
                    state.keys.popleft() for _ in range(min(STREAM_CHUNK_BLOCKS, len(state.keys)))
                ]
                return session, state, chunk
        return None

    def _wait_s(self) -> float:
        """How long until some queued chunk may be sent. Holds the lock."""
        now = time.monotonic()
        waits = [
            self._next_send_at.get(s.target, 0.0) - now for s in self._streams.values() if s.keys
        ]
        return max(0.001, min(waits)) if waits else 1.0

    def _loop(self) -> None:
        while True:
            with self._cond:
                picked = None
                while not self._closing and picked is None:
                    picked = self._next_chunk()
                    if picked is None:
                        self._cond.wait(self._wait_s())
                if self._closing:
                    return
                assert picked is not None
                session, state, chunk = picked
                nbytes = len(chunk) * state.layout.block_bytes
                self._queued_bytes -= nbytes
                self._in_flight_bytes += nbytes
            started = time.monotonic()
            try:
                imported = self._push(state.target, state.layout, chunk, session)
            finally:
                with self._cond:
                    self._in_flight_bytes -= nbytes
                    # Paced by what the link carries, while other pushes share it.
                    rate = self._link_bytes_per_s(state.target) * self._link_share
                    paced = rate > 0 and self._contended()
                    self._next_send_at[state.target] = started + (nbytes / rate if paced else 0.0)
                    self._cond.notify_all()
            if imported is None:
                self._counters.add("stream_errors")
            else:
                self._counters.add_many({"stream_pushes": 1, "streamed_blocks": imported})

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._streams.clear()
            self._queued_bytes = 0
            self._cond.notify_all()
        self._thread.join(timeout=30)
