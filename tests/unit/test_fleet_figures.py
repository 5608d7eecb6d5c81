"""The fleet bench's figures from hand-made samples: which returning turns
count as switched or stayed, and a switch's class by the share of its last
prompt the engine reused (warm >= 90%, partly warm 30-90%, cold below), as
the kv_share write-up counts them; and the issue's targets from them."""

from __future__ import annotations

from bench.fleet.figures import summarize, targets, turn_figures
from bench.fleet.topology import BLOCK_TOKENS
from harness.chat_load import Sample

HOSTS = {"a:1": 0, "b:1": 1}
PROMPT = 40 * BLOCK_TOKENS  # every first turn's prompt: 40 whole blocks


def turn(user: int, n: int, host: str, cached: int, ttft: float = 0.2) -> Sample:
    return Sample(
        user=user,
        turn=n,
        returning=n > 0,
        prompt_tokens=PROMPT + n * BLOCK_TOKENS,
        sent_s=10.0 * n,
        ttft_s=ttft,
        cached_tokens=cached,
        end_s=10.0 * n + 1.0,
        output_tokens=16,
        served_by=host,
    )


def fleet(second_turn_cached: list[int]) -> list[Sample]:
    """User i's first turn on host a, its second on host b with the given reuse;
    one more user that stays on host a."""
    out = []
    for user, cached in enumerate(second_turn_cached):
        out += [turn(user, 0, "a:1", 0), turn(user, 1, "b:1", cached, ttft=0.3)]
    stay = len(second_turn_cached)
    out += [turn(stay, 0, "a:1", 0), turn(stay, 1, "a:1", PROMPT, ttft=0.1)]
    return out


def test_switches_are_warm_partly_warm_or_cold_by_the_reused_share() -> None:
    # 100%, 90% (warm), 89% and 30% (partly), 29% and 0% (cold) of the last prompt
    reused = [PROMPT, PROMPT * 9 // 10, PROMPT * 89 // 100, PROMPT * 3 // 10, PROMPT * 29 // 100, 0]
    f = turn_figures(fleet(reused), HOSTS.__getitem__)
    assert f["returning_turns"] == 7 and f["switched_turns"] == 6
    assert (f["warm_switch_share"], f["partly_warm_switch_share"], f["cold_switch_share"]) == (
        round(2 / 6, 3),
        round(2 / 6, 3),
        round(2 / 6, 3),
    )
    assert f["warm_switch_store_share"] == 1.0  # host b had never run these conversations
    assert f["ttft_switched_p50_s"] == 0.3 and f["ttft_stayed_p50_s"] == 0.1
    assert f["requests_failed"] == 0


def test_a_switch_that_reused_too_little_is_not_warm() -> None:
    """The negative control: the same fleet with every switch short of 90% fails
    the warm-switch target, where all-warm meets it."""
    warm = turn_figures(fleet([PROMPT] * 4), HOSTS.__getitem__)
    short = turn_figures(fleet([PROMPT * 85 // 100] * 4), HOSTS.__getitem__)
    assert warm["warm_switch_share"] == 1.0 and short["warm_switch_share"] == 0.0
    checks = [targets({"modes": {"tierstore": summarize([f])}}) for f in (warm, short)]
    assert [c["warm_switch_share"]["met"] for c in checks] == [True, False]


def test_a_failed_turn_is_counted_and_not_measured() -> None:
    samples = fleet([PROMPT])
    samples[1].error, samples[1].ttft_s = "HTTP 503", None
    f = turn_figures(samples, HOSTS.__getitem__)
    assert f["requests_failed"] == 1
    assert f["switched_turns"] == 0 and f["returning_turns"] == 1
    assert targets({"modes": {"tierstore": summarize([f])}})["requests_failed"]["met"] is False
