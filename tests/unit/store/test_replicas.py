"""ReplicaLedger: the order replicas leave in (least recently pushed first),
the budget promise, and what counts as a replica; make_replica_room: which
replicas it drops for room, in how many calls."""

from __future__ import annotations

from collections.abc import Sequence

from tierstore.keys import BlockKey
from tierstore.store.replicas import ReplicaLedger, make_replica_room


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


class Tiers:
    """The store's ``drop`` / ``held`` over a set of held keys; pinned keys stay."""

    def __init__(self, held: list[BlockKey], pinned: set[BlockKey] = frozenset()) -> None:
        self.held, self.pinned = set(held), set(pinned)
        self.drops: list[list[BlockKey]] = []
        self.asked = 0

    def drop(self, keys: Sequence[BlockKey]) -> int:
        self.drops.append(list(keys))
        gone = [key for key in keys if key not in self.pinned]
        self.held -= set(gone)
        return len(gone)

    def is_held(self, keys: Sequence[BlockKey]) -> list[bool]:
        self.asked += 1
        return [key in self.held for key in keys]


def room(ledger: ReplicaLedger, tiers: Tiers, nbytes: int, budget: int, batch: int = 64) -> bool:
    return make_replica_room(
        ledger, nbytes, budget, held=tiers.is_held, drop=tiers.drop, batch_blocks=batch
    )


def test_replica_room_drops_only_the_oldest_that_cover_the_shortfall_in_one_call() -> None:
    ledger = ReplicaLedger()
    keys = [k(i) for i in range(10)]
    ledger.settle(0, keys, 10)  # 100 bytes of replicas, k(0) oldest
    tiers = Tiers(keys)
    assert room(ledger, tiers, nbytes=25, budget=100)  # 25 short: three blocks go
    assert tiers.drops == [keys[:3]] and tiers.asked == 1
    assert ledger.oldest() == keys[3:] and ledger.pending_bytes() == 25
    assert ledger.used_bytes() + ledger.pending_bytes() <= 100


def test_replica_room_skips_pinned_replicas_and_stops_when_none_can_go() -> None:
    ledger = ReplicaLedger()
    keys = [k(i) for i in range(6)]
    ledger.settle(0, keys, 10)
    tiers = Tiers(keys, pinned={keys[0], keys[1]})
    assert room(ledger, tiers, nbytes=20, budget=60)  # k0, k1 pinned: k2, k3 go next round
    assert tiers.drops == [keys[:2], keys[2:4]]
    assert ledger.oldest() == [keys[0], keys[1], keys[4], keys[5]]
    everything_pinned = Tiers(ledger.oldest(), pinned=set(ledger.oldest()))
    assert not room(ledger, everything_pinned, nbytes=50, budget=60)
    assert len(everything_pinned.drops) == 1  # nothing left to drop: the search ends
    beyond_the_batch = Tiers(ledger.oldest(), pinned={keys[0], keys[1]})
    assert not room(ledger, beyond_the_batch, nbytes=30, budget=60, batch=2)
    assert beyond_the_batch.drops == [keys[:2]]  # only the 2 oldest looked at, both pinned
    assert ledger.pending_bytes() == 20  # the first promise only


def test_replica_room_within_budget_drops_nothing_and_refuses_what_cannot_fit() -> None:
    ledger = ReplicaLedger()
    ledger.settle(0, [k(1)], 10)
    tiers = Tiers([k(1)])
    assert room(ledger, tiers, nbytes=10, budget=40) and tiers.drops == []
    assert not room(ledger, tiers, nbytes=50, budget=40)  # larger than the whole budget
    empty = ReplicaLedger()
    assert empty.reserve(30, 40)  # an import in flight, and no replica to drop
    assert not room(empty, Tiers([]), nbytes=20, budget=40)
