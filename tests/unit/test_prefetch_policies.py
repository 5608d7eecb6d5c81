"""Prefetch policies are pure: they only say how long a caller waits."""

from __future__ import annotations

from tierstore.prefetch import BestEffort, Timeout, WaitAll


def test_best_effort_never_waits() -> None:
    assert BestEffort().wait_s(100_000) == 0 and BestEffort().deadline_s(100_000) is None


def test_wait_is_bounded() -> None:
    assert WaitAll(30.0).wait_s(10) == 30.0 == WaitAll(30.0).deadline_s(10)


def test_timeout_grows_with_tokens() -> None:
    policy = Timeout(base_s=0.05, per_1k_tokens_s=0.02)
    assert policy.wait_s(0) == 0.05
    assert abs(policy.wait_s(50_000) - 1.05) < 1e-9
    assert Timeout(0.05, 0.02, fixed_s=0.3).deadline_s(50_000) == 0.3
