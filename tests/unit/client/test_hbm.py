"""HBM tier on device='cpu': slots, LRU victims, dirty tracking."""

from __future__ import annotations

import torch

from tierstore.client.hbm import HbmTier
from tierstore.keys import BlockKey

FP = b"\x02" * 32


def k(i: int) -> BlockKey:
    return BlockKey(i.to_bytes(32, "little"))


def test_allocate_get_and_evict_lru() -> None:
    hbm = HbmTier(64 << 10, "cpu", segment_bytes=64 << 10)
    for i in range(8):
        slot = hbm.allocate(k(i), FP, 8192, dirty=True)
        assert slot is not None
        slot.fill_(i)
    assert hbm.allocate(k(99), FP, 8192, dirty=True) is None  # full
    hbm.get([k(0)])  # k(0) becomes most recent
    victims = hbm.take_victims(8192, max_blocks=4)
    assert [v.key for v in victims] == [k(1)] and victims[0].dirty
    assert torch.all(hbm.view(victims[0]) == 1)
    assert hbm.contains([k(1)]) == [True]  # readable until freed
    hbm.free(victims)
    assert hbm.contains([k(1)]) == [False]
    assert hbm.allocate(k(99), FP, 8192, dirty=False) is not None
    (view,) = hbm.get([k(0)])
    assert view is not None and torch.all(view == 0)
    stats = hbm.stats()
    assert stats.evictions == 1 and stats.num_blocks == 8 and stats.hits == 2


def test_dirty_and_clean() -> None:
    hbm = HbmTier(64 << 10, "cpu")
    hbm.allocate(k(1), FP, 4096, dirty=True)
    hbm.allocate(k(2), FP, 4096, dirty=False)
    assert [e.key for e in hbm.dirty()] == [k(1)]
    hbm.mark_clean([k(1)])
    assert hbm.dirty() == []
    assert hbm.remove([k(1), k(3)]) == 1
