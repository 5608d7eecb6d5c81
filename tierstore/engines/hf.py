"""HuggingFace transformers adapter: store a causal LM's KV cache, resume warm.

Provides:
- ``layout_for(model, ...)``: the KVLayout of a model, from its config.
- ``model_identity(model)``: the model name that scopes its keys.
- ``check_supported(config)``: raise UnsupportedModelError for models whose
  cache cannot be restored exactly from per-layer K/V blocks.
- ``pack_blocks`` / ``unpack_blocks``: cache tensors <-> block bytes.
- ``HFStoreAdapter``: ``save`` after a prefill, ``resume`` (load the longest
  stored prefix, prefill the rest), ``prefill`` (cold), ``generate``
  (greedy), ``end_turn``; it warns (``InexactAttentionWarning``) when the
  model's attention is not eager, as results are then close, not bitwise.

Block byte layout: one block is the K and V of every layer for
``block_tokens`` tokens, as one C-contiguous array of the layout's dtype with
shape ``[layer][k/v][kv_head][token][head_dim]`` (k = 0, v = 1). K is stored
after the rotary embedding, as the model's cache holds it. Packing and
unpacking copy one strided view per layer and K/V over all blocks at once.

Exactness (measured with transformers 5.24 and 5.19, torch 2.13 CPU, MKL on AVX2):
a resume recomputes at least ``min_compute_tokens`` (default 16) tokens
because GEMM kernels are not batch-invariant for very few rows: MKL sgemm
takes another kernel below 12 rows (torch's bmm below 4), so the rows of a
1-11 token suffix differ from the same rows of a full prefill by about one
float32 ulp. With at least 12 rows every row is bitwise that of the full
prefill, so with ``attn_implementation="eager"`` the last logits of a resume
equal a cold prefill's exactly (torch.equal) in float32, float16 and
bfloat16, and so does every K/V row of the cache. The sdpa CPU kernel splits
queries into tiles of 32, 64 or 256 rows (by length): when a cold prefill's
last tile has 1-3 rows, float32 logits of a resume differ from it by about
1e-7 (float16/bfloat16: equal as measured). The rule costs at most one block.
Measured bitwise with eager attention: Llama, Qwen2, GPT-2 (learned absolute
positions), GPT-NeoX (partial rotary), Falcon and GPT-BigCode (multi-query),
Phi, OPT, Gemma, Bloom (ALiBi), GPT-J.

Runs in the engine process, on the thread that runs the model. An adapter
is not thread-safe (neither is the model's cache); the StoreClient is.
"""

from __future__ import annotations

import inspect
import json
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import blake3
import numpy as np
import torch

from tierstore.client import StoreClient
from tierstore.errors import LayoutError, TierstoreError
from tierstore.keys import DTYPE_BYTES, BlockKey, KVLayout, chain_keys
from tierstore.tiers import TierName

# Config fields that do not change the KV a model computes: excluded from the
# identity hash so that a model saved and reloaded keeps its keys.
_VOLATILE_CONFIG_FIELDS = frozenset(
    "_name_or_path _attn_implementation _attn_implementation_internal _commit_hash dtype "
    "transformers_version torch_dtype use_cache output_attentions output_hidden_states "
    "return_dict _attn_implementation_autoset".split()
)
_RECURRENT_MODEL_TYPES = ("mamba", "rwkv", "xlstm", "recurrent_gemma", "jamba", "zamba")
_CACHE_PARAM_NAMES = ("cache", "past_key_values")  # transformers >= 5.x, before


TokenIds = Sequence[int] | torch.Tensor | np.ndarray


def _as_ids(token_ids: TokenIds) -> torch.Tensor:
    """A prompt as a non-empty 1-D int64 CPU tensor."""
    ids = torch.as_tensor(
        token_ids if isinstance(token_ids, torch.Tensor) else np.asarray(token_ids)
    )
    if ids.ndim != 1 or ids.numel() == 0:
        raise ValueError(
            f"token_ids must be a non-empty 1-D sequence, got shape {tuple(ids.shape)}"
        )
    return ids.to(torch.long).cpu()


class UnsupportedModelError(TierstoreError, ValueError):
    """The model's cache cannot be saved and restored exactly as per-layer K/V blocks."""


class InexactAttentionWarning(UserWarning):
    """The model's attention is not ``eager``: a warm resume is close to a cold
    prefill (about 1e-7 in float32 with sdpa), not bitwise equal."""


def _warn_unless_eager(model: Any) -> None:
    attn = getattr(model.config, "_attn_implementation", None) or "eager"
    if attn != "eager":
        warnings.warn(
            f"attn_implementation={attn!r}: a warm resume's logits can differ from a cold "
            "prefill's in the last bits (sdpa: about 1e-7 in float32); load the model with "
            "attn_implementation='eager' for bitwise-equal results",
            InexactAttentionWarning,
            stacklevel=3,
        )


@dataclass(frozen=True, slots=True)
class ResumeResult:
    """A prefill that may have reused stored blocks.

    ``logits`` are those of the last prompt position (float, shape [vocab]);
    ``cache`` holds the KV of the whole prompt; ``tiers[i]`` is where reused
    block ``i`` came from. ``store_s`` is lookup + load, ``restore_s`` the
    copy of loaded blocks into the cache, ``model_s`` the forward pass.
    """

    logits: torch.Tensor
    cache: Any
    num_tokens: int
    num_reused_tokens: int
    tiers: tuple[TierName, ...]
    store_s: float
    restore_s: float
    model_s: float

    @property
    def num_computed_tokens(self) -> int:
        return self.num_tokens - self.num_reused_tokens


@dataclass(frozen=True, slots=True)
class GenerateResult:
    tokens: list[int]  # the generated ids, prompt excluded
    prompt: ResumeResult
    cache: Any  # KV of the prompt and of every generated token but the last


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


def _kv_shape(config: Any) -> tuple[int, int, int]:
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
    layers, kv_heads, head_dim = _kv_shape(model.config)
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


def _out_cache(out: Any) -> Any:
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


def _fill_layer(layer: Any, keys: torch.Tensor, values: torch.Tensor) -> None:
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


class HFStoreAdapter:
    """Save and restore the KV cache of one transformers causal LM (batch 1).

    ``min_compute_tokens``: a resume reuses at most ``len(tokens) -
    min_compute_tokens`` tokens, rounded down to whole blocks (at least one
    token is always computed: its logits are the result). See the module
    docstring for why 16 keeps float32 results bitwise; 1 maximises reuse.
    """

    def __init__(
        self,
        model: Any,
        client: StoreClient,
        layout: KVLayout | None = None,
        *,
        min_compute_tokens: int = 16,
    ) -> None:
        check_supported(model.config)
        _warn_unless_eager(model)
        self.model = model
        self.client = client
        self.layout = layout or layout_for(model)
        if self.layout.tp_size != 1:
            raise LayoutError(
                "HFStoreAdapter runs the whole model in one process: tp_size must be 1"
            )
        if min_compute_tokens < 1:
            raise ValueError(f"min_compute_tokens must be at least 1, got {min_compute_tokens}")
        self.min_compute_tokens = min_compute_tokens
        self._staging: torch.Tensor | None = None
        shape = (self.layout.num_layers, self.layout.num_kv_heads, self.layout.head_dim)
        if shape != _kv_shape(model.config):
            raise LayoutError(
                f"layout (layers, KV heads, head dim) {shape} != the model's "
                f"{_kv_shape(model.config)}"
            )
        self.store_dtype: torch.dtype = getattr(torch, self.layout.dtype)
        self.kv_dtype: torch.dtype = model.dtype
        params = inspect.signature(model.forward).parameters
        self._cache_arg = next((n for n in _CACHE_PARAM_NAMES if n in params), "past_key_values")
        self._logits_to_keep = "logits_to_keep" in params

    # -- keys ------------------------------------------------------------------------

    def keys(self, token_ids: TokenIds) -> list[BlockKey]:
        """Keys of the full blocks of ``token_ids`` under this adapter's layout."""
        return chain_keys(self.layout, _as_ids(token_ids).numpy())

    # -- store ---------------------------------------------------------------------------

    def save(self, token_ids: TokenIds, cache: Any) -> int:
        """Store the prompt's full blocks that the store does not hold yet.

        ``cache`` is the DynamicCache of a prefill of ``token_ids`` (it may
        hold more tokens, e.g. after generation: only the prompt's blocks are
        stored). The held prefix is skipped after one lookup; the rest is
        packed in one pass and stored. Returns the number of blocks stored.
        """
        keys = self.keys(token_ids)
        if not keys:
            return 0
        have = self.client.lookup(self.layout, keys).num_hits
        if have == len(keys):
            return 0
        blocks = pack_blocks(
            self.layout, cache, have * self.layout.block_tokens, len(keys) - have, self.store_dtype
        )
        held = self.client.store(self.layout, keys[have:], blocks)
        return sum(held)

    def end_turn(
        self,
        session: str,
        token_ids: TokenIds,
        *,
        wait: bool = False,
        replica_target: str = "",
        durable: bool = False,
        durable_timeout_s: float = 0.0,
    ) -> Any:
        """Tell the sidecar that ``session``'s turn ended with ``token_ids``
        (stored first with ``save``); long turns are replicated to a peer:
        ``replica_target`` (a router's spill host) or the rendezvous one.
        ``durable``: return once the remote tier's bucket holds every block
        of the turn (see ``StoreClient.end_turn``; the reply's ``durable``)."""
        ids = _as_ids(token_ids)
        return self.client.end_turn(
            session, self.layout, self.keys(ids), int(ids.numel()), wait=wait,
            replica_target=replica_target, durable=durable, durable_timeout_s=durable_timeout_s,
        )  # fmt: skip

    # -- prefill -------------------------------------------------------------------------

    def reusable_blocks(self, num_tokens: int) -> int:
        """Most blocks a resume of ``num_tokens`` tokens may take from the store."""
        return max(0, num_tokens - self.min_compute_tokens) // self.layout.block_tokens

    def resume(
        self, token_ids: TokenIds, include_peers: bool = False, *, deadline_s: float = 0.0
    ) -> ResumeResult:
        """Prefill ``token_ids``, reusing the longest stored prefix of whole
        blocks (local tiers, and peers with ``include_peers``) up to
        ``reusable_blocks``; the model runs on the remaining tokens only."""
        ids = _as_ids(token_ids)
        keys = chain_keys(
            self.layout, ids[: self.reusable_blocks(len(ids)) * self.layout.block_tokens].numpy()
        )
        t0 = time.perf_counter()
        tiers: tuple[TierName, ...] = ()
        blocks = None
        if keys:
            # load answers the longest available prefix itself (lookup + pin + copy).
            out = self._staging_rows(len(keys))
            loaded = self.client.load(
                self.layout, keys, out, include_peers=include_peers, deadline_s=deadline_s
            )
            tiers = loaded.tiers
            blocks = loaded.blocks[: loaded.num_blocks]
        t1 = time.perf_counter()
        cache = self._new_cache()
        if blocks is not None and len(tiers):
            kv = unpack_blocks(self.layout, blocks, self.kv_dtype, self._device())
            for layer, (k, v) in zip(cache.layers, kv, strict=True):
                _fill_layer(layer, k, v)
        return self._forward(ids, cache, len(tiers), tiers, t1 - t0, time.perf_counter() - t1)

    def prefill(self, token_ids: TokenIds) -> ResumeResult:
        """A cold prefill (no store access), with the same logits rule as resume."""
        return self._forward(_as_ids(token_ids), self._new_cache(), 0, (), 0.0, 0.0)

    def _staging_rows(self, num_blocks: int) -> torch.Tensor:
        """One load buffer reused by every resume (it grows to the largest
        prompt's KV): faulting in a fresh one costs as much as the load."""
        size = self.layout.block_bytes
        if self._staging is None or self._staging.shape[0] < num_blocks:
            self._staging = torch.empty(
                (num_blocks, size), dtype=torch.uint8, device=self.client.device
            )
        return self._staging[:num_blocks]

    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _new_cache(self) -> Any:
        from transformers.cache_utils import DynamicCache

        return DynamicCache(config=self.model.config)

    def _forward(
        self,
        ids: torch.Tensor,
        cache: Any,
        num_blocks: int,
        tiers: tuple[TierName, ...],
        store_s: float,
        restore_s: float,
    ) -> ResumeResult:
        reused = num_blocks * self.layout.block_tokens
        rest = ids[reused:].to(self._device())[None]
        # Logits of the last min_compute_tokens rows: keeps the lm_head GEMM
        # out of the small-row kernels (see the module docstring).
        keep = min(rest.shape[1], self.min_compute_tokens)
        t0 = time.perf_counter()
        kwargs = {self._cache_arg: cache}
        if self._logits_to_keep:
            kwargs["logits_to_keep"] = keep
        with torch.no_grad():
            out = self.model(input_ids=rest, use_cache=True, **kwargs)
        model_s = time.perf_counter() - t0
        return ResumeResult(
            logits=out.logits[0, -1],
            cache=_out_cache(out),
            num_tokens=int(ids.numel()),
            num_reused_tokens=reused,
            tiers=tuple(tiers),
            store_s=store_s,
            restore_s=restore_s,
            model_s=model_s,
        )

    # -- generation ------------------------------------------------------------------

    def generate(
        self,
        token_ids: TokenIds,
        max_new_tokens: int,
        resume: bool = True,
        *,
        include_peers: bool = False,
        eos_token_id: int | None = None,
    ) -> GenerateResult:
        """Greedy continuation of ``token_ids``: the prompt through ``resume``
        (or a cold ``prefill``), then one token per forward pass."""
        first = self.resume(token_ids, include_peers) if resume else self.prefill(token_ids)
        cache, logits = first.cache, first.logits
        tokens: list[int] = []
        device = self._device()
        with torch.no_grad():
            while len(tokens) < max_new_tokens:
                nxt = int(torch.argmax(logits))
                tokens.append(nxt)
                if nxt == eos_token_id or len(tokens) == max_new_tokens:
                    break
                step = torch.tensor([[nxt]], device=device)
                out = self.model(input_ids=step, use_cache=True, **{self._cache_arg: cache})
                cache = _out_cache(out)
                logits = out.logits[0, -1]
        return GenerateResult(tokens, first, cache)
