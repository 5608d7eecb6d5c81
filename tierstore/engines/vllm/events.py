"""The vLLM connector's KV events: vLLM's ``BlockStored`` for the blocks tierstore holds.

With vLLM's KV events on (``--kv-events-config``), a router that reads
vLLM's event stream (llm-d's KV-cache indexer, Dynamo's router) learns from
vLLM itself which prefixes its GPU cache holds. The connector adds one
``BlockStored`` per run of consecutive blocks that a step's saves left in
tierstore (committed, or already held), with vLLM's own block hashes, the
blocks' tokens and ``medium="CPU"`` (tierstore's DRAM, where a save
lands), so the same router sees what tierstore can serve to this engine
after vLLM evicted it.

The worker builds the events once its commits returned
(``stored_events``) and returns them from
``get_kv_connector_kv_cache_events`` as ``TierstoreKVEvents``; vLLM merges
the workers' (``add_events`` / ``increment_workers``) and hands them to the
scheduler's ``update_connector_output``, whose ``take_events`` yields the
events every worker emitted (each tensor-parallel rank saves its own part of
a block; a block is in tierstore once every rank's part is).

``BlockRemoved`` (with ``removed_events_peer``): the events carry each
stored block's tierstore keys (``TierstoreKVEvents.blocks``, every rank's);
the scheduler's ``take_events`` hands the blocks of the events every worker
emitted to a ``vllm.removals.StoredBlocks``, whose watcher follows the
sidecar's ``WatchBlocks`` stream, and adds one ``BlockRemoved`` (same
medium) for the blocks that left tierstore since the last step.

Runs in vLLM's worker and scheduler processes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllm.distributed.kv_events import (
    MEDIUM_CPU,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVConnectorKVEvents,
    KVEventAggregator,
)
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from tierstore.engines.vllm.plan import SaveSpec
from tierstore.engines.vllm.removals import StoredBlocks
from tierstore.keys import BlockKey

MEDIUM = MEDIUM_CPU


def stored_blocks(
    stored: Sequence[tuple[SaveSpec, list[int]]],
) -> dict[Any, tuple[BlockKey, ...]]:
    """vLLM's hash (as in the events) -> the block's keys, one per rank."""
    return {
        maybe_convert_block_hash(spec.block_hashes[p]): tuple(keys[p] for keys in spec.keys)
        for spec, positions in stored
        for p in positions
    }


def removed_event(block_hashes: list[Any]) -> BlockRemoved:
    return BlockRemoved(block_hashes=block_hashes, medium=MEDIUM)


def stored_events(
    stored: Sequence[tuple[SaveSpec, list[int]]], block_tokens: int
) -> list[KVCacheEvent]:
    """One ``BlockStored`` per run of consecutive held positions of each save."""
    events: list[KVCacheEvent] = []
    for spec, positions in stored:
        runs: list[list[int]] = []
        for p in positions:
            if runs and p == runs[-1][-1] + 1:
                runs[-1].append(p)
            else:
                runs.append([p])
        for run in runs:
            a, b = run[0], run[-1] + 1
            parent = spec.block_hashes[a - 1] if a else spec.parent_hash
            events.append(
                BlockStored(
                    block_hashes=[maybe_convert_block_hash(h) for h in spec.block_hashes[a:b]],
                    parent_block_hash=maybe_convert_block_hash(parent) if parent else None,
                    token_ids=list(spec.token_ids[a * block_tokens : b * block_tokens]),
                    block_size=block_tokens,
                    lora_id=None,
                    medium=MEDIUM,
                    lora_name=None,
                )
            )
    return events


class TierstoreKVEvents(KVConnectorKVEvents):
    """vLLM's container for connector events (kept: what every worker emitted)."""

    def __init__(self, num_workers: int = 1) -> None:
        self._aggregator = KVEventAggregator(num_workers)
        # vLLM's hash -> tierstore's keys of the blocks in the BlockStored
        # events (the same from every worker: each names every rank's keys).
        self.blocks: dict[Any, tuple[BlockKey, ...]] = {}

    def add_events(self, events: list[KVCacheEvent]) -> None:
        self._aggregator.add_events(events)

    def aggregate(self) -> TierstoreKVEvents:
        common = self._aggregator.get_common_events()
        self._aggregator.clear_events()
        self._aggregator.add_events(common)
        self._aggregator.reset_workers()
        return self

    def increment_workers(self, count: int = 1) -> None:
        self._aggregator.increment_workers(count)

    def get_all_events(self) -> list[KVCacheEvent]:
        return list(self._aggregator.get_all_events())

    def get_number_of_workers(self) -> int:
        return int(self._aggregator.get_number_of_workers())

    def clear_events(self) -> None:
        self._aggregator.clear_events()
        self._aggregator.reset_workers()

    def __repr__(self) -> str:
        return f"<TierstoreKVEvents {len(self.get_all_events())} events>"


def merge(into: TierstoreKVEvents | None, more: Any) -> TierstoreKVEvents | None:
    """``update_connector_output``'s events added to those not yet taken."""
    if not isinstance(more, TierstoreKVEvents):
        return into
    if into is None:
        return more
    into.add_events(more.get_all_events())
    into.increment_workers(more.get_number_of_workers())
    into.blocks.update(more.blocks)
    return into


def taken(events: TierstoreKVEvents | None, removals: StoredBlocks | None) -> list[KVCacheEvent]:
    """The scheduler's ``take_events``: the events every worker emitted, then
    one ``BlockRemoved`` for what left tierstore since (with ``removals``);
    the stored blocks among them are announced to ``removals``."""
    out = events.aggregate().get_all_events() if events is not None else []
    if removals is not None:
        if events is not None:
            removals.stored(common_blocks(out, events.blocks))
        gone = removals.take()
        if gone:
            out.append(removed_event(gone))
    return out


def common_blocks(
    events: Sequence[KVCacheEvent], blocks: dict[Any, tuple[BlockKey, ...]]
) -> list[tuple[Any, tuple[BlockKey, ...]]]:
    """The (hash, keys) of the blocks in the ``BlockStored`` of ``events``."""
    return [
        (h, blocks[h])
        for e in events
        if isinstance(e, BlockStored)
        for h in e.block_hashes
        if h in blocks
    ]
