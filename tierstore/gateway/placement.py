"""Where a turn runs: the gateway's placement policies.

Provides ``Turn`` (what placement knows of a request: its block keys and
length, its session and where that session last ran, the candidates with
their load and what their engines hold in HBM), ``Decision`` (the hosts in
the order to try them, why the first, whether to pre-position) and one small
class per policy (``gateway_policy``):

- ``RoundRobin``: the next candidate in turn; no store, no load;
- ``LeastLoaded``: the fewest requests in flight (the gateway's and the
  engine's own count), ties in turn;
- ``PrefixAware``: llm-d's precise prefix scorer: the candidate whose
  engine's KV events show the longest cached prefix, unless its waiting
  queue passes ``max_waiting``, then the least loaded; no KV moves;
- ``CostModel``: tierstore's: the router's estimated time to first token on
  each candidate (wait + load or pull of the prefix + prefill of the rest),
  counting what a host can pull from the others; a turn leaves the host of
  its last turn only to save more than ``move_margin_s``; the chosen host is asked
  to pull the prefix ahead of the request (``preposition``) when it would
  load any of it from NVMe, a peer or the bucket.

Placement is independent of HTTP: the same core can answer an Endpoint
Picker. Policies are pure but for ``CostModel``, which asks the router: it
runs on the event loop when the router's index of the hosts' event streams
answers (``may_wait`` False), on a worker thread when the router must ask
the hosts (peer lookups under a deadline).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from tierstore.keys import BlockKey, KVLayout
from tierstore.load import HostLoadView
from tierstore.router.cost import HostCost, Plan
from tierstore.tiers import TIER_CODES, TierName

HBM = TIER_CODES[TierName.HBM]


@dataclass(frozen=True, slots=True)
class Candidate:
    name: str  # the backend's name: its sidecar's peer address, else its engine URL
    load: HostLoadView  # the cost model's view (see gateway.load.host_load)
    waiting: float  # requests not yet started: the gateway's and the engine's count
    in_flight: float  # requests the host is working on, started or not
    hbm: bytes = b""  # tier codes of the prefix its engine's events say it holds
    prefill_tokens_per_s: float = 0.0  # calibrated by the gateway (0: the router's configured)


@dataclass(frozen=True, slots=True)
class Turn:
    layout: KVLayout | None  # None: no keys could be derived (placed by load)
    keys: Sequence[BlockKey]
    num_tokens: int  # the prompt's length (0: unknown)
    session: str
    last_host: str  # where the session's previous turn ran ("" none known)
    candidates: Sequence[Candidate]


@dataclass(frozen=True, slots=True)
class Decision:
    order: tuple[str, ...]  # names: the first is chosen, the rest are its fallbacks
    reason: str  # a label for metrics: why the first
    preposition: bool = False  # ask the first's sidecar to pull the prefix now
    spill_host: str = ""  # where the session's replica should go ("" none)
    costs: Mapping[str, HostCost] = field(default_factory=dict)  # CostModel's estimates


class Policy(Protocol):
    name: str
    uses_keys: bool  # placement reads the prompt's block keys (text is tokenized for it)

    def place(self, turn: Turn) -> Decision: ...

    def may_wait(self, turn: Turn) -> bool:
        """Whether ``place`` may wait on I/O (then it runs on a worker thread)."""
        ...


def _rotate(names: Sequence[str], start: int) -> tuple[str, ...]:
    k = start % len(names)
    return tuple(names[k:]) + tuple(names[:k])


class RoundRobin:
    name = "round_robin"
    uses_keys = False

    def __init__(self) -> None:
        self._next = itertools.count()

    def may_wait(self, turn: Turn) -> bool:
        return False

    def place(self, turn: Turn) -> Decision:
        names = sorted(c.name for c in turn.candidates)
        return Decision(_rotate(names, next(self._next)), "round_robin")


class LeastLoaded:
    name = "least_loaded"
    uses_keys = False

    def __init__(self) -> None:
        self._next = itertools.count()

    def may_wait(self, turn: Turn) -> bool:
        return False

    def place(self, turn: Turn) -> Decision:
        return Decision(self.order(turn.candidates), "least_loaded")

    def order(self, candidates: Sequence[Candidate]) -> tuple[str, ...]:
        """Least in flight first; equal loads in turn (not always the same host)."""
        names = _rotate(sorted(c.name for c in candidates), next(self._next))
        load = {c.name: c.in_flight for c in candidates}
        return tuple(sorted(names, key=lambda n: load[n]))


class PrefixAware:
    """llm-d's precise prefix-cache scoring with a queue threshold."""

    name = "prefix_aware"
    uses_keys = True

    def __init__(self, max_waiting: float) -> None:
        self.max_waiting = max_waiting
        self._fallback = LeastLoaded()

    def may_wait(self, turn: Turn) -> bool:
        return False

    def place(self, turn: Turn) -> Decision:
        by_load = self._fallback.order(turn.candidates)
        rank = {n: i for i, n in enumerate(by_load)}
        scored = sorted(turn.candidates, key=lambda c: (-len(c.hbm), rank[c.name]))
        best = scored[0]
        if not best.hbm:
            return Decision(by_load, "least_loaded")
        if best.waiting > self.max_waiting:
            return Decision(by_load, "prefix_overloaded")
        return Decision(tuple(c.name for c in scored), "prefix")


Route = Callable[..., Plan]


class CostModel:
    """Lowest estimated TTFT (``tierstore.router``); see the module docstring."""

    uses_keys = True

    def __init__(
        self, route: Route, *, preposition: bool, move_margin_s: float = 0.0,
        from_index: Callable[[list[str]], bool] | None = None,
        fallback: LeastLoaded | None = None,
    ) -> None:  # fmt: skip
        self.name = "tierstore" if preposition else "tierstore_no_preposition"
        self._route = route
        self._from_index = from_index  # the router's answers_from_index
        self.preposition = preposition
        self.move_margin_s = move_margin_s
        self._fallback = fallback or LeastLoaded()

    def may_wait(self, turn: Turn) -> bool:
        """The router asks the hosts (under its lookup deadline) unless its
        index of their event streams answers for every candidate."""
        if turn.layout is None or self._from_index is None:
            return turn.layout is not None
        return not self._from_index([c.name for c in turn.candidates])

    def place(self, turn: Turn) -> Decision:
        if turn.layout is None or turn.num_tokens <= 0:
            return Decision(self._fallback.order(turn.candidates), "no_keys")
        by_name = {c.name: c for c in turn.candidates}
        plan = self._route(
            turn.layout,
            list(turn.keys),
            turn.num_tokens,
            hosts=list(by_name),
            session=turn.session,
            current_host=turn.last_host if turn.last_host in by_name else "",
            loads={c.name: c.load for c in turn.candidates},
            held={c.name: c.hbm for c in turn.candidates if c.hbm},
            prefill_tokens_per_s={
                c.name: c.prefill_tokens_per_s
                for c in turn.candidates
                if c.prefill_tokens_per_s > 0
            },
        )
        reachable = [c for c in plan.ranked if c.reachable]
        if not reachable:  # no sidecar answered: the engines may still serve
            return Decision(self._fallback.order(turn.candidates), "no_sidecar")
        down = [c.host for c in plan.ranked if not c.reachable]
        # A move must save more than the margin: the estimates are noisy, and a
        # turn that moves for nothing pulls its prefix and may move straight back.
        current = next((c for c in reachable if c.host == turn.last_host), None)
        if current is not None and current.ttft_s <= reachable[0].ttft_s + self.move_margin_s:
            reachable = [current, *[c for c in reachable if c is not current]]
        best = reachable[0]
        order = tuple(c.host for c in reachable) + tuple(down)
        if not turn.last_host:
            reason = "cost_new"
        elif best.host == turn.last_host:
            reason = "cost_stay"
        else:
            reason = "cost_move"
        local = (str(TierName.HBM), str(TierName.DRAM))
        fetched = sum(n for tier, n in best.blocks.items() if tier not in local)
        return Decision(
            order,
            reason,
            preposition=self.preposition and fetched > 0,
            spill_host=plan.spill_host,
            costs={c.host: c for c in reachable},
        )


def make_policy(
    name: str, route: Route | None, max_waiting: float, move_margin_s: float = 0.0,
    from_index: Callable[[list[str]], bool] | None = None,
) -> Policy:  # fmt: skip
    """The policy ``gateway_policy`` names; the cost model needs ``route``."""
    if name == "round_robin":
        return RoundRobin()
    if name == "least_loaded":
        return LeastLoaded()
    if name == "prefix_aware":
        return PrefixAware(max_waiting)
    if name in ("tierstore", "tierstore_no_preposition"):
        if route is None:
            raise ValueError(f"gateway_policy {name} needs sidecars (backends with peer=...)")
        return CostModel(route, preposition=name == "tierstore", move_margin_s=move_margin_s,
                         from_index=from_index)  # fmt: skip
    raise ValueError(
        f"gateway_policy must be round_robin, least_loaded, prefix_aware, tierstore or "
        f"tierstore_no_preposition, got {name!r}"
    )
