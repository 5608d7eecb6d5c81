"""ReplicaLedger: the order replicas leave in (least recently pushed first),
the budget promise, and what counts as a replica."""

from __future__ import annotations

from tierstore.keys import BlockKey
from tierstore.store.replicas import ReplicaLedger


def k(i: int) -> BlockKey:
    return BlockKey(i.to_bytes(32, "little"))


def test_refresh_moves_a_pushed_again_replica_to_the_newest_end() -> None:
    ledger = ReplicaLedger()
    ledger.settle(0, [k(0), k(1), k(2)], 10)  # session X: head k(0)
    ledger.settle(0, [k(10), k(11)], 10)  # session Y
    ledger.refresh(reversed([k(0), k(1), k(2)]))  # X pushed again, head last
    assert ledger.oldest() == [k(10), k(11), k(2), k(1), k(0)]
    assert ledger.oldest(1) == [k(10)]
    assert ledger.used_bytes() == 50


def test_refresh_leaves_own_blocks_alone() -> None:
    ledger = ReplicaLedger()
    ledger.settle(0, [k(1)], 10)
    ledger.refresh([k(7), k(1)])  # k(7) is this host's own block
    assert ledger.oldest() == [k(1)]
    assert ledger.used_bytes() == 10


def test_reserve_counts_promises_until_settled() -> None:
    ledger = ReplicaLedger()
    assert ledger.reserve(30, budget_bytes=40)
    assert not ledger.reserve(20, budget_bytes=40)
    ledger.settle(30, [k(1), k(2)], 10)
    assert ledger.pending_bytes() == 0 and ledger.used_bytes() == 20
    assert ledger.reserve(20, budget_bytes=40)
