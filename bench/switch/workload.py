"""The switch benchmark's sessions and placement, shared by the real
benchmark (``bench/switch/run.py``) and the simulation (``bench/switch/sim.py``).

Provides:
- ``Workload``: agent-like sessions (prompts that grow turn by turn, think
  times, decode times), drawn per session from its own seeded generator, so
  the real benchmark and the simulation replay the same sessions;
- ``choose_host``: session affinity with a spill: the host of the session's
  last turn if it has a free slot, else its spill host
  (``tierstore.policies.replication.rendezvous_target``, the host kv_share
  replicates to), else the host with the most free slots;
- ``classify``: warm (>= 90% of the prompt reused), partly warm (30-90%),
  cold (< 30%), as in the public write-up; ``shares`` of each class, and
  ``percentile`` (nearest rank).

Everything here is pure (no processes, no sockets) and runs at scale 1:
times in seconds and bytes as in the public experiment.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tierstore.policies.replication import rendezvous_target

WARM_FRACTION = 0.9  # >= this share of the prompt reused: warm
PARTLY_FRACTION = 0.3  # >= this (and < warm): partly warm; below: cold
PUBLIC_DELTA_BYTES = 247 << 20  # the write-up's typical replica delta


@dataclass(frozen=True, slots=True)
class Workload:
    """Agent-like sessions at scale 1 (seconds, tokens, bytes)."""

    block_tokens: int = 128  # tokens per KV block
    bytes_per_token: int = 80 << 10  # KV bytes per token at scale 1 (see docs/switch.md)
    first_prompt_tokens: tuple[int, int] = (6000, 10000)  # system prompt + task, uniform
    input_median_tokens: float = 1500.0  # new input per turn (tool output): lognormal median
    input_sigma: float = 1.0  # lognormal sigma of the new input
    input_max_tokens: int = 12000  # a tool output is cut at this
    output_tokens: tuple[int, int] = (200, 1200)  # generated per turn, uniform
    max_context_tokens: int = 120_000  # then the agent starts a new conversation
    think_mean_s: float = 30.0  # tool execution between turns: exponential mean
    think_min_s: float = 2.0
    decode_s: tuple[float, float] = (3.0, 15.0)  # decode time per turn, uniform
    prefill_tokens_per_s: float = 8000.0  # prefill speed of the (simulated) engine
    seed: int = 1

    def rng(self, session: int) -> random.Random:
        return random.Random(self.seed * 1_000_003 + session)

    def first_prompt(self, rng: random.Random) -> int:
        return rng.randint(*self.first_prompt_tokens)

    def new_input(self, rng: random.Random) -> int:
        n = rng.lognormvariate(math.log(self.input_median_tokens), self.input_sigma)
        return max(1, min(int(n), self.input_max_tokens))

    def output(self, rng: random.Random) -> int:
        return rng.randint(*self.output_tokens)

    def think(self, rng: random.Random) -> float:
        return max(self.think_min_s, rng.expovariate(1.0 / self.think_mean_s))

    def decode(self, rng: random.Random) -> float:
        return rng.uniform(*self.decode_s)

    def prefill_s(self, tokens: int) -> float:
        return tokens / self.prefill_tokens_per_s

    def mean_delta_tokens(self) -> float:
        """Mean growth of a session's cache per turn (input + output)."""
        ln = self.input_median_tokens * math.exp(self.input_sigma**2 / 2)
        return min(ln, self.input_max_tokens) + sum(self.output_tokens) / 2


def session_name(session: int, conversation: int) -> str:
    return f"agent-{session:03d}-c{conversation}"


def choose_host(
    session: str, last: str | None, free: Mapping[str, int], members: Sequence[str]
) -> str | None:
    """Where the next turn of ``session`` runs (None: every slot is busy).

    Affinity first (the host of the last turn, or for a new conversation its
    home: the highest rendezvous weight over all members); then the spill
    host kv_share replicated to; then the host with the most free slots
    (ties by member order)."""
    first = last if last is not None else rendezvous_target(session, members, exclude="")
    if first is not None and free.get(first, 0) > 0:
        return first
    if first is not None:
        spill = rendezvous_target(session, members, exclude=first)
        if spill is not None and free.get(spill, 0) > 0:
            return spill
    best = max(members, key=lambda m: free.get(m, 0))
    return best if free.get(best, 0) > 0 else None


def classify(reused_fraction: float) -> str:
    if reused_fraction >= WARM_FRACTION:
        return "warm"
    if reused_fraction >= PARTLY_FRACTION:
        return "partly_warm"
    return "cold"


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100]); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def shares(outcomes: Sequence[str]) -> dict[str, Any]:
    n = len(outcomes)
    return {
        "switches": n,
        **{k: (outcomes.count(k) / n if n else None) for k in ("warm", "partly_warm", "cold")},
    }
