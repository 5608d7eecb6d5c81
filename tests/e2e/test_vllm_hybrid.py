"""A model that mixes sliding-window and full-attention layers (Gemma-3's
pattern) in real vLLM engines with TierstoreConnector.

TierstoreConnector declares ``SupportsHMA``, so vLLM keeps its hybrid KV
cache manager on: the full-attention layer and the sliding-window layers
are KV cache groups with block ids of their own, and a sliding layer keeps
only its window's blocks. A fresh engine loads the prompt's 5 full blocks
(640 tokens, past the 256-token window): every block of the full layer,
the window's blocks of the sliding ones, in the background (vLLM takes a
multi-group engine's failures only per request). Its 32 greedy ids equal
those of vLLM alone. An engine with the hybrid manager off (one group,
every layer keeps every token) loads the same blocks. A corrupted block on
NVMe fails the load as a whole: vLLM recomputes the request, ids equal.
The negative control: the same load without the sliding groups' blocks
gives other ids.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="needs vllm (pip install 'tierstore[vllm]', see README)")

from harness.sidecar import SidecarProcess, overwrite_nvme_blocks, push_out_of_dram
from tierstore.client import StoreClient
from tierstore.engines.vllm.driver import VllmEngine, kv_transfer_config

from ..conftest import SidecarFactory

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

PROMPT = [random.Random(8).randrange(1, 1000) for _ in range(700)]  # 5 full blocks
NEW_TOKENS = 32
WINDOW = 256
BLOCK = 128
DRAM = 4 << 20
HMA_OFF = "Turning off hybrid kv cache manager"
SKIP_WINDOWS = {  # imported by the engines only (it imports vLLM)
    "kv_connector": "WindowSkippingConnector",
    "kv_connector_module_path": "tests.e2e.window_skip",
}


def tiny_gemma3(path: Path) -> Path:
    """A random-weight Gemma-3 text model: 3 sliding-window layers (256
    tokens) and 1 full-attention layer, hidden 256, 2 KV heads of 64. Its
    own output embedding, a query scale of head_dim and a wider init make
    the greedy ids follow the context: with Gemma's tied embeddings a
    random model repeats one token whatever the KV (measured: changing the
    256 tokens in the window, or only the 384 before it, changed 11 and 9
    of 12 greedy ids)."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(
        vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, sliding_window=WINDOW,
        layer_types=["sliding_attention"] * 3 + ["full_attention"], query_pre_attn_scalar=64,
        tie_word_embeddings=False, max_position_embeddings=4096, initializer_range=0.3,
        torch_dtype="bfloat16",
    )  # fmt: skip
    Gemma3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def sidecar(module_sidecar_factory: SidecarFactory) -> SidecarProcess:
    return module_sidecar_factory(dram=f"{DRAM >> 20}MiB", nvme="64MiB")


def plan(stats: Path) -> dict[str, int]:
    return json.loads(stats.read_text())["plan"]


def test_sliding_window_groups_restore_exactly(tmp_path: Path, sidecar: SidecarProcess) -> None:
    model = tiny_gemma3(tmp_path / "gemma3")
    with VllmEngine(model, None, log_path=tmp_path / "alone.log", in_process=True) as e:
        (alone,), _ = e.generate([PROMPT], NEW_TOKENS, ignore_eos=True)
    assert len(alone.token_ids) == NEW_TOKENS
    transfer = kv_transfer_config(sidecar.socket)
    with VllmEngine(model, transfer, log_path=tmp_path / "cold.log", in_process=True) as e:
        (cold,), _ = e.generate([PROMPT], NEW_TOKENS, ignore_eos=True)
    assert HMA_OFF not in (tmp_path / "cold.log").read_text()
    assert cold.token_ids == alone.token_ids
    with StoreClient(str(sidecar.socket)) as c:
        stored = next(t.num_blocks for t in c.stat().tiers if t.name == "dram")
    assert stored == 5

    stats = tmp_path / "warm-stats.json"
    warm_transfer = kv_transfer_config(sidecar.socket, stats_path=str(stats))
    with VllmEngine(model, warm_transfer, log_path=tmp_path / "warm.log", in_process=True) as e:
        (warm,), _ = e.generate([PROMPT], NEW_TOKENS, ignore_eos=True)
        log = (tmp_path / "warm.log").read_text()
        assert HMA_OFF not in log and "KV store is off" not in log
        assert warm.num_cached_tokens == 640 > WINDOW
        assert warm.token_ids == alone.token_ids
        got = plan(stats)
        assert got["background_loads"] == got["background_loads_done"] == 1  # DRAM, yet async
        assert got["load_failed_blocks"] == 0

        # vLLM's hybrid manager off (one group): the same blocks serve it.
        off = {"disable_hybrid_kv_cache_manager": True}
        with VllmEngine(
            model, transfer, log_path=tmp_path / "off.log", llm_kwargs=off, in_process=True
        ) as o:
            (one_group,), _ = o.generate([PROMPT], NEW_TOKENS, ignore_eos=True)
        assert one_group.num_cached_tokens == 640
        assert one_group.token_ids == alone.token_ids

        # The negative control: the same load without the sliding groups' window
        # blocks (tests/e2e/window_skip.py) gives other ids.
        skip = {**transfer, **SKIP_WINDOWS}
        with VllmEngine(model, skip, log_path=tmp_path / "skip.log", in_process=True) as s:
            (skipped,), _ = s.generate([PROMPT], NEW_TOKENS, ignore_eos=True)
        assert skipped.num_cached_tokens == 640
        assert skipped.token_ids != alone.token_ids

        # The blocks pushed to NVMe and corrupted there: the background load
        # fails verification, and vLLM (told the request failed, not its
        # blocks: it raises on block ids from a multi-group engine) recomputes it.
        assert e.reset_prefix_cache()
        with StoreClient(str(sidecar.socket)) as c:
            push_out_of_dram(c, DRAM, BLOCK, batch=4)
            nvme = next(t for t in c.stat().tiers if t.name == "nvme")
            assert nvme.num_blocks >= 5
        overwrite_nvme_blocks(sidecar.nvme_dir)
        (again,), _ = e.generate([PROMPT], NEW_TOKENS, ignore_eos=True)
        got = plan(stats)
    assert got["background_loads"] == got["background_loads_done"] == 2
    assert got["failed_loads"] == 1 and got["load_failed_blocks"] == 5
    assert again.num_cached_tokens == 0  # recomputed whole: random bytes would change the ids
    assert again.token_ids == alone.token_ids
