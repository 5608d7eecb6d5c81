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

from tierstore.load import HostLoadView
from tierstore.policies.replication import rendezvous_weight
from tierstore.tiers import TIER_CODES, TierName

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


@dataclass(frozen=True, slots=True)
class _PrefixCost:
    load_s: float
    prefill_s: float
    blocks: Mapping[str, int]
    held_blocks: int
    reused_tokens: int


def estimate(
    view: HostView,
    tiers: np.ndarray,
    num_tokens: int,
    block_tokens: int,
    block_bytes: int,
    rates: Rates,
) -> HostCost:
    """TTFT on one host whose usable prefix has these tier codes (its own
    blocks, then PEER for blocks it would fetch); see ``_prefix_costs``."""
    r = view.rates or rates
    (c,) = _prefix_costs(tiers[None, :], [r], num_tokens, block_tokens, block_bytes)
    return _host_cost(view, r, c, num_tokens)


def _host_cost(view: HostView, rates: Rates, c: _PrefixCost, num_tokens: int) -> HostCost:
    queue = queue_wait_s(view.load, rates)
    return HostCost(
        host=view.host,
        ttft_s=queue + c.load_s + c.prefill_s,
        queue_s=queue,
        load_s=c.load_s,
        prefill_s=c.prefill_s,
        blocks=c.blocks,
        held_blocks=c.held_blocks,
        reused_tokens=c.reused_tokens,
        prefill_tokens=num_tokens - c.reused_tokens,
        source=view.source,
        load=view.load,
    )


def _prefix_costs(
    tiers: np.ndarray,
    rates: Sequence[Rates],
    num_tokens: int,
    block_tokens: int,
    block_bytes: int,
) -> list[_PrefixCost]:
    """Load + prefill of each row of ``tiers`` (a usable prefix as tier
    codes, under that row's rates), at the prefix length that minimises
    their sum (the shortest of equal costs: nothing loaded for nothing); at
    least one token is always computed. numpy over rows x blocks."""
    rows, n = tiers.shape

    def col(name: str) -> np.ndarray:
        return np.array([getattr(r, name) for r in rates], dtype=np.float64)

    table = np.zeros((rows, 5))
    table[:, DRAM] = block_bytes / col("dram_bytes_per_s")
    table[:, NVME] = block_bytes / col("nvme_bytes_per_s") + table[:, DRAM]
    table[:, PEER] = block_bytes / col("peer_bytes_per_s") + table[:, DRAM]
    load_cum = np.zeros((rows, n + 1))
    np.cumsum(np.take_along_axis(table, tiers, axis=1), axis=1, out=load_cum[:, 1:])
    lengths = np.arange(n + 1)
    for code, fixed in ((NVME, col("nvme_fixed_s")), (PEER, col("peer_fixed_s"))):
        has = np.concatenate([tiers == code, np.ones((rows, 1), dtype=bool)], axis=1)
        first = has.argmax(axis=1)  # n when the tier is not used
        load_cum += (lengths[None, :] > first[:, None]) * fixed[:, None]
    reused = np.minimum(lengths * block_tokens, max(num_tokens - 1, 0))
    prefill = (num_tokens - reused)[None, :] / col("prefill_tokens_per_s")[:, None]
    best = np.argmin(load_cum + prefill, axis=1)
    out = []
    for h in range(rows):
        b = int(best[h])
        counts = np.bincount(tiers[h, :b], minlength=5)
        out.append(
            _PrefixCost(
                load_s=float(load_cum[h, b]),
                prefill_s=float(prefill[h, b]),
                blocks={
                    str(t): int(counts[TIER_CODES[t]]) for t in _TIER_ORDER if counts[TIER_CODES[t]]
                },
                held_blocks=int(np.count_nonzero(tiers[h] != PEER)),
                reused_tokens=int(reused[b]),
            )
        )
    return out


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
    spill_tie_s: float = 5.0,
) -> Plan:
    """Rank the candidates by estimated TTFT and choose the spill host.

    A host may fetch from any other reachable candidate the blocks beyond its
    own prefix (up to the longest prefix any of them holds). Ties go to the
    host reusing more, then to ``current_host`` (a session does not move for
    nothing), then to the session's rendezvous order, so the choice is
    stable. ``num_blocks`` is the request's full blocks (``num_tokens //
    block_tokens``); views longer than that are cut."""
    if num_tokens < 0 or num_blocks < 0 or num_blocks * block_tokens > num_tokens:
        raise ValueError(f"{num_blocks} blocks of {block_tokens} tokens exceed {num_tokens} tokens")
    reachable = [v for v in views if v.reachable]
    own = {v.host: np.frombuffer(v.tiers[:num_blocks], dtype=np.uint8) for v in reachable}
    for host, t in own.items():
        if t.size and (t.min() < HBM or t.max() > NVME):
            raise ValueError(f"{host}: tier codes must be HBM, DRAM or NVMe, got {sorted(set(t))}")
    longest = max((len(t) for t in own.values()), default=0)
    # Hosts with the same prefix and rates cost the same but for their queue:
    # one row each (in a big fleet most hosts hold nothing of a session).
    rows: dict[tuple[bytes, Rates], int] = {}
    for v in reachable:
        rows.setdefault((own[v.host].tobytes(), v.rates or rates), len(rows))
    tiers = np.full((len(rows), longest), PEER, dtype=np.intp)  # beyond its own: a peer's
    for (held, _), row in rows.items():
        tiers[row, : len(held)] = np.frombuffer(held, dtype=np.uint8)
    prefix = _prefix_costs(tiers, [r for _, r in rows], num_tokens, block_tokens, block_bytes)
    costs = [
        _host_cost(v, v.rates or rates, prefix[rows[own[v.host].tobytes(), v.rates or rates]],
                   num_tokens)
        for v in reachable
    ]  # fmt: skip
    key = session or "-"
    costs.sort(key=lambda c: rendezvous_weight(key, c.host), reverse=True)  # last tie-break
    costs.sort(key=lambda c: (c.ttft_s, -c.reused_tokens, c.host != current_host))  # stable
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
