"""The router's index of what every host holds, fed by the hosts' events.

Provides ``FleetIndex``: per host, the keys held in each tier, kept current
by applying the host's ``WatchBlocks`` stream (``peer.proto``: RESET,
SNAPSHOT..., SYNCED, then ADD/REMOVE batches numbered seq+1, seq+2, ... and
HEARTBEATs). Any break in that order (a missing batch number, another epoch,
a batch before the snapshot completed) raises ``GapError``: the host's state
is dropped and the caller resubscribes with epoch 0, which makes the sidecar
send a fresh snapshot. A host is usable for routing only while synced and
heard from recently (``fresh``), so a silent host falls back to a direct
lookup, never to a stale picture.

Pure apart from the clock passed in; thread-safe.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NoReturn

from tierstore.keys import KEY_BYTES, BlockKey, unpack_keys
from tierstore.load import HostLoadView
from tierstore.v1 import common_pb2, peer_pb2
from tierstore.wire import load_from_proto

_BITS = {common_pb2.TIER_HBM: 1, common_pb2.TIER_DRAM: 2, common_pb2.TIER_NVME: 4}
# The best tier a key is held in, from its bits (HBM over DRAM over NVMe).
_BEST = [0] + [next(t for t, b in _BITS.items() if m & b) for m in range(1, 8)]


def tier_bit(tier: common_pb2.Tier) -> int:
    """The bit of a wire tier (HBM, DRAM, NVMe) in a key's tier bits."""
    return _BITS[tier]


def best_tier(bits: int) -> int:
    """The best wire tier among a key's tier bits (HBM over DRAM over NVMe)."""
    return _BEST[bits]


class GapError(Exception):
    """The event stream of a host broke its order; resynchronise."""


@dataclass
class HostState:
    epoch: int = 0
    seq: int = 0
    synced: bool = False
    held: dict[bytes, int] = field(default_factory=dict)  # key -> tier bits
    load: HostLoadView | None = None
    heard_at: float = 0.0


class FleetIndex:
    def __init__(self, stale_s: float, max_keys_per_host: int = 1 << 23) -> None:
        self.stale_s = stale_s
        self.max_keys_per_host = max_keys_per_host  # bounds the router's memory per host
        self._hosts: dict[str, HostState] = {}
        self._lock = threading.Lock()
        self.resyncs = 0

    def apply(self, host: str, msg: peer_pb2.BlockEvents, now: float) -> None:
        """Apply one message of ``host``'s stream; GapError if out of order."""
        with self._lock:
            st = self._hosts.setdefault(host, HostState())
            op = msg.op
            if op == peer_pb2.BLOCK_OP_RESET:
                self._hosts[host] = HostState(epoch=msg.epoch, heard_at=now)
                return
            if msg.epoch != st.epoch:
                self._broken(host, f"epoch {msg.epoch} while at {st.epoch} without a reset")
            st.heard_at = now
            if op == peer_pb2.BLOCK_OP_SNAPSHOT:
                if st.synced:
                    self._broken(host, "snapshot part after the snapshot ended")
                self._change(host, st, msg, add=True)
            elif op == peer_pb2.BLOCK_OP_SYNCED:
                st.seq, st.synced, st.load = msg.seq, True, _load(msg)
            elif op in (peer_pb2.BLOCK_OP_ADD, peer_pb2.BLOCK_OP_REMOVE):
                if not st.synced or msg.seq != st.seq + 1:
                    self._broken(host, f"batch {msg.seq} after {st.seq}")
                self._change(host, st, msg, add=op == peer_pb2.BLOCK_OP_ADD)
                st.seq = msg.seq
            elif op == peer_pb2.BLOCK_OP_HEARTBEAT:
                if not st.synced or msg.seq != st.seq:
                    self._broken(host, f"heartbeat at batch {msg.seq}, index at {st.seq}")
                st.load = _load(msg)
            else:
                self._broken(host, f"unknown op {op}")

    def _broken(self, host: str, why: str) -> NoReturn:
        """Lock held: forget the host; the caller resubscribes from a snapshot."""
        self._hosts[host] = HostState()
        self.resyncs += 1
        raise GapError(f"{host}: {why}")

    def _change(self, host: str, st: HostState, msg: peer_pb2.BlockEvents, add: bool) -> None:
        bit = _BITS.get(msg.tier)
        if bit is None or len(msg.keys) % KEY_BYTES:
            self._broken(host, f"malformed event: tier {msg.tier}, {len(msg.keys)} key bytes")
        held = st.held
        for key in unpack_keys(msg.keys):
            bits = held.get(key, 0)
            bits = bits | bit if add else bits & ~bit
            if bits:
                held[key] = bits
            else:
                held.pop(key, None)
        if len(held) > self.max_keys_per_host:
            self._broken(host, f"holds more than {self.max_keys_per_host} keys")

    def cursor(self, host: str) -> tuple[int, int]:
        """(epoch, seq) to resume ``host``'s stream from; (0, 0) when not synced."""
        with self._lock:
            st = self._hosts.get(host)
            return (st.epoch, st.seq) if st is not None and st.synced else (0, 0)

    def forget(self, host: str) -> None:
        with self._lock:
            self._hosts.pop(host, None)

    def fresh(self, host: str, now: float) -> bool:
        with self._lock:
            st = self._hosts.get(host)
            return st is not None and st.synced and now - st.heard_at <= self.stale_s

    def silent(self, host: str, now: float) -> bool:
        """No message from ``host`` for longer than stale_s (or never)."""
        with self._lock:
            st = self._hosts.get(host)
            return st is None or now - st.heard_at > self.stale_s

    def prefix(self, host: str, keys: Sequence[BlockKey]) -> tuple[bytes, HostLoadView | None]:
        """Tier codes of the longest prefix of ``keys`` the host holds (best
        tier of each block), and its last reported load."""
        with self._lock:
            st = self._hosts.get(host)
            if st is None:
                return b"", None
            out = bytearray()
            for key in keys:
                bits = st.held.get(key, 0)
                if not bits:
                    break
                out.append(_BEST[bits])
            return bytes(out), st.load

    def num_keys(self, host: str) -> int:
        with self._lock:
            st = self._hosts.get(host)
            return len(st.held) if st is not None else 0


def _load(msg: peer_pb2.BlockEvents) -> HostLoadView | None:
    if not msg.HasField("load"):
        return None
    return load_from_proto(msg.load)
