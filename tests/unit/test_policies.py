"""Eviction, admission and write policies: pure, fast, parametrized over every policy."""

from __future__ import annotations

import pytest

from tierstore.errors import ConfigError
from tierstore.keys import BlockKey
from tierstore.policies.admission import SeenTwiceAdmit, make_admission_policy
from tierstore.policies.eviction import EVICTION_POLICIES, make_eviction_policy
from tierstore.policies.write import WRITE_POLICIES, WriteThroughSelective, make_write_policy


def k(i: int) -> BlockKey:
    return BlockKey(i.to_bytes(32, "little"))


@pytest.fixture(params=sorted(EVICTION_POLICIES))
def policy(request: pytest.FixtureRequest):
    return make_eviction_policy(request.param)


def test_evicts_every_key_once(policy) -> None:
    for i in range(50):
        policy.insert(k(i))
    seen = set()
    while (victim := policy.evict(lambda key: True)) is not None:
        assert victim not in seen
        seen.add(victim)
    assert seen == {k(i) for i in range(50)}
    assert len(policy) == 0


def test_respects_can_evict_and_is_atomic(policy) -> None:
    for i in range(10):
        policy.insert(k(i))
    assert policy.evict(lambda key: False) is None
    assert len(policy) == 10 and all(k(i) in policy for i in range(10))
    victim = policy.evict(lambda key: key == k(7))
    assert victim == k(7) and k(7) not in policy


def test_remove_and_candidates(policy) -> None:
    for i in range(5):
        policy.insert(k(i))
    policy.remove(k(2))
    policy.remove(k(99))  # unknown: ignored
    assert set(policy.candidates()) == {k(0), k(1), k(3), k(4)}


def test_touched_keys_outlive_untouched(policy) -> None:
    for i in range(20):
        policy.insert(k(i))
    for _ in range(2):
        for i in range(10):
            policy.touch(k(i))
    # S3-FIFO keeps a 10% probation queue, so only the first nine are strict.
    first = [policy.evict(lambda key: True) for _ in range(9)]
    assert set(first) <= {k(i) for i in range(10, 20)}


def test_lru_order() -> None:
    lru = make_eviction_policy("lru")
    for i in range(3):
        lru.insert(k(i))
    lru.touch(k(0))
    assert [lru.evict(lambda key: True) for _ in range(3)] == [k(1), k(2), k(0)]


def test_s3fifo_resists_a_scan() -> None:
    s3 = make_eviction_policy("s3fifo")
    hot = [k(i) for i in range(10)]
    for key in hot:
        s3.insert(key)
        s3.touch(key)
    for i in range(100, 200):  # one-hit scan
        s3.insert(k(i))
        if len(s3) > 50:
            assert s3.evict(lambda key: True) not in hot
    assert all(key in s3 for key in hot)


def test_admission() -> None:
    assert make_admission_policy("always").admit(k(1))
    twice = SeenTwiceAdmit(history_keys=2)
    assert not twice.admit(k(1))
    assert twice.admit(k(1))
    assert not twice.admit(k(2))
    assert not twice.admit(k(3))
    assert not twice.admit(k(4))  # history of 2 forgot k(2)
    assert not twice.admit(k(2))
    with pytest.raises(ConfigError, match="unknown eviction policy"):
        make_eviction_policy("mru")
    with pytest.raises(ConfigError, match="unknown admission policy"):
        make_admission_policy("never")


def test_rendezvous_target_is_deterministic_and_stable() -> None:
    from tierstore.policies.replication import rendezvous_target

    members = [f"10.0.0.{i}:7700" for i in range(8)]
    targets = {s: rendezvous_target(s, members, exclude=members[0]) for s in map(str, range(200))}
    assert all(t is not None and t != members[0] for t in targets.values())
    assert len(set(targets.values())) == 7  # spread over the others
    assert targets == {
        s: rendezvous_target(s, list(reversed(members)), members[0]) for s in targets
    }
    fewer = [m for m in members if m != members[3]]
    moved = [s for s, t in targets.items() if rendezvous_target(s, fewer, members[0]) != t]
    assert all(targets[s] == members[3] for s in moved)  # only the removed member's sessions move
    assert rendezvous_target("s", [members[0]], exclude=members[0]) is None


# -- write policies ----------------------------------------------------------------------


@pytest.mark.parametrize("name", WRITE_POLICIES)
def test_write_policies_by_name(name: str) -> None:
    policy = make_write_policy(name, min_tokens=100)
    assert policy.name == name
    assert policy.on_commit(k(1)) == (name == "write_through")
    assert policy.on_turn(100) == (name == "write_through_selective")
    assert not policy.on_turn(99)
    assert policy.watches_hits == (name == "write_through_selective")


def test_selective_writes_a_block_read_again_once() -> None:
    policy = WriteThroughSelective(min_tokens=100, history_keys=2)
    assert policy.on_hit(k(1)) and not policy.on_hit(k(1))
    assert policy.on_hit(k(2)) and policy.on_hit(k(3))  # k(1) leaves the bounded history
    assert policy.on_hit(k(1))


def test_unknown_write_policy_names_the_choices() -> None:
    with pytest.raises(ConfigError, match="write_through_selective"):
        make_write_policy("write_around")
