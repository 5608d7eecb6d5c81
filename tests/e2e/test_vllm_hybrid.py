"""A model that mixes sliding-window and full-attention layers (Gemma-3's
pattern) in real vLLM engines with TierstoreConnector.

TierstoreConnector does not declare ``SupportsHMA``, so vLLM turns its
hybrid KV cache manager off for it: every layer, sliding or not, keeps
every token's KV in one full-attention group, and the window only masks
the attention. A stored prefix then restores exactly: a fresh engine loads
the prompt's 5 full blocks (640 tokens, past the 256-token window) and its
32 greedy ids equal those of vLLM alone (with its hybrid manager on, which
keeps only the window's blocks of the sliding layers: the same attention).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="needs vllm (pip install 'tierstore[vllm]', see README)")

from tierstore.client import StoreClient
from tierstore.engines.vllm.driver import VllmEngine, kv_transfer_config

from ..integration.sidecar import SidecarProcess

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

PROMPT = [random.Random(8).randrange(1, 1000) for _ in range(700)]  # 5 full blocks
NEW_TOKENS = 32
WINDOW = 256


def tiny_gemma3(path: Path) -> Path:
    """A random-weight Gemma-3 text model: 3 sliding-window layers (256
    tokens) and 1 full-attention layer, hidden 256, 2 KV heads of 64."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(
        vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, sliding_window=WINDOW,
        layer_types=["sliding_attention"] * 3 + ["full_attention"],
        max_position_embeddings=4096, initializer_range=0.1, torch_dtype="bfloat16",
    )  # fmt: skip
    Gemma3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    return path


def test_sliding_window_layers_restore_exactly(
    tmp_path: Path, vllm_sidecar: SidecarProcess
) -> None:
    model = tiny_gemma3(tmp_path / "gemma3")
    with VllmEngine(model, None, log_path=tmp_path / "alone.log") as e:
        (alone,), _ = e.generate([PROMPT], NEW_TOKENS, ignore_eos=True)
    transfer = kv_transfer_config(vllm_sidecar.socket)
    with VllmEngine(model, transfer, log_path=tmp_path / "cold.log") as e:
        (cold,), _ = e.generate([PROMPT], NEW_TOKENS, ignore_eos=True)
    with StoreClient(str(vllm_sidecar.socket)) as c:
        stored = next(t.num_blocks for t in c.stat().tiers if t.name == "dram")
    assert stored == 5
    with VllmEngine(model, transfer, log_path=tmp_path / "warm.log") as e:
        (warm,), _ = e.generate([PROMPT], NEW_TOKENS, ignore_eos=True)
    assert "KV store is off" not in (tmp_path / "warm.log").read_text()
    assert warm.num_cached_tokens == 640 > WINDOW
    assert len(alone.token_ids) == NEW_TOKENS
    assert cold.token_ids == alone.token_ids
    assert warm.token_ids == alone.token_ids
