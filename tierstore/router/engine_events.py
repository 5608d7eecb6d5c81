"""The router's index of what vLLM engines say they hold, from vLLM's own KV events.

Provides:
- ``EngineIndex``: per candidate host (a sidecar's peer address), the
  tierstore keys of the blocks its engine's ``BlockStored`` events announced
  and no ``BlockRemoved`` took back, with the tier each is in (medium
  ``GPU``: HBM; ``CPU``, which tierstore's connector uses for its DRAM:
  DRAM; any other: NVMe). vLLM's block hashes are not tierstore keys, and
  they cannot be turned into them: the index chains tierstore's keys itself
  (``chain_keys`` with the engine's layout) over each event's token ids,
  starting from the key of the event's parent block, which it learned from
  the event that announced the parent (none: the chain's root). An event
  whose parent it never saw (pushed out of its bound, or announced before
  the router subscribed) is skipped and counted, as is a block vLLM keyed
  by more than its tokens (LoRA, images, a cache salt: ``extra_keys``).
  ``AllBlocksCleared`` drops
  the engine's HBM blocks. Bounded: at most ``max_blocks`` hashes per host
  (least recently announced forgotten first). Pure apart from its lock;
  thread-safe.
- ``EngineSubscriber``: one thread per engine ("router-vllm-events-HOST")
  that reads vLLM's ZMQ publisher (``--kv-events-config``: ``[topic, seq,
  msgpack(KVEventBatch)]``, decoded by ``router.kv_events`` without vLLM)
  with a receive deadline of ``poll_s`` so that
  ``close`` ends it; a batch number that skips one drops the host's picture
  (a lost ``BlockRemoved`` would leave a stale one). Decode errors are
  counted, never fatal; an unexpected error ends the thread with one log
  line and ``alive()`` False.

Runs in the router's process (``tierstore router --vllm-events``).
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from tierstore.counters import Counters
from tierstore.errors import ConfigError
from tierstore.keys import BlockKey, KVLayout, chain_keys
from tierstore.router.index import best_tier, tier_bit
from tierstore.router.kv_events import decode_batch
from tierstore.v1 import common_pb2

log = logging.getLogger(__name__)

_MEDIUM_TIERS = {"GPU": common_pb2.TIER_HBM, "CPU": common_pb2.TIER_DRAM}
_HBM_BIT = tier_bit(common_pb2.TIER_HBM)


def medium_bit(medium: str | None) -> int:
    """vLLM's medium as the index's tier bit (None: vLLM's own cache, GPU)."""
    if medium is None:
        return _HBM_BIT
    return tier_bit(_MEDIUM_TIERS.get(medium.upper(), common_pb2.TIER_NVME))


@dataclass(slots=True)
class _Engine:
    key_of: OrderedDict[Any, BlockKey] = field(default_factory=OrderedDict)  # hash -> key
    bits: dict[BlockKey, int] = field(default_factory=dict)  # key -> tier bits
    seq: int = -1  # the last batch number applied


class EngineIndex:
    """See the module docstring."""

    def __init__(self, layout: KVLayout, max_blocks: int = 1 << 20) -> None:
        self.layout = layout
        self.max_blocks = max_blocks
        self._lock = threading.Lock()
        self._engines: dict[str, _Engine] = {}
        self.counters = Counters(
            ("batches", "stored_blocks", "removed_blocks", "unknown_parent", "partial_blocks",
             "other_block_size", "salted_blocks", "forgotten", "gaps", "clears")
        )  # fmt: skip

    def apply(self, host: str, seq: int, events: Iterable[Any]) -> None:
        """Apply batch ``seq`` of ``host``'s engine (a KVEventBatch's events)."""
        with self._lock:
            eng = self._engines.setdefault(host, _Engine())
            if eng.seq >= 0 and seq != eng.seq + 1:
                self.counters.add("gaps")
                eng = self._engines[host] = _Engine()
            eng.seq = seq
            self.counters.add("batches")
            for ev in events:
                kind = type(ev).__name__
                if kind == "BlockStored":
                    self._stored(eng, ev)
                elif kind == "BlockRemoved":
                    self._removed(eng, ev)
                elif kind == "AllBlocksCleared":
                    self._clear(eng)

    def _stored(self, eng: _Engine, ev: Any) -> None:
        if ev.block_size != self.layout.block_tokens:
            self.counters.add("other_block_size")
            return
        if getattr(ev, "lora_name", None) or any(getattr(ev, "extra_keys", None) or ()):
            # LoRA, images or a cache salt: vLLM keyed these blocks by more
            # than their tokens, and so would the connector; an unsalted
            # prompt with the same tokens does not hold them.
            self.counters.add("salted_blocks")
            return
        parent = None
        if ev.parent_block_hash is not None:
            parent = eng.key_of.get(ev.parent_block_hash)
            if parent is None:
                self.counters.add("unknown_parent")
                return
        keys = chain_keys(self.layout, list(ev.token_ids), parent)
        if len(keys) != len(ev.block_hashes):
            self.counters.add("partial_blocks")
            return
        bit = medium_bit(ev.medium)
        for h, key in zip(ev.block_hashes, keys):
            eng.key_of.pop(h, None)
            eng.key_of[h] = key
            eng.bits[key] = eng.bits.get(key, 0) | bit
        self.counters.add("stored_blocks", len(keys))
        while len(eng.key_of) > self.max_blocks:
            _, key = eng.key_of.popitem(last=False)
            eng.bits.pop(key, None)
            self.counters.add("forgotten")

    def _removed(self, eng: _Engine, ev: Any) -> None:
        bit = medium_bit(ev.medium)
        for h in ev.block_hashes:
            key = eng.key_of.get(h)
            if key is None:
                continue
            bits = eng.bits.get(key, 0) & ~bit
            if bits:
                eng.bits[key] = bits
            else:  # the hash stays known: a child announced later still chains from it
                eng.bits.pop(key, None)
            self.counters.add("removed_blocks")

    def _clear(self, eng: _Engine) -> None:
        self.counters.add("clears")
        for key in [k for k, b in eng.bits.items() if b & _HBM_BIT]:
            bits = eng.bits[key] & ~_HBM_BIT
            if bits:
                eng.bits[key] = bits
            else:
                del eng.bits[key]

    def forget(self, host: str) -> None:
        with self._lock:
            self._engines.pop(host, None)

    def prefix(self, host: str, keys: Sequence[BlockKey]) -> bytes:
        """Tier codes of the longest prefix of ``keys`` the engine's events say it holds."""
        with self._lock:
            eng = self._engines.get(host)
            if eng is None:
                return b""
            out = bytearray()
            for key in keys:
                bits = eng.bits.get(key, 0)
                if not bits:
                    break
                out.append(best_tier(bits))
            return bytes(out)

    def num_keys(self, host: str) -> int:
        with self._lock:
            eng = self._engines.get(host)
            return len(eng.bits) if eng is not None else 0


def merge_tiers(a: bytes, b: bytes) -> bytes:
    """Per block, the better tier of two prefixes (HBM < DRAM < NVMe in code);
    the merged prefix runs as long as either holds each block."""
    n = max(len(a), len(b))
    return bytes(
        min(x for x in (a[i] if i < len(a) else 0, b[i] if i < len(b) else 0) if x)
        for i in range(n)
    )


def read_layout(text: str) -> KVLayout:
    """A KV layout from JSON, or from the file holding it."""
    source = text
    if not text.lstrip().startswith("{"):
        try:
            source = Path(text).read_text()
        except OSError as e:
            raise ConfigError(f"router_vllm_layout: cannot read {text!r}: {e}") from e
    try:
        return KVLayout.from_dict(json.loads(source))
    except (json.JSONDecodeError, TypeError, ValueError) as e:
        raise ConfigError(f"router_vllm_layout: not a KV layout: {e}") from e


def parse_endpoints(items: Iterable[str]) -> dict[str, str]:
    """``HOST=tcp://engine:port`` items as {candidate host: ZMQ endpoint}."""
    out: dict[str, str] = {}
    for item in items:
        host, sep, endpoint = item.partition("=")
        if not sep or not host or "://" not in endpoint:
            raise ConfigError(
                f"router_vllm_events: expected HOST=tcp://ENGINE:PORT (HOST: the sidecar's "
                f"peer address among the candidates), got {item!r}"
            )
        out[host] = endpoint
    return out


class EngineSubscriber:
    """See the module docstring."""

    def __init__(
        self, index: EngineIndex, host: str, endpoint: str, poll_s: float = 0.5, topic: str = ""
    ) -> None:
        import zmq

        self.index, self.host, self.endpoint, self.poll_s = index, host, endpoint, poll_s
        self._sock: Any = zmq.Context.instance().socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._sock.setsockopt(zmq.RCVTIMEO, int(poll_s * 1000))
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(endpoint)
        self._again = zmq.Again
        self._stop = threading.Event()
        self.counters = Counters(("batches", "bad_frames", "unknown_events", "subscriber_died"))
        self.error = ""
        self._thread = threading.Thread(
            target=self._run, name=f"router-vllm-events-{host}", daemon=True
        )
        self._thread.start()

    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    frames = self._sock.recv_multipart()
                except self._again:  # the receive deadline: look at _stop again
                    continue
                if len(frames) != 3 or len(frames[1]) != 8:
                    self.counters.add("bad_frames")
                    continue
                try:
                    batch = decode_batch(frames[2])
                except msgspec.DecodeError:
                    self.counters.add("bad_frames")
                    continue
                self.index.apply(self.host, int.from_bytes(frames[1], "big"), batch.events)
                self.counters.add("batches")
                self.counters.add("unknown_events", batch.unknown)
        except BaseException as e:  # a bug: visible in the log and alive(), never silent
            log.exception("vLLM events of %s (%s): the subscriber died", self.host, self.endpoint)
            self.error = f"{type(e).__name__}: {e}"
            self.counters.add("subscriber_died")
        finally:
            self._sock.close(linger=0)

    def close(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)


def start_subscribers(
    index: EngineIndex, endpoints: Mapping[str, str], poll_s: float = 0.5
) -> list[EngineSubscriber]:
    return [EngineSubscriber(index, h, e, poll_s) for h, e in endpoints.items()]
