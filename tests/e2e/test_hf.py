"""HFStoreAdapter with small random-weight transformers models and real sidecars.

A warm resume must give the logits of a cold full prefill bit for bit
(torch.equal), a cache whose K/V bytes are those of the cold prefill, and the
same greedy continuation, whichever tier the blocks come from: the engine's
HBM pool, the sidecar's DRAM, its NVMe, or a peer sidecar; for Llama, for
families built differently (GPT-2: learned absolute positions, LayerNorm,
fused QKV; GPT-NeoX: partial rotary, parallel residual) and for
float16/bfloat16 layouts (and from DRAM for Falcon's multi-query heads and
Qwen2). Models are built from configs (no weights
are downloaded) with eager attention: see tierstore/engines/hf/__init__.py for why
sdpa is only close in float32. One sidecar serves the module (1 MiB of DRAM)
and a pair of peered sidecars serves the peer tests.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from transformers import (
    FalconConfig,
    FalconForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MambaConfig,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    StaticCache,
    T5Config,
)

from harness import REPO
from harness.sidecar import SidecarProcess, start_sidecar
from tierstore.cli.ports import free_port
from tierstore.client import StoreClient
from tierstore.engines.hf import HFStoreAdapter, InexactAttentionWarning
from tierstore.engines.hf.model import UnsupportedModelError, check_supported, layout_for
from tierstore.keys import chain_keys
from tierstore.tiers import TierName

VOCAB = 512
# Resumes reuse 1, 3 and 7 blocks (all but the last 16-31 tokens); 64 ends on
# a block boundary, 33 and 130 inside a block. Prompts under 32 tokens reuse
# nothing: test_every_length_is_bitwise covers them.
LENGTHS = [33, 64, 130]
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
# Families whose layers differ from Llama's where a restored cache could go
# wrong: positions (learned, partial rotary), K/V heads (multi-query).
FAMILIES: dict[str, tuple[Any, Any, dict[str, Any]]] = {
    "llama": (LlamaForCausalLM, LlamaConfig, SMALL),
    "gpt2": (
        GPT2LMHeadModel,
        GPT2Config,
        dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=1024,
             bos_token_id=0, eos_token_id=0),
    ),
    "gpt_neox": (
        GPTNeoXForCausalLM,
        GPTNeoXConfig,
        dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, max_position_embeddings=1024, rotary_pct=0.25),
    ),
    "falcon": (
        FalconForCausalLM,
        FalconConfig,
        dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
             multi_query=True, bos_token_id=0, eos_token_id=0),
    ),
    "qwen2": (Qwen2ForCausalLM, Qwen2Config, SMALL),
}  # fmt: skip
HALF_DTYPES = [torch.float16, torch.bfloat16]
PEER_COMMON = ("--set", "peer_token=e2e-token", "--set", "min_tokens=64")
FAST_STOP = ("--set", "shutdown_grace_s=0.5")
SIDECAR_DRAM_BYTES = 1 << 20  # the module sidecar's dram="1MiB"


def build(
    model_cls: Any = LlamaForCausalLM,
    config_cls: Any = LlamaConfig,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    attn: str = "eager",
    base: dict[str, Any] = SMALL,
    **overrides: Any,
) -> Any:
    config = config_cls(**{**base, **overrides})
    config._attn_implementation = attn
    torch.manual_seed(seed)
    return model_cls(config).eval().to(dtype)


_MODELS: dict[tuple[str, torch.dtype], Any] = {}


def model_of(family: str, dtype: torch.dtype = torch.float32) -> Any:
    """One model per family and dtype for the whole module (read-only use)."""
    if (family, dtype) not in _MODELS:
        model_cls, config_cls, base = FAMILIES[family]
        _MODELS[family, dtype] = build(model_cls, config_cls, dtype=dtype, base=base)
    return _MODELS[family, dtype]


def _case(family: str, dtype: torch.dtype = torch.float32) -> Any:
    name = family if dtype == torch.float32 else f"{family}-{str(dtype).removeprefix('torch.')}"
    return pytest.param(family, dtype, id=name)


# Every tier: Llama, two families built differently, and the half layouts.
# DRAM also takes the families that differ from these only in their heads
# (Falcon's multi-query) or biases (Qwen2): the tier does not change that.
CASES = [_case(f) for f in ("llama", "gpt2", "gpt_neox")] + [_case("llama", d) for d in HALF_DTYPES]
DRAM_CASES = [*CASES, _case("falcon"), _case("qwen2")]


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
    assert res.logits.dtype == ref.dtype == adapter.model.dtype
    if exact:
        assert torch.equal(res.logits, ref)
        cold = adapter.prefill(ids).cache
        for warm_layer, cold_layer in zip(res.cache.layers, cold.layers, strict=True):
            assert same_bytes(warm_layer.keys, cold_layer.keys)
            assert same_bytes(warm_layer.values, cold_layer.values)
    else:
        torch.testing.assert_close(res.logits, ref, rtol=0, atol=1e-5)
    warm = adapter.generate(ids, NEW_TOKENS, include_peers=include_peers).tokens
    assert warm == adapter.generate(ids, NEW_TOKENS, resume=False).tokens
    assert len(warm) == NEW_TOKENS


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (torch.equal takes -0.0 for 0.0 and NaN for unequal)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(ints), b.contiguous().view(ints))


def save_cold(adapter: HFStoreAdapter, ids: torch.Tensor) -> int:
    return adapter.save(ids, adapter.prefill(ids).cache)


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
    proc = start_sidecar(tmp_path_factory.mktemp("sidecar"), *FAST_STOP, dram="1MiB", nvme="64MiB")
    yield proc
    _stop(proc)


@pytest.fixture(scope="module")
def client(sidecar: SidecarProcess) -> Iterator[StoreClient]:
    with StoreClient(str(sidecar.socket)) as c:
        yield c


@pytest.fixture(scope="module")
def llama() -> Any:
    return model_of("llama")


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
            procs.append(start_sidecar(root, *extra, *PEER_COMMON, *FAST_STOP, dram="4MiB"))
        yield tuple(procs)
    finally:
        _stop(*procs)


# -- warm resume from every tier -----------------------------------------------------


def adapter_for(family: str, dtype: torch.dtype, client: StoreClient) -> HFStoreAdapter:
    adapter = HFStoreAdapter(model_of(family, dtype), client)
    assert adapter.layout.dtype == str(dtype).removeprefix("torch.")
    return adapter


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize(("family", "dtype"), DRAM_CASES)
def test_warm_from_dram(client: StoreClient, family: str, dtype: torch.dtype, n: int) -> None:
    adapter = adapter_for(family, dtype, client)
    ids = prompt(n, seed=100 + n)
    assert save_cold(adapter, ids) == n // 16
    check_warm(adapter, ids, TierName.DRAM)


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize(("family", "dtype"), CASES)
def test_warm_from_hbm(sidecar: SidecarProcess, family: str, dtype: torch.dtype, n: int) -> None:
    with StoreClient(str(sidecar.socket), hbm_bytes=256 << 10) as hbm_client:
        adapter = adapter_for(family, dtype, hbm_client)
        ids = prompt(n, seed=200 + n)
        assert save_cold(adapter, ids) == n // 16
        check_warm(adapter, ids, TierName.HBM)


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize(("family", "dtype"), CASES)
def test_warm_from_nvme(client: StoreClient, family: str, dtype: torch.dtype, n: int) -> None:
    adapter = adapter_for(family, dtype, client)
    ids = prompt(n, seed=300 + n)
    save_cold(adapter, ids)
    # Filler of 1.25x the DRAM tier pushes everything older out to NVMe.
    layout = adapter.layout
    num_filler = SIDECAR_DRAM_BYTES * 5 // 4 // layout.block_bytes
    batch = SIDECAR_DRAM_BYTES // 4 // layout.block_bytes  # a batch must fit the DRAM tier
    filler_keys = chain_keys(layout, np.arange(num_filler * 16) + 10_000 * n)
    filler = torch.randint(0, 256, (num_filler, layout.block_bytes), dtype=torch.uint8)
    for lo in range(0, num_filler, batch):
        assert all(client.store(layout, filler_keys[lo : lo + batch], filler[lo : lo + batch]))
    keys = adapter.keys(ids)
    assert client.lookup(layout, keys).tiers == (TierName.NVME,) * len(keys)
    check_warm(adapter, ids, TierName.NVME)


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize(("family", "dtype"), CASES)
def test_warm_from_peer(
    peers: tuple[SidecarProcess, ...], family: str, dtype: torch.dtype, n: int
) -> None:
    a, b = peers
    with StoreClient(str(a.socket)) as ca, StoreClient(str(b.socket)) as cb:
        on_a, on_b = adapter_for(family, dtype, ca), adapter_for(family, dtype, cb)
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


def test_resume_falls_back_to_prefill_when_the_peer_fails(llama: Any, tmp_path: Any) -> None:
    """The peer that holds the prefix stalls (SIGSTOP), then dies (SIGKILL):
    each resume on the other host is a cold prefill within the lookup
    deadline, with exactly the cold logits, and the host keeps serving."""
    pa, pb = free_port(), free_port()
    hosts = []
    for name, port, other in (("a", pa, pb), ("b", pb, pa)):
        (tmp_path / name).mkdir()
        extra = ("--set", f"peer_port={port}", "--set", f"peers=127.0.0.1:{other}")
        hosts.append(start_sidecar(tmp_path / name, *extra, *PEER_COMMON, *FAST_STOP))
    a, b = hosts
    try:
        with StoreClient(str(a.socket)) as ca, StoreClient(str(b.socket)) as cb:
            on_a, on_b = HFStoreAdapter(llama, ca), HFStoreAdapter(llama, cb)
            ids = prompt(16 * 6 + 5, seed=470)
            save_cold(on_a, ids)
            assert on_b.resume(ids, include_peers=True).tiers[0] == TierName.PEER
            ids = prompt(16 * 6 + 5, seed=471)  # a prefix b has not fetched yet
            save_cold(on_a, ids)
            ref = cold_logits(llama, ids)
            for sig in (signal.SIGSTOP, signal.SIGKILL):
                if sig == signal.SIGSTOP:
                    a.freeze()  # every thread stopped: none answers the lookup
                else:
                    a.proc.send_signal(sig)
                res = on_b.resume(ids, include_peers=True)
                assert res.num_reused_tokens == 0, sig
                assert torch.equal(res.logits, ref), sig
                # The peer lookup gave up at its deadline (peer_lookup_timeout_s 0.5).
                assert res.store_s < 0.5 + 1.0, (sig, res.store_s)
            assert (
                on_b.generate(ids, NEW_TOKENS).tokens
                == on_b.generate(ids, NEW_TOKENS, resume=False).tokens
            )
    finally:
        a.thaw()
        a.stop()
        for name in os.listdir("/dev/shm"):  # a SIGKILLed sidecar cannot remove its arena
            if name.startswith(f"tierstore-{a.proc.pid}-"):
                os.unlink(os.path.join("/dev/shm", name))
        _stop(b)


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


@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_half_layout_is_half_the_bytes(dtype: torch.dtype) -> None:
    """Half layouts (their warm legs run in the tier tests) store 2-byte K/V."""
    layout = layout_for(model_of("llama", dtype))
    assert layout.dtype == str(dtype).removeprefix("torch.")
    assert layout.block_bytes == layout_for(model_of("llama")).block_bytes // 2 == 4096


def test_sdpa_is_close_not_bitwise(client: StoreClient) -> None:
    """sdpa's CPU kernel tiles queries by 32 below 192 tokens: a cold prefill
    of 32k+1..3 tokens runs its last rows in a tiny tile, which takes other
    GEMM kernels. Close within 1e-5, same greedy tokens."""
    model = build(attn="sdpa")
    with pytest.warns(InexactAttentionWarning, match="attn_implementation='sdpa'"):
        adapter = HFStoreAdapter(model, client)
    for n in (16 * 6 + 1, 16 * 5 + 7):
        ids = prompt(n, seed=900 + n)
        save_cold(adapter, ids)
        check_warm(adapter, ids, TierName.DRAM, exact=False)


def test_eager_attention_does_not_warn(llama: Any, client: StoreClient) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", InexactAttentionWarning)
        HFStoreAdapter(llama, client)


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


def test_refuses_encoder_decoder() -> None:
    with pytest.raises(UnsupportedModelError, match="encoder-decoder"):
        check_supported(T5Config(vocab_size=VOCAB, d_model=64, num_layers=2, num_heads=4))


# -- keys --------------------------------------------------------------------------------

KEYS_SCRIPT = """
import json, torch
from tests.e2e.test_hf import build, prompt
from tierstore.engines.hf.model import layout_for
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
