"""The serving benchmark's pure helpers (harness/chat_load.py): the workload's
scripts and open-loop schedule, stream chunks and metrics parsing,
percentiles, summaries, output comparison."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import pytest

from harness.chat_load import (
    Sample,
    Scheduled,
    Workload,
    _chunk_tokens,
    chat_schedule,
    conversations,
    output_mismatches,
    parse_metrics,
    parse_sse_line,
    percentile,
    stream_scheduled,
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
        assert [len(r) for r in s.replies] == [w.output_tokens] * 3
        assert len(s.think_s) == 3 and all(1.0 <= t <= 3.0 for t in s.think_s)
        ids = [*s.history, *(t for m in s.messages + s.replies for t in m)]
        assert all(w.first_token_id <= t < w.vocab for t in ids)
    assert w.final_context_tokens(15) == 7 + 15 + 4 * (5 + w.output_tokens)


SMALL = Workload(users=3, turns=4, system_tokens=7, history_min_tokens=10,
                 history_max_tokens=20, message_tokens=5, output_tokens=4)  # fmt: skip


def test_workload_rejects_a_schedule_without_gaps() -> None:
    with pytest.raises(ValueError):
        Workload(think_s=0.0)
    assert Workload().returning_turns >= 32  # the bench's default: enough returning turns


def test_schedule_depends_on_the_seed_only() -> None:
    a, b = chat_schedule(SMALL), chat_schedule(SMALL)
    assert a == b and len(a) == SMALL.users * SMALL.turns
    assert [json.dumps(r.body) for r in a] == [json.dumps(r.body) for r in b]  # byte-identical
    other = chat_schedule(replace(SMALL, seed=SMALL.seed + 1))
    assert [r.body["prompt"] for r in other] != [r.body["prompt"] for r in a]
    assert [r.at_s for r in other] != [r.at_s for r in a]


def test_schedule_extends_each_prompt_by_the_scripted_reply_and_the_new_message() -> None:
    system, scripts = conversations(SMALL)
    schedule = chat_schedule(SMALL)
    assert [r.at_s for r in schedule] == sorted(r.at_s for r in schedule)  # in send order
    for s in scripts:
        turns = sorted((r for r in schedule if r.user == s.user), key=lambda r: r.turn)
        assert [r.turn for r in turns] == list(range(SMALL.turns))
        assert turns[0].body["prompt"] == [*system, *s.history, *s.messages[0]]
        assert turns[0].at_s == pytest.approx(s.start_s)
        for k in range(1, SMALL.turns):
            want = [*turns[k - 1].body["prompt"], *s.replies[k - 1], *s.messages[k]]
            assert turns[k].body["prompt"] == want
            assert turns[k].at_s > turns[k - 1].at_s  # strictly increasing per user
            assert turns[k].at_s - turns[k - 1].at_s == pytest.approx(s.think_s[k - 1], abs=2e-3)
        for r in turns:
            assert r.path == "/v1/completions" and r.prompt_tokens == len(r.body["prompt"])
            b = r.body
            assert (b["temperature"], b["ignore_eos"], b["stream"], b["return_token_ids"]) == (
                0.0, True, True, True
            )  # fmt: skip
            assert b["max_tokens"] == SMALL.output_tokens and "kv_transfer_params" not in b


def test_schedule_gives_each_user_a_session_key_when_the_mode_sends_transfer_params() -> None:
    schedule = chat_schedule(SMALL, {"kv_transfer_params": {"x": 1}})
    assert {(r.user, r.body["kv_transfer_params"]["session"]) for r in schedule} == {
        (u, f"u{u}") for u in range(SMALL.users)
    }
    assert all(r.body["kv_transfer_params"]["x"] == 1 for r in schedule)
    # the prompts and times do not depend on the mode's extras
    plain = chat_schedule(SMALL)
    assert [(r.at_s, r.body["prompt"]) for r in schedule] == [
        (r.at_s, r.body["prompt"]) for r in plain
    ]


def test_chunk_tokens_counts_and_collects_ids() -> None:
    assert _chunk_tokens({"choices": [{"text": "", "token_ids": [5, 6, 7]}]}) == (3, [5, 6, 7])
    assert _chunk_tokens({"choices": [{"text": "hi"}]}) == (1, [])  # no ids: one token
    assert _chunk_tokens({"choices": [{"delta": {"content": "hi"}}]}) == (1, [])
    assert _chunk_tokens({"choices": [], "usage": {"completion_tokens": 3}}) == (0, [])


class _Response:
    """What stream_scheduled reads of aiohttp's response: status, headers, lines."""

    status = 200
    headers: dict[str, str] = {}

    def __init__(self, lines: list[str]) -> None:
        self._lines = lines

    async def __aenter__(self) -> _Response:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    @property
    def content(self) -> AsyncIterator[bytes]:
        async def lines() -> AsyncIterator[bytes]:
            for line in self._lines:
                yield (line + "\n").encode()

        return lines()


class _Http:
    def __init__(self, lines: list[str]) -> None:
        self.lines = lines
        self.posted: list[tuple[str, Any]] = []

    def post(self, url: str, json: Any, timeout: Any) -> _Response:
        self.posted.append((url, json))
        return _Response(self.lines)


def test_stream_scheduled_collects_the_streamed_ids() -> None:
    chunks = [
        {"choices": [{"index": 0, "text": "", "token_ids": [11]}]},
        {"choices": [{"index": 0, "text": "", "token_ids": [12, 13]}]},
        {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 3,
                                  "prompt_tokens_details": {"cached_tokens": 8}}},
    ]  # fmt: skip
    http = _Http([f"data: {json.dumps(c)}" for c in chunks] + ["", "data: [DONE]"])
    req = Scheduled(1, 2, 0.0, "/v1/completions", {"prompt": [3] * 9, "max_tokens": 3}, 9)
    sample = asyncio.run(stream_scheduled(http, "http://h", req, time.perf_counter(), 5.0))  # type: ignore[arg-type]
    assert http.posted == [("http://h/v1/completions", req.body)]
    assert sample.error is None and sample.output_ids == [11, 12, 13]
    assert (sample.user, sample.turn, sample.returning) == (1, 2, True)
    assert sample.output_tokens == 3 and sample.cached_tokens == 8 and len(sample.itl_s) == 2
    assert sample.ttft_s is not None


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
    s = summarize(samples, wall_s=2.0)
    assert (s["requests"], s["failures"], s["skipped_turns"]) == (4, 1, 0)
    assert s["returning_turns"] == 1  # answered
    assert s["errors"] == ["TimeoutError"]
    assert s["ttft_first_p50_s"] == pytest.approx(2.0)
    assert s["ttft_returning_p50_s"] == pytest.approx(0.2)
    assert s["itl_p50_s"] == pytest.approx(0.15)
    assert s["itl_max_s"] == pytest.approx(0.4)
    assert s["output_tokens"] == 9 and s["output_tokens_per_s"] == pytest.approx(4.5)


def test_summarize_of_nothing_reports_none_not_zero() -> None:
    s = summarize([], wall_s=1.0)
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
