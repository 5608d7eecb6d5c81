"""The fleet bench's users: multi-turn chats on a fixed, seeded, open-loop schedule.

Provides ``FleetWorkload`` (frozen config) and ``schedule(w)``: every request
of every mode's run, fixed before the run from the seed alone:

- ``groups`` shared contexts (a team's repository, a long system prompt);
  users of a group start their chat with it;
- the load is skewed on purpose: the ``hot_users`` of group 0 come back
  every ``hot_think_s``, the others every ``think_s``. Cache affinity keeps
  a conversation where its prefix is, so the host that served group 0's
  first turns gets most of the work (a hotspot) unless KV can move;
- each user has a long history of its own (``history_tokens``: an agent's
  files and tool output), then one new message a turn; the assistant's
  earlier replies are scripted text of ``output_tokens`` words, so every
  mode sends byte-identical prompts whatever its engines answered;
- open loop: turn n+1 of a user is sent at a time the schedule fixes, not
  when that mode finished turn n, so a slow mode's late turns do not
  shift the arrivals of the others (``bench/serving/vllm_serve.py`` once
  let each mode's speed set its own arrival times);
- ``time_scale`` stretches every time of the schedule (first-turn spread and
  gaps) by one factor: the times above are for engines that prefill
  ``REFERENCE_PREFILL_TOKENS_PER_S``, and on an engine k times slower the
  same schedule at scale k asks the same share of its time (the bench
  measures the rate and sets the scale, ``bench.fleet.run.calibrate``).

Text is words of ``engines.vllm.driver.chat_tokenizer`` (``w0 w1 ...``: one
token a word), so prompt lengths are known in tokens. Pure; any thread.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

# The engine speed the default times are sized for: the wide-KV model's cold
# prefill on one core of the Intel Xeon (AMX) the bench was first run on
# (1,600-2,100 tokens/s, measured), where the engines kept up in every mode.
REFERENCE_PREFILL_TOKENS_PER_S = 2000.0


@dataclass(frozen=True)
class FleetWorkload:
    users: int = 12
    hot_users: int = 6  # of group 0, the hotspot
    groups: int = 3
    turns: int = 4  # per user; returning turns: users * (turns - 1)
    context_tokens: int = 1024  # each group's shared context
    history_tokens: int = 2048  # each user's own history before its first turn
    message_tokens: int = 96  # each later user message
    output_tokens: int = 16  # per turn (ignore_eos: exactly this many)
    think_s: float = 24.0  # between a user's turns
    hot_think_s: float = 8.0  # between a hot user's turns
    start_spread_s: float = 40.0  # first turns spread over this
    jitter: float = 0.2  # each gap scaled by a factor in [1 - jitter, 1 + jitter]
    seed: int = 2026
    vocab_words: int = 1000  # w0 .. w999 (chat_tokenizer's words of a 1024-id vocabulary)
    time_scale: float = 1.0  # every time above, multiplied (a slower engine: > 1)

    def __post_init__(self) -> None:
        if not 0 < self.hot_users <= self.users or self.groups < 1 or self.turns < 2:
            raise ValueError(f"bad workload: {self}")
        if not 0.05 <= self.time_scale <= 100:
            raise ValueError(f"time_scale {self.time_scale} is outside 0.05-100")

    @property
    def returning_turns(self) -> int:
        return self.users * (self.turns - 1)


@dataclass(frozen=True)
class Request:
    """One turn of one user, as every mode sends it."""

    user: int
    turn: int
    group: int
    hot: bool
    at_s: float  # when it is sent, from the run's start
    messages: tuple[dict[str, str], ...]
    prompt_words: int  # the messages' words (the prompt's tokens, but the template's)

    def body(self, model: str, output_tokens: int) -> dict[str, Any]:
        return {
            "model": model,
            "messages": list(self.messages),
            "max_tokens": output_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }


def schedule(w: FleetWorkload) -> list[Request]:
    """Every request of the run, in the order they are sent."""
    rng = random.Random(w.seed)

    def text(n: int) -> str:
        return " ".join(f"w{rng.randrange(w.vocab_words)}" for _ in range(n))

    contexts = [text(w.context_tokens) for _ in range(w.groups)]
    out: list[Request] = []
    for u in range(w.users):
        hot = u < w.hot_users
        group = 0 if hot else 1 + (u - w.hot_users) % max(w.groups - 1, 1)
        group = min(group, w.groups - 1)
        think = w.hot_think_s if hot else w.think_s
        at = w.start_spread_s * w.time_scale * rng.random()
        messages: list[dict[str, str]] = [
            {"role": "system", "content": contexts[group]},
            {"role": "user", "content": text(w.history_tokens)},
        ]
        words = w.context_tokens + w.history_tokens
        for turn in range(w.turns):
            if turn:
                messages.append({"role": "assistant", "content": text(w.output_tokens)})
                messages.append({"role": "user", "content": text(w.message_tokens)})
                words += w.output_tokens + w.message_tokens
                at += think * w.time_scale * rng.uniform(1 - w.jitter, 1 + w.jitter)
            out.append(Request(u, turn, group, hot, round(at, 3), tuple(messages), words))
    return sorted(out, key=lambda r: r.at_s)
