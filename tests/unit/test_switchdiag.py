"""The switch benchmark's diagnosis of a host switch, and the perfect-sender
replay of a run's turns (bench/switch/diag.py)."""

from __future__ import annotations

import pytest

from bench.switch.diag import (
    PushRecord,
    oracle_switches,
    peak_offered_load,
    replica_jobs,
    switch_cause,
)

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


# -- the perfect sender: 1-byte blocks on a link of 10 blocks/s --------------------------------

LINK = 10.0


def turn(session: str, host: str, start: float, prompt: int, end: float, blocks: int) -> dict:
    """A turn whose prompt's blocks were stored at its start."""
    return {
        "session": session,
        "host": host,
        "t_start": start,
        "prompt_blocks": prompt,
        "t_prompt": start,
        "t_end": end,
        "blocks": blocks,
    }


def two_sessions_back_at(x_back: float, y_back: float) -> list[dict]:
    """x and y each store 10 blocks at 0 and 10 more at 1 on A (40 blocks:
    4 s of link), then resume on B."""
    return [
        turn("x", "A", 0.0, 10, 1.0, 20),
        turn("y", "A", 0.0, 10, 1.0, 20),
        turn("x", "B", x_back, 22, x_back + 1, 24),
        turn("y", "B", y_back, 22, y_back + 1, 24),
    ]


def classes(turns: list[dict], order: str = "deadline") -> dict[str, str]:
    return {
        o["session"]: o["oracle_class_of_cached"] for o in oracle_switches(turns, LINK, 1, order)
    }


@pytest.mark.parametrize(
    ("x_back", "y_back", "expected"),
    [
        (2.5, 3.0, {"x": "warm", "y": "partly_warm"}),  # x due first: x's 20 by 2.0
        (3.0, 2.5, {"x": "partly_warm", "y": "warm"}),  # released together, y due first
        (9.0, 9.5, {"x": "warm", "y": "warm"}),  # the link had time for both
    ],
)
def test_the_oracle_sends_what_is_due_first(x_back: float, y_back: float, expected) -> None:
    assert classes(two_sessions_back_at(x_back, y_back)) == expected


def test_a_session_that_stays_does_not_hold_up_one_that_switches() -> None:
    turns = [
        turn("stay", "A", 0.0, 30, 0.1, 30),  # 30 blocks first, due never
        turn("stay", "A", 5.0, 30, 6.0, 30),
        turn("go", "A", 0.5, 10, 0.6, 10),
        turn("go", "B", 2.0, 11, 3.0, 12),  # its 10 blocks need 1 s, behind 3 s of "stay"'s
    ]
    assert classes(turns) == {"go": "warm"}
    # Oldest first sends stay's 30 blocks before go's 10: go's land at 4.0 s.
    assert classes(turns, "oldest") == {"go": "cold"}
    # Fewest bytes left first: at 0.5 s stay has 25 left, go 10, so go's by 1.5 s.
    assert classes(turns, "shortest") == {"go": "warm"}


def test_a_replay_in_an_order_it_does_not_know_is_refused() -> None:
    with pytest.raises(ValueError, match="order 'newest'"):
        classes(two_sessions_back_at(2.5, 3.0), "newest")


def test_blocks_the_host_computed_itself_count_and_only_the_delta_is_sent() -> None:
    turns = [
        turn("s", "A", 0.0, 10, 0.1, 10),
        turn("s", "B", 2.0, 11, 2.1, 12),  # B got A's 10 and computed 2
        turn("s", "A", 2.15, 12, 3.0, 14),  # back 0.05 s later: 1 of B's 2 blocks arrived
    ]
    jobs = replica_jobs(turns, 1)
    assert [(j.lo, j.hi) for j in jobs["B"]] == [(10, 11), (11, 12)]
    assert [o["oracle_held"] for o in oracle_switches(turns, LINK, 1)] == [10, 11]


def test_the_peak_offered_load_is_the_busiest_window_over_the_link() -> None:
    jobs = replica_jobs(two_sessions_back_at(9.0, 9.5), 1)["A"]
    assert peak_offered_load(jobs, 1.0, LINK) == 4.0  # 40 blocks within 1 s, 10 carried
    assert peak_offered_load(jobs, 0.5, LINK) == 4.0  # 20 within 0.5 s, 5 carried
    assert peak_offered_load(jobs, 10.0, LINK) == pytest.approx(0.4)


def test_a_run_tells_a_switch_lost_to_the_order_from_one_lost_to_the_sending() -> None:
    from bench.switch.driver import RunStats
    from bench.switch.real import _oracle

    turns = [
        turn("stay", "A", 0.0, 30, 0.1, 30),
        turn("stay", "A", 5.0, 30, 6.0, 30),
        turn("go", "A", 0.5, 10, 0.6, 10),
        turn("go", "B", 2.0, 11, 3.0, 12),
    ]
    st = RunStats(turn_log=turns)
    # The sidecars held none of go's 10 blocks when it switched at 2.0 s.
    st.switch_log = [{"session": "go", "t_s": 2.0, "class_of_cached": "cold"}]
    oracle = _oracle(st, LINK, 1)
    assert oracle is not None
    online = oracle["online_orders"]
    # Oldest first loses it too: the order's loss, none of the sending's.
    assert online["oldest"]["not_warm_t_s"] == [2.0]
    assert online["oldest"]["lost_by_sender"] == []
    assert online["oldest"]["sidecars_kept_of_allowed"] is None  # it allows no switch
    # Fewest bytes first keeps it: there the sidecars lost a switch the order allowed.
    assert online["shortest"]["not_warm_t_s"] == []
    assert [e["session"] for e in online["shortest"]["lost_by_sender"]] == ["go"]
    assert online["shortest"]["sidecars_kept_of_allowed"] == 0.0
