"""A multi-turn chat load against OpenAI-compatible servers, and its
statistics: the serving benchmark's (``bench/serving/vllm_serve.py``), and
any bench that drives engines through HTTP.

Provides:
- ``Workload`` (frozen config) and ``conversations(workload)``: U users'
  deterministic scripts from one seed: a system prompt all users share, each
  user's own history, one new message per turn, the assistant's scripted
  reply to each turn but the last, and the gap before each later turn;
- ``chat_schedule(workload)``: those scripts as an open-loop schedule of
  token-id ``/v1/completions`` requests (greedy, ``ignore_eos``, streamed
  with ``return_token_ids``): turn k's prompt is turn k-1's, its scripted
  reply and the new message, sent at the user's start plus its gaps. The
  replies are the script's, not the engine's, so every run of one seed sends
  byte-identical prompts at identical times, whatever its server answered
  and however fast;
- ``Scheduled`` and ``run_schedule(base_url, schedule)``: an open-loop load,
  every request sent at the time its schedule fixes (so a slow run's late
  turns do not delay the arrivals of the others), text, chat or token-id
  prompts, with the streamed token ids and the gateway's placement headers
  recorded;
- ``parse_sse_line``, ``parse_metrics`` (Prometheus text), ``percentile``,
  ``summarize`` and ``output_mismatches``: pure helpers, unit-tested
  (tests/unit/test_serve_load.py).

Token-id prompts: the serving bench's server runs with
``--skip-tokenizer-init`` (its random Llama has no tokenizer, and nothing may
be downloaded), and each streamed chunk carries its token ids
(``return_token_ids``). Runs in the benchmark's process, on one asyncio loop.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp


@dataclass(frozen=True)
class Workload:
    users: int = 8
    turns: int = 5  # per user; returning turns: users * (turns - 1)
    system_tokens: int = 256  # shared by every user
    history_min_tokens: int = 1024  # each user's own history before turn 0
    history_max_tokens: int = 4096
    message_tokens: int = 64  # the new user message of each turn
    output_tokens: int = 32  # greedy, ignore_eos: exactly this many a turn (and a scripted reply)
    think_s: float = 30.0  # mean gap between the sends of a user's turns (open loop)
    stagger_s: float = 3.0  # user u starts at u * stagger_s
    seed: int = 2026
    vocab: int = 1024
    first_token_id: int = 3  # ids below are the random Llama's special tokens

    def __post_init__(self) -> None:
        if self.users < 1 or self.turns < 1 or self.think_s <= 0 or self.stagger_s < 0:
            raise ValueError(f"bad workload: {self}")

    @property
    def returning_turns(self) -> int:
        return self.users * (self.turns - 1)

    def final_context_tokens(self, history_tokens: int) -> int:
        """A user's context after its last turn (prompt and output)."""
        per_turn = self.message_tokens + self.output_tokens
        return self.system_tokens + history_tokens + self.turns * per_turn


@dataclass(frozen=True)
class Script:
    """One user's conversation, fixed before the run."""

    user: int
    start_s: float  # offset from the load's start: its first turn's send time
    history: tuple[int, ...]
    messages: tuple[tuple[int, ...], ...]  # one per turn
    replies: tuple[tuple[int, ...], ...]  # the assistant's, to each turn but the last
    think_s: tuple[float, ...]  # gap from each turn's send to the next one's

    def send_times_s(self) -> list[float]:
        """Each turn's send time from the load's start (3 decimals)."""
        times, at = [], self.start_s
        for turn in range(len(self.messages)):
            at += self.think_s[turn - 1] if turn else 0.0
            times.append(round(at, 3))
        return times


@dataclass
class Sample:
    """One request as the client saw it; ``error`` is set for a failure."""

    user: int
    turn: int
    returning: bool  # turn > 0: its conversation's earlier prompt was sent before
    prompt_tokens: int
    sent_s: float  # since the load's start
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)  # gap before each later token
    output_ids: list[int] = field(default_factory=list)  # streamed ids (chunks with token_ids)
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens
    end_s: float | None = None
    error: str | None = None
    output_tokens: int = 0  # streamed tokens (usage's completion_tokens when given)
    served_by: str = ""  # a gateway's x-tierstore-host: the engine that answered
    placement: str = ""  # a gateway's x-tierstore-placement: why that engine
    estimate: str = ""  # a gateway's x-tierstore-estimate: what its cost model expected


def conversations(w: Workload) -> tuple[tuple[int, ...], list[Script]]:
    """The shared system prompt and every user's script, from ``w.seed`` only."""
    rng = random.Random(w.seed)

    def ids(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(w.first_token_id, w.vocab) for _ in range(n))

    system = ids(w.system_tokens)
    scripts = []
    for u in range(w.users):
        history = ids(rng.randint(w.history_min_tokens, w.history_max_tokens))
        messages = tuple(ids(w.message_tokens) for _ in range(w.turns))
        replies = tuple(ids(w.output_tokens) for _ in range(w.turns - 1))
        think = tuple(w.think_s * rng.uniform(0.5, 1.5) for _ in range(w.turns - 1))
        scripts.append(Script(u, u * w.stagger_s, history, messages, replies, think))
    return system, scripts


def parse_sse_line(line: str) -> dict[str, Any] | None:
    """The JSON of one ``data:`` line of a stream; None for other lines and
    for ``[DONE]``."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if not data or data == "[DONE]":
        return None
    parsed: dict[str, Any] = json.loads(data)
    return parsed


# -- open loop: every request sent at a time the schedule fixes -------------------------


@dataclass(frozen=True)
class Scheduled:
    """One request of a fixed schedule: sent ``at_s`` after the run's start,
    whether or not the earlier requests of its conversation have finished."""

    user: int
    turn: int
    at_s: float
    path: str  # /v1/completions or /v1/chat/completions
    body: dict[str, Any]  # streamed (``stream``, ``stream_options.include_usage``)
    prompt_tokens: int  # its prompt's length, as the schedule knows it


def chat_schedule(w: Workload, extra_body: dict[str, Any] | None = None) -> list[Scheduled]:
    """Every request of ``w``'s conversations, in send order, from ``w.seed``
    alone (see the module docstring). ``extra_body`` is merged into each body;
    its ``kv_transfer_params``, when given, gain the user's session key
    (``u<user>``)."""
    system, scripts = conversations(w)
    out = []
    for s in scripts:
        prompt = [*system, *s.history]
        for turn, at_s in enumerate(s.send_times_s()):
            if turn:
                prompt += s.replies[turn - 1]
            prompt += s.messages[turn]
            body: dict[str, Any] = {
                "model": "m",
                "prompt": list(prompt),
                "max_tokens": w.output_tokens,
                "temperature": 0.0,
                "ignore_eos": True,
                "stream": True,
                "return_token_ids": True,
                "stream_options": {"include_usage": True},
                **(extra_body or {}),
            }
            if "kv_transfer_params" in body:  # per user: a session key the connector may use
                body["kv_transfer_params"] = {**body["kv_transfer_params"], "session": f"u{s.user}"}
            out.append(Scheduled(s.user, turn, at_s, "/v1/completions", body, len(prompt)))
    return sorted(out, key=lambda r: (r.at_s, r.user))


def _chunk_tokens(obj: dict[str, Any]) -> tuple[int, list[int]]:
    """Tokens one streamed chunk carries, and their ids: its ``token_ids``
    (``return_token_ids``), else one token of unknown id for a non-empty
    text or chat delta (vLLM streams a token per engine step)."""
    n, ids = 0, []
    for choice in obj.get("choices") or []:
        got = choice.get("token_ids")
        if got:
            n += len(got)
            ids.extend(got)
        elif choice.get("text") or (choice.get("delta") or {}).get("content"):
            n += 1
    return n, ids


async def stream_scheduled(
    http: aiohttp.ClientSession, base_url: str, req: Scheduled, t0: float, timeout_s: float
) -> Sample:
    """Send ``req`` at its time and read its stream: TTFT (to the first
    token, not the role-only first chat chunk), the gap before each later
    token, the streamed token ids (``output_ids``, when the chunks carry
    them), the usage's cached prompt tokens, and the gateway's headers."""
    await asyncio.sleep(max(0.0, t0 + req.at_s - time.perf_counter()))
    sample = Sample(req.user, req.turn, req.turn > 0, req.prompt_tokens, time.perf_counter() - t0)
    sent = time.perf_counter()
    last: float | None = None
    try:
        async with http.post(base_url + req.path, json=req.body,
                             timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:  # fmt: skip
            sample.served_by = resp.headers.get("x-tierstore-host", "")
            sample.placement = resp.headers.get("x-tierstore-placement", "")
            sample.estimate = resp.headers.get("x-tierstore-estimate", "")
            if resp.status != 200:
                sample.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return sample
            async for raw in resp.content:
                obj = parse_sse_line(raw.decode().strip())
                if obj is None:
                    continue
                usage = obj.get("usage")
                if usage:
                    sample.prompt_tokens = usage.get("prompt_tokens", sample.prompt_tokens)
                    sample.cached_tokens = (usage.get("prompt_tokens_details") or {}).get(
                        "cached_tokens"
                    )
                    sample.output_tokens = usage.get("completion_tokens", sample.output_tokens)
                got, ids = _chunk_tokens(obj)
                sample.output_ids.extend(ids)
                if not got:
                    continue
                now = time.perf_counter()
                if last is None:
                    sample.ttft_s = now - sent
                else:
                    sample.itl_s.extend([(now - last) / got] * got)
                last = now
                if not usage:
                    sample.output_tokens += got
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as e:
        sample.error = f"{type(e).__name__}: {e}"[:300]
    finally:
        sample.end_s = time.perf_counter() - t0
    if sample.error is None and sample.ttft_s is None:
        sample.error = "the stream ended before a token"
    return sample


def run_schedule(
    base_url: str, schedule: list[Scheduled], *, timeout_s: float
) -> tuple[list[Sample], float]:
    """Every request of ``schedule`` against ``base_url`` (a gateway or an
    engine), each sent at its own time, none waiting for another (open
    loop): the samples (by user, turn) and the run's wall seconds."""

    async def run() -> tuple[list[Sample], float]:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
            t0 = time.perf_counter()
            samples = await asyncio.gather(
                *(stream_scheduled(http, base_url, r, t0, timeout_s) for r in schedule)
            )
            return sorted(samples, key=lambda s: (s.user, s.turn)), time.perf_counter() - t0

    return asyncio.run(run())


# -- statistics -----------------------------------------------------------------------


def percentile(values: Iterable[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100), linear between order statistics (numpy's
    default); None for no values."""
    xs = sorted(values)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _r(x: float | None, digits: int = 4) -> float | None:
    return None if x is None else round(x, digits)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text exposition: each sample's value, keyed by its name with
    its labels as written (``name{a="b"}``), and each name's sum over its label
    sets under the bare name."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        try:
            v = float(value)
        except ValueError:
            continue
        out[key] = v
        name = key.split("{", 1)[0]
        if "{" in key:
            out[name] = out.get(name, 0.0) + v
    return out


def summarize(samples: list[Sample], wall_s: float) -> dict[str, Any]:
    """Per-mode figures over the successful requests; failures counted.
    ``skipped_turns`` is 0: in an open loop every turn is sent (its prompt is
    scripted), whatever became of its conversation's earlier turns."""
    ok = [s for s in samples if s.error is None]
    first = [s.ttft_s for s in ok if not s.returning and s.ttft_s is not None]
    back = [s.ttft_s for s in ok if s.returning and s.ttft_s is not None]
    itl = [g for s in ok for g in s.itl_s]
    out_tokens = sum(len(s.output_ids) for s in ok)
    return {
        "requests": len(samples),
        "returning_turns": len(back),
        "failures": len(samples) - len(ok),
        "skipped_turns": 0,
        "errors": sorted({s.error for s in samples if s.error})[:5],
        "ttft_first_p50_s": _r(percentile(first, 50)),
        "ttft_first_p90_s": _r(percentile(first, 90)),
        "ttft_returning_p50_s": _r(percentile(back, 50)),
        "ttft_returning_p90_s": _r(percentile(back, 90)),
        "itl_p50_s": _r(percentile(itl, 50), 5),
        "itl_p90_s": _r(percentile(itl, 90), 5),
        "itl_max_s": _r(max(itl, default=None), 5) if itl else None,
        "output_tokens": out_tokens,
        "prompt_tokens": sum(s.prompt_tokens for s in ok),
        "wall_s": round(wall_s, 3),
        "output_tokens_per_s": round(out_tokens / wall_s, 3) if wall_s > 0 else None,
    }


def raw_samples(samples: list[Sample]) -> list[dict[str, Any]]:
    """Every request's record for the JSON (a chart draws CDFs from them)."""
    rows = []
    for s in samples:
        row = asdict(s)
        row["itl_s"] = [round(g, 5) for g in s.itl_s]
        for key in ("ttft_s", "sent_s", "end_s"):
            row[key] = _r(row[key])
        rows.append(row)
    return rows


def output_mismatches(
    reference: dict[tuple[int, int], list[int]], other: dict[tuple[int, int], list[int]]
) -> list[dict[str, int | None]]:
    """(user, turn) pairs whose greedy ids differ from ``reference``'s, with
    the first index that differs (None when one side has no output)."""
    bad: list[dict[str, int | None]] = []
    for key in sorted(set(reference) | set(other)):
        a, b = reference.get(key), other.get(key)
        if a == b:
            continue
        index = None
        if a is not None and b is not None:
            index = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                         min(len(a), len(b)))  # fmt: skip
        bad.append({"user": key[0], "turn": key[1], "first_diff_index": index})
    return bad
