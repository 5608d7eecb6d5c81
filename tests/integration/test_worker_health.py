"""A background worker that dies of a bug is visible: the sidecar's health
turns NOT_SERVING, `Stat` lists the worker, `tierstore stat` says so, and the
death is logged once with its traceback. One test per worker: the demoter,
a prefetch worker, a replicator; the bug is injected into the running sidecar
(in this process), the way a real one would surface."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tierstore.cli.ports import free_port
from tierstore.cli.stat import _stat_dict, format_stat
from tierstore.config import Config
from tierstore.config.peer import PeerConfig
from tierstore.config.server import ServerConfig
from tierstore.config.store import StoreConfig
from tierstore.keys import chain_keys
from tierstore.sidecar.process import Sidecar
from tierstore.sidecar.service import SERVICE_NAME
from tierstore.sidecar.stat import stat_reply
from tierstore.v1 import local_pb2, local_pb2_grpc

from ..conftest import SMALL_LAYOUT

WAIT_S = 10.0


class Bug(Exception):
    """The injected bug: nothing in tierstore expects or catches it."""


@pytest.fixture
def sidecar(tmp_path: Path) -> Iterator[Sidecar]:
    config = Config(
        store=StoreConfig(
            dram_bytes=1 << 20,
            dram_segment_bytes=64 << 10,
            nvme_dir=str(tmp_path / "nvme"),
            nvme_bytes=8 << 20,
            nvme_segment_bytes=64 << 10,
            demoter_poll_s=0.05,
        ),
        server=ServerConfig(socket_path=str(tmp_path / "ts.sock"), metrics_port=0),
        peer=PeerConfig(
            peer_port=free_port(),
            peer_token="t",
            peers=(f"127.0.0.1:{free_port()}",),
            min_tokens=1,
        ),
    )
    sc = Sidecar(config)
    yield sc
    sc.stop()


def health(sc: Sidecar) -> int:
    with grpc.insecure_channel(f"unix:{sc.socket_path}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=5).status


def wait_for_failure(sc: Sidecar, name: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while name not in sc.workers.failed():
        assert time.monotonic() < deadline, f"{name} did not die: {sc.workers.failed()}"
        time.sleep(0.02)


def assert_visible(sc: Sidecar, name: str, caplog: pytest.LogCaptureFixture) -> None:
    wait_for_failure(sc, name)
    assert health(sc) == health_pb2.HealthCheckResponse.NOT_SERVING
    stat = _stat_dict(stat_reply(sc.servicer))
    assert any(w.startswith(f"{name}: Bug") for w in stat["failed_workers"])
    assert stat["counters"]["worker_failures"] == 1
    assert "NOT SERVING" in format_stat(stat) and name in format_stat(stat)
    assert sum(f"worker {name} died" in r.message for r in caplog.records) == 1
    assert any(r.exc_info and r.exc_info[0] is Bug for r in caplog.records)
    # The rest of the sidecar still answers (the operator can look, then restart it).
    with grpc.insecure_channel(f"unix:{sc.socket_path}") as channel:
        reply = local_pb2_grpc.LocalServiceStub(channel).Stat(local_pb2.StatRequest(), timeout=5)
    assert list(reply.failed_workers) == stat["failed_workers"]


def test_serving_while_healthy(sidecar: Sidecar) -> None:
    assert health(sidecar) == health_pb2.HealthCheckResponse.SERVING
    assert _stat_dict(stat_reply(sidecar.servicer))["failed_workers"] == []


def test_a_dead_demoter_is_visible(sidecar: Sidecar, caplog, monkeypatch) -> None:
    def broken(want_bytes: int) -> list:
        raise Bug("demoter")

    store = sidecar.store
    monkeypatch.setattr(store.demoter, "_take_victims", broken)
    keys = chain_keys(SMALL_LAYOUT, np.arange(SMALL_LAYOUT.block_tokens * 120))
    with caplog.at_level("ERROR", logger="tierstore.workers"):
        # Past the high watermark: the demoter wakes and calls the broken method.
        for i in range(0, len(keys), 8):
            batch = keys[i : i + 8]
            store.put(SMALL_LAYOUT, batch, bytes(SMALL_LAYOUT.block_bytes * len(batch)))
            if "tierstore-demoter" in sidecar.workers.failed():
                break
        assert_visible(sidecar, "tierstore-demoter", caplog)


def test_a_dead_prefetch_worker_is_visible(sidecar: Sidecar, caplog, monkeypatch) -> None:
    from tierstore.sidecar.prefetch import BestEffort

    prefetcher = sidecar.servicer.prefetcher

    def broken(job: object) -> None:
        raise Bug("prefetch")

    monkeypatch.setattr(prefetcher, "_promote", broken)
    keys = chain_keys(SMALL_LAYOUT, np.arange(SMALL_LAYOUT.block_tokens * 2))
    with caplog.at_level("ERROR", logger="tierstore.workers"):
        prefetcher.run(SMALL_LAYOUT, keys, BestEffort())
        deadline = time.monotonic() + WAIT_S
        while not any(n.startswith("tierstore-prefetch-") for n in sidecar.workers.failed()):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        name = next(iter(sidecar.workers.failed()))
        assert_visible(sidecar, name, caplog)


def test_a_dead_replicator_is_visible(sidecar: Sidecar, caplog, monkeypatch) -> None:
    tier = sidecar.peer_server.tier if sidecar.peer_server is not None else None
    assert tier is not None

    def broken(push: object) -> None:
        raise Bug("replicator")

    monkeypatch.setattr(tier.replicator, "_push", broken)
    keys = chain_keys(SMALL_LAYOUT, np.arange(SMALL_LAYOUT.block_tokens * 2))
    target = sidecar.config.peer.peers[0]
    with caplog.at_level("ERROR", logger="tierstore.workers"):
        push = tier.end_turn("s1", SMALL_LAYOUT, keys, num_tokens=16, wait=True, target=target)
        assert push is not None and push.done.is_set()  # the waiter is released, not hung
        deadline = time.monotonic() + WAIT_S
        while not any(n.startswith("tierstore-replicator-") for n in sidecar.workers.failed()):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        name = next(iter(sidecar.workers.failed()))
        assert_visible(sidecar, name, caplog)
