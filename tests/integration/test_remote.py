"""The remote tier between real sidecars and a real SeaweedFS: blocks gone
from DRAM and NVMe come back verified, two sidecars share the bucket, a
fleet restarted with empty disks resumes warm, the store stopped or
throttling mid-upload and mid-read gives misses within the deadline and no
leaked pins, uploads resume, configuration problems stop `serve` with a
clear message, and GC by two hosts at once never serves a wrong block.

Every wait is bounded; every process this file starts is stopped.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from harness import REPO
from harness.seaweed import ACCESS_KEY, SECRET_KEY, FaultProxy
from harness.sidecar import SidecarProcess, serve_args, start_sidecar
from tests.conftest import SMALL_LAYOUT
from tierstore.client import StoreClient
from tierstore.config.store import StoreConfig
from tierstore.keys import BlockKey, KVLayout, chain_keys
from tierstore.store.tiered import TieredStore
from tierstore.tiers import TierName

pytestmark = pytest.mark.timeout(180)
L: KVLayout = SMALL_LAYOUT
BLOCK = L.block_bytes
REMOTE, NVME, DRAM = TierName.REMOTE, TierName.NVME, TierName.DRAM


@pytest.fixture
def s3_env(seaweed: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Credentials the standard way for the sidecars this test starts: AWS_* variables."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    return seaweed


@pytest.fixture
def sidecars(tmp_path: Path) -> Iterator[Callable[..., SidecarProcess]]:
    started: list[SidecarProcess] = []
    url = f"s3://tierstore-test/it-{secrets.token_hex(6)}"

    def start(
        name: str, endpoint: str, *extra: str, dram: str = "1MiB", nvme: str = "1MiB"
    ) -> SidecarProcess:
        root = tmp_path / name
        root.mkdir(exist_ok=True)
        proc = start_sidecar(
            root, "--remote-url", url, "--remote-endpoint", endpoint,
            "--set", "remote_min_tokens=64", "--set", "remote_request_timeout_s=2",
            "--set", "remote_max_retries=2", "--set", "shutdown_grace_s=0.5",
            *extra, dram=dram, nvme=nvme,
        )  # fmt: skip
        started.append(proc)
        return proc

    yield start
    for p in started:
        p.stop(timeout_s=20)


def blocks_of(n: int, seed: int) -> tuple[list[BlockKey], torch.Tensor]:
    rng = np.random.default_rng(seed)
    toks = rng.integers(0, 32000, size=n * L.block_tokens)
    data = rng.standard_normal((n, BLOCK // 2)).astype(np.float16).view(np.uint8).copy()
    return chain_keys(L, toks), torch.from_numpy(data)


def store(client: StoreClient, keys: list[BlockKey], data: torch.Tensor) -> None:
    """In batches that fit in DRAM (a batch's reservations cannot be evicted)."""
    for lo in range(0, len(keys), 32):
        assert all(client.store(L, keys[lo : lo + 32], data[lo : lo + 32]))


def counters(client: StoreClient) -> dict[str, int]:
    return dict(client.stat().counters)


def wait_uploads(client: StoreClient, timeout_s: float = 30.0) -> dict[str, int]:
    deadline = time.monotonic() + timeout_s
    while True:
        c = counters(client)
        if c["remote_uploads_queued"] == 0:
            return c
        assert time.monotonic() < deadline, f"uploads still queued after {timeout_s}s: {c}"
        time.sleep(0.1)


def pins(client: StoreClient) -> int:
    return sum(c.pins for c in client.stat().clients)


def test_block_gone_from_dram_and_nvme_comes_back_verified(s3_env: Any, sidecars: Any) -> None:
    a = sidecars("a", s3_env.endpoint)
    keys, data = blocks_of(400, 1)  # 3.2 MiB through 1 MiB of DRAM and 1 MiB of NVMe
    with StoreClient(str(a.socket)) as c:
        store(c, keys, data)
        stat = wait_uploads(c)
        assert stat["remote_uploads"] >= 250, {k: v for k, v in stat.items() if v}
        local = c.lookup(L, keys)
        assert local.num_hits < 400  # the first blocks left DRAM and NVMe both
        found = c.lookup(L, keys, include_peers=True)
        assert found.num_hits == 400 and found.tiers[0] == REMOTE
        for lo in range(0, 400, 32):  # DRAM holds about 120 blocks
            res = c.load(L, keys[lo : lo + 32], include_peers=True, deadline_s=30)
            assert res.num_blocks == len(keys[lo : lo + 32])
            assert torch.equal(res.blocks, data[lo : lo + 32])
        after = counters(c)
        assert after["remote_reads"] > 0 and after["remote_verify_failures"] == 0
        assert pins(c) == 0
        tiers = {t.name: t for t in c.stat().tiers}
        assert tiers["remote"].hits == after["remote_reads"]


def test_two_sidecars_share_and_a_fleet_restart_resumes_warm(s3_env: Any, sidecars: Any) -> None:
    keys, data = blocks_of(40, 2)
    a = sidecars("a", s3_env.endpoint, dram="4MiB")
    b = sidecars("b", s3_env.endpoint, dram="4MiB")
    with StoreClient(str(a.socket)) as ca:
        store(ca, keys, data)
        ca.end_turn("s1", L, keys, len(keys) * L.block_tokens)  # >= remote_min_tokens
        assert wait_uploads(ca)["remote_uploads"] == 40
    with StoreClient(str(b.socket)) as cb:
        assert cb.lookup(L, keys).num_hits == 0
        res = cb.load(L, keys, include_peers=True, deadline_s=30)
        assert res.num_blocks == 40 and torch.equal(res.blocks, data)
    # Every sidecar killed, every NVMe directory gone: new ones resume from the bucket.
    for p in (a, b):
        p.stop(signal.SIGKILL)
        shutil.rmtree(p.nvme_dir)
        p.socket.unlink(missing_ok=True)
    a2 = sidecars("a2", s3_env.endpoint)
    with StoreClient(str(a2.socket)) as c:
        found = c.lookup(L, keys, include_peers=True)
        assert found.num_hits == 40 and set(found.tiers) == {REMOTE}
        res = c.load(L, keys, include_peers=True, deadline_s=30)
        assert res.num_blocks == 40 and torch.equal(res.blocks, data)
        assert counters(c)["remote_lookup_round_trips"] <= 3


def test_store_down_slow_or_throttling_gives_misses_and_uploads_resume(
    s3_env: Any, sidecars: Any
) -> None:
    proxy = FaultProxy(int(s3_env.endpoint.rsplit(":", 1)[1]))
    try:
        a = sidecars("a", proxy.endpoint, dram="4MiB")
        keys, data = blocks_of(24, 3)
        other, other_data = blocks_of(8, 4)  # read mid-fault: in the bucket, not on A
        w = sidecars("w", s3_env.endpoint)
        with StoreClient(str(w.socket)) as cw:
            store(cw, other, other_data)
            cw.end_turn("other", L, other, len(other) * L.block_tokens)
            assert wait_uploads(cw)["remote_uploads"] == len(other)
        with StoreClient(str(a.socket)) as c:
            # A sees them in the bucket through the proxy, so a miss below is the fault's.
            found = c.lookup(L, other, include_peers=True)
            assert found.num_hits == len(other) and set(found.tiers) == {REMOTE}
            proxy.set_mode("blackhole")  # mid-upload: the store stops answering
            store(c, keys, data)
            c.end_turn("s", L, keys, len(keys) * L.block_tokens)
            for mode in ("blackhole", "slowdown", "refuse", "delay"):
                proxy.set_mode(mode, delay_s=5.0)
                t0 = time.monotonic()
                res = c.load(L, other, include_peers=True, deadline_s=1.0)  # mid-read
                assert res.num_blocks == 0, mode
                assert time.monotonic() - t0 < 1.0 + 3.0, mode  # the deadline, not the store
                assert pins(c) == 0
            assert counters(c)["remote_uploads_queued"] > 0  # still waiting, not dropped
            proxy.set_mode("pass")
            stat = wait_uploads(c, 60)
            assert stat["remote_uploads"] == 24 and stat["remote_upload_retries"] > 0
            assert stat["remote_request_errors"] > 0
            res = c.load(L, other, include_peers=True, deadline_s=30)  # the store is back
            assert res.num_blocks == len(other) and torch.equal(res.blocks, other_data)
        b = sidecars("b", s3_env.endpoint)
        with StoreClient(str(b.socket)) as cb:
            res = cb.load(L, keys, include_peers=True, deadline_s=30)
            assert res.num_blocks == 24 and torch.equal(res.blocks, data)
    finally:
        proxy.close()


def serve_fails(tmp_path: Path, env: dict[str, str], *extra: str) -> str:
    args = serve_args(tmp_path / "s.sock", tmp_path / "nvme", "1MiB", "1MiB", *extra)
    run = subprocess.run(
        args, env={**env, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=60
    )
    assert run.returncode != 0
    return run.stdout + run.stderr


def test_configuration_problems_stop_serve_with_a_clear_message(
    s3_env: Any, tmp_path: Path
) -> None:
    env = dict(os.environ, AWS_SECRET_ACCESS_KEY="wrong")
    url = ("--remote-url", "s3://tierstore-test/x", "--remote-endpoint", s3_env.endpoint)
    assert "refused the credentials" in serve_fails(tmp_path, env, *url)
    env = dict(os.environ)
    missing = ("--remote-url", "s3://no-such-bucket-x/y", "--remote-endpoint", s3_env.endpoint)
    assert "does not exist" in serve_fails(tmp_path, env, *missing)
    assert "s3://bucket/prefix" in serve_fails(tmp_path, env, "--remote-url", "gs://b/p")


def test_stat_json_shows_the_remote_tier(s3_env: Any, sidecars: Any) -> None:
    a = sidecars("a", s3_env.endpoint)
    out = subprocess.run(
        [sys.executable, "-m", "tierstore.cli", "stat", "--json", "--socket", str(a.socket)],
        env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    stat = json.loads(out.stdout)
    assert "remote" in {t["name"] for t in stat["tiers"]}
    assert "remote_uploads" in stat["counters"]


def test_gc_by_two_hosts_never_serves_a_wrong_block(
    remote_config: Any, store_config: Callable[..., StoreConfig], tmp_path: Path
) -> None:
    obj = 112 + BLOCK
    cfg = remote_config(remote_bytes=40 * obj, remote_gc_interval_s=0.2, remote_cache_ttl_s=0.05)
    hosts = [
        TieredStore(store_config(nvme_bytes=0, nvme_dir=str(tmp_path / f"n{i}")), remote=cfg)
        for i in range(2)
    ]
    chains = [blocks_of(30, 10 + i) for i in range(4)]
    wrong: list[str] = []
    compared = [0, 0]  # blocks read back from the bucket and checked, per host
    errors: list[str] = []  # a host thread's exception fails the test (not just a warning)
    stop = threading.Event()

    def host(i: int) -> None:
        store, rng = hosts[i], np.random.default_rng(i)
        try:
            while not stop.is_set():
                keys, data = chains[int(rng.integers(0, len(chains)))]
                rows = [data[j].numpy().tobytes() for j in range(len(keys))]
                store.put(L, keys, rows)
                store.demote(keys)  # to the bucket (nvme off): DRAM holds nothing of it now
                store.flush_remote(10)
                n = store.pull_remote(L, keys, 5.0)
                got = store.get(L, keys[:n])
                for j, block in enumerate(got):
                    if block != rows[j]:
                        wrong.append(f"host {i} block {j}")
                compared[i] += len(got)
                store.drop(keys)
        except Exception:
            errors.append(f"host {i}: {traceback.format_exc()}")

    threads = [threading.Thread(target=host, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    time.sleep(4.0)
    stop.set()
    for t in threads:
        t.join(30)
    try:
        assert not any(t.is_alive() for t in threads)
        assert not errors, "\n".join(errors)
        assert not wrong
        stats = [h.stat() for h in hosts]
        # Each host read blocks back from the bucket (not from its DRAM) and
        # compared them, and each host's GC deleted objects: both raced.
        reads = [s["store"]["remote_reads"] for s in stats]
        assert all(n > 0 for n in compared), compared
        assert all(n > 0 for n in reads), reads
        deletions = [s["store"]["remote_gc_deletions"] for s in stats]
        assert all(n > 0 for n in deletions), deletions
        assert all(h.dram.pin_count(0) == 0 for h in hosts)
    finally:
        for h in hosts:
            h.close()


def test_prefetch_pre_positions_from_peers_and_from_the_bucket(s3_env: Any, sidecars: Any) -> None:
    from tierstore.cli.ports import free_port

    ports = [free_port(), free_port()]

    def peer_args(i: int) -> tuple[str, ...]:
        return (
            "--set", f"peer_port={ports[i]}", "--set", "peer_token=pre-position",
            "--set", f"peers=127.0.0.1:{ports[1 - i]}", "--set", "min_tokens=1000000",
            "--set", "replicate_policy=kv_share",  # no replica push at all
        )  # fmt: skip

    a = sidecars("a", s3_env.endpoint, *peer_args(0), dram="4MiB")
    b = sidecars("b", s3_env.endpoint, *peer_args(1), dram="4MiB")
    on_peer, peer_data = blocks_of(24, 20)  # held by A only (never leaves its DRAM)
    in_bucket, bucket_data = blocks_of(24, 21)  # written through to the bucket
    with StoreClient(str(a.socket)) as ca:
        store(ca, on_peer, peer_data)
        store(ca, in_bucket, bucket_data)
        ca.end_turn("bucket-session", L, in_bucket, len(in_bucket) * L.block_tokens)
        assert wait_uploads(ca)["remote_uploads"] == 24
    with StoreClient(str(b.socket)) as cb:
        for keys, source in ((on_peer, "peer"), (in_bucket, "bucket")):
            if source == "bucket":
                a.stop()  # the peer is gone: the bucket still has the turn
            assert cb.lookup(L, keys).num_hits == 0
            res = cb.prefetch(L, keys, "wait")
            assert res.ready_blocks == len(keys), source
            here = cb.lookup(L, keys)  # local only: the blocks are in B's DRAM now
            assert here.num_hits == len(keys) and set(here.tiers) == {DRAM}, source
        for keys, data in ((on_peer, peer_data), (in_bucket, bucket_data)):
            res = cb.load(L, keys)
            assert res.num_blocks == len(keys) and torch.equal(res.blocks, data)
        c = counters(cb)
        assert c["prefetch_peer_pulls"] == 1 and c["remote_pulled_blocks"] == 24
