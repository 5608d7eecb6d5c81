"""A real `tierstore serve` driven by StoreClient from this and other processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import Future
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from harness import REPO
from harness.sidecar import SidecarProcess, start_sidecar
from tierstore.cli.ports import free_port
from tierstore.client import PrefetchResult, StoreClient
from tierstore.client.results import SidecarUnavailable
from tierstore.keys import BlockKey, KVLayout, chain_keys
from tierstore.tiers import TierName

from ..conftest import SMALL_LAYOUT, SidecarFactory

DRAM, NVME, HBM = TierName.DRAM, TierName.NVME, TierName.HBM


def blocks(n: int, seed: int = 0, layout: KVLayout = SMALL_LAYOUT) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, layout.block_bytes), dtype=torch.uint8, generator=gen)


def keys_for(n: int, start: int = 0) -> list[BlockKey]:
    return chain_keys(SMALL_LAYOUT, np.arange(start, start + 8 * n))


@pytest.fixture
def sidecar(sidecar_factory: SidecarFactory) -> SidecarProcess:
    return sidecar_factory()


@pytest.mark.parametrize("failing", ["ArenaCopier", "HbmTier", "Prefetcher", "TierReporter"])
def test_a_client_whose_start_fails_half_way_detaches(
    sidecar: SidecarProcess, monkeypatch: pytest.MonkeyPatch, failing: str
) -> None:
    """Pinning refused or the device pool out of memory after the attach:
    the client unmaps the arena and ends its Attach stream before raising,
    so the sidecar does not keep it (nor its pins) until it exits."""
    import tierstore.client.store_client as module

    def refuse(*args: object, **kwargs: object) -> None:
        raise RuntimeError(f"{failing} refused")

    with StoreClient(str(sidecar.socket), name="watcher") as watcher:
        monkeypatch.setattr(module, failing, refuse)
        with pytest.raises(RuntimeError, match="refused") as failed:
            StoreClient(str(sidecar.socket), name="half-started", hbm_bytes=64 << 10)
        monkeypatch.undo()
        # The traceback keeps the half-built client alive, as an engine's
        # error handling or log may: only its own cleanup detaches it.
        assert failed.traceback
        deadline = time.monotonic() + 10
        while [c.name for c in watcher.stat().clients] != ["watcher"]:
            assert time.monotonic() < deadline, [c.name for c in watcher.stat().clients]
            time.sleep(0.05)
        del failed


def test_round_trip_from_dram_and_nvme(sidecar: SidecarProcess) -> None:
    keys, data = keys_for(300), blocks(300)
    with StoreClient(str(sidecar.socket)) as client:
        # 1 MiB of DRAM holds 128 blocks of 8 KiB: the oldest spill to NVMe.
        for lo in range(0, 300, 50):
            assert all(client.store(SMALL_LAYOUT, keys[lo : lo + 50], data[lo : lo + 50]))
        found = client.lookup(SMALL_LAYOUT, keys)
        assert found.num_hits == 300
        assert found.tiers[0] == NVME and found.tiers[-1] == DRAM
        first_tiers = []
        for lo in range(0, 300, 50):
            res = client.load(SMALL_LAYOUT, keys[lo : lo + 50])
            assert res.num_blocks == 50
            assert torch.equal(res.blocks, data[lo : lo + 50])
            first_tiers.append(res.tiers[0])
        assert first_tiers[0] == NVME
        assert client.load(SMALL_LAYOUT, keys[-10:]).tiers == (DRAM,) * 10  # just promoted
        stat = client.stat()
        assert stat.counters["promotions"] >= 50 and stat.counters["spilled_blocks"] >= 172


@pytest.mark.parametrize("path", ["fast", "grpc"])
def test_a_loads_release_comes_before_the_clients_next_call(
    sidecar: SidecarProcess, caplog: pytest.LogCaptureFixture, path: str
) -> None:
    """A load's release is made before the client's next call: over the
    fast path, one round trip; over gRPC, sent without waiting for the
    reply, which the next call waits for. Either way that call sees the pins
    gone. A release that fails is counted and logged (its pins go when the
    client detaches)."""
    keys, data = keys_for(20), blocks(20)
    with StoreClient(str(sidecar.socket)) as client:
        if path == "grpc":
            client._control.fast_calls = None
        assert all(client.store(SMALL_LAYOUT, keys, data))
        for _ in range(3):
            assert torch.equal(client.load(SMALL_LAYOUT, keys).blocks, data)
            assert sum(c.pins for c in client.stat().clients) == 0
        real = client._stub.Release
        fast = client._control.fast_calls

        class Lost(grpc.RpcError, grpc.Future):  # a release the sidecar never saw
            def result(self, timeout=None):
                raise self

            def exception(self, timeout=None):
                return self

            def done(self) -> bool:
                return True

        class FailingRelease:
            def future(self, request, timeout):
                return Lost()

        class FailingFastRelease:  # the other calls still made
            def call(self, method, request, timeout_s, what):
                if method != "Release":
                    return fast.call(method, request, timeout_s, what)
                raise SidecarUnavailable(f"{what}: sidecar unavailable: lost")

        client._stub.Release = FailingRelease()
        if fast is not None:
            client._control.fast_calls = FailingFastRelease()  # type: ignore[assignment]
        assert client.load(SMALL_LAYOUT, keys).num_blocks == 20
        client._stub.Release = real
        client._control.fast_calls = fast
        assert sum(c.pins for c in client.stat().clients) == 20  # left until detach
        assert client.release_errors == 1
        assert "release" in caplog.text and "pins kept" in caplog.text
    with StoreClient(str(sidecar.socket)) as other:
        assert sum(c.pins for c in other.stat().clients) == 0  # the detach dropped them


def test_cascade_hbm_dram_nvme_and_back(sidecar: SidecarProcess) -> None:
    keys, data = keys_for(300), blocks(300, seed=1)
    with StoreClient(str(sidecar.socket), hbm_bytes=256 << 10) as client:  # 32 blocks of HBM
        for lo in range(0, 300, 20):
            assert all(client.store(SMALL_LAYOUT, keys[lo : lo + 20], data[lo : lo + 20]))
        tiers = client.lookup(SMALL_LAYOUT, keys).tiers
        assert len(tiers) == 300
        assert tiers[0] == NVME and DRAM in tiers and tiers[-1] == HBM
        assert tiers.count(HBM) == 32
        for lo in range(0, 300, 25):
            res = client.load(SMALL_LAYOUT, keys[lo : lo + 25])
            assert res.num_blocks == 25 and torch.equal(res.blocks, data[lo : lo + 25])
        # Loaded blocks were promoted into HBM: the last ones read now hit there.
        assert client.lookup(SMALL_LAYOUT, keys[-25:]).tiers == (HBM,) * 25
        assert client.hbm is not None and client.hbm.stats().evictions > 0


def test_blocks_are_shared_between_client_processes(sidecar: SidecarProcess) -> None:
    keys, data = keys_for(10, start=5000), blocks(10, seed=2)
    code = f"""
import numpy as np, torch
from tierstore.client import PrefetchResult, StoreClient
from tierstore.client.results import SidecarUnavailable
from tierstore.keys import KVLayout, chain_keys
layout = KVLayout("test-model", 2, 2, 64, "float16", 8)
keys = chain_keys(layout, np.arange(5000, 5000 + 80))
gen = torch.Generator().manual_seed(2)
data = torch.randint(0, 256, (10, layout.block_bytes), dtype=torch.uint8, generator=gen)
with StoreClient({str(sidecar.socket)!r}, name="writer") as c:
    assert all(c.store(layout, keys, data))
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, cwd=REPO)
    with StoreClient(str(sidecar.socket), name="reader") as client:
        res = client.load(SMALL_LAYOUT, keys)
        assert res.num_blocks == 10 and torch.equal(res.blocks, data)


def test_residency_truth_after_eviction(sidecar: SidecarProcess) -> None:
    """A block that left a tier is reported absent there, never remembered."""
    keys, data = keys_for(4, start=9000), blocks(4, seed=3)
    filler_keys, filler = keys_for(200, start=20000), blocks(200, seed=4)
    with StoreClient(str(sidecar.socket), hbm_bytes=64 << 10) as client:  # 8 blocks of HBM
        client.store(SMALL_LAYOUT, keys, data)
        assert client.lookup(SMALL_LAYOUT, keys).tiers == (HBM,) * 4
        for lo in range(0, 200, 20):  # push them out of HBM, then out of DRAM
            client.store(SMALL_LAYOUT, filler_keys[lo : lo + 20], filler[lo : lo + 20])
        assert client.lookup(SMALL_LAYOUT, keys).tiers == (NVME,) * 4
        res = client.load(SMALL_LAYOUT, keys)
        assert torch.equal(res.blocks, data) and res.tiers == (NVME,) * 4
        assert client.lookup(SMALL_LAYOUT, keys).tiers == (HBM,) * 4


WAIT_S = 30.0  # deadline of every wait in these tests (none should come near it)


def wait_for_tiers(
    client: StoreClient, keys: list[BlockKey], tiers: tuple[TierName, ...]
) -> tuple[TierName, ...]:
    """Poll lookup until it answers ``tiers`` (background work), or give up
    at WAIT_S and return the last answer."""
    deadline = time.monotonic() + WAIT_S
    while (got := client.lookup(SMALL_LAYOUT, keys).tiers) != tiers:
        if time.monotonic() > deadline:
            return got
        time.sleep(0.02)
    return got


def store_and_spill(
    client: StoreClient, keys: list[BlockKey], data: torch.Tensor, cold: int
) -> None:
    """Store ``keys`` in batches of 50: more than DRAM (and HBM) hold, so the
    first ``cold`` keys end up on NVMe only."""
    for lo in range(0, len(keys), 50):
        assert all(client.store(SMALL_LAYOUT, keys[lo : lo + 50], data[lo : lo + 50]))
    assert client.lookup(SMALL_LAYOUT, keys[:cold]).tiers == (NVME,) * cold


def test_prefetch_policies(sidecar: SidecarProcess) -> None:
    keys, data = keys_for(200, start=40000), blocks(200, seed=5)
    with StoreClient(str(sidecar.socket)) as client:
        store_and_spill(client, keys, data, cold=40)
        cold = keys[:40]

        done = client.prefetch(SMALL_LAYOUT, cold, "wait")
        assert not isinstance(done, Future)
        assert (done.outcome, done.ready_blocks, done.available_blocks) == ("done", 40, 40)
        assert client.lookup(SMALL_LAYOUT, cold).tiers == (DRAM,) * 40

        for lo in range(50, 200, 50):  # push them back out
            client.store(SMALL_LAYOUT, keys[lo : lo + 50], data[lo : lo + 50])
        client.load(SMALL_LAYOUT, keys[100:200])
        assert client.lookup(SMALL_LAYOUT, cold).tiers[0] == NVME
        late = client.prefetch(SMALL_LAYOUT, cold, "timeout", timeout_s=1e-6)
        assert not isinstance(late, Future)
        assert late.outcome == "late" and late.ready_blocks < 40

        # best_effort: the sidecar queues the work and answers at once; the
        # client does not wait for it (the Future is done on return).
        fut = client.prefetch(SMALL_LAYOUT, keys[:60], "best_effort")
        assert isinstance(fut, Future) and fut.done()
        assert fut.result() == PrefetchResult("started", 0, 60)
        assert wait_for_tiers(client, keys[:60], (DRAM,) * 60) == (DRAM,) * 60
        assert torch.equal(client.load(SMALL_LAYOUT, keys[:60]).blocks, data[:60])

        missing = client.prefetch(SMALL_LAYOUT, keys_for(5, start=123456), "wait")
        assert not isinstance(missing, Future)
        assert missing.available_blocks == 0 and missing.ready_blocks == 0
        counters = client.stat().counters
        assert counters["prefetch_done"] == 2 and counters["prefetch_late"] == 1
        assert counters["prefetch_started"] == 1 and counters["prefetch_cancelled"] == 0


@pytest.mark.parametrize(
    "base_s, per_1k_tokens_s, outcome",
    [
        ("1e-9", "0", "late"),  # the deadline passes before the worker starts
        ("20", "0", "done"),  # the base alone leaves ample time
        ("1e-9", "50", "done"),  # 40 blocks of 8 tokens: 1e-9 + 50 * 0.32 = 16 s
    ],
)
def test_prefetch_timeout_is_base_plus_per_1k_tokens(
    tmp_path, base_s: str, per_1k_tokens_s: str, outcome: str
) -> None:
    """A timeout prefetch that gives no timeout_s gets the config's
    deadline: prefetch_timeout_base_s + prefetch_timeout_per_1k_tokens_s *
    tokens / 1000. The values make each outcome certain, not a race."""
    keys, data = keys_for(200, start=50000), blocks(200, seed=7)
    proc = start_sidecar(
        tmp_path,
        "--set",
        f"prefetch_timeout_base_s={base_s}",
        "--set",
        f"prefetch_timeout_per_1k_tokens_s={per_1k_tokens_s}",
    )
    try:
        with StoreClient(str(proc.socket)) as client:
            store_and_spill(client, keys, data, cold=40)
            got = client.prefetch(SMALL_LAYOUT, keys[:40], "timeout")
            assert not isinstance(got, Future)
            assert (got.outcome, got.available_blocks) == (outcome, 40)
            if outcome == "done":
                assert got.ready_blocks == 40
                assert client.lookup(SMALL_LAYOUT, keys[:40]).tiers == (DRAM,) * 40
            else:
                assert got.ready_blocks == 0
            assert client.stat().counters[f"prefetch_{outcome}"] == 1
    finally:
        proc.stop()


def test_prefetch_into_hbm(sidecar: SidecarProcess) -> None:
    """With an HBM tier (device='cpu') a prefetch brings the blocks on from
    NVMe through DRAM into HBM: waited for, or in the background."""
    keys, data = keys_for(600, start=60000), blocks(600, seed=8)
    with StoreClient(str(sidecar.socket), hbm_bytes=512 << 10) as client:  # 64 blocks of HBM
        # 300 stored: 64 stay in HBM, 236 are written down to 128 blocks of DRAM.
        store_and_spill(client, keys[:300], data[:300], cold=40)
        done = client.prefetch(SMALL_LAYOUT, keys[:40], "wait")
        assert done == PrefetchResult("done", 40, 40)
        assert client.lookup(SMALL_LAYOUT, keys[:40]).tiers == (HBM,) * 40

        store_and_spill(client, keys[300:], data[300:], cold=0)  # pushes them out of HBM and DRAM
        assert client.lookup(SMALL_LAYOUT, keys[:40]).tiers == (NVME,) * 40
        fut = client.prefetch(SMALL_LAYOUT, keys[:40], "best_effort")
        assert isinstance(fut, Future)
        assert fut.result(timeout=WAIT_S) == PrefetchResult("started", 40, 40)
        assert client.lookup(SMALL_LAYOUT, keys[:40]).tiers == (HBM,) * 40
        res = client.load(SMALL_LAYOUT, keys[:40])
        assert res.tiers == (HBM,) * 40 and torch.equal(res.blocks, data[:40])


def test_stat_cli_and_json(sidecar: SidecarProcess) -> None:
    with StoreClient(str(sidecar.socket), name="stat-test") as client:
        client.store(SMALL_LAYOUT, keys_for(3), blocks(3))
        client.report_load(2, 8, 5)
        cli = [sys.executable, "-m", "tierstore.cli", "stat", "--socket", str(sidecar.socket)]
        table = subprocess.run(
            cli, capture_output=True, text=True, timeout=60, cwd=REPO, check=True
        ).stdout
        assert "dram" in table and "nvme" in table and "stat-test" in table
        assert "2/8 slots busy, 5 queued" in table
        stat = json.loads(
            subprocess.run(
                [*cli, "--json"], capture_output=True, text=True, timeout=60, cwd=REPO, check=True
            ).stdout
        )
        dram = next(t for t in stat["tiers"] if t["name"] == "dram")
        assert dram["num_blocks"] == 3 and len(stat["clients"]) == 1
        # 64-bit figures are JSON numbers, not protobuf's strings.
        assert type(dram["capacity_bytes"]) is int and dram["capacity_bytes"] > 0
        assert type(stat["counters"]["lookups"]) is int
        assert type(stat["clients"][0]["client_id"]) is int
        assert stat["failed_workers"] == []


def test_stat_into_a_closed_pipe_ends_quietly(sidecar: SidecarProcess) -> None:
    """`tierstore stat --json --watch | head -1`: the reader leaves, the
    command ends with SIGPIPE's conventional status and no traceback."""
    cli = [sys.executable, "-m", "tierstore.cli", "stat", "--socket", str(sidecar.socket),
           "--json", "--watch", "0.05"]  # fmt: skip
    proc = subprocess.Popen(cli, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO)
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.readline().strip() == b"{"
    proc.stdout.close()
    try:
        code = proc.wait(timeout=60)
    finally:
        proc.kill()
    err = proc.stderr.read().decode()
    assert code == 141, err
    assert "Traceback" not in err and "BrokenPipe" not in err


def test_second_sidecar_is_refused(sidecar: SidecarProcess, tmp_path) -> None:
    dup = subprocess.run(
        [
            sys.executable,
            "-m",
            "tierstore.cli",
            "serve",
            "--socket",
            str(sidecar.socket),
            "--nvme-dir",
            str(tmp_path / "other"),
            "--metrics-port",
            "0",
            "--dram-bytes",
            "1MiB",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert dup.returncode != 0 and "served by another tierstore process" in dup.stderr
    other = tmp_path / "other-sock"
    other.mkdir()
    dup = subprocess.run(
        [
            sys.executable,
            "-m",
            "tierstore.cli",
            "serve",
            "--socket",
            str(other / "s.sock"),
            "--nvme-dir",
            str(sidecar.nvme_dir),
            "--metrics-port",
            "0",
            "--dram-bytes",
            "1MiB",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert dup.returncode != 0 and "in use by another tierstore process" in dup.stderr
    with StoreClient(str(sidecar.socket)) as client:  # the first one still serves
        assert client.stat().version


def test_sigterm_shuts_down_cleanly_and_restart_keeps_nvme(tmp_path) -> None:
    keys, data = keys_for(200, start=70000), blocks(200, seed=6)
    proc = start_sidecar(tmp_path)
    with StoreClient(str(proc.socket)) as client:
        for lo in range(0, 200, 50):
            client.store(SMALL_LAYOUT, keys[lo : lo + 50], data[lo : lo + 50])
        on_nvme = [i for i, t in enumerate(client.lookup(SMALL_LAYOUT, keys).tiers) if t == NVME]
    assert on_nvme[:10] == list(range(10))
    assert proc.stop() == 0
    assert not proc.socket.exists()
    proc = start_sidecar(tmp_path)
    try:
        with StoreClient(str(proc.socket)) as client:
            res = client.load(SMALL_LAYOUT, keys[: len(on_nvme)])
            assert res.num_blocks == len(on_nvme)
            assert torch.equal(res.blocks[: res.num_blocks], data[: len(on_nvme)])
    finally:
        proc.stop()


def test_metrics_and_health(tmp_path) -> None:
    import urllib.request

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    port = free_port()
    proc = start_sidecar(tmp_path, "--metrics-port", str(port))
    try:
        with StoreClient(str(proc.socket)) as client:
            client.store(SMALL_LAYOUT, keys_for(2), blocks(2))
            client.report_load(3, 4, 1)
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
                text = r.read().decode()
            assert 'tierstore_tier_num_blocks{tier="dram"} 2.0' in text
            assert "tierstore_clients 1.0" in text
            assert "tierstore_engine_busy_slots 3.0" in text
            assert "tierstore_engine_queue_len 1.0" in text
        with grpc.insecure_channel(f"unix:{proc.socket}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            for service in ("", "tierstore.v1.LocalService"):
                reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        proc.stop()


def test_serve_runs_with_no_config() -> None:
    """Embedded defaults: socket and NVMe directory under the user's dirs."""
    # A short directory: pytest's own (more so a worker's under xdist) can make the
    # default socket path longer than a Unix socket allows, which serve refuses by name.
    with tempfile.TemporaryDirectory(prefix="ts-noconf-") as tmp:
        _serve_with_no_config(Path(tmp))


def _serve_with_no_config(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERSTORE_")}
    env.update(
        XDG_CACHE_HOME=str(tmp_path / "cache"),
        PYTHONPATH=str(REPO),
        TIERSTORE_METRICS_PORT=str(free_port()),
    )  # only to stay clear of other runs
    env.pop("XDG_RUNTIME_DIR", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "tierstore.cli", "serve"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    socket_path = tmp_path / "cache" / "tierstore" / "run" / "tierstore.sock"
    try:
        deadline = time.monotonic() + 30
        while not socket_path.exists():
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            assert time.monotonic() < deadline
            time.sleep(0.05)
        with StoreClient(str(socket_path)) as client:
            stat = client.stat()
            assert stat.nvme_dir == str(tmp_path / "cache" / "tierstore" / "nvme")
            assert {t.name for t in stat.tiers} == {"dram", "nvme"}
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0


WRITER = """
import sys
import numpy as np
import torch
from tierstore.client import StoreClient
from tierstore.errors import TierstoreError
from tierstore.keys import chain_keys
from tests.conftest import SMALL_LAYOUT
from tests.integration.test_sidecar import block_of
client = StoreClient(sys.argv[1], call_timeout_s=10)
for chain in range(10_000):  # until the sidecar goes
    keys = chain_keys(SMALL_LAYOUT, np.arange(8 * 40) + 1_000_000 * chain)
    try:
        client.store(SMALL_LAYOUT, keys, torch.stack([block_of(k) for k in keys]))
    except TierstoreError:
        break
    print(chain, flush=True)
"""


def block_of(key: BlockKey) -> torch.Tensor:
    """The bytes the writer stores under ``key`` (a function of the key)."""
    gen = torch.Generator().manual_seed(int.from_bytes(key[:8], "little") >> 1)
    return torch.randint(0, 256, (SMALL_LAYOUT.block_bytes,), dtype=torch.uint8, generator=gen)


def test_sigterm_during_heavy_writes_keeps_what_it_acknowledged(tmp_path) -> None:
    """SIGTERM while a writer stores chains through DRAM into NVMe (spills in
    flight): the sidecar exits cleanly (status 0), and after a restart it
    serves what reached NVMe, every block the writer's bytes, none failing
    its digest (a batch cut by the signal is gone whole, never half there)."""
    proc = start_sidecar(tmp_path)
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(proc.socket)],
        stdout=subprocess.PIPE, text=True, cwd=REPO,
    )  # fmt: skip
    try:
        with StoreClient(str(proc.socket)) as observer:
            deadline = time.monotonic() + 60
            while observer.stat().counters["spilled_blocks"] < 200:
                assert time.monotonic() < deadline, "no spills within 60 s"
                assert writer.poll() is None, "the writer stopped early"
                time.sleep(0.05)
        assert proc.stop() == 0, proc.output()[-3000:]
    finally:
        out, _ = writer.communicate(timeout=60)
    acknowledged = [int(line) for line in out.split()]
    assert len(acknowledged) >= 5
    proc = start_sidecar(tmp_path)
    try:
        with StoreClient(str(proc.socket)) as client:
            served = 0
            for chain in range(acknowledged[-1] + 2):
                keys = chain_keys(SMALL_LAYOUT, np.arange(8 * 40) + 1_000_000 * chain)
                res = client.load(SMALL_LAYOUT, keys)
                for key, got in zip(keys, res.blocks[: res.num_blocks]):
                    assert torch.equal(got, block_of(key)), f"wrong bytes in chain {chain}"
                served += res.num_blocks
            assert served > 0  # what reached NVMe before the signal
            nvme = next(t for t in client.stat().tiers if t.name == "nvme")
            assert nvme.num_blocks > 0 and nvme.verify_failures == 0 and nvme.read_failures == 0
    finally:
        proc.stop()


def _serve_until_ready(args: list[str], env: dict[str, str], socket_path: Path) -> subprocess.Popen:
    proc = subprocess.Popen(args, env=env, cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)  # fmt: skip
    deadline = time.monotonic() + 30
    while not socket_path.exists():
        assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
        assert time.monotonic() < deadline, "sidecar not ready in 30 s"
        time.sleep(0.05)
    return proc


def test_serve_config_precedence_toml_env_flags(tmp_path) -> None:
    """`tierstore serve`: the TOML file, then TIERSTORE_* variables, then
    flags, each overriding the one before, seen in the running sidecar."""
    sock = tmp_path / "c.sock"
    toml = tmp_path / "tierstore.toml"
    toml.write_text(
        f'dram_bytes = "2MiB"\ndram_segment_bytes = "64KiB"\nnvme_bytes = 0\n'
        f'[server]\nsocket_path = "{sock}"\nmetrics_port = 0\n'
    )
    base = [sys.executable, "-m", "tierstore.cli", "serve", "--config", str(toml)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERSTORE_")}
    env["PYTHONPATH"] = str(REPO)
    cases = [
        ([], {}, 2 << 20),
        ([], {"TIERSTORE_DRAM_BYTES": "3MiB"}, 3 << 20),
        (["--dram-bytes", "4MiB"], {"TIERSTORE_DRAM_BYTES": "3MiB"}, 4 << 20),
    ]
    for flags, extra_env, want in cases:
        proc = _serve_until_ready(base + flags, {**env, **extra_env}, sock)
        try:
            with StoreClient(str(sock)) as client:
                dram = next(t for t in client.stat().tiers if t.name == "dram")
            assert dram.capacity_bytes == want, (flags, extra_env, dram.capacity_bytes)
        finally:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(30) == 0


def test_stat_watch_refreshes_until_interrupted(sidecar: SidecarProcess) -> None:
    cli = [sys.executable, "-m", "tierstore.cli", "stat", "--socket", str(sidecar.socket),
           "--json", "--watch", "0.2"]  # fmt: skip
    watch = subprocess.Popen(cli, cwd=REPO, stdout=subprocess.PIPE, text=True)
    with StoreClient(str(sidecar.socket)) as client:
        time.sleep(1.0)
        client.store(SMALL_LAYOUT, keys_for(3, start=90000), blocks(3, seed=9))
        time.sleep(1.0)
    watch.send_signal(signal.SIGINT)
    out, _ = watch.communicate(timeout=30)
    decoder, snapshots, at = json.JSONDecoder(), [], 0
    while at < len(out.rstrip()):
        obj, at = decoder.raw_decode(out, at)
        snapshots.append(obj)
        while at < len(out) and out[at].isspace():
            at += 1
    assert len(snapshots) >= 4, len(snapshots)
    drams = [next(t for t in snap["tiers"] if t["name"] == "dram") for snap in snapshots]
    blocks_seen = [int(t["num_blocks"]) for t in drams]
    assert blocks_seen[0] == 0 and blocks_seen[-1] == 3  # it shows the store as it happens


def test_load_into_a_given_tensor(sidecar: SidecarProcess) -> None:
    """``out`` receives the blocks in place; one too small or not contiguous
    (reshape would copy it, and the blocks would be lost) is refused."""
    from tierstore.errors import BlockSizeError

    keys, data = keys_for(4, start=95000), blocks(4, seed=12)
    with StoreClient(str(sidecar.socket)) as client:
        assert all(client.store(SMALL_LAYOUT, keys, data))
        out = torch.zeros(4, SMALL_LAYOUT.block_bytes, dtype=torch.uint8)
        res = client.load(SMALL_LAYOUT, keys, out)
        assert res.blocks is out and torch.equal(out, data)
        wide = torch.zeros(SMALL_LAYOUT.block_bytes, 8, dtype=torch.uint8)
        with pytest.raises(BlockSizeError, match="contiguous"):
            client.load(SMALL_LAYOUT, keys, wide.t())  # a transposed view
        with pytest.raises(BlockSizeError, match="blocks need"):
            client.load(SMALL_LAYOUT, keys, out[:3])
