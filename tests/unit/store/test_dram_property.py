"""Property test: the DRAM tier's eviction order against a simple model.

Random sequences of commits, pins, unpins, evictions and owner releases;
the model keeps a recency stamp per block (set by its commit, its pins and
its last unpin) and pin counts. Every victim must be the least recently used
unpinned block, never a pinned one, and the readable count must match.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from tierstore.keys import BlockKey
from tierstore.memory.arena import Arena
from tierstore.store.dram import DramTier, ReserveStatus

FP = b"\x02" * 32
BLOCK = 4096
KEYS = 12
OWNERS = 3

ops = st.lists(
    st.one_of(
        st.tuples(st.just("put"), st.integers(0, KEYS - 1)),
        st.tuples(st.just("pin"), st.integers(0, KEYS - 1), st.integers(1, OWNERS)),
        st.tuples(st.just("unpin"), st.integers(0, KEYS - 1), st.integers(1, OWNERS)),
        st.tuples(st.just("evict")),
        st.tuples(st.just("release"), st.integers(1, OWNERS)),
    ),
    max_size=80,
)


def k(i: int) -> BlockKey:
    return BlockKey(i.to_bytes(32, "little"))


@settings(max_examples=150, deadline=None)
@given(ops)
def test_eviction_matches_the_model(sequence: list[tuple]) -> None:
    arena = Arena.create(1 << 20, tag="prop")
    tier = DramTier(arena, segment_bytes=64 << 10)
    stamp: dict[int, int] = {}  # held block -> recency
    pins: dict[int, Counter[int]] = {o: Counter() for o in range(1, OWNERS + 1)}
    clock = 0

    def pinned(i: int) -> int:
        return sum(p[i] for p in pins.values())

    try:
        for op in sequence:
            clock += 1
            if op[0] == "put":
                status, _ = tier.reserve(k(op[1]), FP, BLOCK)
                if status == ReserveStatus.OK:
                    assert tier.commit([k(op[1])]) == [True]
                    stamp[op[1]] = clock
                else:
                    assert status == ReserveStatus.EXISTS and op[1] in stamp
            elif op[0] == "pin":
                got = tier.pin([k(op[1])], owner=op[2])[0]
                assert (got is not None) == (op[1] in stamp)
                if got is not None:
                    pins[op[2]][op[1]] += 1
                    stamp[op[1]] = clock
            elif op[0] == "unpin":
                n = tier.unpin([k(op[1])], owner=op[2])
                assert n == (1 if pins[op[2]][op[1]] else 0)
                if n:
                    pins[op[2]][op[1]] -= 1
                    if not pinned(op[1]):
                        stamp[op[1]] = clock
            elif op[0] == "release":
                dropped = sum(pins[op[1]].values())
                assert tier.release_owner(op[1]) == (0, dropped)
                released = [i for i, c in pins[op[1]].items() if c > 0]
                pins[op[1]].clear()
                for i in released:
                    if not pinned(i):
                        stamp[i] = clock
            else:
                candidates = [i for i in stamp if not pinned(i)]
                victim = tier.take_victim()
                if not candidates:
                    assert victim is None
                    continue
                assert victim is not None
                want = min(candidates, key=lambda i: stamp[i])
                assert victim.key == k(want)
                assert tier.drop(victim)
                del stamp[want]
            assert tier.stats().num_blocks == len(stamp)
            for o in pins:
                assert tier.pin_count(o) == sum(pins[o].values())
    finally:
        tier.close()
        arena.close()
