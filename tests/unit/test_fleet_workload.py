"""The fleet bench's schedule and its pace: ``time_scale`` stretches every send
time by one factor and changes nothing else, the scale follows from the
measured prefill rate, and the calibration's cold prompts share no block with
each other or with any user's prompt."""

from __future__ import annotations

from dataclasses import replace

import pytest

from bench.fleet.run import QUICK, auto_time_scale, cold_prompts
from bench.fleet.topology import BLOCK_TOKENS
from bench.fleet.workload import REFERENCE_PREFILL_TOKENS_PER_S, FleetWorkload, schedule


def test_the_time_scale_stretches_every_send_time_and_nothing_else() -> None:
    base = schedule(FleetWorkload())
    slow = schedule(FleetWorkload(time_scale=4.0))
    assert len(base) == len(slow) == 48
    moved = 0
    for a, b in zip(base, slow):
        assert (a.user, a.turn, a.messages) == (b.user, b.turn, b.messages)
        assert a.prompt_words == b.prompt_words
        assert b.at_s == pytest.approx(4.0 * a.at_s, abs=0.005)
        moved += a.at_s > 0
    assert moved > 40  # the times compared were not all zero
    # The control: a different scale is seen (the check above can fail).
    assert schedule(FleetWorkload(time_scale=1.5))[-1].at_s != pytest.approx(4.0 * base[-1].at_s)


def test_the_scale_is_the_reference_rate_over_the_measured_one() -> None:
    assert auto_time_scale(REFERENCE_PREFILL_TOKENS_PER_S) == 1.0
    assert auto_time_scale(REFERENCE_PREFILL_TOKENS_PER_S / 5) == 5.0  # 5x slower engines
    assert auto_time_scale(REFERENCE_PREFILL_TOKENS_PER_S * 2) == 0.5
    for rate in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="not positive"):
            auto_time_scale(rate)
    with pytest.raises(ValueError, match="outside"):  # 200x slower: not a machine to bench on
        auto_time_scale(REFERENCE_PREFILL_TOKENS_PER_S / 200)


def test_bad_time_scales_are_refused() -> None:
    for scale in (0.0, -2.0, 1000.0):
        with pytest.raises(ValueError, match="time_scale"):
            FleetWorkload(time_scale=scale)


@pytest.mark.parametrize("w", [FleetWorkload(), QUICK], ids=["full", "quick"])
def test_calibration_prompts_are_cold_first_turns_of_the_workloads_shape(w: FleetWorkload) -> None:
    prompts = cold_prompts(w, 4)
    assert len(prompts) == 4
    assert all(p.prompt_words == w.context_tokens + w.history_tokens for p in prompts)

    def first_block(messages: tuple[dict[str, str], ...]) -> tuple[str, ...]:
        return tuple(" ".join(m["content"] for m in messages).split()[:BLOCK_TOKENS])

    heads = [first_block(p.messages) for p in prompts]
    users = {first_block(r.messages) for r in schedule(replace(w, time_scale=1.0))}
    assert len(set(heads)) == len(heads)  # no two calibration prompts share a first block
    assert not set(heads) & users  # nor any with a user's prompt
    # The control: a second call with the same offset gives the same prompts.
    assert [first_block(p.messages) for p in cold_prompts(w, 4)] == heads
    assert first_block(cold_prompts(w, 1, first=2)[0].messages) == heads[2]
