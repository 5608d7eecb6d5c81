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
- ``RoutedPlacement``: the KV-aware router's placement
  (``tierstore.router.cost.plan``) over what the simulated hosts hold and
  their slots and queues: the turn goes to the host with the least
  estimated TTFT, and the replica to the plan's spill host;
- ``churn_sweep``: the same fleet with hosts dying and joining during the
  run, every host's peer list static against live membership (etcd leases);
- ``simulate``: a discrete-event model of N hosts x 4 slots with either
  placement policy and one FIFO of waiting turns for the fleet
  (``policy="affinity"``: the head of the FIFO takes its affinity host or
  the spill; ``policy="router"``: each waiting turn, in FIFO order, starts
  when the host with its least estimated TTFT has a free slot, so a turn may
  wait for the host holding its prefix rather than go cold) and the same
  replication (``replicate``: ``kv_share``, push after a turn of >=
  min_tokens; ``headroom``, tierstore's default rule, which also pushes
  shorter turns while the host's uplink backlog drains within
  ``headroom_s``; ``stream``, the headroom rule with the prompt's blocks
  streamed when the prefill ends, the output's after the turn; always to
  the spill host, only the blocks it lacks), each host's uplink a FIFO of its
  pushes at a given bandwidth plus a fixed per-push import cost (downlink
  contention is not modelled). Every turn's TTFT is its wait for a slot,
  plus the load of the prefix its host holds, plus the prefill of the rest.
  Simulated engines do not pull from peers on a switch (the public
  experiment's did not), so the router's model is told peer fetches are
  unusable.

Everything here is pure (no processes, no sockets) and runs at scale 1:
times in seconds and bytes as in the public experiment.
"""

from __future__ import annotations

import heapq
import math
import random
import statistics
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tierstore.load import HostLoadView
from tierstore.policies import HeadroomRule, ReplicaRequest, rendezvous_target
from tierstore.router.cost import DRAM, HostView, Plan, Rates, plan

REPLICATE_RULES = ("kv_share", "headroom", "stream")
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


class RoutedPlacement:
    """The router's decisions for a fleet of simulated engines:
    ``tierstore.router``'s cost model over what each host holds of the
    session (tier codes of its prefix) and its slots and queue. Candidates
    are the hosts holding any of the session plus the least busy others (the
    rest can only tie with those); ``turn_s`` is the running mean of slot
    occupancy, as an engine would measure it. ``time_scale`` and
    ``block_bytes`` let bench/switch.py use it at its scale (times and bytes
    both multiplied by the scale)."""

    def __init__(
        self, members: list[str], slots: int, wl: Workload, cfg: SimConfig,
        block_bytes: int | None = None, time_scale: float = 1.0,
    ) -> None:  # fmt: skip
        self.members, self.slots, self.wl = members, slots, wl
        self.block_bytes = block_bytes or wl.block_tokens * wl.bytes_per_token
        self.rates = Rates(
            prefill_tokens_per_s=wl.prefill_tokens_per_s / time_scale,
            dram_bytes_per_s=cfg.dram_load_bytes_per_s,
            peer_bytes_per_s=1.0,  # engines import what their host holds; no pulls on a switch
            turn_s=15.0 * time_scale,
        )
        self._busy_total, self._turns = 0.0, 0
        self._lock = threading.Lock()

    def observe(self, busy_s: float) -> None:
        with self._lock:
            self._busy_total += busy_s
            self._turns += 1
            if self._turns % 16 == 0:
                self.rates = replace(self.rates, turn_s=self._busy_total / self._turns)

    def plan(
        self, name: str, prompt: int, current: str | None, prefixes: Mapping[str, bytes],
        busy: Mapping[str, int], queued: Mapping[str, int],
    ) -> Plan:  # fmt: skip
        """``prefixes[host]``: tier codes of the prompt's prefix the host
        holds (absent: nothing)."""
        blocks = prompt // self.wl.block_tokens
        holders = [m for m in self.members if prefixes.get(m)]
        others = sorted(
            (m for m in self.members if not prefixes.get(m)), key=lambda m: busy[m] + queued[m]
        )[:3]
        views = [
            HostView(
                m, prefixes.get(m, b"")[:blocks], HostLoadView(True, busy[m], self.slots, queued[m])
            )
            for m in (*holders, *others)
        ]
        return plan(
            views, blocks, prompt, self.wl.block_tokens, self.block_bytes, self.rates,
            session=name, current_host=current or "",
        )  # fmt: skip


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
    replicate: str = "kv_share"  # kv_share | headroom | stream (see the module docstring)
    headroom_s: float = 10.0  # headroom / stream: short turns while the uplink drains this fast
    policy: str = "affinity"  # affinity (with a spill) | router (least estimated TTFT)
    dram_load_bytes_per_s: float = 10e9  # a held block's load into the engine (both policies)
    workload: Workload = field(default_factory=Workload)
    # Hosts that come and go (affinity placement only): ``extra_hosts`` more
    # hosts exist but are down at the start; ``churn`` is (time s, "join" |
    # "leave", host index) events (a host that left does not come back).
    # ``membership``: "static" (every host's list is the hosts up at the
    # start: a dead one stays a replica target, a new one is never used) or
    # "live" (etcd: a new host is seen at once, a dead one after
    # ``membership_ttl_s``).
    extra_hosts: int = 0
    churn: tuple[tuple[float, str, int], ...] = ()
    membership: str = "static"
    membership_ttl_s: float = 10.0


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
    """Run the fleet for ``cfg.duration_s`` and report switch warmth, TTFT,
    load balance and replica traffic."""
    if cfg.policy not in ("affinity", "router"):
        raise ValueError(f"policy must be affinity or router, got {cfg.policy!r}")
    if cfg.membership not in ("static", "live"):
        raise ValueError(f"membership must be static or live, got {cfg.membership!r}")
    if (cfg.churn or cfg.extra_hosts) and cfg.policy != "affinity":
        raise ValueError("hosts joining and leaving are simulated with affinity placement only")
    if cfg.replicate not in REPLICATE_RULES:
        raise ValueError(f"replicate must be one of {REPLICATE_RULES}, got {cfg.replicate!r}")
    link_bytes_per_s = cfg.link_bits_per_s / 8
    headroom = HeadroomRule(cfg.min_tokens, cfg.headroom_s, link_bytes_per_s)
    wl = cfg.workload
    block_bytes = wl.block_tokens * wl.bytes_per_token
    everyone = [f"host-{i:02d}" for i in range(cfg.hosts + cfg.extra_hosts)]
    up = set(everyone[: cfg.hosts])
    # The group as placement and kv_share see it (the configured list, or
    # etcd's live set): what rendezvous hashing runs over.
    members = everyone[: cfg.hosts]
    free = {m: cfg.slots_per_host if m in up else 0 for m in everyone}
    held: dict[str, dict[str, int]] = {m: {} for m in everyone}  # host -> conversation -> blocks
    up_free = dict.fromkeys(everyone, 0.0)
    busy_s = dict.fromkeys(everyone, 0.0)  # slot-seconds served per host
    router = RoutedPlacement(members, cfg.slots_per_host, wl, cfg)
    sessions = [_Session(i, wl.rng(i)) for i in range(cfg.sessions)]
    events: list[tuple[float, int, str, Any]] = []
    seq = 0

    def push_event(t: float, kind: str, data: Any) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (t, seq, kind, data))

    for s in sessions:
        push_event(s.rng.uniform(0, wl.think_mean_s), "arrive", s)
    for t, what, index in cfg.churn:
        if what not in ("join", "leave") or not 0 <= index < len(everyone):
            raise ValueError(f"churn event {(t, what, index)!r}: (time, join|leave, host index)")
        push_event(t, what, everyone[index])
    gone: set[str] = set()
    pushes_to_dead = 0
    joined_turns = 0
    waiting: list[tuple[_Session, int, float]] = []  # (session, prompt, arrival): one FIFO
    outcomes: list[str] = []
    send_s: list[float] = []
    ttft_s: list[float] = []
    wait_s: list[float] = []
    reusable: list[str] = []  # the same classes, of what the last host had cached
    sent_bytes = 0
    turns = 0
    dropped = 0
    skipped = 0  # pushes the rule declined (short turns; under headroom, a busy uplink)
    scheduled: dict[tuple[str, str], int] = {}  # (target, conversation) -> blocks on the way

    def replicate(host: str, context: int, push_bytes: int, now: float) -> bool:
        if cfg.replicate == "kv_share":
            return context >= cfg.min_tokens
        backlog = int(max(0.0, up_free[host] - now) * link_bytes_per_s)
        return headroom.replicate(
            ReplicaRequest(context, push_bytes, link_bytes_per_s, backlog, False)
        )

    def push(
        host: str, target: str | None, s: _Session, blocks: int, context: int, now: float
    ) -> None:
        """Queue the push of what ``target`` (``s``'s spill host) lacks of its first ``blocks``."""
        nonlocal dropped, skipped
        if not cfg.replication or target is None:
            return
        there = max(held[target].get(s.name, 0), scheduled.get((target, s.name), 0))
        missing = blocks - there
        if missing <= 0:
            return
        nbytes = missing * block_bytes
        if not replicate(host, context, nbytes, now):
            skipped += 1
            return
        begin = max(now, up_free[host])
        done = begin + cfg.import_fixed_s + nbytes * 8 / cfg.link_bits_per_s
        if done - now > cfg.push_deadline_s:
            dropped += 1
            return
        up_free[host] = done
        send_s.append(done - now)
        scheduled[(target, s.name)] = blocks
        push_event(done, "replica", (target, s.name, blocks, nbytes))

    def start(s: _Session, prompt: int, host: str, now: float, arrived: float) -> None:
        nonlocal turns, joined_turns
        turns += 1
        joined_turns += host not in everyone[: cfg.hosts]
        free[host] -= 1
        reuse = min(held[host].get(s.name, 0) * wl.block_tokens, prompt)
        if s.last_host is not None and host != s.last_host:
            outcomes.append(classify(reuse / prompt))
            cached = s.context // wl.block_tokens * wl.block_tokens
            reusable.append(classify(reuse / cached if cached else 1.0))
        load = reuse // wl.block_tokens * block_bytes / cfg.dram_load_bytes_per_s
        first_token = load + wl.prefill_s(prompt - reuse)
        ttft_s.append(now - arrived + first_token)
        wait_s.append(now - arrived)
        busy = first_token + wl.decode(s.rng)
        if cfg.replicate == "stream":  # the prompt's blocks stream once its prefill ends
            push_event(now + first_token, "prefill_done", (s, prompt, host))
        busy_s[host] += busy
        router.observe(busy)
        push_event(now + busy, "end", (s, prompt, host))

    def place_waiting(now: float) -> None:
        if cfg.policy == "router":
            return route_waiting(now)
        while waiting:
            s, prompt, arrived = waiting[0]
            host = choose_host(s.name, s.last_host, free, members)
            if host is None:
                return
            waiting.pop(0)
            start(s, prompt, host, now, arrived)

    def prefixes(name: str) -> dict[str, bytes]:  # every held block is in DRAM here
        return {m: bytes([DRAM]) * held[m][name] for m in members if held[m].get(name)}

    def fleet_load() -> tuple[dict[str, int], dict[str, int]]:
        return {m: cfg.slots_per_host - free[m] for m in members}, dict.fromkeys(members, 0)

    def route_waiting(now: float) -> None:
        i = 0
        while i < len(waiting) and any(free.values()):
            s, prompt, arrived = waiting[i]
            best = router.plan(s.name, prompt, s.last_host, prefixes(s.name), *fleet_load()).best
            assert best is not None
            if free[best.host] > 0:
                waiting.pop(i)
                start(s, prompt, best.host, now, arrived)
            else:
                i += 1  # waiting for that host beats starting elsewhere

    def spill_target(s: _Session, host: str) -> str | None:
        if cfg.policy == "affinity":
            return rendezvous_target(s.name, members, exclude=host)
        return (
            router.plan(s.name, s.context, host, prefixes(s.name), *fleet_load()).spill_host or None
        )

    while events:
        now, _, kind, data = heapq.heappop(events)
        if now > cfg.duration_s:
            break
        if kind == "arrive":
            s = data
            prompt = s.context + wl.new_input(s.rng) if s.context else wl.first_prompt(s.rng)
            waiting.append((s, prompt, now))
            place_waiting(now)
        elif kind == "end":
            s, prompt, host = data
            s.context = prompt + wl.output(s.rng)
            s.last_host = host
            blocks = s.context // wl.block_tokens
            target = None
            if host in up:  # a turn on a host that died meanwhile left nothing behind
                free[host] += 1
                held[host][s.name] = max(held[host].get(s.name, 0), blocks)
                target = spill_target(s, host)
            if target is not None and target not in up:
                pushes_to_dead += 1  # a static list (or a live one within its TTL): lost
                target = None
            push(host, target, s, blocks, s.context, now)
            if s.context >= wl.max_context_tokens:
                s.conversation += 1
                s.context = 0
                s.last_host = None
            push_event(now + wl.think(s.rng), "arrive", s)
            place_waiting(now)
        elif kind == "prefill_done":
            s, prompt, host = data
            target = spill_target(s, host) if host in up else None
            if target is not None and target in up:
                push(host, target, s, prompt // wl.block_tokens, prompt, now)
        elif kind == "replica":
            target, name, blocks, nbytes = data
            if target in up:
                held[target][name] = max(held[target].get(name, 0), blocks)
                sent_bytes += nbytes
        elif kind == "join":
            if data in gone or data in up:
                raise ValueError(f"{data} cannot join: it is up or it left before")
            up.add(data)
            free[data] = cfg.slots_per_host
            if cfg.membership == "live":  # seen within a watch round trip
                members = sorted({*members, data})
            place_waiting(now)
        elif kind == "leave":
            if data not in up:
                raise ValueError(f"{data} cannot leave: it is not up")
            up.discard(data)
            gone.add(data)
            free[data] = 0
            held[data].clear()
            if cfg.membership == "live":  # its lease expires one TTL later
                push_event(now + cfg.membership_ttl_s, "expire", data)
        elif kind == "expire":
            members = [m for m in members if m != data]
    per_host_mbps = sent_bytes * 8 / cfg.duration_s / 1e6 / cfg.hosts
    loads = list(busy_s.values())
    return {
        "hosts": cfg.hosts,
        "sessions": cfg.sessions,
        "link_gbps": cfg.link_bits_per_s / 1e9,
        "replication": cfg.replication,
        "replicate": cfg.replicate,
        "policy": cfg.policy,
        "turns": turns,
        **shares(outcomes),
        **{f"{k}_of_cached": v for k, v in shares(reusable).items() if k != "switches"},
        "ttft_mean_s": statistics.fmean(ttft_s) if ttft_s else None,
        "ttft_p90_s": percentile(ttft_s, 90),
        "wait_mean_s": statistics.fmean(wait_s) if wait_s else None,
        # Load balance: the busiest host's slot-seconds over the mean host's.
        "busy_max_over_mean": max(loads) / statistics.fmean(loads) if any(loads) else None,
        "pushes_dropped": dropped,
        "pushes_to_dead": pushes_to_dead,
        "turns_on_joined_hosts": joined_turns,
        "membership": cfg.membership,
        "pushes_skipped": skipped,
        "send_p50_s": percentile(send_s, 50),
        "send_p90_s": percentile(send_s, 90),
        "replica_bytes": sent_bytes,
        "replica_mbps_per_host": per_host_mbps,
        "link_util_mean": per_host_mbps * 1e6 / cfg.link_bits_per_s,
    }


# Two hosts die and two new ones join during the 90 minutes of an 8-host fleet.
CHURN = ((1200.0, "leave", 3), (1800.0, "join", 8), (2400.0, "leave", 5), (3000.0, "join", 9))


def churn_sweep(
    seeds: Sequence[int] = (1, 2, 3), base: SimConfig | None = None,
    ttls_s: Sequence[float] = (10.0, 60.0),
) -> list[dict[str, Any]]:  # fmt: skip
    """8 hosts x 4 slots, 6 sessions per host, 1 Gbit/s, affinity placement:
    a fixed fleet; then ``CHURN`` with every host's list static; then with
    live membership at each lease TTL in ``ttls_s``. Means over ``seeds``."""
    base = base or SimConfig()
    fleet = replace(base, hosts=8, sessions=48, policy="affinity", replication=True)
    churned = replace(fleet, extra_hosts=2, churn=CHURN)
    cases: list[tuple[str, SimConfig]] = [("fixed fleet", fleet), ("static list", churned)]
    cases += [
        (f"live, TTL {ttl:g} s", replace(churned, membership="live", membership_ttl_s=ttl))
        for ttl in ttls_s
    ]
    rows = []
    for name, cfg in cases:
        runs = [simulate(replace(cfg, workload=replace(cfg.workload, seed=s))) for s in seeds]
        row: dict[str, Any] = {"case": name, "seeds": len(seeds), "membership": cfg.membership}
        for key in (
            "switches",
            "turns",
            "replica_bytes",
            "pushes_to_dead",
            "turns_on_joined_hosts",
        ):
            row[key] = sum(r[key] for r in runs)
        for key in ("warm", "partly_warm", "cold", "ttft_mean_s", "ttft_p90_s",
                    "replica_mbps_per_host", "busy_max_over_mean"):  # fmt: skip
            vals = [r[key] for r in runs if r[key] is not None]
            row[key] = statistics.fmean(vals) if vals else None
        rows.append(row)
    return rows


def fleet_sweep(
    hosts: Sequence[int] = (2, 4, 8, 16, 32, 64),
    sessions_per_host: Sequence[int] = (6, 8),
    links_gbps: Sequence[float] = (1.0, 10.0),
    seeds: Sequence[int] = (1, 2, 3),
    base: SimConfig | None = None,
    router_hosts: Sequence[int] = (),
    rules: Sequence[str] = (),
) -> list[dict[str, Any]]:
    """Mean over ``seeds`` of ``simulate`` for every combination, plus
    replication off; with affinity placement, and also with the router for
    the fleet sizes in ``router_hosts`` (at the first link speed), and with
    each replication rule of ``rules`` besides the base's (affinity, every
    link speed)."""
    base = base or SimConfig()
    rows = []
    Combo = tuple[int, int, float, bool, str, str]
    first = base.replicate
    combos: list[Combo] = [
        (h, sph, g, True, "affinity", first)
        for h in hosts
        for sph in sessions_per_host
        for g in links_gbps
    ]
    combos += [
        (h, sph, links_gbps[0], False, "affinity", first)
        for h in hosts
        for sph in sessions_per_host
    ]
    combos += [
        (h, sph, links_gbps[0], True, "router", first)
        for h in router_hosts
        for sph in sessions_per_host
    ]
    combos += [
        (h, sph, g, True, "affinity", rule)
        for rule in rules
        if rule != first
        for h in hosts
        for sph in sessions_per_host
        for g in links_gbps
    ]
    for h, sph, gbps, repl, policy, rule in combos:
        runs = [
            simulate(
                replace(
                    base,
                    hosts=h,
                    sessions=sph * h,
                    link_bits_per_s=gbps * 1e9,
                    replication=repl,
                    policy=policy,
                    replicate=rule,
                    workload=replace(base.workload, seed=seed),
                )
            )
            for seed in seeds
        ]
        row = dict(runs[0])
        for key in ("switches", "turns", "replica_bytes", "pushes_dropped", "pushes_skipped"):
            row[key] = sum(r[key] for r in runs)
        for key in (
            "warm",
            "partly_warm",
            "cold",
            "warm_of_cached",
            "partly_warm_of_cached",
            "cold_of_cached",
            "ttft_mean_s",
            "ttft_p90_s",
            "wait_mean_s",
            "busy_max_over_mean",
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
