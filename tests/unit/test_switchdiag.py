"""The switch benchmark's diagnosis of a host switch (bench/switchdiag.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from switchdiag import PushRecord, switch_cause

BT = 128  # tokens per block
MIN = 8192


def done(blocks: int, target_held: int, *, at: float = 1.0, tokens: int = 20_000) -> PushRecord:
    return PushRecord(blocks, tokens, 0.0, finished=at, replicating=True, target_held=target_held)


def cause(push: PushRecord | None, held: int, prompt_blocks: int, started: float = 2.0) -> str:
    return switch_cause(push, held, prompt_blocks * BT, prompt_blocks, started, BT, MIN)


def test_warm_when_the_target_held_90_percent_of_the_prompt() -> None:
    assert cause(done(100, 100), 95, 105) == "warm"


def test_new_input_over_10_percent_is_not_the_store() -> None:
    assert cause(done(100, 100), 100, 120) == "prompt_grew"


@pytest.mark.parametrize(
    ("push", "expected"),
    [
        (PushRecord(100, 20_000, 0.0), "push_late"),  # end_turn not answered yet
        (done(100, 100, at=3.0), "push_late"),  # finished after the turn began
        (PushRecord(100, 20_000, 0.0, finished=1.0, error=True), "push_error"),
        (PushRecord(50, 6_000, 0.0, finished=1.0, replicating=False), "not_replicated_short"),
        (PushRecord(100, 20_000, 0.0, finished=1.0, replicating=False), "not_pushed"),
        (done(100, 40), "push_incomplete"),  # budget, fetch error or deadline
        (done(100, 100), "evicted"),  # held after the push, not at the switch
        (None, "no_push_record"),
    ],
)
def test_the_first_reason_the_target_held_less(push: PushRecord | None, expected: str) -> None:
    assert cause(push, 10, 105) == expected
