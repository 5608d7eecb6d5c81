"""The KVLayout of a vLLM engine, and what the vLLM connector refuses.

Provides:
- ``ConnectorSettings``: the connector's ``kv_connector_extra_config``,
  validated (unknown keys raise).
- ``engine_layouts(vllm_config, kv_cache_config, settings)``: one KVLayout
  per tensor-parallel rank; the model identity in it names the model (name,
  revision, a hash of its config and dtype) and vLLM's page format (platform
  and ``kv_cache_config.kv_cache_layout``), so CPU- and GPU-layout blocks,
  or two models, never share a key.
- ``engine_refusal(...)``: why an engine's KV cannot be restored by prefix
  (a KV cache group of another kind than full or sliding-window attention:
  Mamba state, MLA, chunked attention; groups of different pages; pages
  that are not K+V; pipeline parallelism), or None, with the group named.
- ``kv_groups(kv_cache_config)``: every attention layer in the model's
  order and its KV cache group. vLLM's hybrid KV cache manager (the
  connector declares ``SupportsHMA``) puts full-attention and
  sliding-window layers in groups of their own, with block ids of their
  own; without it one group holds every layer. The block is the same
  either way (every layer's KV, in the model's layer order), so engines
  with and without the hybrid manager share blocks.
- ``request_refusal(request)``: why one request's KV cannot (multimodal
  inputs, LoRA, prompt embeddings), or None.
- ``request_salt(settings, request)``: the tenant salt of a request's keys
  (vLLM's per-request ``cache_salt`` isolates tenants: so do our keys);
  ``salted`` the same from the two salts.

A block is the K and V of every layer for ``block_size`` tokens: layer after
layer, each layer's part being vLLM's own page of that block, byte for byte
(on the CPU backend ``[kv_heads][block_size][2*head_size]``: per head the
block's K rows, then its V rows). Pure functions; any process, any thread.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace
from typing import Any

import blake3

from tierstore.keys import DTYPE_BYTES, KVLayout
from tierstore.memory.memcopy import copy_thread_count

# Config fields that do not change the KV a model computes.
_VOLATILE_CONFIG_FIELDS = frozenset(
    "_name_or_path _attn_implementation _attn_implementation_internal _commit_hash "
    "transformers_version use_cache output_attentions output_hidden_states return_dict "
    "_attn_implementation_autoset architectures".split()
)


@dataclass(frozen=True, slots=True)
class ConnectorSettings:
    """``kv_connector_extra_config`` of the TierstoreConnector."""

    socket_path: str = ""  # the sidecar's Unix socket; "" = tierstore's config default
    include_peers: bool = False  # lookups and loads also ask the group's other sidecars
    load_deadline_s: float = 5.0  # one load's deadline for fetches from a peer
    # Prefixes not all in DRAM (NVMe, a peer, the bucket) load in the background
    # (vLLM's async loads): the request waits, the others keep running.
    async_loads: bool = True
    async_load_timeout_s: float = 30.0  # a background load not done by then: recompute
    # A lookup that asks peers or the bucket and has not answered within this
    # is asked again at vLLM's next step (the scheduler does not wait for it).
    lookup_budget_s: float = 0.005
    stats_path: str = ""  # the scheduler's counters, as JSON, rewritten when they change
    connect_timeout_s: float = 2.0  # a sidecar that does not answer in time: run cold
    call_timeout_s: float = 10.0  # any one control call
    reconnect_s: float = 5.0  # after the sidecar failed, try it again this often
    fast_path: bool = True  # lookups and the hot calls over the sidecar's fast path; false: gRPC
    end_turn: bool = True  # tell the sidecar when a request ends (replica push)
    model_name: str = ""  # the model's name in keys ("" = vLLM's model name or path)
    tenant_salt: str = ""  # a namespace of its own (e.g. per deployment)
    # vLLM's BlockRemoved (KV events on): the sidecar's peer address (host:port)
    # whose WatchBlocks stream says when a stored block leaves tierstore, and
    # the group token's file ("" = no BlockRemoved). Plaintext peer port only.
    removed_events_peer: str = ""
    removed_events_token_file: str = ""
    # Blocks remembered for BlockRemoved (LRU; ~200 bytes each per rank): one
    # pushed out gets no BlockRemoved when it leaves.
    removed_events_max_blocks: int = 100_000
    removed_events_stream_s: float = 30.0  # one WatchBlocks stream's deadline, then reopened
    # Threads for one layer's copies between vLLM's pages and the arena on the
    # CPU (vLLM-CPU; a GPU's copies are DMA). 0 = the cores the copying thread
    # may run on, at most 4 (memcopy.copy_thread_count; measured in docs/benchmarks.md).
    copy_threads: int = 0
    # A background load longer than this asks the sidecar to prefetch the whole
    # prefix and pins and copies it this much at a time, each copy overlapping
    # the arrival of the rest; 0 = pin the whole prefix, then copy it.
    load_piece_bytes: int = 256 << 20

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> ConnectorSettings:
        extra = dict(extra or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(
                f"unknown TierstoreConnector settings {unknown}; known: {sorted(known)}"
            )
        settings = cls(**extra)
        for name in (
            "load_deadline_s",
            "async_load_timeout_s",
            "lookup_budget_s",
            "connect_timeout_s",
            "call_timeout_s",
            "reconnect_s",
            "removed_events_stream_s",
            "removed_events_max_blocks",
        ):
            if not getattr(settings, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(settings, name)!r}")
        copy_thread_count(settings.copy_threads)  # raises for a bad value
        piece = settings.load_piece_bytes
        if isinstance(piece, bool) or not isinstance(piece, int) or piece < 0:
            raise ValueError(
                f"load_piece_bytes must be >= 0 (0: the whole prefix at once), "
                f"got {settings.load_piece_bytes!r}"
            )
        if settings.removed_events_peer and not settings.removed_events_token_file:
            raise ValueError("removed_events_peer needs removed_events_token_file")
        for name in ("include_peers", "async_loads", "end_turn", "fast_path"):
            if not isinstance(getattr(settings, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(settings, name)!r}")
        return settings


def _config_hash(hf_config: Any, dtype: str) -> str:
    raw = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(vars(hf_config))
    cfg = {k: v for k, v in raw.items() if k not in _VOLATILE_CONFIG_FIELDS}
    cfg["__compute_dtype__"] = dtype
    encoded = json.dumps(cfg, sort_keys=True, separators=(",", ":"), default=str)
    return blake3.blake3(encoded.encode()).hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class KVGroups:
    """See ``kv_groups``."""

    layer_names: tuple[str, ...]  # the model's order: a block's layers, in order
    group_of: tuple[int, ...]  # each layer's KV cache group
    windowed: bool  # some group frees its blocks before a sliding window

    @property
    def num_groups(self) -> int:
        return max(self.group_of) + 1


def kv_groups(kv_cache_config: Any) -> KVGroups:
    """The attention layers of vLLM's KV cache groups, in the model's layer
    order (vLLM's own ``extract_layer_index``, which orders its KV caches)."""
    from vllm.model_executor.models.utils import extract_layer_index
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    pairs = [
        (name, g)
        for g, group in enumerate(kv_cache_config.kv_cache_groups)
        for name in group.layer_names
    ]
    pairs.sort(key=lambda p: extract_layer_index(p[0]))
    windowed = any(
        isinstance(group.kv_cache_spec, SlidingWindowSpec)
        for group in kv_cache_config.kv_cache_groups
    )
    return KVGroups(tuple(n for n, _ in pairs), tuple(g for _, g in pairs), windowed)


def _group_refusal(spec: Any) -> str | None:
    """Why one group's layers cannot be restored from stored blocks."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec

    if isinstance(spec, MLAAttentionSpec) or "MLA" in type(spec).__name__:
        return "MLA (pages hold one latent per token, not K and V)"
    # Exactly these kinds: their subclasses (sinks, ring windows) keep other pages.
    if type(spec) not in (FullAttentionSpec, SlidingWindowSpec):
        return f"layers of kind {type(spec).__name__}, not full or sliding-window attention"
    # A sliding window inside a full-attention group is vLLM without its hybrid
    # KV cache manager: every layer keeps every token's KV, the window only
    # masks the attention, so a stored prefix restores exactly.
    if getattr(spec, "attention_chunk_size", None):
        return "chunked attention"
    if _dtype_name(spec.dtype) not in DTYPE_BYTES:
        return f"KV cache dtype {spec.dtype}"
    if getattr(spec, "head_size_v", spec.head_size) != spec.head_size:
        return "K and V of different head sizes"
    return None


def _page_shape(spec: Any) -> tuple[Any, ...]:
    return (spec.block_size, spec.num_kv_heads, spec.head_size, _dtype_name(spec.dtype),
            spec.page_size_bytes)  # fmt: skip


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def engine_refusal(vllm_config: Any, kv_cache_config: Any) -> str | None:
    """Why this engine's KV cannot be restored from stored prefix blocks
    (a hybrid model's group that cannot is named: the engine then runs
    without the store, since a request needs every group's KV)."""
    groups = kv_cache_config.kv_cache_groups
    for g, group in enumerate(groups):
        reason = _group_refusal(group.kv_cache_spec)
        if reason is not None:
            return reason if len(groups) == 1 else f"KV cache group {g} of {len(groups)}: {reason}"
    shapes = {_page_shape(group.kv_cache_spec) for group in groups}
    if len(shapes) > 1:
        return (
            "KV cache groups of different pages "
            f"(block, heads, head size, dtype, bytes: {sorted(shapes)})"
        )
    if vllm_config.parallel_config.pipeline_parallel_size != 1:
        return "pipeline parallelism (each rank holds some layers)"
    spec = groups[0].kv_cache_spec
    layout = engine_layouts(vllm_config, kv_cache_config, ConnectorSettings())[0]
    page_bytes = int(spec.page_size_bytes)
    if layout.block_bytes != layout.num_layers * page_bytes:
        return (
            f"pages of {page_bytes} bytes per layer are not K+V of {spec.num_kv_heads} heads "
            f"x {spec.head_size} x {spec.block_size} tokens (MLA or padded pages)"
        )
    return None


def engine_layouts(
    vllm_config: Any, kv_cache_config: Any, settings: ConnectorSettings
) -> tuple[KVLayout, ...]:
    """One KVLayout per tensor-parallel rank (index = rank)."""
    from vllm.platforms import current_platform

    spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
    model_config = vllm_config.model_config
    dtype = _dtype_name(spec.dtype)
    name = settings.model_name or str(model_config.model)
    revision = model_config.revision or ""
    cfg = _config_hash(model_config.hf_text_config, _dtype_name(model_config.dtype))
    page = f"{current_platform.device_type}-{kv_cache_config.kv_cache_layout}"
    model = f"vllm:{name}@{revision}#{cfg}/{page}"
    tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
    base = KVLayout(
        model=model,
        num_layers=len(kv_groups(kv_cache_config).layer_names),
        num_kv_heads=int(spec.num_kv_heads),
        head_dim=int(spec.head_size),
        dtype=dtype,
        block_tokens=int(spec.block_size),
        tp_rank=0,
        tp_size=tp_size,
        tenant_salt=settings.tenant_salt,
    )
    return tuple(replace(base, tp_rank=r) for r in range(tp_size))


def request_refusal(request: Any) -> str | None:
    """Why this request's KV cannot be restored by its token ids alone."""
    if request.prompt_token_ids is None:
        return "prompt_embeds"
    if request.mm_features:
        return "multimodal"  # images change KV without changing token ids
    if request.lora_request is not None:
        return "lora"
    return None


def request_salt(settings: ConnectorSettings, request: Any) -> str:
    """The tenant salt of this request's keys: the deployment's salt and
    vLLM's per-request ``cache_salt`` (tenant isolation)."""
    return salted(settings.tenant_salt, getattr(request, "cache_salt", None) or "")


def salted(tenant_salt: str, cache_salt: str) -> str:
    """The tenant salt of keys under a deployment's ``tenant_salt`` for a
    request with vLLM's ``cache_salt`` (the gateway derives the same)."""
    if not cache_salt:
        return tenant_salt
    return f"{tenant_salt}\x00cache_salt={cache_salt}"
