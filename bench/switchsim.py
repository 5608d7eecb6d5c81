"""The switch benchmark's workload, placement and a pure fleet simulation.

Provides:
- ``Workload``: agent-like sessions (prompts that grow turn by turn, think
  times, decode times), drawn per session from its own seeded generator, so
  the real benchmark (``bench/switch.py``) and the simulation replay the same
  sessions;
- ``choose_host``: session affinity with a spill: the host of the session's
  last turn if it has a free slot, else its spill host
  (``tierstore.policies.rendezvous_target``, the host kv_share replicates
  to), else the host with the most free slots;
- ``classify``: warm (>= 90% of the prompt reused), partly warm (30-90%),
  cold (< 30%), as in the public write-up;
- ``simulate``: a discrete-event model of N hosts x 4 slots with the same
  placement and replication policy (push after a turn of >= min_tokens to
  the spill host, only the blocks it lacks), each host's uplink a FIFO of its
  pushes at a given bandwidth plus a fixed per-push import cost (downlink
  contention is not modelled).

Everything here is pure (no processes, no sockets) and runs at scale 1:
times in seconds and bytes as in the public experiment.
"""

from __future__ import annotations

import heapq
import math
import random
import statistics
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tierstore.policies import rendezvous_target

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


# -- the pure fleet simulation ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SimConfig:
    hosts: int = 2
    slots_per_host: int = 4
    sessions: int = 16
    duration_s: float = 5400.0  # 90 min, as in the public runs
    link_bits_per_s: float = 1e9  # each host's uplink (pushes queue on it, one at a time)
    import_fixed_s: float = 0.05  # per push: RPCs, verify and commit set-up
    push_deadline_s: float = 120.0  # pushes ending later than this after the turn: dropped
    min_tokens: int = 8192  # kv_share: turns shorter than this are not replicated
    replication: bool = True
    workload: Workload = field(default_factory=Workload)


@dataclass(slots=True)
class _Session:
    index: int
    rng: random.Random
    conversation: int = 0
    context: int = 0  # tokens cached after the last turn (prompt + output)
    last_host: str | None = None

    @property
    def name(self) -> str:
        return session_name(self.index, self.conversation)


def simulate(cfg: SimConfig) -> dict[str, Any]:
    """Run the fleet for ``cfg.duration_s`` and report switch warmth and replica traffic."""
    wl = cfg.workload
    block_bytes = wl.block_tokens * wl.bytes_per_token
    members = [f"host-{i:02d}" for i in range(cfg.hosts)]
    free = {m: cfg.slots_per_host for m in members}
    held: dict[str, dict[str, int]] = {m: {} for m in members}  # host -> conversation -> blocks
    up_free = dict.fromkeys(members, 0.0)
    sessions = [_Session(i, wl.rng(i)) for i in range(cfg.sessions)]
    events: list[tuple[float, int, str, Any]] = []
    seq = 0

    def push_event(t: float, kind: str, data: Any) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (t, seq, kind, data))

    for s in sessions:
        push_event(s.rng.uniform(0, wl.think_mean_s), "arrive", s)
    waiting: list[tuple[_Session, int]] = []
    outcomes: list[str] = []
    send_s: list[float] = []
    reusable: list[str] = []  # the same classes, of what the last host had cached
    sent_bytes = 0
    turns = 0
    dropped = 0

    def start(s: _Session, prompt: int, host: str, now: float) -> None:
        nonlocal turns
        turns += 1
        free[host] -= 1
        reuse = min(held[host].get(s.name, 0) * wl.block_tokens, prompt)
        if s.last_host is not None and host != s.last_host:
            outcomes.append(classify(reuse / prompt))
            cached = s.context // wl.block_tokens * wl.block_tokens
            reusable.append(classify(reuse / cached if cached else 1.0))
        busy = wl.prefill_s(prompt - reuse) + wl.decode(s.rng)
        push_event(now + busy, "end", (s, prompt, host))

    def place_waiting(now: float) -> None:
        while waiting:
            s, prompt = waiting[0]
            host = choose_host(s.name, s.last_host, free, members)
            if host is None:
                return
            waiting.pop(0)
            start(s, prompt, host, now)

    while events:
        now, _, kind, data = heapq.heappop(events)
        if now > cfg.duration_s:
            break
        if kind == "arrive":
            s = data
            prompt = s.context + wl.new_input(s.rng) if s.context else wl.first_prompt(s.rng)
            waiting.append((s, prompt))
            place_waiting(now)
        elif kind == "end":
            s, prompt, host = data
            free[host] += 1
            s.context = prompt + wl.output(s.rng)
            s.last_host = host
            blocks = s.context // wl.block_tokens
            held[host][s.name] = max(held[host].get(s.name, 0), blocks)
            target = rendezvous_target(s.name, members, exclude=host)
            if cfg.replication and target is not None and s.context >= cfg.min_tokens:
                missing = blocks - held[target].get(s.name, 0)
                if missing > 0:
                    nbytes = missing * block_bytes
                    begin = max(now, up_free[host])
                    done = begin + cfg.import_fixed_s + nbytes * 8 / cfg.link_bits_per_s
                    if done - now > cfg.push_deadline_s:
                        dropped += 1
                    else:
                        up_free[host] = done
                        send_s.append(done - now)
                        push_event(done, "replica", (target, s.name, blocks, nbytes))
            if s.context >= wl.max_context_tokens:
                s.conversation += 1
                s.context = 0
                s.last_host = None
            push_event(now + wl.think(s.rng), "arrive", s)
            place_waiting(now)
        elif kind == "replica":
            target, name, blocks, nbytes = data
            held[target][name] = max(held[target].get(name, 0), blocks)
            sent_bytes += nbytes
    per_host_mbps = sent_bytes * 8 / cfg.duration_s / 1e6 / cfg.hosts
    return {
        "hosts": cfg.hosts,
        "sessions": cfg.sessions,
        "link_gbps": cfg.link_bits_per_s / 1e9,
        "replication": cfg.replication,
        "turns": turns,
        **shares(outcomes),
        **{f"{k}_of_cached": v for k, v in shares(reusable).items() if k != "switches"},
        "pushes_dropped": dropped,
        "send_p50_s": percentile(send_s, 50),
        "send_p90_s": percentile(send_s, 90),
        "replica_bytes": sent_bytes,
        "replica_mbps_per_host": per_host_mbps,
        "link_util_mean": per_host_mbps * 1e6 / cfg.link_bits_per_s,
    }


def fleet_sweep(
    hosts: Sequence[int] = (2, 4, 8, 16, 32, 64),
    sessions_per_host: Sequence[int] = (6, 8),
    links_gbps: Sequence[float] = (1.0, 10.0),
    seeds: Sequence[int] = (1, 2, 3),
    base: SimConfig | None = None,
) -> list[dict[str, Any]]:
    """Mean over ``seeds`` of ``simulate`` for every combination, plus replication off."""
    base = base or SimConfig()
    rows = []
    combos = [(h, sph, g, True) for h in hosts for sph in sessions_per_host for g in links_gbps]
    combos += [(h, sph, links_gbps[0], False) for h in hosts for sph in sessions_per_host]
    for h, sph, gbps, repl in combos:
        runs = [
            simulate(
                replace(
                    base,
                    hosts=h,
                    sessions=sph * h,
                    link_bits_per_s=gbps * 1e9,
                    replication=repl,
                    workload=replace(base.workload, seed=seed),
                )
            )
            for seed in seeds
        ]
        row = dict(runs[0])
        for key in ("switches", "turns", "replica_bytes", "pushes_dropped"):
            row[key] = sum(r[key] for r in runs)
        for key in (
            "warm",
            "partly_warm",
            "cold",
            "warm_of_cached",
            "partly_warm_of_cached",
            "cold_of_cached",
            "send_p50_s",
            "send_p90_s",
            "replica_mbps_per_host",
            "link_util_mean",
        ):
            vals = [r[key] for r in runs if r[key] is not None]
            row[key] = statistics.fmean(vals) if vals else None
        row["sessions_per_host"] = sph
        row["seeds"] = len(seeds)
        rows.append(row)
    return rows
