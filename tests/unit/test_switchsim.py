"""The switch benchmark's pure parts (bench/switch/workload.py, sim.py):
placement, classes, the fleet simulation."""

from __future__ import annotations

from dataclasses import replace

import pytest

from bench.switch.sim import SimConfig, simulate
from bench.switch.workload import Workload, choose_host, classify, percentile
from tierstore.policies.replication import rendezvous_target

MEMBERS = ["h0", "h1", "h2", "h3"]


def test_affinity_first() -> None:
    assert choose_host("s", "h2", dict.fromkeys(MEMBERS, 1), MEMBERS) == "h2"


def test_spill_goes_to_the_replica_target_when_it_is_free() -> None:
    free = dict.fromkeys(MEMBERS, 1) | {"h2": 0}
    assert choose_host("s", "h2", free, MEMBERS) == rendezvous_target("s", MEMBERS, exclude="h2")


def test_spill_elsewhere_when_the_target_is_busy_and_none_when_all_are() -> None:
    target = rendezvous_target("s", MEMBERS, exclude="h2")
    free = dict.fromkeys(MEMBERS, 0) | {m: 2 for m in MEMBERS if m not in ("h2", target)}
    assert choose_host("s", "h2", free, MEMBERS) not in ("h2", target)
    assert choose_host("s", "h2", dict.fromkeys(MEMBERS, 0), MEMBERS) is None


def test_new_conversation_goes_home() -> None:
    home = rendezvous_target("s", MEMBERS, exclude="")
    assert choose_host("s", None, dict.fromkeys(MEMBERS, 1), MEMBERS) == home


@pytest.mark.parametrize(
    ("fraction", "cls"), [(1.0, "warm"), (0.9, "warm"), (0.5, "partly_warm"), (0.29, "cold")]
)
def test_classes(fraction: float, cls: str) -> None:
    assert classify(fraction) == cls


def test_percentile() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 90) == 4.0


def test_workload_delta_is_about_the_public_one() -> None:
    wl = Workload()
    assert 200 << 20 < wl.mean_delta_tokens() * wl.bytes_per_token < 300 << 20


def test_simulation_is_deterministic_and_replication_warms_switches() -> None:
    cfg = SimConfig(sessions=16, duration_s=1800)
    on = simulate(cfg)
    assert simulate(cfg) == on
    off = simulate(replace(cfg, replication=False))
    assert on["switches"] > 0 and off["switches"] > 0
    assert on["warm"] > off["warm"]
    assert off["replica_bytes"] == 0 and on["replica_bytes"] > 0


def test_a_faster_link_sends_faster() -> None:
    slow = simulate(SimConfig(duration_s=1800, link_bits_per_s=1e9))
    fast = simulate(SimConfig(duration_s=1800, link_bits_per_s=1e10))
    assert fast["send_p50_s"] < slow["send_p50_s"]


def test_router_policy_runs_the_same_workload_and_is_deterministic() -> None:
    cfg = SimConfig(hosts=4, sessions=40, duration_s=1200, policy="router")
    routed = simulate(cfg)
    assert simulate(cfg) == routed
    affinity = simulate(replace(cfg, policy="affinity"))
    assert routed["policy"] == "router" and affinity["policy"] == "affinity"
    for r in (routed, affinity):
        assert r["turns"] > 100 and r["ttft_mean_s"] > 0 and r["busy_max_over_mean"] >= 1.0
        assert r["ttft_p90_s"] >= r["ttft_mean_s"] * 0.5
    with pytest.raises(ValueError, match="policy"):
        simulate(replace(cfg, policy="random"))


def test_the_router_waits_for_the_host_holding_a_long_prefix() -> None:
    """The placement's own decision: a session whose home is full but holds
    50k tokens waits a slot there (2.5 s) instead of prefilling 6 s elsewhere."""
    from bench.switch.sim import RoutedPlacement
    from tierstore.router.cost import DRAM

    members = ["h0", "h1"]
    wl = Workload()
    placement = RoutedPlacement(members, 4, wl, SimConfig(policy="router"))
    held = {"h0": bytes([DRAM]) * (50_000 // wl.block_tokens)}
    full_home = placement.plan("s", 50_500, "h0", held, {"h0": 4, "h1": 0}, {"h0": 0, "h1": 0})
    assert full_home.best is not None and full_home.best.host == "h0"
    short = {"h0": bytes([DRAM]) * (2000 // wl.block_tokens)}
    moved = placement.plan("s", 2500, "h0", short, {"h0": 4, "h1": 0}, {"h0": 0, "h1": 0})
    assert moved.best is not None and moved.best.host == "h1"  # 0.3 s of prefill < the wait


CHURNED = SimConfig(
    hosts=4, sessions=24, duration_s=1800, extra_hosts=1,
    churn=((400.0, "leave", 1), (600.0, "join", 4)),
)  # fmt: skip


def test_a_static_list_pushes_to_the_dead_and_never_uses_a_new_host() -> None:
    r = simulate(CHURNED)
    assert r["pushes_to_dead"] > 0 and r["turns_on_joined_hosts"] == 0


def test_live_membership_stops_pushing_to_the_dead_after_the_ttl_and_uses_new_hosts() -> None:
    live = simulate(replace(CHURNED, membership="live", membership_ttl_s=10.0))
    slow = simulate(replace(CHURNED, membership="live", membership_ttl_s=300.0))
    assert live["turns_on_joined_hosts"] > 0
    assert live["pushes_to_dead"] < slow["pushes_to_dead"] < simulate(CHURNED)["pushes_to_dead"]


def test_bad_churn_is_refused() -> None:
    with pytest.raises(ValueError, match="join\\|leave"):
        simulate(replace(CHURNED, churn=((1.0, "explode", 0),)))
    with pytest.raises(ValueError, match="cannot join"):
        simulate(replace(CHURNED, churn=((1.0, "join", 0),)))  # already up
    with pytest.raises(ValueError, match="affinity"):
        simulate(replace(CHURNED, policy="router"))


def test_replication_rules_on_the_same_sessions() -> None:
    """The headroom rule replicates short turns kv_share leaves out (fewer
    skipped pushes); streaming sends the prompt's blocks at prefill end, so
    its pushes land sooner after the turn."""
    base = SimConfig(hosts=2, sessions=16, duration_s=1800.0)
    kv = simulate(replace(base, replicate="kv_share"))
    head = simulate(replace(base, replicate="headroom"))
    stream = simulate(replace(base, replicate="stream"))
    assert head["pushes_skipped"] < kv["pushes_skipped"]
    assert stream["send_p50_s"] < kv["send_p50_s"]
    assert {kv["replicate"], head["replicate"], stream["replicate"]} == {
        "kv_share",
        "headroom",
        "stream",
    }


def test_unknown_replication_rule() -> None:
    with pytest.raises(ValueError, match="replicate must be one of"):
        simulate(SimConfig(replicate="always"))
