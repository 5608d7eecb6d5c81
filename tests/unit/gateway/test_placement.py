"""The gateway's placement policies, each on its own (pure), and the cost
model's through the router's real ``plan`` (no sidecars: views made here)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tierstore.gateway.load import host_load
from tierstore.gateway.placement import (
    Candidate,
    CostModel,
    LeastLoaded,
    PrefixAware,
    RoundRobin,
    Turn,
    make_policy,
)
from tierstore.keys import chain_keys
from tierstore.router.cost import HostView, Rates, plan
from tierstore.tiers import TIER_CODES, TierName

from ...conftest import SMALL_LAYOUT as L

HBM, DRAM = TIER_CODES[TierName.HBM], TIER_CODES[TierName.DRAM]
KEYS = chain_keys(L, np.arange(10 * L.block_tokens))


def cand(name: str, waiting: float = 0, in_flight: float = 0, hbm: int = 0,
         pending_s: float = 0.0) -> Candidate:  # fmt: skip
    return Candidate(name, host_load(pending_s, 0, None, 0.0), waiting, in_flight,
                     bytes([HBM]) * hbm)  # fmt: skip


def turn(*cands: Candidate, last: str = "", keys: bool = True) -> Turn:
    return Turn(L if keys else None, KEYS if keys else [], 10 * L.block_tokens + 3, "s", last,
                cands)  # fmt: skip


def test_round_robin_turns_through_every_host() -> None:
    p = RoundRobin()
    firsts = [p.place(turn(cand("a"), cand("b"), cand("c"))).order[0] for _ in range(6)]
    assert firsts == ["a", "b", "c", "a", "b", "c"]


def test_least_loaded_picks_the_fewest_in_flight_and_keeps_the_rest_as_fallbacks() -> None:
    d = LeastLoaded().place(
        turn(cand("a", in_flight=3), cand("b", in_flight=1), cand("c", in_flight=2))
    )
    assert d.order == ("b", "c", "a") and d.reason == "least_loaded"


def test_least_loaded_spreads_ties() -> None:
    p = LeastLoaded()
    assert {p.place(turn(cand("a"), cand("b"))).order[0] for _ in range(4)} == {"a", "b"}


def test_prefix_aware_follows_the_longest_cached_prefix_until_its_queue_is_full() -> None:
    p = PrefixAware(max_waiting=2)
    d = p.place(turn(cand("a", in_flight=5, hbm=3, waiting=1), cand("b", hbm=1)))
    assert d.order[0] == "a" and d.reason == "prefix"
    d = p.place(turn(cand("a", in_flight=5, hbm=3, waiting=3), cand("b", hbm=1)))
    assert d.order[0] == "b" and d.reason == "prefix_overloaded"
    d = p.place(turn(cand("a", in_flight=2), cand("b", in_flight=1)))
    assert d.order[0] == "b" and d.reason == "least_loaded"


def fake_route(tiers: dict[str, bytes], rates: Rates) -> Any:
    """Router.route over views made here, through the real cost model."""
    calls: list[dict[str, Any]] = []

    def route(layout: Any, keys: Any, num_tokens: int, **kw: Any) -> Any:
        calls.append(kw)
        views = [HostView(h, tiers.get(h, b""), kw["loads"].get(h)) for h in kw["hosts"]]
        return plan(views, len(keys), num_tokens, layout.block_tokens, layout.block_bytes, rates,
                    session=kw["session"], current_host=kw["current_host"])  # fmt: skip

    route.calls = calls  # type: ignore[attr-defined]
    return route


RATES = Rates(prefill_tokens_per_s=100.0, peer_bytes_per_s=1e6, dram_bytes_per_s=1e9)


def test_the_cost_model_stays_where_the_prefix_is_while_that_host_is_free() -> None:
    route = fake_route({"a": bytes([DRAM]) * 10}, RATES)
    d = CostModel(route, preposition=True).place(turn(cand("a"), cand("b"), last="a"))
    assert d.order[0] == "a" and d.reason == "cost_stay" and not d.preposition
    assert d.costs["a"].reused_tokens == 10 * L.block_tokens


def test_the_cost_model_moves_a_turn_off_a_busy_host_and_prepositions_the_pull() -> None:
    route = fake_route({"a": bytes([DRAM]) * 10}, RATES)
    busy = cand("a", pending_s=30.0)
    d = CostModel(route, preposition=True).place(turn(busy, cand("b"), last="a"))
    assert d.order == ("b", "a") and d.reason == "cost_move"
    assert d.preposition  # b pulls the prefix from a's sidecar ahead of the request
    assert d.costs["b"].blocks.get(str(TierName.PEER)) == 10
    d = CostModel(route, preposition=False).place(turn(busy, cand("b"), last="a"))
    assert d.order[0] == "b" and not d.preposition


def test_the_cost_model_passes_hbm_prefixes_and_learned_speeds_to_the_router() -> None:
    route = fake_route({}, RATES)
    c = Candidate("a", host_load(0, 0, None, 0), 0, 0, bytes([HBM]) * 2, 123.0)
    CostModel(route, preposition=True).place(turn(c, cand("b")))
    (call,) = route.calls
    assert call["held"] == {"a": bytes([HBM]) * 2}
    assert call["prefill_tokens_per_s"] == {"a": 123.0}


def test_without_keys_the_cost_model_places_by_load() -> None:
    d = CostModel(fake_route({}, RATES), preposition=True).place(
        turn(cand("a", in_flight=2), cand("b"), keys=False)
    )
    assert d.order[0] == "b" and d.reason == "no_keys"


def test_policy_names() -> None:
    assert make_policy("round_robin", None, 1).name == "round_robin"
    assert make_policy("tierstore_no_preposition", fake_route({}, RATES), 1).name == (
        "tierstore_no_preposition"
    )
    with pytest.raises(ValueError, match="needs sidecars"):
        make_policy("tierstore", None, 1)
    with pytest.raises(ValueError, match="gateway_policy must be"):
        make_policy("random", None, 1)


def test_a_turn_moves_only_to_save_more_than_the_margin() -> None:
    route = fake_route({"a": bytes([DRAM]) * 10}, RATES)
    # a's queue costs 0.3 s more than b's pull of the prefix and prefill: a move saves ~0.3 s.
    busy = cand("a", pending_s=0.3 + 0.01 + 10 * L.block_bytes / 1e6)
    moved = CostModel(route, preposition=True).place(turn(busy, cand("b"), last="a"))
    assert moved.order[0] == "b" and moved.reason == "cost_move"
    kept = CostModel(route, preposition=True, move_margin_s=0.5).place(
        turn(busy, cand("b"), last="a")
    )
    assert kept.order == ("a", "b") and kept.reason == "cost_stay" and not kept.preposition
    far = cand("a", pending_s=5.0)
    assert (
        CostModel(route, preposition=True, move_margin_s=0.5)
        .place(turn(far, cand("b"), last="a"))
        .order[0]
        == "b"
    )
