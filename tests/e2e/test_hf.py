"""HFStoreAdapter with small random-weight transformers models and real sidecars.

A warm resume must give the logits of a cold full prefill bit for bit
(torch.equal) and the same greedy continuation, whichever tier the blocks
come from: the engine's HBM pool, the sidecar's DRAM, its NVMe, or a peer
sidecar. Models are built from configs (no weights are downloaded) with
eager attention: see tierstore/engines/hf.py for why sdpa is only close in
float32. One sidecar serves the module (1 MiB of DRAM: 128 blocks of 8 KiB)
and a pair of peered sidecars serves the peer tests.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MambaConfig,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    StaticCache,
)

from tierstore.client import StoreClient
from tierstore.engines.hf import (
    HFStoreAdapter,
    UnsupportedModelError,
    check_supported,
    layout_for,
)
from tierstore.keys import chain_keys
from tierstore.tiers.base import TierName

from ..integration.sidecar import REPO, SidecarProcess

VOCAB = 512
LENGTHS = [16 * 5, 16 * 5 + 7, 3]  # on a block boundary, inside a block, under one block
NEW_TOKENS = 8
SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
)
PEER_COMMON = ("--set", "peer_token=e2e-token", "--set", "min_tokens=64")
FAST_STOP = ("--set", "shutdown_grace_s=0.5")


def build(
    model_cls: Any = LlamaForCausalLM,
    config_cls: Any = LlamaConfig,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    attn: str = "eager",
    **overrides: Any,
) -> Any:
    config = config_cls(**{**SMALL, **overrides})
    config._attn_implementation = attn
    torch.manual_seed(seed)
    return model_cls(config).eval().to(dtype)


def prompt(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def cold_logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    """The reference: one plain forward pass over the whole prompt."""
    with torch.no_grad():
        return model(input_ids=ids[None]).logits[0, -1]


def check_warm(
    adapter: HFStoreAdapter,
    ids: torch.Tensor,
    tier: TierName | None,
    *,
    include_peers: bool = False,
    exact: bool = True,
) -> None:
    """Resume ``ids`` (stored before), expecting every reused block from ``tier``."""
    res = adapter.resume(ids, include_peers)
    assert res.num_reused_tokens == adapter.reusable_blocks(len(ids)) * 16
    assert res.num_computed_tokens >= 1
    if res.num_reused_tokens:
        assert res.tiers == (tier,) * (res.num_reused_tokens // 16)
    ref = cold_logits(adapter.model, ids)
    if exact:
        assert torch.equal(res.logits, ref)
        cold = adapter.prefill(ids).cache
        for warm_layer, cold_layer in zip(res.cache.layers, cold.layers, strict=True):
            assert torch.equal(warm_layer.keys, cold_layer.keys)
            assert torch.equal(warm_layer.values, cold_layer.values)
    else:
        torch.testing.assert_close(res.logits, ref, rtol=0, atol=1e-5)
    warm = adapter.generate(ids, NEW_TOKENS, include_peers=include_peers).tokens
    assert warm == adapter.generate(ids, NEW_TOKENS, resume=False).tokens
    assert len(warm) == NEW_TOKENS


def save_cold(adapter: HFStoreAdapter, ids: torch.Tensor) -> int:
    return adapter.save(ids, adapter.prefill(ids).cache)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- fixtures: one sidecar (and one peer pair) per module --------------------------


def _stop(*procs: SidecarProcess) -> None:
    for p in procs:
        if p.proc.poll() is None:
            p.proc.send_signal(signal.SIGTERM)
    for p in procs:
        p.stop()
        left = [n for n in os.listdir("/dev/shm") if n.startswith(f"tierstore-{p.proc.pid}-")]
        for name in left:
            os.unlink(os.path.join("/dev/shm", name))
        assert not left, f"sidecar {p.proc.pid} left its arena behind: {left}"


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SidecarProcess]:
    proc = SidecarProcess(tmp_path_factory.mktemp("sidecar"), *FAST_STOP, nvme="32MiB")
    yield proc
    _stop(proc)


@pytest.fixture(scope="module")
def client(sidecar: SidecarProcess) -> Iterator[StoreClient]:
    with StoreClient(str(sidecar.socket)) as c:
        yield c


@pytest.fixture(scope="module")
def llama() -> Any:
    return build()


@pytest.fixture(scope="module")
def adapter(llama: Any, client: StoreClient) -> HFStoreAdapter:
    return HFStoreAdapter(llama, client)


@pytest.fixture(scope="module")
def peers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[SidecarProcess, ...]]:
    pa, pb = free_port(), free_port()
    procs = []
    try:
        for port, other in ((pa, pb), (pb, pa)):
            root = tmp_path_factory.mktemp(f"peer{port}")
            extra = ("--set", f"peer_port={port}", "--set", f"peers=127.0.0.1:{other}")
            procs.append(SidecarProcess(root, *extra, *PEER_COMMON, *FAST_STOP, dram="4MiB"))
        yield tuple(procs)
    finally:
        _stop(*procs)


# -- warm resume from every tier -----------------------------------------------------


@pytest.mark.parametrize("n", LENGTHS)
def test_warm_from_dram(adapter: HFStoreAdapter, n: int) -> None:
    ids = prompt(n, seed=100 + n)
    assert save_cold(adapter, ids) == n // 16
    check_warm(adapter, ids, TierName.DRAM)


@pytest.mark.parametrize("n", LENGTHS)
def test_warm_from_hbm(llama: Any, sidecar: SidecarProcess, n: int) -> None:
    with StoreClient(str(sidecar.socket), hbm_bytes=256 << 10) as hbm_client:
        adapter = HFStoreAdapter(llama, hbm_client)
        ids = prompt(n, seed=200 + n)
        assert save_cold(adapter, ids) == n // 16
        check_warm(adapter, ids, TierName.HBM)


@pytest.mark.parametrize("n", LENGTHS)
def test_warm_from_nvme(adapter: HFStoreAdapter, client: StoreClient, n: int) -> None:
    ids = prompt(n, seed=300 + n)
    save_cold(adapter, ids)
    # 160 blocks of filler push everything older out of the 128-block DRAM.
    layout = adapter.layout
    filler_keys = chain_keys(layout, np.arange(160 * 16) + 10_000 * n)
    filler = torch.randint(0, 256, (160, layout.block_bytes), dtype=torch.uint8)
    for lo in range(0, 160, 40):  # a batch must fit the DRAM tier
        assert all(client.store(layout, filler_keys[lo : lo + 40], filler[lo : lo + 40]))
    keys = adapter.keys(ids)
    assert client.lookup(layout, keys).tiers == (TierName.NVME,) * len(keys)
    check_warm(adapter, ids, TierName.NVME)


@pytest.mark.parametrize("n", LENGTHS)
def test_warm_from_peer(llama: Any, peers: tuple[SidecarProcess, ...], n: int) -> None:
    a, b = peers
    with StoreClient(str(a.socket)) as ca, StoreClient(str(b.socket)) as cb:
        on_a, on_b = HFStoreAdapter(llama, ca), HFStoreAdapter(llama, cb)
        ids = prompt(n, seed=400 + n)
        save_cold(on_a, ids)
        # Host b holds nothing of it: without peers the resume is cold (and exact).
        assert cb.lookup(on_b.layout, on_b.keys(ids)).num_hits == 0
        assert on_b.resume(ids).num_reused_tokens == 0
        check_warm(on_b, ids, TierName.PEER, include_peers=True)


def test_matches_transformers_generate(adapter: HFStoreAdapter) -> None:
    """The adapter's warm greedy decode equals transformers' own generate()."""
    model = adapter.model
    ids = prompt(16 * 5 + 7, seed=150)
    save_cold(adapter, ids)
    eos, model.generation_config.eos_token_id = model.generation_config.eos_token_id, None
    try:
        ref = model.generate(ids[None], max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    finally:
        model.generation_config.eos_token_id = eos
    assert adapter.generate(ids, NEW_TOKENS).tokens == ref[0, len(ids) :].tolist()


def test_every_length_is_bitwise(adapter: HFStoreAdapter) -> None:
    """Every residue of the prompt length modulo the block size, and prompts
    that end just before, on and after the min_compute_tokens boundary."""
    for n in range(1, 16 * 8):
        ids = prompt(n, seed=1_000 + n)
        save_cold(adapter, ids)
        res = adapter.resume(ids)
        assert res.num_reused_tokens == max(0, n - 16) // 16 * 16
        assert torch.equal(res.logits, cold_logits(adapter.model, ids)), n


def test_end_turn_replicates_to_the_peer(llama: Any, peers: tuple[SidecarProcess, ...]) -> None:
    a, b = peers
    with StoreClient(str(a.socket)) as ca, StoreClient(str(b.socket)) as cb:
        on_a, on_b = HFStoreAdapter(llama, ca), HFStoreAdapter(llama, cb)
        ids = prompt(16 * 6 + 5, seed=450)
        save_cold(on_a, ids)
        on_a.end_turn("session-e2e", ids, wait=True)
        keys = on_b.keys(ids)
        assert cb.lookup(on_b.layout, keys).num_hits == len(keys)  # local on b now
        check_warm(on_b, ids, TierName.DRAM)


# -- save -----------------------------------------------------------------------------


def test_save_skips_the_stored_prefix(adapter: HFStoreAdapter) -> None:
    ids = prompt(16 * 7 + 3, seed=500)
    assert save_cold(adapter, ids[:80]) == 5
    assert save_cold(adapter, ids[:80]) == 0
    res = adapter.resume(ids)  # reuses the 5 stored blocks, computes the rest
    assert res.num_reused_tokens == 80
    assert adapter.save(ids, res.cache) == 2  # only the two new full blocks
    gen = adapter.generate(ids, NEW_TOKENS)
    assert adapter.save(ids, gen.cache) == 0  # a cache grown by decoding: prompt blocks only


def test_save_refuses_other_caches(adapter: HFStoreAdapter, llama: Any) -> None:
    ids = prompt(40, seed=501)
    static = StaticCache(config=llama.config, max_cache_len=64)
    with pytest.raises(UnsupportedModelError, match=r"StaticLayer|StaticCache"):
        adapter.save(ids, static)


def test_min_compute_tokens_1_reuses_more_within_an_ulp(llama: Any, client: StoreClient) -> None:
    """Reusing all but one token is allowed, but a 1-11 row suffix runs other
    GEMM kernels than the full prefill: close, not bitwise, in float32."""
    adapter = HFStoreAdapter(llama, client, min_compute_tokens=1)
    ids = prompt(16 * 5 + 1, seed=600)
    save_cold(adapter, ids)
    res = adapter.resume(ids)
    assert res.num_reused_tokens == 80 and res.num_computed_tokens == 1
    torch.testing.assert_close(res.logits, cold_logits(llama, ids), rtol=0, atol=1e-5)


# -- other families and dtypes ----------------------------------------------------------


def test_qwen2(client: StoreClient) -> None:
    model = build(Qwen2ForCausalLM, Qwen2Config)
    adapter = HFStoreAdapter(model, client)
    ids = prompt(16 * 5 + 7, seed=700)
    save_cold(adapter, ids)
    check_warm(adapter, ids, TierName.DRAM)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_dtypes(client: StoreClient, dtype: torch.dtype) -> None:
    """Bitwise equal as measured on this CPU for every suffix length."""
    model = build(dtype=dtype)
    adapter = HFStoreAdapter(model, client)
    assert adapter.layout.dtype == str(dtype).removeprefix("torch.")
    assert adapter.layout.block_bytes == 4096
    for n in (16 * 5, 16 * 5 + 7):
        ids = prompt(n, seed=800 + n)
        save_cold(adapter, ids)
        check_warm(adapter, ids, TierName.DRAM)


def test_sdpa_is_close_not_bitwise(client: StoreClient) -> None:
    """sdpa's CPU kernel tiles queries by 32 below 192 tokens: a cold prefill
    of 32k+1..3 tokens runs its last rows in a tiny tile, which takes other
    GEMM kernels. Close within 1e-5, same greedy tokens."""
    model = build(attn="sdpa")
    adapter = HFStoreAdapter(model, client)
    for n in (16 * 6 + 1, 16 * 5 + 7):
        ids = prompt(n, seed=900 + n)
        save_cold(adapter, ids)
        check_warm(adapter, ids, TierName.DRAM, exact=False)


# -- refusals ------------------------------------------------------------------------


def test_refuses_sliding_window(client: StoreClient) -> None:
    model = build(MistralForCausalLM, MistralConfig, sliding_window=32)
    with pytest.raises(UnsupportedModelError, match="sliding_attention with a window of 32"):
        HFStoreAdapter(model, client)
    with pytest.raises(UnsupportedModelError, match="sliding"):
        layout_for(model)
    # The same family without a window is a plain full-attention model.
    HFStoreAdapter(build(MistralForCausalLM, MistralConfig, sliding_window=None), client)


def test_refuses_hybrid_sliding_qwen2() -> None:
    config = Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=32, max_window_layers=1)
    with pytest.raises(UnsupportedModelError, match="layer 1 is sliding_attention"):
        check_supported(config)


def test_refuses_recurrent_state() -> None:
    with pytest.raises(UnsupportedModelError, match="recurrent/SSM"):
        check_supported(MambaConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2))


# -- keys --------------------------------------------------------------------------------

KEYS_SCRIPT = """
import json, torch
from tests.e2e.test_hf import build, prompt
from tierstore.engines.hf import layout_for
from tierstore.keys import chain_keys
layout = layout_for(build())
keys = chain_keys(layout, prompt(16 * 4, seed=1000).numpy())
print(json.dumps({"model": layout.model, "fp": layout.fingerprint.hex(),
                  "keys": [k.hex() for k in keys]}))
"""


def test_keys_are_stable_across_processes(llama: Any) -> None:
    layout = layout_for(llama)
    keys = chain_keys(layout, prompt(16 * 4, seed=1000).numpy())
    out = subprocess.run(
        [sys.executable, "-c", KEYS_SCRIPT],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONHASHSEED="123"),
    )
    assert out.returncode == 0, out.stderr[-2000:]
    other = json.loads(out.stdout.strip().splitlines()[-1])
    assert other == {
        "model": layout.model,
        "fp": layout.fingerprint.hex(),
        "keys": [k.hex() for k in keys],
    }
    # Another random model with the same config must not share keys.
    assert layout_for(build(seed=1)).model != layout.model
    assert layout_for(build(seed=1, hidden_size=128)).fingerprint != layout.fingerprint
    assert layout_for(llama, tenant_salt="t").fingerprint != layout.fingerprint
