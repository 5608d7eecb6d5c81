"""What a transformers model is, as tierstore sees it: whether its cache can
be stored, the shape of its KV, the name that scopes its keys, its layout.

Provides:
- ``check_supported(config)``: raise ``UnsupportedModelError`` for models
  whose cache cannot be restored exactly from per-layer K/V blocks
  (sliding-window or chunked attention, recurrent/SSM state, shared-KV
  layers, encoder-decoder cross-attention);
- ``kv_shape(config)``: (layers, KV heads, head dim) of a decoder config;
- ``model_identity(model)``: the model name that scopes its keys
  (deterministic across processes and machines);
- ``layout_for(model, ...)``: the model's KVLayout.

Pure reads of the model's config and weights; runs in the engine process,
on the thread that builds the adapter.
"""

from __future__ import annotations

import json
from typing import Any

import blake3
import torch

from tierstore.errors import LayoutError, TierstoreError
from tierstore.keys import DTYPE_BYTES, KVLayout

# Config fields that do not change the KV a model computes: excluded from the
# identity hash so that a model saved and reloaded keeps its keys.
_VOLATILE_CONFIG_FIELDS = frozenset(
    "_name_or_path _attn_implementation _attn_implementation_internal _commit_hash dtype "
    "transformers_version torch_dtype use_cache output_attentions output_hidden_states "
    "return_dict _attn_implementation_autoset".split()
)
_RECURRENT_MODEL_TYPES = ("mamba", "rwkv", "xlstm", "recurrent_gemma", "jamba", "zamba")


class UnsupportedModelError(TierstoreError, ValueError):
    """The model's cache cannot be saved and restored exactly as per-layer K/V blocks."""


def _text_config(config: Any) -> Any:
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def check_supported(config: Any) -> None:
    """Raise UnsupportedModelError unless every layer keeps a full per-layer
    K/V cache (a plain DynamicLayer): sliding-window and chunked attention
    drop old tokens, recurrent/SSM and linear attention keep a state that is
    not per token, shared-KV layers keep none."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    text = _text_config(config)
    model_type = str(getattr(text, "model_type", ""))
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(
            f"{model_type}: encoder-decoder models are not supported (cross-attention cache)"
        )
    if any(t in model_type for t in _RECURRENT_MODEL_TYPES) or hasattr(text, "ssm_state_size"):
        raise UnsupportedModelError(
            f"{model_type}: recurrent/SSM state cannot be restored from per-token K/V blocks"
        )
    layer_types, kwargs = get_layer_types_and_kwargs(text)
    for i, (kind, kw) in enumerate(zip(layer_types, kwargs)):
        if kind == "full_attention":
            continue
        if "sliding_window" in kw:
            why = (
                f"layer {i} is {kind} with a window of {kw['sliding_window']} tokens: its "
                "cache drops older tokens, so a stored prefix cannot be restored exactly"
            )
        else:
            why = f"layer {i} is {kind!r}, not full attention with a per-token K/V cache"
        raise UnsupportedModelError(f"{model_type}: {why}")


def kv_shape(config: Any) -> tuple[int, int, int]:
    """(layers, KV heads, head dim) of a decoder config."""
    text = _text_config(config)
    heads = text.num_attention_heads
    # num_kv_heads: Falcon's name for it. multi_query without Falcon's new
    # decoder (Falcon-7B, GPT-BigCode) caches one K/V head, whatever the rest says.
    kv_heads = (
        getattr(text, "num_key_value_heads", None) or getattr(text, "num_kv_heads", None) or heads
    )
    if getattr(text, "multi_query", False) and not getattr(text, "new_decoder_architecture", False):
        kv_heads = 1
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return int(text.num_hidden_layers), int(kv_heads), int(head_dim)


def _dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_BYTES:
        raise LayoutError(f"KV dtype {name!r} is not supported; use one of {sorted(DTYPE_BYTES)}")
    return name


def model_identity(model: Any) -> str:
    """``<name or model_type>@<config hash>``, plus ``+w<weights hash>`` when
    the model has no name (random weights: two of them with one config must
    not share keys). Deterministic across processes and machines."""
    text = _text_config(model.config)
    cfg = {k: v for k, v in text.to_dict().items() if k not in _VOLATILE_CONFIG_FIELDS}
    cfg["__compute_dtype__"] = str(model.dtype)
    encoded = json.dumps(cfg, sort_keys=True, separators=(",", ":"), default=str)
    ident = f"@{blake3.blake3(encoded.encode()).hexdigest()[:16]}"
    name = getattr(model.config, "_name_or_path", "") or ""
    if name:
        return name + ident
    hasher = blake3.blake3()
    for pname, tensor in model.state_dict().items():
        hasher.update(pname.encode() + b"\x00")
        hasher.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    return f"{text.model_type}{ident}+w{hasher.hexdigest()[:16]}"


def layout_for(
    model: Any,
    block_tokens: int = 16,
    dtype: torch.dtype | str | None = None,
    tp_rank: int = 0,
    tp_size: int = 1,
    tenant_salt: str = "",
    model_name: str | None = None,
) -> KVLayout:
    """The KVLayout of ``model``'s cache. ``dtype`` defaults to the model's;
    ``num_kv_heads`` is per tensor-parallel rank (replicated when
    ``tp_size`` exceeds the KV heads). ``model_name`` overrides
    ``model_identity`` (e.g. a name plus a revision)."""
    check_supported(model.config)
    layers, kv_heads, head_dim = kv_shape(model.config)
    if tp_size <= kv_heads and kv_heads % tp_size:
        raise LayoutError(f"{kv_heads} KV heads do not split over tp_size={tp_size}")
    dtype = model.dtype if dtype is None else dtype
    return KVLayout(
        model=model_name or model_identity(model),
        num_layers=layers,
        num_kv_heads=max(1, kv_heads // tp_size),
        head_dim=head_dim,
        dtype=dtype if isinstance(dtype, str) else _dtype_name(dtype),
        block_tokens=block_tokens,
        tp_rank=tp_rank,
        tp_size=tp_size,
        tenant_salt=tenant_salt,
    )
