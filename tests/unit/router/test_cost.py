"""The router's cost model: TTFT = queue wait + prefix load by tier + prefill."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tierstore.load import HostLoadView
from tierstore.router.cost import (
    DRAM,
    NVME,
    PEER,
    HostCost,
    HostView,
    Rates,
    estimate,
    plan,
    queue_wait_s,
    spill_host,
)

BT = 16  # tokens per block
BB = 1 << 20  # bytes per block
# Round numbers: a block of 16 tokens takes 16 ms to prefill, 0.1 ms to load
# from DRAM, 1 ms (+ DRAM) from NVMe, 10 ms (+ DRAM) from a peer.
R = Rates(
    prefill_tokens_per_s=1000.0,
    dram_bytes_per_s=BB / 1e-4,
    nvme_bytes_per_s=BB / 1e-3,
    peer_bytes_per_s=BB / 1e-2,
    nvme_fixed_s=0.0,
    peer_fixed_s=0.0,
    turn_s=8.0,
)


def tiers(*codes: int) -> np.ndarray:
    return np.array(codes, dtype=np.intp)


def busy(busy_slots: int, slots: int, queue: int = 0, wait_s: float = 0.0) -> HostLoadView:
    return HostLoadView(True, busy_slots, slots, queue, wait_s)


def test_nothing_held_costs_the_whole_prefill() -> None:
    c = estimate(HostView("a"), tiers(), 100, BT, BB, R)
    assert c.ttft_s == pytest.approx(0.1) and c.prefill_s == pytest.approx(0.1)
    assert c.reused_tokens == 0 and c.prefill_tokens == 100 and c.load_s == 0 and c.blocks == {}


def test_a_dram_prefix_replaces_its_prefill_by_its_load() -> None:
    c = estimate(HostView("a"), tiers(DRAM, DRAM, DRAM), 100, BT, BB, R)
    assert c.reused_tokens == 48 and c.prefill_tokens == 52
    assert c.load_s == pytest.approx(3e-4)
    assert c.ttft_s == pytest.approx(3e-4 + 0.052)
    assert c.blocks == {"dram": 3}


def test_nvme_and_peer_blocks_cost_their_read_plus_the_dram_copy() -> None:
    c = estimate(HostView("a"), tiers(DRAM, NVME, PEER), 100, BT, BB, R)
    assert c.load_s == pytest.approx(1e-4 + 1.1e-3 + 10.1e-3)
    assert c.blocks == {"dram": 1, "nvme": 1, "peer": 1}


def test_a_block_slower_to_load_than_to_prefill_is_recomputed() -> None:
    r = Rates(prefill_tokens_per_s=1000.0, dram_bytes_per_s=1e12, peer_bytes_per_s=BB / 0.05)
    c = estimate(HostView("a"), tiers(DRAM, PEER, PEER), 100, BT, BB, r)
    assert c.blocks == {"dram": 1}  # 50 ms per peer block > 16 ms to prefill it
    assert c.reused_tokens == 16


def test_fixed_costs_can_make_a_short_fetch_not_worth_it() -> None:
    r = Rates(prefill_tokens_per_s=1000.0, dram_bytes_per_s=1e12, peer_bytes_per_s=1e12,
              peer_fixed_s=0.040)  # fmt: skip
    one = estimate(HostView("a"), tiers(PEER), 100, BT, BB, r)
    assert one.blocks == {}  # 40 ms set-up to save 16 ms of prefill
    many = estimate(HostView("a"), tiers(*[PEER] * 5), 100, BT, BB, r)
    assert many.blocks == {"peer": 5}  # 40 ms to save 80 ms


def test_at_least_one_token_is_computed() -> None:
    c = estimate(HostView("a"), tiers(DRAM, DRAM), 32, BT, BB, R)
    assert c.reused_tokens == 31 and c.prefill_tokens == 1


def test_queue_wait() -> None:
    assert queue_wait_s(None, R) == 0.0
    assert queue_wait_s(HostLoadView(), R) == 0.0  # not reported: counted as idle
    assert queue_wait_s(busy(3, 4), R) == 0.0
    assert queue_wait_s(busy(3, 4, queue=1), R) == pytest.approx(2.0)  # the free slot is taken
    assert queue_wait_s(busy(4, 4), R) == pytest.approx(2.0)  # turn_s / slots
    assert queue_wait_s(busy(4, 4, queue=2), R) == pytest.approx(2.0 + 2 * 2.0)
    assert queue_wait_s(busy(4, 4, queue=2, wait_s=0.5), R) == pytest.approx(0.5 + 2 * 2.0)


def test_the_longest_prefix_wins_when_hosts_are_idle() -> None:
    views = [
        HostView("a", bytes([DRAM] * 2)),
        HostView("b", bytes([DRAM] * 6)),
        HostView("c", b""),
    ]
    p = plan(views, 6, 100, BT, BB, R)
    assert [c.host for c in p.ranked] == ["b", "a", "c"]
    assert p.best is not None and p.best.reused_tokens == 96
    # a and c would fetch the rest of b's prefix from b
    by_host = {c.host: c for c in p.ranked}
    assert by_host["a"].blocks == {"dram": 2, "peer": 4}
    assert by_host["c"].blocks == {"peer": 6}
    assert by_host["c"].held_blocks == 0 and by_host["b"].held_blocks == 6


def test_a_queue_sends_the_turn_to_a_host_that_is_faster_overall() -> None:
    views = [
        HostView("a", bytes([DRAM] * 6), load=busy(4, 4, queue=3)),  # ~8 s of waiting
        HostView("b", b"", load=busy(1, 4)),
    ]
    p = plan(views, 6, 100, BT, BB, R)
    assert p.best is not None and p.best.host == "b"
    # ... but not when the prefill saved is larger than the wait
    long_prompt = 60_000
    views = [
        HostView("a", bytes([DRAM] * 3700), load=busy(4, 4, queue=3)),
        HostView("b", b"", load=busy(1, 4)),
    ]
    p = plan(views, 3700, long_prompt, BT, BB, R)
    assert p.best is not None and p.best.host == "a"
    assert p.best.queue_s == pytest.approx(8.0)


def test_unreachable_hosts_come_last_and_ties_are_stable() -> None:
    views = [HostView(h) for h in ("h1", "h2", "h3", "h4")]
    views.append(HostView("down", reachable=False, error="DEADLINE_EXCEEDED"))
    first = plan(views, 0, 10, BT, BB, R, session="s-1")
    again = plan(list(reversed(views)), 0, 10, BT, BB, R, session="s-1")
    assert [c.host for c in first.ranked] == [c.host for c in again.ranked]
    assert first.ranked[-1].host == "down" and math.isinf(first.ranked[-1].ttft_s)
    assert not first.ranked[-1].reachable and first.ranked[-1].error == "DEADLINE_EXCEEDED"
    others = {tuple(c.host for c in plan(views, 0, 10, BT, BB, R, session=f"s-{i}").ranked[:4])
              for i in range(20)}  # fmt: skip
    assert len(others) > 1  # sessions spread over equal hosts


def test_a_session_stays_on_its_host_when_another_is_as_good() -> None:
    views = [HostView(h, bytes([DRAM] * 6)) for h in ("h1", "h2", "h3")]
    for current in ("h1", "h2", "h3"):
        assert (
            plan(views, 6, 100, BT, BB, R, session="s", current_host=current).ranked[0].host
            == current
        )


def test_spill_host_is_the_least_busy_other_host() -> None:
    costs = [
        HostCost("home", 0.1, queue_s=0.0, held_blocks=9),
        HostCost("x", 1.0, queue_s=6.0, held_blocks=9),
        HostCost("y", 1.0, queue_s=0.2, held_blocks=0),
        HostCost("z", 1.0, queue_s=0.3, held_blocks=5),
    ]
    assert spill_host(costs, "home", "s", tie_s=0.5) == "z"  # y and z tie; z holds more
    assert spill_host(costs, "home", "s", tie_s=0.0) == "y"
    assert spill_host(costs[:1], "home", "s", 0.5) == ""
    down = [HostCost("home", 0.1), HostCost("x", math.inf, reachable=False)]
    assert spill_host(down, "home", "s", 0.5) == ""


def test_plan_spill_host_defaults_to_leaving_the_best_host() -> None:
    views = [HostView("a", bytes([DRAM] * 6)), HostView("b", b""), HostView("c", b"")]
    p = plan(views, 6, 100, BT, BB, R, session="sess")
    assert p.best is not None and p.best.host == "a" and p.spill_host in ("b", "c")
    assert plan(views, 6, 100, BT, BB, R, session="sess", current_host="b").spill_host != "b"


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="exceed"):
        plan([HostView("a")], 7, 100, BT, BB, R)
    with pytest.raises(ValueError, match="tier codes"):
        plan([HostView("a", bytes([PEER]))], 1, 100, BT, BB, R)
    with pytest.raises(ValueError, match="prefill_tokens_per_s"):
        Rates(prefill_tokens_per_s=0)
    with pytest.raises(ValueError, match="peer_fixed_s"):
        Rates(peer_fixed_s=-1)


def test_measured_rates_replace_configured_ones_per_host() -> None:
    r = R.for_host(prefill_tokens_per_s=2000.0, nvme_bytes_per_s=0.0)
    assert r.prefill_tokens_per_s == 2000.0 and r.nvme_bytes_per_s == R.nvme_bytes_per_s
    fast = HostView("fast", b"", rates=r)
    slow = HostView("slow", b"")
    p = plan([slow, fast], 0, 1000, BT, BB, R)
    assert [c.host for c in p.ranked] == ["fast", "slow"]
    assert p.ranked[0].prefill_s == pytest.approx(0.5)


def test_explain_lists_unreachable_hosts_apart() -> None:
    from tierstore.cli.route import format_plan, plan_to_dict

    views = [HostView("a:1", bytes([DRAM] * 3)), HostView("b:2", reachable=False, error="DOWN")]
    p = plan(views, 3, 60, BT, BB, R)
    text = format_plan(p, explain=True)
    assert "best host a:1" in text and "unreachable: b:2 (DOWN)" in text
    assert plan_to_dict(p)["hosts"][1]["ttft_s"] is None
