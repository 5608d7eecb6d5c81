"""The vLLM connector's BlockRemoved over a real sidecar (DRAM only, no NVMe).

Blocks announced in the connector's BlockStored are pushed out of the
sidecar's DRAM by later stores; the scheduler side's events
(``vllm.events.taken``, what ``take_events`` returns) then hold one
``BlockRemoved`` with exactly their vLLM hashes, read from the sidecar's
``WatchBlocks`` stream by ``vllm.removals.RemovalWatcher``. Controls:
blocks still held, blocks never announced and blocks pushed out of the
connector's map get none; hashes shifted by one block fail the oracle.

Every wait is bounded; the sidecar is stopped when the module ends.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import pytest
import torch
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

pytest.importorskip("vllm")

from vllm.distributed.kv_events import BlockRemoved, BlockStored

from tierstore.client import StoreClient
from tierstore.config.peer import PeerConfig
from tierstore.engines.vllm.events import (
    TierstoreKVEvents,
    merge,
    stored_blocks,
    stored_events,
    taken,
)
from tierstore.engines.vllm.plan import SaveSpec
from tierstore.engines.vllm.removals import RemovalWatcher, StoredBlocks
from tierstore.keys import KVLayout, chain_keys
from tierstore.peer.client import PeerClient

from ..conftest import SMALL_LAYOUT
from .test_peers import TOKEN, addr, free_port, start, stop_all

L: KVLayout = SMALL_LAYOUT  # 8 KiB blocks of 8 tokens
DRAM_BLOCKS = 32  # 256 KiB of DRAM, no NVMe: a block pushed out is gone


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, str]]:
    port = free_port()
    car = start(
        tmp_path_factory.mktemp("removals"), port, [], "--set", "watch_heartbeat_s=0.2",
        "--set", "dram_high_watermark=1.0", "--set", "dram_low_watermark=0.99",
        dram=f"{DRAM_BLOCKS * L.block_bytes}", nvme="0",
    )  # fmt: skip
    try:
        yield car, addr(port)
    finally:
        stop_all(car)


def wait_for(cond: Callable[[], bool], timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def tokens(seed: int, blocks: int) -> np.ndarray:
    return np.arange(blocks * L.block_tokens, dtype=np.int64) + seed * 1_000_000


def save(client: StoreClient, seed: int, blocks: int) -> tuple[SaveSpec, list[bytes]]:
    """Store a chain of ``blocks`` blocks; its SaveSpec with made-up vLLM hashes."""
    assert blocks < DRAM_BLOCKS
    ids = tokens(seed, blocks)
    keys = chain_keys(L, ids)
    data = torch.zeros((len(keys), L.block_bytes), dtype=torch.uint8)
    assert all(client.store(L, keys, data))
    spec = SaveSpec(
        req_id=f"r{seed}", salt="", keys=(tuple(keys),), block_ids=(tuple(range(blocks)),),
        block_hashes=tuple((seed * 1000 + i).to_bytes(32, "big") for i in range(blocks)),
        token_ids=tuple(ids.tolist()),
    )  # fmt: skip
    return spec, keys


def worker_events(spec: SaveSpec, hashes_of: SaveSpec | None = None) -> TierstoreKVEvents:
    """What the worker's get_kv_connector_kv_cache_events returns for a
    committed save, merged as the scheduler gets it (``hashes_of``: the
    control, announcing spec's keys under another save's hashes)."""
    positions = list(range(len(spec.keys[0])))
    events = TierstoreKVEvents()
    events.add_events(stored_events([(spec, positions)], L.block_tokens))
    events.blocks = stored_blocks([(spec, positions)])
    if hashes_of is not None:
        other = stored_blocks([(hashes_of, positions)])
        events.blocks = dict(zip(other, events.blocks.values()))
        events.add_events(stored_events([(hashes_of, positions)], L.block_tokens))
    out = merge(None, events)
    assert out is not None
    return out


def hashes(spec: SaveSpec) -> list[Any]:
    """vLLM's hashes of the save as its events carry them."""
    return sorted(maybe_convert_block_hash(h) for h in spec.block_hashes)


def removed_hashes(events: list[Any]) -> list[Any]:
    return [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]


def watcher(address: str, max_blocks: int) -> RemovalWatcher:
    client = PeerClient(address, PeerConfig(), TOKEN)
    w = RemovalWatcher(StoredBlocks(max_blocks), client.watch_blocks, stream_s=1.0)
    wait_for(lambda: w.blocks.cursor() != (0, 0))  # the first snapshot is in
    return w


def push_out(client: StoreClient, seed: int, gone: list[bytes], kept: Sequence[bytes] = ()) -> None:
    """Store new blocks one at a time, using ``kept`` after each (the most
    recent, never evicted), until every block of ``gone`` left DRAM."""
    keys = chain_keys(L, tokens(seed, 4 * DRAM_BLOCKS))
    block = torch.zeros((1, L.block_bytes), dtype=torch.uint8)
    into = torch.empty((len(kept), L.block_bytes), dtype=torch.uint8)
    for key in keys:
        if all(client.lookup(L, [k]).num_hits == 0 for k in gone):
            break
        assert all(client.store(L, [key], block))
        if kept:
            assert client.load(L, kept, into).num_blocks == len(kept)
    assert all(client.lookup(L, [k]).num_hits == 0 for k in gone)
    assert client.lookup(L, kept).num_hits == len(kept)


def collect_removed(w: RemovalWatcher, want: int, timeout_s: float = 15.0) -> list[Any]:
    got: list[Any] = []
    deadline = time.monotonic() + timeout_s
    while len(got) < want and time.monotonic() < deadline:
        got += removed_hashes(taken(None, w.blocks))
        time.sleep(0.05)
    return got


def test_blocks_that_leave_tierstore_get_block_removed_with_their_hashes(
    sidecar: tuple[Any, str],
) -> None:
    car, address = sidecar
    client = StoreClient(str(car.socket), name="vllm-removals")
    w = watcher(address, max_blocks=1000)
    try:
        spec, keys = save(client, 1, 8)
        out = taken(worker_events(spec), w.blocks)
        stored = [h for e in out if isinstance(e, BlockStored) for h in e.block_hashes]
        assert sorted(stored) == hashes(spec)
        assert not removed_hashes(out)  # held: nothing removed yet

        push_out(client, 2, keys)  # chain 2 is never announced: no event for it
        assert sorted(collect_removed(w, len(keys))) == hashes(spec)
        assert len(w.blocks) == 0

        # Control: a block still held gets none. Chains 3 and 4 are announced,
        # chain 4 is used, and the next push evicts chain 3 only.
        spec3, keys3 = save(client, 3, 4)
        spec4, keys4 = save(client, 4, 4)
        taken(worker_events(spec3), w.blocks)
        taken(worker_events(spec4), w.blocks)
        push_out(client, 5, keys3, kept=keys4)
        got = collect_removed(w, len(keys3))
        assert sorted(got) == hashes(spec3)
        assert len(w.blocks) == 4
        # Each stream ends at its deadline (1 s) and is reopened from its cursor.
        wait_for(lambda: w.counters.stream_ends >= 1)
        stats = w.stats()
        assert stats["alive"] and stats["gaps"] == stats["stream_errors"] == 0
        assert stats["removed"] == 12 and stats["tracked_blocks"] == 4
    finally:
        w.close()
        client.close()


def test_the_oracle_fails_on_other_hashes_and_forgets_beyond_its_bound(
    sidecar: tuple[Any, str],
) -> None:
    car, address = sidecar
    client = StoreClient(str(car.socket), name="vllm-removals-control")
    small = watcher(address, max_blocks=4)
    try:
        spec, keys = save(client, 11, 8)
        # The map holds the last 4 blocks announced; the first 4 are forgotten.
        taken(worker_events(spec), small.blocks)
        assert small.blocks.counters.forgotten == 4
        push_out(client, 12, keys)
        removed = collect_removed(small, 4)
        assert sorted(removed) == hashes(spec)[4:]

        # Chain 13's keys announced under chain 14's hashes (and the other way
        # round): chain 13 leaves, and the oracle sees the wrong hashes.
        spec13, keys13 = save(client, 13, 2)
        spec14, keys14 = save(client, 14, 2)
        taken(worker_events(spec13, hashes_of=spec14), small.blocks)
        taken(worker_events(spec14, hashes_of=spec13), small.blocks)
        push_out(client, 15, keys13, kept=keys14)
        wrong = collect_removed(small, 2)
        assert sorted(wrong) == hashes(spec14)
        assert sorted(wrong) != hashes(spec13)
    finally:
        small.close()
        client.close()
