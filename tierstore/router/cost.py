"""The router's cost model: estimated time to first token of a turn on each host.

Provides:
- ``Rates``: the speeds the model assumes (prefill tokens/s, bytes/s of each
  tier's load path, fixed costs, mean slot occupancy), from config, and
  replaced per host by what that host measured (``Rates.for_host``);
- ``HostView``: what one candidate host holds of the request's prefix (one
  tier code per block, as the peer Lookup answers) and its load;
- ``estimate``: TTFT = queue wait + load of the reused prefix + prefill of
  the rest, with the reused length chosen to minimise it (a block is loaded
  only where loading beats recomputing, and only as a prefix);
- ``plan``: every candidate's ``HostCost`` (with peer-fetchable blocks: what
  another candidate holds beyond this one's prefix) ranked best first, and
  ``spill_host``: where the session's replica should go (the host it would
  move to if its current host were busy).

Pure: no I/O, no clocks. Per-block work is numpy, not Python loops.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from tierstore.loadboard import HostLoadView
from tierstore.policies import rendezvous_weight
from tierstore.tiers.base import TIER_CODES, TierName

_TIER_ORDER = (TierName.HBM, TierName.DRAM, TierName.NVME, TierName.PEER)
HBM, DRAM, NVME, PEER = (TIER_CODES[t] for t in _TIER_ORDER)


@dataclass(frozen=True, slots=True)
class Rates:
    prefill_tokens_per_s: float = 8000.0  # the engine's prefill speed
    dram_bytes_per_s: float = 10e9  # host memory -> device (PCIe, or memcpy on CPU hosts)
    nvme_bytes_per_s: float = 2e9  # local NVMe read + verify
    peer_bytes_per_s: float = 1.25e9  # fetch from another host (10 GbE)
    nvme_fixed_s: float = 0.001  # per load that touches NVMe
    peer_fixed_s: float = 0.01  # per fetch: lookup, OpenFetch and connection set-up
    turn_s: float = 10.0  # mean time a request holds a slot (for queue waits)

    def __post_init__(self) -> None:
        for name in ("prefill_tokens_per_s", "dram_bytes_per_s", "nvme_bytes_per_s",
                     "peer_bytes_per_s", "turn_s"):  # fmt: skip
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("nvme_fixed_s", "peer_fixed_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    def for_host(
        self,
        prefill_tokens_per_s: float = 0.0,
        nvme_bytes_per_s: float = 0.0,
        peer_bytes_per_s: float = 0.0,
    ) -> Rates:
        """These rates with a host's measured speeds (0: not measured) in place."""
        return replace(
            self,
            prefill_tokens_per_s=prefill_tokens_per_s or self.prefill_tokens_per_s,
            nvme_bytes_per_s=nvme_bytes_per_s or self.nvme_bytes_per_s,
            peer_bytes_per_s=peer_bytes_per_s or self.peer_bytes_per_s,
        )


@dataclass(frozen=True, slots=True)
class HostView:
    """One candidate as the router sees it now."""

    host: str
    tiers: bytes = b""  # tier code of each block of the prefix the host holds itself
    load: HostLoadView | None = None  # None: unknown (counted as idle)
    rates: Rates | None = None  # measured speeds folded in; None: the router's rates
    reachable: bool = True
    error: str = ""
    source: str = "lookup"  # lookup | index


@dataclass(frozen=True, slots=True)
class HostCost:
    host: str
    ttft_s: float
    queue_s: float = 0.0
    load_s: float = 0.0
    prefill_s: float = 0.0
    blocks: Mapping[str, int] = field(default_factory=dict)  # loaded blocks by tier name
    held_blocks: int = 0  # prefix blocks the host holds itself (any tier)
    reused_tokens: int = 0
    prefill_tokens: int = 0
    reachable: bool = True
    error: str = ""
    source: str = "lookup"
    load: HostLoadView | None = None


@dataclass(frozen=True, slots=True)
class Plan:
    ranked: list[HostCost]  # reachable hosts best first, then the unreachable ones
    spill_host: str  # "" when no other reachable host
    num_blocks: int
    num_tokens: int

    @property
    def best(self) -> HostCost | None:
        return self.ranked[0] if self.ranked and self.ranked[0].reachable else None


def queue_wait_s(load: HostLoadView | None, rates: Rates) -> float:
    """Expected wait for a slot: none while a slot is free for this request;
    else the requests ahead of it, each freeing up at slots/turn_s, after the
    first slot frees (the engine's own ``wait_s`` if it gave one)."""
    if load is None or not load.reported:
        return 0.0
    slots = max(load.slots, 1)
    free = max(slots - load.busy_slots, 0)
    ahead = load.queue_len - free  # requests that will take a slot before this one
    if ahead < 0:
        return 0.0
    first = load.wait_s if load.wait_s > 0 else rates.turn_s / slots
    return first + ahead * rates.turn_s / slots


def estimate(
    view: HostView,
    tiers: np.ndarray,
    num_tokens: int,
    block_tokens: int,
    block_bytes: int,
    rates: Rates,
) -> HostCost:
    """TTFT on one host whose usable prefix has these tier codes (its own
    blocks, then PEER for blocks it would fetch). Loads the prefix length
    that minimises load + prefill; at least one token is always computed."""
    r = view.rates or rates
    queue = queue_wait_s(view.load, r)
    per_block = np.zeros(5, dtype=np.float64)
    per_block[DRAM] = block_bytes / r.dram_bytes_per_s
    per_block[NVME] = block_bytes / r.nvme_bytes_per_s + per_block[DRAM]
    per_block[PEER] = block_bytes / r.peer_bytes_per_s + per_block[DRAM]
    n = len(tiers)
    load_cum = np.zeros(n + 1)
    np.cumsum(per_block[tiers], out=load_cum[1:])
    lengths = np.arange(n + 1)
    for code, fixed in ((NVME, r.nvme_fixed_s), (PEER, r.peer_fixed_s)):
        first = np.flatnonzero(tiers == code)
        if first.size:
            load_cum[first[0] + 1 :] += fixed
    reused = np.minimum(lengths * block_tokens, max(num_tokens - 1, 0))
    prefill = (num_tokens - reused) / r.prefill_tokens_per_s
    total = load_cum + prefill
    best = int(np.argmin(total))  # the shortest of equal costs: no load for nothing
    used = tiers[:best]
    counts = np.bincount(used, minlength=5)
    blocks = {str(t): int(counts[TIER_CODES[t]]) for t in _TIER_ORDER if counts[TIER_CODES[t]]}
    held = int(np.count_nonzero(tiers != PEER))
    return HostCost(
        host=view.host,
        ttft_s=queue + float(total[best]),
        queue_s=queue,
        load_s=float(load_cum[best]),
        prefill_s=float(prefill[best]),
        blocks=blocks,
        held_blocks=held,
        reused_tokens=int(reused[best]),
        prefill_tokens=num_tokens - int(reused[best]),
        source=view.source,
        load=view.load,
    )


def plan(
    views: Sequence[HostView],
    num_blocks: int,
    num_tokens: int,
    block_tokens: int,
    block_bytes: int,
    rates: Rates,
    *,
    session: str = "",
    current_host: str = "",
    spill_tie_s: float = 0.5,
) -> Plan:
    """Rank the candidates by estimated TTFT and choose the spill host.

    A host may fetch from any other reachable candidate the blocks beyond its
    own prefix (up to the longest prefix any of them holds). Ties go to the
    host holding more, then to the session's rendezvous order, so the choice
    is stable. ``num_blocks`` is the request's full blocks (``num_tokens //
    block_tokens``); views longer than that are cut."""
    if num_tokens < 0 or num_blocks < 0 or num_blocks * block_tokens > num_tokens:
        raise ValueError(f"{num_blocks} blocks of {block_tokens} tokens exceed {num_tokens} tokens")
    reachable = [v for v in views if v.reachable]
    own = {v.host: np.frombuffer(v.tiers[:num_blocks], dtype=np.uint8) for v in reachable}
    for host, t in own.items():
        if t.size and (t.min() < HBM or t.max() > NVME):
            raise ValueError(f"{host}: tier codes must be HBM, DRAM or NVMe, got {sorted(set(t))}")
    longest = max((len(t) for t in own.values()), default=0)
    costs = []
    for v in reachable:
        tiers = np.full(longest, PEER, dtype=np.intp)  # beyond its own: fetched from a peer
        tiers[: len(own[v.host])] = own[v.host]
        costs.append(estimate(v, tiers, num_tokens, block_tokens, block_bytes, rates))
    key = session or "-"
    costs.sort(key=lambda c: rendezvous_weight(key, c.host), reverse=True)  # last tie-break
    costs.sort(key=lambda c: (c.ttft_s, -c.reused_tokens))  # stable: ties keep that order
    down = [
        HostCost(host=v.host, ttft_s=math.inf, reachable=False, error=v.error, source=v.source)
        for v in views
        if not v.reachable
    ]
    return Plan(
        ranked=costs + down,
        spill_host=spill_host(
            costs, current_host or (costs[0].host if costs else ""), key, spill_tie_s
        ),
        num_blocks=num_blocks,
        num_tokens=num_tokens,
    )


def spill_host(costs: Sequence[HostCost], home: str, session: str, tie_s: float) -> str:
    """Where the session's replica goes: the host it would move to when
    ``home`` is busy. After a push every candidate would hold the prefix, so
    what differs is the wait for a slot: the shortest wait (within ``tie_s``)
    wins; then the host already holding most of it (the smallest push); then
    the session's rendezvous order, which keeps the choice stable."""
    others = [c for c in costs if c.reachable and c.host != home]
    if not others:
        return ""
    least = min(c.queue_s for c in others)
    close = [c for c in others if c.queue_s <= least + tie_s]
    return max(close, key=lambda c: (c.held_blocks, rendezvous_weight(session, c.host))).host
