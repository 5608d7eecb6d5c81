"""The vLLM connector's layouts and engine refusals, from vLLM's own KV cache specs."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vllm (pip install 'tierstore[vllm]')")

import torch
from transformers import LlamaConfig
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

from tierstore.engines.vllm.layout import (
    ConnectorSettings,
    engine_layouts,
    engine_refusal,
    kv_groups,
)

LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(4)]


def full(**kw: Any) -> FullAttentionSpec:
    args: dict[str, Any] = dict(block_size=128, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    args.update(kw)
    return FullAttentionSpec(**args)


def kv_config(*specs: Any, layout: str = "LBHNC") -> KVCacheConfig:
    groups = [KVCacheGroupSpec(LAYERS, s) for s in specs]
    return KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=groups,
                         kv_cache_layout=layout)  # fmt: skip


def vllm_config(tp: int = 1, pp: int = 1, model: str = "/models/llama", **cfg: Any) -> Any:
    hf = LlamaConfig(num_hidden_layers=4, hidden_size=256, num_attention_heads=4,
                     num_key_value_heads=2, **cfg)  # fmt: skip
    return SimpleNamespace(
        model_config=SimpleNamespace(model=model, revision=None, hf_text_config=hf,
                                     dtype=torch.bfloat16),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp),
    )  # fmt: skip


def test_full_attention_is_served_with_a_layout_per_rank() -> None:
    cfg, kv = vllm_config(tp=2), kv_config(full())
    assert engine_refusal(cfg, kv) is None
    a, b = engine_layouts(cfg, kv, ConnectorSettings())
    assert (a.num_layers, a.num_kv_heads, a.head_dim, a.dtype, a.block_tokens) == (
        4, 2, 64, "bfloat16", 128,
    )  # fmt: skip
    assert (a.tp_rank, b.tp_rank, a.tp_size) == (0, 1, 2)
    assert a.fingerprint != b.fingerprint
    assert a.model.startswith("vllm:/models/llama@#") and a.model.endswith("/cpu-LBHNC")
    assert a.block_bytes == 4 * full().page_size_bytes


def test_identity_names_model_config_page_format_and_salt() -> None:
    kv = kv_config(full())
    base = engine_layouts(vllm_config(), kv, ConnectorSettings())[0]
    same = engine_layouts(vllm_config(), kv, ConnectorSettings())[0]
    assert base == same  # deterministic
    others = [
        engine_layouts(vllm_config(rope_theta=1e6), kv, ConnectorSettings())[0],
        engine_layouts(vllm_config(), kv_config(full(), layout="BLHNC"), ConnectorSettings())[0],
        engine_layouts(vllm_config(), kv, ConnectorSettings(model_name="llama-3"))[0],
        engine_layouts(vllm_config(), kv, ConnectorSettings(tenant_salt="t1"))[0],
    ]
    assert len({base.fingerprint, *(o.fingerprint for o in others)}) == 5
    # The name set in the settings replaces the path: hosts with other paths share keys.
    here = engine_layouts(vllm_config(model="/a"), kv, ConnectorSettings(model_name="m"))[0]
    there = engine_layouts(vllm_config(model="/b"), kv, ConnectorSettings(model_name="m"))[0]
    assert here == there


def window(**kw: Any) -> SlidingWindowSpec:
    args: dict[str, Any] = dict(block_size=128, num_kv_heads=2, head_size=64,
                                dtype=torch.bfloat16, sliding_window=512)  # fmt: skip
    args.update(kw)
    return SlidingWindowSpec(**args)


def hybrid_config(*groups: tuple[Any, list[int]]) -> KVCacheConfig:
    """vLLM's hybrid KV cache manager's groups: (spec, the layers it holds)."""
    specs = [KVCacheGroupSpec([LAYERS[i] for i in layers], spec) for spec, layers in groups]
    return KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=specs,
                         kv_cache_layout="LBHNC")  # fmt: skip


def test_hybrid_groups_are_served_in_the_models_layer_order() -> None:
    """Gemma-3's pattern under vLLM's hybrid manager: a full-attention
    group and sliding-window groups, each with block ids of its own. A block
    is every layer's KV in the model's order, the same block an engine
    without the hybrid manager (one group) stores."""
    cfg = vllm_config()
    hybrid = hybrid_config((full(), [3]), (window(), [0, 2]), (window(), [1]))
    assert engine_refusal(cfg, hybrid) is None
    groups = kv_groups(hybrid)
    assert groups.layer_names == tuple(LAYERS)
    assert groups.group_of == (1, 2, 1, 0)
    assert groups.num_groups == 3 and groups.windowed
    one = kv_config(full(sliding_window=512))
    assert kv_groups(one).group_of == (0, 0, 0, 0) and not kv_groups(one).windowed
    (a,) = engine_layouts(cfg, hybrid, ConnectorSettings())
    (b,) = engine_layouts(cfg, one, ConnectorSettings())
    assert a == b and a.num_layers == 4
    # Every layer sliding: one group of window blocks.
    assert engine_refusal(cfg, kv_config(window())) is None
    assert kv_groups(kv_config(window())).windowed


def test_what_cannot_be_restored_by_prefix_is_refused() -> None:
    cfg = vllm_config()
    mla = MLAAttentionSpec(block_size=128, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    chunked = ChunkedLocalAttentionSpec(
        block_size=128, num_kv_heads=2, head_size=64, dtype=torch.bfloat16,
        attention_chunk_size=1024,
    )  # fmt: skip
    # A group that cannot is named; the engine runs without the store.
    reason = str(engine_refusal(cfg, hybrid_config((full(), [0, 1]), (chunked, [2, 3]))))
    assert reason.startswith("KV cache group 1 of 2: layers of kind ChunkedLocalAttentionSpec")
    assert "group 0 of 2: MLA" in str(engine_refusal(cfg, hybrid_config((mla, [0]), (full(), [1]))))
    mixed = hybrid_config((full(), [0, 1]), (window(head_size=128), [2, 3]))
    assert "groups of different pages" in str(engine_refusal(cfg, mixed))
    # vLLM without its hybrid manager: sliding layers in one full-attention group
    # keep every token's KV, so they restore exactly; chunked attention does not.
    assert engine_refusal(cfg, kv_config(full(sliding_window=512))) is None
    assert "chunked" in str(engine_refusal(cfg, kv_config(full(attention_chunk_size=1024))))
    assert "pipeline" in str(engine_refusal(vllm_config(pp=2), kv_config(full())))
    assert "head sizes" in str(engine_refusal(cfg, kv_config(full(head_size_v=32))))
    assert "MLA" in str(engine_refusal(cfg, kv_config(mla)))


def test_a_refused_engine_runs_without_the_store_on_every_connector_hook() -> None:
    """A refusal turns the connector off; every hook vLLM calls on either
    side must then answer as "nothing", never raise (a sliding-window model
    once died at start in register_kv_caches)."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from tierstore.engines.vllm import TierstoreConnector, TierstoreConnectorMetadata

    cfg = vllm_config()
    cfg.kv_transfer_config = KVTransferConfig(
        kv_connector="TierstoreConnector", kv_role="kv_both",
        kv_connector_extra_config={"socket_path": "/nonexistent/tierstore.sock"},
    )  # fmt: skip
    mla = MLAAttentionSpec(block_size=128, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        c = TierstoreConnector(cfg, role, kv_config(mla))
        assert c.disabled is not None and "MLA" in c.disabled
        assert c.refusals == {f"engine: {c.disabled}": 1}
        c.register_kv_caches({})
        c.bind_connector_metadata(TierstoreConnectorMetadata())
        c.start_load_kv(None)
        c.wait_for_layer_load(LAYERS[0])
        c.save_kv_layer(LAYERS[0], torch.zeros(1), None)
        c.wait_for_save()
        assert c.get_finished(set()) == (None, None)
        assert c.get_block_ids_with_load_errors() == set()
        assert c.get_num_new_matched_tokens(SimpleNamespace(), 0) == (0, False)
        assert isinstance(c.build_connector_meta(None), TierstoreConnectorMetadata)
        assert list(c.take_events()) == []
        assert c.get_kv_connector_kv_cache_events() is None
        stats = c.get_kv_connector_stats()
        assert stats is not None and stats.data["counters"] == {f"refusals|engine: {c.disabled}": 1}
        assert c.request_finished(SimpleNamespace(), []) == (False, None)
        c.shutdown()
