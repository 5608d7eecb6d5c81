"""The switch benchmark's pure fleet simulation, and the router's placement
that the real benchmark (``bench/switch/run.py``) runs too.

Provides:
- ``RoutedPlacement``: the KV-aware router's placement
  (``tierstore.router.cost.plan``) over what the hosts hold and their slots
  and queues: the turn goes to the host with the least estimated TTFT, and
  the replica to the plan's spill host;
- ``simulate``: a discrete-event model of N hosts x 4 slots with either
  placement policy and one FIFO of waiting turns for the fleet
  (``policy="affinity"``: the head of the FIFO takes its affinity host or
  the spill, ``bench.switch.workload.choose_host``; ``policy="router"``:
  each waiting turn, in FIFO order, starts when the host with its least
  estimated TTFT has a free slot, so a turn may wait for the host holding its
  prefix rather than go cold) and the same replication (``replicate``:
  ``kv_share``, push after a turn of >= min_tokens; ``headroom``,
  tierstore's default rule, which also pushes shorter turns while the host's
  uplink backlog drains within ``headroom_s``; ``stream``, the headroom rule
  with the prompt's blocks streamed when the prefill ends, the output's after
  the turn; always to the spill host, only the blocks it lacks), each host's
  uplink a FIFO of its pushes at a given bandwidth plus a fixed per-push
  import cost (downlink contention is not modelled). Every turn's TTFT is its
  wait for a slot, plus the load of the prefix its host holds, plus the
  prefill of the rest. Simulated engines do not pull from peers on a switch
  (the public experiment's did not), so the router's model is told peer
  fetches are unusable (``bench/switch/sweeps.py`` runs it over fleets).

Everything here is pure (no processes, no sockets) and runs at scale 1:
times in seconds and bytes as in the public experiment.
"""

from __future__ import annotations

import heapq
import random
import statistics
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from bench.switch.workload import (
    Workload,
    choose_host,
    classify,
    percentile,
    session_name,
    shares,
)
from tierstore.load import HostLoadView
from tierstore.policies.replication import HeadroomRule, ReplicaRequest, rendezvous_target
from tierstore.router.cost import DRAM, HostView, Plan, Rates, plan

REPLICATE_RULES = ("kv_share", "headroom", "stream")


class RoutedPlacement:
    """The router's decisions for a fleet of simulated engines:
    ``tierstore.router``'s cost model over what each host holds of the
    session (tier codes of its prefix) and its slots and queue. Candidates
    are the hosts holding any of the session plus the least busy others (the
    rest can only tie with those); ``turn_s`` is the running mean of slot
    occupancy, as an engine would measure it. ``time_scale`` and
    ``block_bytes`` let bench/switch/run.py use it at its scale (times and bytes
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
