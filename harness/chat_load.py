"""A multi-turn chat load against OpenAI-compatible servers, and its
statistics: the serving benchmark's (``bench/serving/vllm_serve.py``), and
any bench that drives engines through HTTP.

Provides:
- ``Workload`` (frozen config) and ``conversations(workload)``: U users'
  deterministic scripts from one seed: a system prompt all users share, each
  user's own history, one new message per turn and the think time before it.
- ``run_load(urls, workload, ...)``: the users as concurrent asyncio tasks
  against OpenAI-compatible ``/v1/completions`` servers with streaming (a
  ``place`` callable picks each turn's server; without it, the first), each turn's
  prompt being the conversation so far (the previous turns' outputs
  appended); every request bounded by a timeout. Returns one ``Sample`` per
  request, failures included (a user's conversation stops at its first
  failure: the next prompt would need the failed output; the turns it did not
  send are counted as skipped).
- ``Scheduled`` and ``run_schedule(base_url, schedule)``: an open-loop load,
  every request sent at the time its schedule fixes (so a slow run's late
  turns do not delay the arrivals of the others), text, chat or token-id
  prompts, with the gateway's placement headers recorded;
- ``parse_sse_line``, ``parse_metrics`` (Prometheus text), ``percentile``,
  ``summarize`` and ``output_mismatches``: pure helpers, unit-tested
  (tests/unit/test_serve_load.py).

Prompts are token ids (the server runs with ``--skip-tokenizer-init``: the
bench's random Llama has no tokenizer, and nothing may be downloaded), and
each streamed chunk carries its token ids (``return_token_ids``). Runs in the
benchmark's process, on one asyncio loop.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp


@dataclass(frozen=True)
class Workload:
    users: int = 4
    turns: int = 2
    system_tokens: int = 256  # shared by every user
    history_min_tokens: int = 1024  # each user's own history before turn 0
    history_max_tokens: int = 4096
    message_tokens: int = 64  # the new user message of each turn
    output_tokens: int = 32  # greedy, ignore_eos: exactly this many a turn
    think_s: float = 2.0  # mean pause between a reply and the next message
    stagger_s: float = 1.0  # user u starts at u * stagger_s
    seed: int = 2026
    vocab: int = 1024
    first_token_id: int = 3  # ids below are the random Llama's special tokens

    def final_context_tokens(self, history_tokens: int) -> int:
        """A user's context after its last turn (prompt and output)."""
        per_turn = self.message_tokens + self.output_tokens
        return self.system_tokens + history_tokens + self.turns * per_turn


@dataclass(frozen=True)
class Script:
    """One user's conversation, fixed before the run."""

    user: int
    start_s: float  # offset from the load's start
    history: tuple[int, ...]
    messages: tuple[tuple[int, ...], ...]  # one per turn
    think_s: tuple[float, ...]  # pause before each turn after the first


@dataclass
class Sample:
    """One request as the client saw it; ``error`` is set for a failure."""

    user: int
    turn: int
    returning: bool  # turn > 0: the conversation's prefix was served before
    prompt_tokens: int
    sent_s: float  # since the load's start
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)  # gap before each later token
    output_ids: list[int] = field(default_factory=list)
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens
    end_s: float | None = None
    error: str | None = None
    host: int = 0  # index of the server that served it
    place_s: float = 0.0  # time the placement took (a router's decision)
    output_tokens: int = 0  # streamed tokens (usage's completion_tokens when given)
    served_by: str = ""  # a gateway's x-tierstore-host: the engine that answered
    placement: str = ""  # a gateway's x-tierstore-placement: why that engine


Place = Callable[[int, int, list[int], list[int]], int]
"""(user, turn, prompt ids, requests in flight per server) -> server index;
called on a worker thread (it may block on a router's RPC)."""


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
        think = tuple(w.think_s * rng.uniform(0.5, 1.5) for _ in range(w.turns - 1))
        scripts.append(Script(u, u * w.stagger_s, history, messages, think))
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


async def stream_completion(
    http: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    sample: Sample,
    t0: float,
    timeout_s: float,
) -> None:
    """POST one streamed completion, filling ``sample``'s timings and ids."""
    sent = time.perf_counter()
    last: float | None = None
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    try:
        async with http.post(url, json=body, timeout=timeout) as resp:
            if resp.status != 200:
                text = (await resp.text())[:300]
                sample.error = f"HTTP {resp.status}: {text}"
                return
            async for raw in resp.content:
                obj = parse_sse_line(raw.decode().strip())
                if obj is None:
                    continue
                usage = obj.get("usage")
                if usage:
                    details = usage.get("prompt_tokens_details") or {}
                    sample.cached_tokens = details.get("cached_tokens")
                for choice in obj.get("choices", []):
                    got = choice.get("token_ids") or []
                    if not got:
                        continue
                    now = time.perf_counter()
                    if last is None:
                        sample.ttft_s = now - sent
                    else:  # one gap per chunk; several tokens in a chunk share it
                        sample.itl_s.extend([(now - last) / len(got)] * len(got))
                    last = now
                    sample.output_ids.extend(got)
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as e:
        sample.error = f"{type(e).__name__}: {e}"[:300]
    finally:
        sample.end_s = time.perf_counter() - t0
    want = body["max_tokens"]
    if sample.error is None and len(sample.output_ids) != want:
        sample.error = f"{len(sample.output_ids)} output tokens, not {want}"


@dataclass
class _Load:
    """What the users of one run share (on the event loop's thread)."""

    urls: list[str]
    w: Workload
    system: tuple[int, ...]
    t0: float
    timeout_s: float
    extra_body: dict[str, Any]
    place: Place | None
    inflight: list[int]
    samples: list[Sample] = field(default_factory=list)


async def _user(http: aiohttp.ClientSession, load: _Load, script: Script) -> int:
    """Run one conversation; returns the number of turns it skipped."""
    w = load.w
    await asyncio.sleep(max(0.0, load.t0 + script.start_s - time.perf_counter()))
    context = list(load.system) + list(script.history)
    for turn, message in enumerate(script.messages):
        if turn:
            await asyncio.sleep(script.think_s[turn - 1])
        context += message
        sample = Sample(script.user, turn, turn > 0, len(context), time.perf_counter() - load.t0)
        load.samples.append(sample)
        if load.place is not None:
            t = time.perf_counter()
            try:
                sample.host = await asyncio.to_thread(
                    load.place, script.user, turn, list(context), list(load.inflight)
                )
            except (ValueError, RuntimeError) as e:  # e.g. the router found no host
                sample.error = f"placement: {type(e).__name__}: {e}"[:300]
                return w.turns - turn - 1
            finally:
                sample.place_s = time.perf_counter() - t
        body = {
            "model": "m",
            "prompt": list(context),
            "max_tokens": w.output_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "return_token_ids": True,
            "stream_options": {"include_usage": True},
            **load.extra_body,
        }
        if "kv_transfer_params" in body:  # per user: a session key the connector may use
            body["kv_transfer_params"] = {
                **body["kv_transfer_params"],
                "session": f"u{script.user}",
            }
        url = f"{load.urls[sample.host]}/v1/completions"
        load.inflight[sample.host] += 1
        try:
            await stream_completion(http, url, body, sample, load.t0, load.timeout_s)
        finally:
            load.inflight[sample.host] -= 1
        if sample.error is not None:
            return w.turns - turn - 1
        context += sample.output_ids
    return 0


async def _run(
    urls: list[str], w: Workload, timeout_s: float, extra_body: dict[str, Any], place: Place | None
) -> tuple[list[Sample], float, int]:
    system, scripts = conversations(w)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as http:
        load = _Load(urls, w, system, time.perf_counter(), timeout_s, extra_body, place,
                     [0] * len(urls))  # fmt: skip
        skipped = await asyncio.gather(*(_user(http, load, s) for s in scripts))
        wall_s = time.perf_counter() - load.t0
    samples = sorted(load.samples, key=lambda s: (s.user, s.turn))
    return samples, wall_s, sum(skipped)


def run_load(
    urls: list[str],
    w: Workload,
    *,
    timeout_s: float,
    extra_body: dict[str, Any] | None = None,
    place: Place | None = None,
) -> tuple[list[Sample], float, int]:
    """Every user's conversation against ``urls``: the samples (sorted by
    user, turn), the load's wall seconds and the turns skipped after failures."""
    return asyncio.run(_run(urls, w, timeout_s, extra_body or {}, place))


# -- open loop: every request sent at a time the schedule fixes -------------------------


@dataclass(frozen=True)
class Scheduled:
    """One request of a fixed schedule: sent ``at_s`` after the run's start,
    whenever the earlier requests of its conversation finish."""

    user: int
    turn: int
    at_s: float
    path: str  # /v1/completions or /v1/chat/completions
    body: dict[str, Any]  # streamed (``stream``, ``stream_options.include_usage``)
    prompt_tokens: int  # its prompt's length, as the schedule knows it


def _chunk_tokens(obj: dict[str, Any]) -> int:
    """Tokens one streamed chunk carries: its token ids, else one for a
    non-empty text or chat delta (vLLM streams a token per engine step)."""
    n = 0
    for choice in obj.get("choices") or []:
        ids = choice.get("token_ids")
        if ids:
            n += len(ids)
        elif choice.get("text") or (choice.get("delta") or {}).get("content"):
            n += 1
    return n


async def stream_scheduled(
    http: aiohttp.ClientSession, base_url: str, req: Scheduled, t0: float, timeout_s: float
) -> Sample:
    """Send ``req`` at its time and read its stream: TTFT (to the first
    token, not the role-only first chat chunk), the gap before each later
    token, the usage's cached prompt tokens, and the gateway's headers."""
    await asyncio.sleep(max(0.0, t0 + req.at_s - time.perf_counter()))
    sample = Sample(req.user, req.turn, req.turn > 0, req.prompt_tokens, time.perf_counter() - t0)
    sent = time.perf_counter()
    last: float | None = None
    try:
        async with http.post(base_url + req.path, json=req.body,
                             timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:  # fmt: skip
            sample.served_by = resp.headers.get("x-tierstore-host", "")
            sample.placement = resp.headers.get("x-tierstore-placement", "")
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
                got = _chunk_tokens(obj)
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


def summarize(samples: list[Sample], wall_s: float, skipped_turns: int) -> dict[str, Any]:
    """Per-mode figures over the successful requests; failures counted."""
    ok = [s for s in samples if s.error is None]
    first = [s.ttft_s for s in ok if not s.returning and s.ttft_s is not None]
    back = [s.ttft_s for s in ok if s.returning and s.ttft_s is not None]
    itl = [g for s in ok for g in s.itl_s]
    out_tokens = sum(len(s.output_ids) for s in ok)
    return {
        "requests": len(samples),
        "failures": len(samples) - len(ok),
        "skipped_turns": skipped_turns,
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
