"""The fault bench's short form (bench/reliability/faults.py): a two-host
fleet in network namespaces, peered through a real etcd, with the remote
tier on a real SeaweedFS, under engines and a writer, through SIGKILLs of
sidecars, engines and the writer, a full disk, the bucket gone, etcd gone,
1% and 5% packet loss, added delay and a partition.

Proved: every kind of fault happened (its own trace in the sidecars'
counters: the disk capped, bucket requests failing, etcd outages seen, TCP
retransmitting, packets carried by the delay line), blocks were served and
checked in every window, none was wrong, every turn the store called
durable loads whole from a fresh host on empty disks (from the bucket),
and the fleet recovered from each fault within the probe's deadline. The
oracles are shown to fail on wrong data: a changed byte, a turn the bucket
never had.

Needs root, ip(8), tc(8), mount(8), /dev/net/tun, etcd and SeaweedFS
(.ci/run installs them; nothing here skips).
"""

from __future__ import annotations

from typing import Any

import pytest

from bench.reliability import faults
from harness import fault_load
from harness.fault_fleet import KINDS
from harness.reliability import LAYOUT, blocks_of, chain
from harness.sidecar import SidecarProcess
from tierstore.client import StoreClient

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
KILLS, HOLD_S = 12, 3.0


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return faults.run(KILLS, HOLD_S, engines=2, seed=40, workdir=tmp_path_factory.mktemp("faults"))


def test_every_kill_happened_and_the_fleet_came_back(out: dict[str, Any]) -> None:
    assert out["kills"] == KILLS
    assert set(out["kills_by_target"]) == {"sidecar", "engine", "writer"}, out["kills_by_target"]
    kills = out["faults"]["kills"]
    assert 0 < kills["restart_p50_s"] <= kills["recover_s"] < 60
    assert out["writer"]["chains"] > 0 and out["writer"]["checked"] > 0


def test_each_fault_left_its_trace(out: dict[str, Any]) -> None:
    f = out["faults"]
    assert list(f) == ["none", *KINDS]
    assert f["disk_full"]["counters"]["nvme_full_events"] >= 1
    assert f["disk_full"]["counters"]["nvme_full_resumed"] >= 1
    assert f["bucket_down"]["counters"]["remote_request_errors"] > 0
    assert f["etcd_down"]["counters"]["membership_etcd_outages"] >= 1
    for kind in ("loss_1pct", "loss_5pct"):
        assert f[kind]["counters"]["tcp_retransmits"] > 0, kind
    assert f["delay"]["counters"]["delay_line_packets"] > 0
    assert f["none"]["counters"]["delay_line_packets"] == 0


def test_nothing_wrong_was_served_and_every_window_was_checked(out: dict[str, Any]) -> None:
    assert out["wrong_blocks"] == 0 and out["wrong_bytes"] == 0
    for kind, fig in out["faults"].items():
        assert fig["turns"] > 0 and fig["checked"] > 0, kind
        assert fig["wrong"] == 0, kind
        assert fig["failed_unexpected"] == 0, kind  # only calls to a sidecar being killed
        assert fig["recover_s"] >= 0, kind
    assert out["checked_blocks"] > 1000


def test_no_durable_turn_was_lost(out: dict[str, Any]) -> None:
    durable = out["durable"]
    assert out["durable_turns_lost"] == 0
    assert durable["durable_turns"] > 0 and durable["checked"] > 0
    assert durable["from_bucket"] == durable["checked"]  # the fresh host had nothing else


# -- the oracles fail on wrong data ------------------------------------------------------


def test_control_the_engines_check_counts_a_changed_byte() -> None:
    keys = chain(7, 4)
    rows = blocks_of(keys)
    assert fault_load.check(keys, rows, 4) == (0, 0)
    rows[2, 100] ^= 0xFF
    assert fault_load.check(keys, rows, 4) == (1, 1)


def test_control_the_durable_audit_counts_a_turn_the_bucket_never_had(
    sidecar_factory: Any,
) -> None:
    sc: SidecarProcess = sidecar_factory(dram="4MiB")
    held, never = 10, 11
    with StoreClient(str(sc.socket)) as c:
        keys = chain(held, 8)
        assert all(c.store(LAYOUT, keys, blocks_of(keys)))
    turns = [{"seed": held, "blocks": 8}, {"seed": never, "blocks": 8}]
    got = faults.durable_audit(str(sc.socket), turns)
    assert got["durable_turns_lost"] == 1 and got["checked"] == 8 and got["wrong"] == 0


def test_a_failed_call_is_expected_only_inside_its_hosts_outage() -> None:
    outages = [(1, 10.0, 11.0)]
    assert faults.during_outage({"host": 1, "t": 10.5}, outages)
    assert faults.during_outage({"host": 1, "t": 11.0 + faults.OUTAGE_GRACE_S}, outages)
    assert not faults.during_outage({"host": 0, "t": 10.5}, outages)  # the other host
    assert not faults.during_outage({"host": 1, "t": 9.9}, outages)
    assert not faults.during_outage({"host": 1, "t": 11.1 + faults.OUTAGE_GRACE_S}, outages)


def test_control_a_window_with_a_wrong_block_reports_it() -> None:
    events = [
        {"op": "turn", "t": 1.0, "asked": 8, "served": 8, "wrong": 1, "wrong_bytes": 3,
         "tiers": {"nvme": 8}, "moved": True, "asked_durable": False, "durable": False},
        {"op": "error", "t": 1.5, "stage": "load"},
    ]  # fmt: skip
    fig = faults.window_figures(events, 0.0, 2.0)
    assert (fig["wrong"], fig["wrong_bytes"], fig["failed"], fig["moved_turns"]) == (1, 3, 1, 1)
    assert fig["failed_unexpected"] == 1  # no outage marked it expected
    assert faults.window_figures(events, 2.0, 3.0)["turns"] == 0
