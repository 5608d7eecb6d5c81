"""``router.engine_events.EngineIndex``: tierstore keys chained from vLLM's events."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("vllm")
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

from tierstore.errors import ConfigError
from tierstore.keys import chain_keys
from tierstore.router.engine_events import EngineIndex, merge_tiers, parse_endpoints
from tierstore.v1 import common_pb2

from ...conftest import SMALL_LAYOUT as L

HBM, DRAM, NVME = common_pb2.TIER_HBM, common_pb2.TIER_DRAM, common_pb2.TIER_NVME
TOKENS = list(range(6 * L.block_tokens))
KEYS = chain_keys(L, np.asarray(TOKENS))


def stored(
    lo: int, hi: int, medium: str | None = "GPU", block_size: int = L.block_tokens
) -> BlockStored:
    bt = L.block_tokens
    return BlockStored(
        block_hashes=[100 + i for i in range(lo, hi)], parent_block_hash=99 + lo if lo else None,
        token_ids=TOKENS[lo * bt : hi * bt], block_size=block_size, lora_id=None, medium=medium,
        lora_name=None,
    )  # fmt: skip


def test_chains_across_events_and_keeps_the_best_tier_per_medium() -> None:
    idx = EngineIndex(L)
    idx.apply("h", 0, [stored(0, 2), stored(2, 6, "CPU")])
    assert idx.prefix("h", KEYS) == bytes([HBM, HBM, DRAM, DRAM, DRAM, DRAM])
    idx.apply("h", 1, [stored(0, 1, "CPU"), BlockRemoved(block_hashes=[100], medium="GPU")])
    assert idx.prefix("h", KEYS)[:2] == bytes([DRAM, HBM])
    idx.apply("h", 2, [BlockRemoved(block_hashes=[103], medium="CPU")])
    assert len(idx.prefix("h", KEYS)) == 3
    idx.apply("h", 3, [AllBlocksCleared()])  # vLLM's GPU cache only
    assert idx.prefix("h", KEYS) == bytes([DRAM])
    assert idx.prefix("other", KEYS) == b""


def test_unknown_parents_other_block_sizes_and_gaps_are_not_indexed() -> None:
    idx = EngineIndex(L)
    idx.apply("h", 5, [stored(2, 4)])  # its parent was never announced
    idx.apply("h", 6, [stored(0, 2, block_size=16)])
    assert idx.prefix("h", KEYS) == b""
    assert idx.counters.unknown_parent == 1 and idx.counters.other_block_size == 1
    idx.apply("h", 7, [stored(0, 2)])
    assert len(idx.prefix("h", KEYS)) == 2
    idx.apply("h", 9, [])  # batch 8 was lost: its BlockRemoved could be missing
    assert idx.prefix("h", KEYS) == b"" and idx.counters.gaps == 1


def test_the_index_forgets_the_least_recently_announced() -> None:
    idx = EngineIndex(L, max_blocks=3)
    idx.apply("h", 0, [stored(0, 6)])
    assert idx.prefix("h", KEYS) == b"" and idx.num_keys("h") == 3
    assert idx.prefix("h", KEYS[3:]) == bytes([HBM] * 3)


def test_merge_tiers_and_endpoints() -> None:
    assert merge_tiers(bytes([DRAM, NVME]), bytes([HBM, 0, DRAM])) == bytes([HBM, NVME, DRAM])
    assert merge_tiers(b"", bytes([DRAM])) == bytes([DRAM])
    assert parse_endpoints(["a:1=tcp://e:5557"]) == {"a:1": "tcp://e:5557"}
    with pytest.raises(ConfigError):
        parse_endpoints(["tcp://e:5557"])
