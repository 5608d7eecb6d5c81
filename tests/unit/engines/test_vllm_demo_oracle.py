"""The vLLM demo's oracle: warm against a like-for-like no-store reference,
the cold full prefill as information only (no engine is started)."""

from __future__ import annotations

from typing import Any

import pytest

from tierstore.engines.vllm.demo import (
    ROUNDING_NOTE,
    DemoError,
    compare_outputs,
    first_difference,
    format_result,
)
from tierstore.engines.vllm.driver import Output

IDS = list(range(100, 132))  # 32 greedy tokens
TURNS = [0, 768]  # tokens A's turns reused from its own cache


def _with(ids: list[int], at: int, token: int) -> list[int]:
    return [*ids[:at], token, *ids[at + 1 :]]


def test_first_difference() -> None:
    assert first_difference(IDS, list(IDS)) is None
    assert first_difference(IDS, _with(IDS, 9, 7)) == 9
    assert first_difference(IDS, IDS[:20]) == 20  # a shorter output differs where it ends
    assert first_difference([], []) is None


def test_warm_equal_to_reference_passes_whatever_the_cold_prefill_gives() -> None:
    cold = Output(_with(IDS, 9, 7), 0)
    r = compare_outputs(Output(IDS, 1536), Output(list(IDS), 1536), cold, TURNS, TURNS)
    assert r["outputs_equal"] is True and r["warm_first_difference"] is None
    assert r["compared_tokens"] == 32 and r["reference_cached_tokens"] == 1536
    assert r["cold_equal"] is False and r["cold_first_difference"] == 9


@pytest.mark.parametrize("at", [0, 9, 31])
def test_warm_that_differs_from_the_reference_fails(at: int) -> None:
    warm = Output(_with(IDS, at, 7), 1536)
    cold = Output(_with(IDS, 9, 7), 0)
    r = compare_outputs(warm, Output(IDS, 1536), cold, TURNS, TURNS)
    assert r["outputs_equal"] is False and r["warm_first_difference"] == at
    # The cold prefill is held against the reference, never against a wrong warm.
    assert r["cold_first_difference"] == 9


def test_a_reference_that_did_not_reuse_what_warm_did_is_refused() -> None:
    # Equal ids, but the reference computed more (or other chunks) itself.
    with pytest.raises(DemoError, match="not a like-for-like reference"):
        compare_outputs(Output(IDS, 1536), Output(IDS, 768), Output(IDS, 0), TURNS, TURNS)
    with pytest.raises(DemoError, match="not a like-for-like reference"):
        compare_outputs(Output(IDS, 1536), Output(IDS, 1536), Output(IDS, 0), [0, 0], TURNS)


def _result(**verdict: Any) -> dict[str, Any]:
    r: dict[str, Any] = {
        "turns": [
            {"turn": 1, "host": "A", "prompt_tokens": 768, "reused_tokens": 0, "seconds": 1.0}
        ],
        "switch_prompt_tokens": 1632,
        "replica_bytes_on_b": 12 * 2**20,
        "cold_ttft_s": 2.0,
        "warm_ttft_s": 0.5,
        "reused_tokens": 1536,
        "warm_blocks_on_b": {"pinned": 12, "fetched_from_peer": 0},
        "speedup": 4.0,
    }
    r.update(verdict)
    return r


def test_the_text_says_why_the_cold_prefill_differs_and_when_warm_does() -> None:
    cold = Output(_with(IDS, 9, 7), 0)
    ok = compare_outputs(Output(IDS, 1536), Output(IDS, 1536), cold, TURNS, TURNS)
    text = format_result(_result(**ok))
    assert "(1536 tokens from its own cache): yes" in text
    assert f"no, from token 9 on ({ROUNDING_NOTE})" in text
    bad = compare_outputs(Output(_with(IDS, 3, 7), 1536), Output(IDS, 1536), cold, TURNS, TURNS)
    assert "NO, from token 3 on" in format_result(_result(**bad))
