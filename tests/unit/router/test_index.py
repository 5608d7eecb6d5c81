"""The block event log (sidecar side) and the router's FleetIndex (router side):
order, gaps, resync, and that snapshot + replay equals what the tiers hold."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np
import pytest

from tierstore.config.store import StoreConfig
from tierstore.keys import KVLayout, chain_keys
from tierstore.load import RateMeter
from tierstore.router.index import FleetIndex, GapError
from tierstore.sidecar.loadboard import EngineLoad, LoadBoard
from tierstore.store.events import BlockEventLog
from tierstore.store.tiered import TieredStore
from tierstore.tiers import TIER_CODES, TierName
from tierstore.v1 import common_pb2, peer_pb2

K = [bytes([i]) * 32 for i in range(1, 20)]
DRAM, NVME = common_pb2.TIER_DRAM, common_pb2.TIER_NVME


def ev(
    op: int, seq: int = 0, tier: int = DRAM, keys: Sequence[bytes] = (), epoch: int = 7
) -> peer_pb2.BlockEvents:
    return peer_pb2.BlockEvents(epoch=epoch, seq=seq, op=op, tier=tier, keys=b"".join(keys))


def synced_index(seq: int = 10) -> FleetIndex:
    idx = FleetIndex(stale_s=5.0)
    idx.apply("h", ev(peer_pb2.BLOCK_OP_RESET), 0.0)
    idx.apply("h", ev(peer_pb2.BLOCK_OP_SNAPSHOT, keys=K[:3]), 0.0)
    idx.apply("h", ev(peer_pb2.BLOCK_OP_SNAPSHOT, tier=NVME, keys=K[2:5]), 0.0)
    idx.apply("h", ev(peer_pb2.BLOCK_OP_SYNCED, seq=seq), 0.0)
    return idx


# -- the sidecar's log -------------------------------------------------------------


def test_log_numbers_batches_and_hands_them_out_in_order() -> None:
    log = BlockEventLog(max_keys=100)
    assert log.epoch > 0 and log.seq == 0
    log.record(True, TierName.DRAM, K[:2])
    log.record(False, TierName.DRAM, K[:1])
    log.record(True, TierName.DRAM, [])  # nothing: no batch
    got = log.after(0, timeout_s=0)
    assert got is not None and [b.seq for b in got] == [1, 2]
    assert got[0].added and not got[1].added and got[0].keys == K[0] + K[1]
    assert log.after(2, timeout_s=0.01) == []  # nothing new: waits, then empty
    assert [b.seq for b in log.after(0, timeout_s=0, limit=1) or []] == [1]


def test_log_wakes_a_waiting_reader() -> None:
    log = BlockEventLog(max_keys=100)
    threading.Timer(0.05, lambda: log.record(True, TierName.NVME, K[:1])).start()
    got = log.after(0, timeout_s=10)
    assert got is not None and got[0].tier == TierName.NVME


def test_log_drops_old_batches_and_says_so() -> None:
    log = BlockEventLog(max_keys=4)
    for k in K[:6]:
        log.record(True, TierName.DRAM, [k])
    assert log.retained_from() == 3
    assert log.after(0, timeout_s=0) is None  # batches 1-2 are gone: resync
    assert log.after(1, timeout_s=0) is None
    got = log.after(2, timeout_s=0)
    assert got is not None and [b.seq for b in got] == [3, 4, 5, 6]
    with pytest.raises(ValueError):
        BlockEventLog(max_keys=0)


def test_log_bounds_batches_too() -> None:
    log = BlockEventLog(max_keys=1024)  # 128 batches at most
    for i in range(500):
        log.record(False, TierName.DRAM, [i.to_bytes(32, "big")])
    assert log.retained_from() == 500 - 128 + 1 and log.seq == 500


# -- the router's index ----------------------------------------------------------------


def test_index_applies_snapshot_then_batches() -> None:
    idx = synced_index()
    assert idx.cursor("h") == (7, 10)
    tiers, _ = idx.prefix("h", K[:6])
    assert list(tiers) == [DRAM, DRAM, DRAM, NVME, NVME]  # K[2] in both: DRAM is better
    idx.apply("h", ev(peer_pb2.BLOCK_OP_REMOVE, seq=11, keys=K[2:3]), 1.0)
    tiers, _ = idx.prefix("h", K[:6])
    assert list(tiers) == [DRAM, DRAM, NVME, NVME, NVME]
    idx.apply("h", ev(peer_pb2.BLOCK_OP_REMOVE, seq=12, tier=NVME, keys=K[2:3]), 1.0)
    assert len(idx.prefix("h", K[:6])[0]) == 2
    idx.apply("h", ev(peer_pb2.BLOCK_OP_ADD, seq=13, keys=K[2:3]), 1.0)
    assert len(idx.prefix("h", K[:6])[0]) == 5
    assert idx.num_keys("h") == 5


def test_a_missing_batch_is_a_gap_and_forgets_the_host() -> None:
    idx = synced_index()
    with pytest.raises(GapError, match="batch 12 after 10"):
        idx.apply("h", ev(peer_pb2.BLOCK_OP_ADD, seq=12, keys=K[5:6]), 1.0)
    assert idx.resyncs == 1 and idx.cursor("h") == (0, 0)  # resubscribe from a snapshot
    assert idx.prefix("h", K[:3])[0] == b"" and not idx.fresh("h", 1.0)


@pytest.mark.parametrize(
    "msg, why",
    [
        (ev(peer_pb2.BLOCK_OP_HEARTBEAT, seq=11), "heartbeat at batch 11"),
        (ev(peer_pb2.BLOCK_OP_ADD, seq=11, epoch=8, keys=K[:1]), "epoch 8"),
        (ev(peer_pb2.BLOCK_OP_SNAPSHOT, keys=K[:1]), "after the snapshot ended"),
        (ev(peer_pb2.BLOCK_OP_ADD, seq=11, tier=common_pb2.TIER_PEER, keys=K[:1]), "malformed"),
        (peer_pb2.BlockEvents(epoch=7, seq=11, op=peer_pb2.BLOCK_OP_ADD, tier=DRAM, keys=b"x"),
         "malformed"),
        (ev(99, seq=11), "unknown op"),
    ],
)  # fmt: skip
def test_out_of_order_or_malformed_streams_resync(msg: peer_pb2.BlockEvents, why: str) -> None:
    idx = synced_index()
    with pytest.raises(GapError, match=why):
        idx.apply("h", msg, 1.0)
    assert idx.cursor("h") == (0, 0)


def test_a_host_over_the_key_bound_is_dropped() -> None:
    idx = FleetIndex(stale_s=5.0, max_keys_per_host=4)
    idx.apply("h", ev(peer_pb2.BLOCK_OP_RESET), 0.0)
    with pytest.raises(GapError, match="more than 4 keys"):
        idx.apply("h", ev(peer_pb2.BLOCK_OP_SNAPSHOT, keys=K[:5]), 0.0)
    assert idx.num_keys("h") == 0


def test_batches_before_the_snapshot_ended_are_a_gap() -> None:
    idx = FleetIndex(stale_s=5.0)
    idx.apply("h", ev(peer_pb2.BLOCK_OP_RESET), 0.0)
    with pytest.raises(GapError):
        idx.apply("h", ev(peer_pb2.BLOCK_OP_ADD, seq=1, keys=K[:1]), 0.0)


def test_freshness_follows_heartbeats() -> None:
    idx = synced_index()
    assert idx.fresh("h", 4.0) and not idx.fresh("h", 6.0) and idx.silent("h", 6.0)
    load = common_pb2.HostLoad(reported=True, busy_slots=2, slots=4, queue_len=1)
    idx.apply("h", peer_pb2.BlockEvents(epoch=7, seq=10, op=peer_pb2.BLOCK_OP_HEARTBEAT,
                                        load=load), 6.0)  # fmt: skip
    assert idx.fresh("h", 10.0)
    view = idx.prefix("h", K[:1])[1]
    assert view is not None and (view.busy_slots, view.slots, view.queue_len) == (2, 4, 1)
    assert not idx.fresh("other", 0.0) and idx.silent("other", 0.0)


# -- snapshot + replay equals the tiers ---------------------------------------------


def _as_messages(store: TieredStore, epoch: int, after_seq: int) -> list[peer_pb2.BlockEvents]:
    batches = store.events.after(after_seq, timeout_s=0, limit=1 << 30) or []
    return [
        peer_pb2.BlockEvents(
            epoch=epoch,
            seq=b.seq,
            tier=TIER_CODES[b.tier],
            keys=b.keys,
            op=peer_pb2.BLOCK_OP_ADD if b.added else peer_pb2.BLOCK_OP_REMOVE,
        )
        for b in batches
    ]


def test_snapshot_plus_replay_equals_what_the_tiers_hold(
    store_config: Callable[..., StoreConfig], layout: KVLayout
) -> None:
    rng = random.Random(3)
    keys = chain_keys(layout, np.arange(96 * layout.block_tokens))
    data = np.zeros((1, layout.block_bytes), dtype=np.uint8)
    # 1 MiB DRAM over 2 MiB NVMe with 8 KiB blocks: writes evict and spill.
    with TieredStore(store_config(dram_bytes=256 << 10, nvme_bytes=2 << 20)) as store:
        idx = FleetIndex(stale_s=60)
        epoch = store.events.epoch
        snapshot_at = 150
        for step in range(300):
            k = rng.choice(keys)
            action = rng.random()
            if action < 0.6:
                store.put(layout, [k], data)
            elif action < 0.8:
                store.demote([k])
            else:
                store.drop([k], [rng.choice([TierName.DRAM, TierName.NVME])])
            if step == snapshot_at:
                seq, held = store.snapshot()
                idx.apply("h", ev(peer_pb2.BLOCK_OP_RESET, epoch=epoch), 0.0)
                for tier, tkeys in held.items():
                    idx.apply("h", ev(peer_pb2.BLOCK_OP_SNAPSHOT, tier=TIER_CODES[tier],
                                      keys=tkeys, epoch=epoch), 0.0)  # fmt: skip
                synced_seq = seq
        deadline = time.monotonic() + 10
        while store.dram.used_bytes() > store.demoter.high_bytes and time.monotonic() < deadline:
            time.sleep(0.01)  # let the demoter settle
        idx.apply("h", ev(peer_pb2.BLOCK_OP_SYNCED, seq=synced_seq, epoch=epoch), 0.0)
        for msg in _as_messages(store, epoch, synced_seq):
            idx.apply("h", msg, 0.0)
        _, truth = store.snapshot()
        dram, nvme = set(truth[TierName.DRAM]), set(truth[TierName.NVME])
        assert dram and nvme  # the workload really used both tiers
        for k in keys:
            tiers, _ = idx.prefix("h", [k])
            want = DRAM if k in dram else NVME if k in nvme else None
            assert (tiers[0] if tiers else None) == want


# -- load reports and rate meters -----------------------------------------------------


def test_load_board_sums_fresh_reports(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    board = LoadBoard(ttl_s=10)
    assert not board.host().reported
    board.report(1, EngineLoad(2, 4, 1, prefill_tokens_per_s=1000.0))
    now[0] = 105.0
    board.report(2, EngineLoad(4, 4, 3, wait_s=1.5, prefill_tokens_per_s=3000.0))
    h = board.host()
    assert (h.busy_slots, h.slots, h.queue_len, h.wait_s) == (6, 8, 4, 1.5)
    assert h.prefill_tokens_per_s == 2000.0 and h.age_s == pytest.approx(5.0)
    now[0] = 112.0  # the first report expired
    assert board.host().slots == 4
    board.forget(2)
    assert not board.host().reported
    with pytest.raises(ValueError, match="exceeds"):
        board.report(3, EngineLoad(5, 4, 0))


def test_rate_meter_pools_small_reads() -> None:
    m = RateMeter()
    m.add(512 << 10, 0.001)
    assert m.bytes_per_s == 0.0  # half a sample
    m.add(512 << 10, 0.001)
    assert m.bytes_per_s == pytest.approx((1 << 20) / 0.002)
    m.add(4 << 20, 1.0)
    assert (1 << 20) / 0.002 > m.bytes_per_s > 4 << 20
