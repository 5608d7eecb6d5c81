"""vLLM's KV events as they cross the wire, decoded without vLLM.

vLLM publishes ``[topic, seq, msgpack(KVEventBatch)]`` on ZMQ
(``--kv-events-config``). A batch is a msgpack array ``[ts, events,
data_parallel_rank]``; each event a map tagged by its class name
(``type``: ``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``).
Provides structs with the fields the router reads, under the same names,
and ``decode_batch(payload)``: the batch's events, in order, an event of a
kind this module does not know skipped (returned in ``unknown``), so a
newer vLLM's new event kind does not stop the stream. Fields beyond those
are ignored, as msgspec does for maps.

This keeps the router and the gateway free of a vLLM install;
``tests/unit/router/test_kv_events.py`` decodes what vLLM's own classes
encode. Pure; any thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec


class _Event(msgspec.Struct, tag=True, gc=False):
    pass


class BlockStored(_Event):
    block_hashes: list[Any]
    parent_block_hash: Any | None
    token_ids: list[int]
    block_size: int
    medium: str | None = None
    lora_name: str | None = None
    # LoRA, multimodal identifiers and the cache salt of each block: a
    # block with any is keyed by more than its tokens (see EngineIndex).
    extra_keys: list[Any] | None = None


class BlockRemoved(_Event):
    block_hashes: list[Any]
    medium: str | None = None


class AllBlocksCleared(_Event):
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


class _Batch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


_batch = msgspec.msgpack.Decoder(_Batch)
_event = msgspec.msgpack.Decoder(Event)
_tag = msgspec.msgpack.Decoder(dict[str, Any])


@dataclass(frozen=True, slots=True)
class Decoded:
    events: list[Event]
    unknown: int  # events of other kinds, skipped


def decode_batch(payload: bytes) -> Decoded:
    """The events of one KVEventBatch payload; raises msgspec.DecodeError
    when the payload is not a batch."""
    batch = _batch.decode(payload)
    events: list[Event] = []
    unknown = 0
    for raw in batch.events:
        try:
            events.append(_event.decode(raw))
        except msgspec.ValidationError:
            if _tag.decode(raw).get("type") in ("BlockStored", "BlockRemoved", "AllBlocksCleared"):
                raise  # one of ours, malformed: the batch is bad
            unknown += 1
    return Decoded(events, unknown)
