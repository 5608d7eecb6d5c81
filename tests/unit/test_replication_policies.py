"""Replication policies (pure): kv_share's min_tokens rule, the headroom rule,
and which replicas leave DRAM before the host's own blocks."""

from __future__ import annotations

import pytest

from tierstore.errors import ConfigError
from tierstore.policies.replication import (
    HeadroomRule,
    KvShareRule,
    ReplicaRequest,
    ReplicaRetention,
    ReplicationPolicy,
    make_replication_policy,
)

MIN = 8192
MB = 1_000_000


def req(
    tokens: int,
    push_mb: float = 10,
    link_mb_s: float = 125,
    backlog_mb: float = 0,
    rejected: bool = False,
) -> ReplicaRequest:
    return ReplicaRequest(tokens, int(push_mb * MB), link_mb_s * MB, int(backlog_mb * MB), rejected)


POLICIES: list[ReplicationPolicy] = [KvShareRule(MIN), HeadroomRule(MIN, 1.0, 125e6)]


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: type(p).__name__)
@pytest.mark.parametrize(
    "request_",
    [
        req(MIN),
        req(MIN * 4, push_mb=10_000, backlog_mb=10_000),  # however loaded the link
        req(MIN, rejected=True),  # however full the target's budget
        req(MIN, link_mb_s=0.001),
    ],
)
def test_min_tokens_is_the_floor_for_every_policy(
    policy: ReplicationPolicy, request_: ReplicaRequest
) -> None:
    assert policy.replicate(request_)


def test_kv_share_never_replicates_a_short_turn() -> None:
    assert not KvShareRule(MIN).replicate(req(MIN - 1, push_mb=0.001, backlog_mb=0))


@pytest.mark.parametrize(
    ("request_", "want"),
    [
        (req(100, push_mb=10), True),  # 0.08 s of a 125 MB/s link
        (req(100, push_mb=100, backlog_mb=20), True),  # 0.96 s
        (req(100, push_mb=100, backlog_mb=30), False),  # 1.04 s: the link is busy
        (req(100, push_mb=200), False),  # this push alone takes too long
        (req(100, push_mb=10, rejected=True), False),  # the target's budget is full
        (req(100, push_mb=10, link_mb_s=0), True),  # unmeasured: the default rate
        (req(100, push_mb=10, link_mb_s=5), False),  # measured slow
    ],
)
def test_headroom_replicates_short_turns_only_with_headroom(
    request_: ReplicaRequest, want: bool
) -> None:
    assert HeadroomRule(MIN, 1.0, 125e6).replicate(request_) is want


def test_headroom_without_any_rate_replicates_no_short_turn() -> None:
    assert not HeadroomRule(MIN, 1.0, 0.0).replicate(req(100, link_mb_s=0))


@pytest.mark.parametrize(("name", "kind"), [("kv_share", KvShareRule), ("headroom", HeadroomRule)])
def test_make_replication_policy(name: str, kind: type) -> None:
    assert isinstance(make_replication_policy(name, MIN, 1.0, 125e6), kind)


def test_unknown_replication_policy_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="unknown replication policy"):
        make_replication_policy("always", MIN, 1.0, 125e6)


@pytest.mark.parametrize(
    ("live_s", "age_s", "first"),
    [(300.0, 0.0, False), (300.0, 299.9, False), (300.0, 300.0, True), (0.0, 0.0, True)],
)
def test_replica_retention(live_s: float, age_s: float, first: bool) -> None:
    assert ReplicaRetention(live_s).evict_before_own(age_s) is first
