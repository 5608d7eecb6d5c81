"""A transformers DynamicCache as block bytes, and back.

Provides ``pack_blocks`` (tokens of a cache as (num_blocks, block_bytes)
uint8 rows in the layout's dtype), ``unpack_blocks`` (rows as per-layer K/V
tensors), ``fill_layer`` (make an empty cache layer hold K/V without a
copy) and ``out_cache`` (the cache a forward pass returned).

Block byte layout: one block is the K and V of every layer for
``block_tokens`` tokens, as one C-contiguous array of the layout's dtype with
shape ``[layer][k/v][kv_head][token][head_dim]`` (k = 0, v = 1). K is stored
after the rotary embedding, as the model's cache holds it. Packing and
unpacking copy one strided view per layer and K/V over all blocks at once.

Runs in the engine process, on the thread that runs the model (the cache is
not thread-safe).
"""

from __future__ import annotations

from typing import Any

import torch

from tierstore.engines.hf.model import UnsupportedModelError
from tierstore.errors import LayoutError
from tierstore.keys import KVLayout


def out_cache(out: Any) -> Any:
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


def fill_layer(layer: Any, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Make an empty DynamicLayer hold ``keys``/``values`` without the copy
    that ``update`` (torch.cat onto an empty tensor) would make; the model's
    next ``update`` concatenates onto them, so views are fine."""
    from transformers.cache_utils import DynamicLayer

    if type(layer) is DynamicLayer and not layer.is_initialized:
        layer.lazy_initialization(keys, values)
        layer.keys, layer.values = keys, values
    else:
        layer.update(keys, values)


def _layer_kv(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The (K, V) of each layer of a standard DynamicCache, or raise."""
    from transformers.cache_utils import DynamicCache, DynamicLayer

    if not isinstance(cache, DynamicCache) or getattr(cache, "offloading", False):
        raise UnsupportedModelError(
            f"cache of type {type(cache).__name__} is not supported: pass the DynamicCache "
            "(without offloading) that the model filled"
        )
    layers: list[Any] = list(cache.layers)
    for i, layer in enumerate(layers):
        if type(layer) is not DynamicLayer:
            raise UnsupportedModelError(
                f"cache layer {i} is a {type(layer).__name__}; only full-attention "
                "DynamicLayer caches can be stored"
            )
    return [(layer.keys, layer.values) for layer in layers]


def pack_blocks(
    layout: KVLayout, cache: Any, first_token: int, num_blocks: int, dtype: torch.dtype
) -> torch.Tensor:
    """Blocks of tokens ``[first_token, first_token + num_blocks * block_tokens)``
    of ``cache`` as a (num_blocks, block_bytes) uint8 tensor on the cache's
    device, converted to ``dtype`` (the layout's). Batch row 0 only."""
    kv = _layer_kv(cache)
    bt, heads, dim = layout.block_tokens, layout.num_kv_heads, layout.head_dim
    end = first_token + num_blocks * bt
    if len(kv) != layout.num_layers:
        raise LayoutError(f"cache has {len(kv)} layers; the layout has {layout.num_layers}")
    k0 = kv[0][0]
    if k0.shape[1] != heads or k0.shape[3] != dim or k0.shape[2] < end:
        raise LayoutError(
            f"cache layer shape {tuple(k0.shape)} does not hold {heads} heads x {end} tokens "
            f"x {dim} dims"
        )
    out = torch.empty(
        (num_blocks, layout.num_layers, 2, heads, bt, dim), dtype=dtype, device=k0.device
    )
    for layer, pair in enumerate(kv):
        for j, t in enumerate(pair):
            # [heads, tokens, dim] -> [blocks, heads, block_tokens, dim]: one strided copy.
            out[:, layer, j].copy_(
                t[0, :, first_token:end].unflatten(1, (num_blocks, bt)).transpose(0, 1)
            )
    return out.view(num_blocks, -1).view(torch.uint8)


def unpack_blocks(
    layout: KVLayout, blocks: torch.Tensor, dtype: torch.dtype, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer (K, V) of shape [1, heads, num_blocks * block_tokens, dim]
    from (num_blocks, block_bytes) uint8 ``blocks``, as ``dtype`` on ``device``:
    one strided copy for all layers and blocks; the results are views of it."""
    nb, bt, layers = blocks.shape[0], layout.block_tokens, layout.num_layers
    heads, dim = layout.num_kv_heads, layout.head_dim
    x = blocks.to(device).view(getattr(torch, layout.dtype)).view(nb, layers, 2, heads, bt, dim)
    kv = torch.empty((layers, 2, 1, heads, nb, bt, dim), dtype=dtype, device=device)
    kv.copy_(x.permute(1, 2, 3, 0, 4, 5).unsqueeze(2))
    kv = kv.view(layers, 2, 1, heads, nb * bt, dim)
    return [(kv[layer, 0], kv[layer, 1]) for layer in range(layers)]
