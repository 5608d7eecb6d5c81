"""The switch benchmark's pure parts: placement, classes, the fleet simulation."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from switchsim import SimConfig, Workload, choose_host, classify, percentile, simulate

from tierstore.policies import rendezvous_target

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
