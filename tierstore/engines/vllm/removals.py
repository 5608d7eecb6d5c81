"""vLLM's ``BlockRemoved`` for the blocks the connector reported stored, once they leave tierstore.

Provides:
- ``StoredBlocks``: a bounded LRU of the blocks the connector announced in
  a ``BlockStored`` (vLLM's block hash -> tierstore's keys, one per
  tensor-parallel rank) with the local tiers each key is in, kept current by
  applying the sidecar's ``WatchBlocks`` stream (``peer.proto``). A block
  whose key left the sidecar's last local tier (DRAM, NVMe; a demotion adds
  to NVMe before it removes from DRAM) is removed from the map and its hash
  queued for a ``BlockRemoved``. A block pushed out of the LRU
  (``removed_events_max_blocks``) gets no ``BlockRemoved``. Pure apart from
  its lock; thread-safe.
- ``RemovalWatcher``: the thread ("tierstore-vllm-removals") that reads the
  stream into a ``StoredBlocks``: each stream lives at most
  ``removed_events_stream_s`` (its gRPC deadline) and is reopened from its
  cursor, so a silent or vanished sidecar costs at most that long; errors
  reconnect with a bounded backoff; a gap resubscribes from a snapshot, and
  keys announced before the snapshot began and absent from it are removed.
  An unexpected exception ends the thread with one log line, and
  ``counters`` (``watcher_died``, ``stream_errors``, ...) show it in the
  connector's stats.

Runs in vLLM's scheduler process: ``stored`` and ``take`` on the
scheduler's thread (``take_events``), the stream on the watcher's thread.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import grpc

from tierstore.counters import Counters
from tierstore.keys import KEY_BYTES, BlockKey, unpack_keys
from tierstore.v1 import common_pb2, peer_pb2

log = logging.getLogger("tierstore.engines.vllm")

_BITS = {common_pb2.TIER_HBM: 1, common_pb2.TIER_DRAM: 2, common_pb2.TIER_NVME: 4}
_DRAM = _BITS[common_pb2.TIER_DRAM]  # where a commit lands
BACKOFF_MIN_S = 0.1
BACKOFF_MAX_S = 2.0

# (epoch, from_seq, timeout_s) -> an iterable of BlockEvents with cancel()
OpenStream = Callable[[int, int, float], Any]


class GapError(Exception):
    """The stream broke its order; resubscribe from a snapshot."""


@dataclass(slots=True)
class _Block:
    keys: tuple[BlockKey, ...]  # one per tensor-parallel rank
    gen: int  # when it was announced (against the snapshot that follows a reset)


class StoredBlocks:
    """See the module docstring."""

    def __init__(self, max_blocks: int) -> None:
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
        self.max_blocks = max_blocks
        self._lock = threading.Lock()
        self._blocks: OrderedDict[Any, _Block] = OrderedDict()  # vLLM hash -> block
        self._hash_of: dict[BlockKey, Any] = {}
        self._bits: dict[BlockKey, int] = {}  # key -> local tiers it is in
        self._removed: deque[Any] = deque()  # hashes not yet taken (at most max_blocks)
        self._gen = 0
        # The stream's cursor and the snapshot being received.
        self.epoch = 0
        self.seq = 0
        self.synced = False
        self._reset_gen = 0
        self._snapshot: dict[BlockKey, int] = {}
        self.counters = Counters(("announced", "removed", "forgotten", "removed_dropped"))

    def stored(self, blocks: Iterable[tuple[Any, Sequence[BlockKey]]]) -> None:
        """Announce ``(vLLM hash, keys)`` of blocks just reported stored."""
        with self._lock:
            for block_hash, keys in blocks:
                self._gen += 1
                old = self._blocks.pop(block_hash, None)
                # Announced again (stored again, or already held): the tiers the
                # stream says it is in stand; a new key was just committed to DRAM.
                bits = {k: self._bits.get(k) or _DRAM for k in keys}
                if old is not None:
                    self._drop_keys(old)
                self._blocks[block_hash] = _Block(tuple(keys), self._gen)
                for key in keys:
                    self._hash_of[key] = block_hash
                    self._bits[key] = bits[key]
                self.counters.add("announced")
            while len(self._blocks) > self.max_blocks:
                _, gone = self._blocks.popitem(last=False)
                self._drop_keys(gone)
                self.counters.add("forgotten")

    def take(self) -> list[Any]:
        """vLLM hashes of the blocks that left tierstore since the last call."""
        with self._lock:
            out = list(self._removed)
            self._removed.clear()
            return out

    def cursor(self) -> tuple[int, int]:
        with self._lock:
            return (self.epoch, self.seq) if self.synced else (0, 0)

    def __len__(self) -> int:
        with self._lock:
            return len(self._blocks)

    def apply(self, msg: peer_pb2.BlockEvents) -> None:
        """Apply one message of the sidecar's stream; GapError if out of order."""
        with self._lock:
            op = msg.op
            if op == peer_pb2.BLOCK_OP_RESET:
                self.epoch, self.seq, self.synced = msg.epoch, 0, False
                self._reset_gen, self._snapshot = self._gen, {}
                return
            if msg.epoch != self.epoch:
                self._broken(f"epoch {msg.epoch} while at {self.epoch} without a reset")
            if op == peer_pb2.BLOCK_OP_SNAPSHOT:
                if self.synced:
                    self._broken("snapshot part after the snapshot ended")
                bit = self._bit(msg)
                for key in unpack_keys(msg.keys):
                    if key in self._hash_of:
                        self._snapshot[key] = self._snapshot.get(key, 0) | bit
            elif op == peer_pb2.BLOCK_OP_SYNCED:
                self._synced(msg.seq)
            elif op in (peer_pb2.BLOCK_OP_ADD, peer_pb2.BLOCK_OP_REMOVE):
                if not self.synced or msg.seq != self.seq + 1:
                    self._broken(f"batch {msg.seq} after {self.seq}")
                self._change(msg, add=op == peer_pb2.BLOCK_OP_ADD)
                self.seq = msg.seq
            elif op == peer_pb2.BLOCK_OP_HEARTBEAT:
                if not self.synced or msg.seq != self.seq:
                    self._broken(f"heartbeat at batch {msg.seq}, cursor at {self.seq}")
            else:
                self._broken(f"unknown op {op}")

    # -- internals (lock held) --------------------------------------------------

    def _drop_keys(self, block: _Block) -> None:
        for key in block.keys:
            self._hash_of.pop(key, None)
            self._bits.pop(key, None)

    def _broken(self, why: str) -> NoReturn:
        self.synced, self.epoch, self.seq = False, 0, 0
        raise GapError(why)

    def _bit(self, msg: peer_pb2.BlockEvents) -> int:
        bit = _BITS.get(msg.tier)
        if bit is None or len(msg.keys) % KEY_BYTES:
            self._broken(f"malformed event: tier {msg.tier}, {len(msg.keys)} key bytes")
        return bit

    def _synced(self, seq: int) -> None:
        # A key announced before the reset was committed before the snapshot
        # was taken: absent from it, it left. One announced since may be newer
        # than the snapshot: its ADD is in the batches that follow.
        for key in list(self._hash_of):
            if key in self._snapshot:
                self._bits[key] = self._snapshot[key]
            elif self._blocks[self._hash_of[key]].gen <= self._reset_gen:
                self._left(key)
        self._snapshot = {}
        self.seq, self.synced = seq, True

    def _change(self, msg: peer_pb2.BlockEvents, add: bool) -> None:
        bit = self._bit(msg)
        for key in unpack_keys(msg.keys):
            bits = self._bits.get(key)
            if bits is None:
                continue
            bits = bits | bit if add else bits & ~bit
            self._bits[key] = bits
            if not bits:
                self._left(key)

    def _left(self, key: BlockKey) -> None:
        """The block of ``key`` is no longer whole in tierstore (any rank's part gone)."""
        block_hash = self._hash_of.get(key)
        if block_hash is None:
            return
        self._drop_keys(self._blocks.pop(block_hash))
        if len(self._removed) >= self.max_blocks:
            self._removed.popleft()
            self.counters.add("removed_dropped")
        self._removed.append(block_hash)
        self.counters.add("removed")


class RemovalWatcher:
    """See the module docstring. ``open_stream(epoch, from_seq, timeout_s)``
    opens the sidecar's WatchBlocks (``PeerClient.watch_blocks``)."""

    def __init__(self, blocks: StoredBlocks, open_stream: OpenStream, stream_s: float) -> None:
        self.blocks = blocks
        self.stream_s = stream_s
        self._open = open_stream
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._call: Any = None
        self.counters = Counters(
            ("streams_opened", "stream_ends", "stream_errors", "gaps", "watcher_died")
        )
        self.error = ""  # the last stream error, one line
        self._thread = threading.Thread(
            target=self._run, name="tierstore-vllm-removals", daemon=True
        )
        self._thread.start()

    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # a bug: visible in the log and the stats, never silent
            log.exception("tierstore connector: the BlockRemoved watcher died")
            self.error = f"died: {type(e).__name__}: {e}"
            self.counters.add("watcher_died")

    def _loop(self) -> None:
        backoff = BACKOFF_MIN_S
        while not self._stop.is_set():
            epoch, seq = self.blocks.cursor()
            try:
                call = self._open(epoch, seq, self.stream_s)
            except (grpc.RpcError, ValueError, OSError) as e:
                self._failed(f"cannot watch the sidecar: {e}")
                self._stop.wait(backoff)
                backoff = min(backoff * 2, BACKOFF_MAX_S)
                continue
            self.counters.add("streams_opened")
            with self._lock:
                self._call = call
            if self._stop.is_set():
                call.cancel()
            try:
                for msg in call:
                    self.blocks.apply(msg)
                    backoff = BACKOFF_MIN_S
            except GapError as e:
                self.counters.add("gaps")
                log.info("tierstore connector: resynchronising the removal watch: %s", e)
                backoff = BACKOFF_MIN_S
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:  # the stream's own bound
                    self.counters.add("stream_ends")
                    continue  # reopen at once from the cursor
                if not self._stop.is_set():
                    self._failed(f"{e.code().name}: {e.details()}")
            finally:
                with self._lock:
                    self._call = None
                call.cancel()
            self._stop.wait(backoff)
            backoff = min(max(backoff * 2, BACKOFF_MIN_S), BACKOFF_MAX_S)

    def _failed(self, why: str) -> None:
        if not self.counters.stream_errors:
            log.warning("tierstore connector: %s; BlockRemoved waits, retrying", why)
        self.counters.add("stream_errors")
        self.error = why

    def stats(self) -> dict[str, Any]:
        return {
            **self.counters.snapshot(),
            **self.blocks.counters.snapshot(),
            "tracked_blocks": len(self.blocks),
            "alive": self.alive(),
            "error": self.error,
        }

    def close(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        with self._lock:
            call = self._call
        if call is not None:
            call.cancel()
        self._thread.join(timeout_s)
