"""The simulated experiments of ``bench/switch/run.py --simulate``, each a
sweep of ``bench.switch.sim.simulate`` averaged over seeds.

Provides ``fleet_sweep`` (fleet sizes, sessions per host, link speeds,
replication off, the router's placement and each replication rule) and
``churn_sweep`` (an 8-host fleet with hosts dying and joining during the run,
``CHURN``, every host's peer list static against live membership at each
lease TTL). Pure, at scale 1, in the caller's process.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from bench.switch.sim import SimConfig, simulate

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
