"""KV-aware routing: choose the host for each turn by its estimated time to first token.

- ``cost``: the pure cost model (queue wait + prefix load by tier + prefill);
- ``index`` and ``feeder``: an index of every host's blocks fed by their
  sequence-numbered event streams, with gap detection and resync;
- ``router``: batched lookups (or the index) in, ranked hosts out;
- ``service`` and ``cli``: the gRPC service a gateway calls, and
  ``tierstore route`` / ``tierstore router``.
"""

from tierstore.router.cost import HostCost, HostView, Plan, Rates, estimate, plan, spill_host

__all__ = ["HostCost", "HostView", "Plan", "Rates", "estimate", "plan", "spill_host"]
