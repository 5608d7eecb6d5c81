"""The engines' HBM tiers in `tierstore stat`: clients report their pools
(ReportTiers), the sidecar sums them, shows them first, and forgets a
client's report when it detaches; a report it must not take is refused."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request

import grpc
import numpy as np
import pytest
import torch

from harness import REPO
from harness.sidecar import SidecarProcess
from tierstore.cli.ports import free_port
from tierstore.client import StoreClient
from tierstore.keys import BlockKey, chain_keys
from tierstore.v1 import common_pb2, local_pb2

from ..conftest import SMALL_LAYOUT, SidecarFactory

BLOCK = SMALL_LAYOUT.block_bytes


def keys_for(n: int, start: int) -> list[BlockKey]:
    return chain_keys(SMALL_LAYOUT, np.arange(start, start + 8 * n))


def blocks(n: int) -> torch.Tensor:
    return torch.randint(0, 256, (n, BLOCK), dtype=torch.uint8, generator=torch.Generator())


def hbm_row(client: StoreClient) -> common_pb2.TierStat | None:
    return next((t for t in client.stat().tiers if t.name == "hbm"), None)


def wait_for(predicate, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError("condition not met in time")


@pytest.fixture
def sidecar(sidecar_factory: SidecarFactory) -> SidecarProcess:
    port = free_port()
    proc = sidecar_factory("--metrics-port", str(port))
    proc.metrics_port = port  # type: ignore[attr-defined]
    return proc


def test_hbm_pools_are_summed_shown_and_forgotten(sidecar: SidecarProcess) -> None:
    with (
        StoreClient(str(sidecar.socket), name="observer") as observer,
        StoreClient(str(sidecar.socket), hbm_bytes=8 * BLOCK, tier_report_s=0.1) as a,
        StoreClient(str(sidecar.socket), hbm_bytes=4 * BLOCK, tier_report_s=0.1) as b,
    ):
        a.store(SMALL_LAYOUT, keys_for(3, 0), blocks(3))
        b.store(SMALL_LAYOUT, keys_for(2, 100), blocks(2))
        row = wait_for(lambda: (r := hbm_row(observer)) and r.num_blocks == 5 and r)
        assert row.capacity_bytes == 12 * BLOCK
        assert row.used_bytes == 5 * BLOCK
        assert observer.stat().tiers[0].name == "hbm"  # the fastest tier first
        a.load(SMALL_LAYOUT, keys_for(3, 0))
        a.report_tiers()  # now, not at the next tick
        assert hbm_row(observer).hits >= 3

        text = subprocess.run(
            [sys.executable, "-m", "tierstore.cli", "stat", "--socket", str(sidecar.socket)],
            capture_output=True, text=True, timeout=60, cwd=REPO, check=True,
        ).stdout  # fmt: skip
        assert any(line.split()[:1] == ["hbm"] for line in text.splitlines()), text
        url = f"http://127.0.0.1:{sidecar.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as r:
            assert 'tierstore_tier_num_blocks{tier="hbm"} 5.0' in r.read().decode()

        b.close()  # detached: its pool is no longer the host's
        row = wait_for(lambda: (r := hbm_row(observer)) and r.capacity_bytes == 8 * BLOCK and r)
        assert row.num_blocks == 3
    with StoreClient(str(sidecar.socket)) as later:
        assert hbm_row(later) is None


def test_reports_the_sidecar_must_not_take_are_refused(sidecar: SidecarProcess) -> None:
    with StoreClient(str(sidecar.socket), name="engine") as client:
        stub = client._stub
        fake_dram = common_pb2.TierStat(name="dram", num_blocks=10**9)
        twice = [common_pb2.TierStat(name="hbm")] * 2
        for tiers in ([fake_dram], twice):
            req = local_pb2.ReportTiersRequest(client_id=client.client_id, tiers=tiers)
            with pytest.raises(grpc.RpcError) as err:
                stub.ReportTiers(req, timeout=10)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "engine tiers must be distinct names" in err.value.details()
        req = local_pb2.ReportTiersRequest(client_id=client.client_id + 999, tiers=[])
        with pytest.raises(grpc.RpcError) as err:
            stub.ReportTiers(req, timeout=10)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "is not attached" in err.value.details()
        dram = next(t for t in client.stat().tiers if t.name == "dram")
        assert dram.num_blocks == 0  # the fake report changed nothing
        assert hbm_row(client) is None
        # Values that would overflow a sum: Stat still answers (saturated).
        huge = common_pb2.TierStat(name="hbm", num_blocks=(1 << 64) - 1, hits=(1 << 64) - 1)
        with StoreClient(str(sidecar.socket), name="other") as other:
            for c in (client, other):
                req = local_pb2.ReportTiersRequest(client_id=c.client_id, tiers=[huge])
                stub.ReportTiers(req, timeout=10)
            assert hbm_row(client).num_blocks == (1 << 64) - 1


def test_tier_report_interval_must_be_positive(sidecar: SidecarProcess) -> None:
    with pytest.raises(ValueError, match="tier_report_s must be > 0"):
        StoreClient(str(sidecar.socket), tier_report_s=0)
