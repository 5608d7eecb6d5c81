"""The serving benchmark's pure helpers (harness/chat_load.py): the workload's
scripts, stream and metrics parsing, percentiles, summaries, output comparison."""

from __future__ import annotations

import pytest

from harness.chat_load import (
    Sample,
    Workload,
    conversations,
    output_mismatches,
    parse_metrics,
    parse_sse_line,
    percentile,
    summarize,
)


def test_conversations_depend_on_the_seed_only() -> None:
    w = Workload(users=3, turns=4, history_min_tokens=10, history_max_tokens=20)
    assert conversations(w) == conversations(w)
    other = conversations(
        Workload(users=3, turns=4, history_min_tokens=10, history_max_tokens=20, seed=w.seed + 1)
    )
    assert other != conversations(w)


def test_conversations_follow_the_workload() -> None:
    w = Workload(
        users=3,
        turns=4,
        system_tokens=7,
        history_min_tokens=10,
        history_max_tokens=20,
        message_tokens=5,
        think_s=2.0,
        stagger_s=0.5,
    )
    system, scripts = conversations(w)
    assert len(system) == 7 and len(scripts) == 3
    for u, s in enumerate(scripts):
        assert s.user == u and s.start_s == pytest.approx(u * 0.5)
        assert 10 <= len(s.history) <= 20
        assert [len(m) for m in s.messages] == [5] * 4
        assert len(s.think_s) == 3 and all(1.0 <= t <= 3.0 for t in s.think_s)
        ids = [*s.history, *(t for m in s.messages for t in m)]
        assert all(w.first_token_id <= t < w.vocab for t in ids)
    assert w.final_context_tokens(15) == 7 + 15 + 4 * (5 + w.output_tokens)


def test_parse_sse_line() -> None:
    assert parse_sse_line('data: {"a": 1}') == {"a": 1}
    assert parse_sse_line("data: [DONE]") is None
    assert parse_sse_line(": keep-alive") is None
    assert parse_sse_line("") is None


def test_parse_metrics_keeps_labels_and_sums_them() -> None:
    text = "\n".join(
        [
            "# HELP vllm:x_total a counter",
            'vllm:x_total{engine="0",source="a"} 3.0',
            'vllm:x_total{engine="0",source="b"} 4.5',
            "vllm:y 2",
            "garbage line",
        ]
    )
    m = parse_metrics(text)
    assert m['vllm:x_total{engine="0",source="a"}'] == 3.0
    assert m["vllm:x_total"] == 7.5
    assert m["vllm:y"] == 2.0
    assert "garbage" not in m


def test_percentile_interpolates_like_numpy() -> None:
    assert percentile([], 50) is None
    assert percentile([4.0], 90) == 4.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)
    assert percentile([4.0, 1.0, 3.0, 2.0], 90) == pytest.approx(3.7)
    assert percentile(range(11), 0) == 0 and percentile(range(11), 100) == 10


def _sample(
    user: int, turn: int, ttft: float | None, itl: list[float], error: str | None = None, n: int = 3
) -> Sample:
    return Sample(user, turn, turn > 0, 100, 0.0, ttft, itl, list(range(n)), error=error)


def test_summarize_splits_first_and_returning_turns_and_counts_failures() -> None:
    samples = [
        _sample(0, 0, 1.0, [0.1, 0.1]),
        _sample(1, 0, 3.0, [0.2, 0.4]),
        _sample(0, 1, 0.2, [0.1, 0.3]),
        _sample(1, 1, None, [], error="TimeoutError", n=0),
    ]
    s = summarize(samples, wall_s=2.0, skipped_turns=1)
    assert (s["requests"], s["failures"], s["skipped_turns"]) == (4, 1, 1)
    assert s["errors"] == ["TimeoutError"]
    assert s["ttft_first_p50_s"] == pytest.approx(2.0)
    assert s["ttft_returning_p50_s"] == pytest.approx(0.2)
    assert s["itl_p50_s"] == pytest.approx(0.15)
    assert s["itl_max_s"] == pytest.approx(0.4)
    assert s["output_tokens"] == 9 and s["output_tokens_per_s"] == pytest.approx(4.5)


def test_summarize_of_nothing_reports_none_not_zero() -> None:
    s = summarize([], wall_s=1.0, skipped_turns=0)
    assert s["ttft_first_p50_s"] is None and s["itl_p90_s"] is None and s["itl_max_s"] is None


def test_output_mismatches() -> None:
    ref = {(0, 0): [1, 2, 3], (0, 1): [4, 5], (1, 0): [6]}
    assert output_mismatches(ref, dict(ref)) == []
    other = {(0, 0): [1, 9, 3], (0, 1): [4, 5]}
    assert output_mismatches(ref, other) == [
        {"user": 0, "turn": 0, "first_diff_index": 1},
        {"user": 1, "turn": 0, "first_diff_index": None},
    ]
    assert output_mismatches({(0, 0): [1, 2]}, {(0, 0): [1]}) == [
        {"user": 0, "turn": 0, "first_diff_index": 1}
    ]


def test_sizing_keeps_vllms_cache_below_the_workload_and_the_stores_above() -> None:
    from bench.serving.engine import BLOCK_BYTES, BLOCK_TOKENS, sizing

    w = Workload(users=8, turns=3, history_min_tokens=1024, history_max_tokens=4096)
    s = sizing(w, kv_cache_share=0.25)
    _, scripts = conversations(w)
    longest = max(w.final_context_tokens(len(x.history)) for x in scripts)
    assert s.max_model_len >= longest and s.max_model_len % BLOCK_TOKENS == 0
    assert 2 * s.max_model_len // BLOCK_TOKENS <= s.kv_cache_blocks < s.workload_blocks
    assert s.kv_cache_bytes == s.kv_cache_blocks * BLOCK_BYTES
    assert s.store_bytes >= s.workload_blocks * BLOCK_BYTES
    assert s.full_kv_cache_blocks > s.workload_blocks


def test_mismatch_counts_split_first_and_returning_turns() -> None:
    from bench.serving.vllm_serve import mismatch_counts

    bad = [
        {"user": 0, "turn": 0, "first_diff_index": 3},
        {"user": 1, "turn": 2, "first_diff_index": 0},
    ]
    got = mismatch_counts(bad, {(0, 0): [1], (1, 2): [2]}, 6)
    assert got == {"compared": 6, "answered": 2, "first_turns": 1, "returning_turns": 1}
