"""The namespace of SGLang's HiCache pages in tierstore, and the backend's settings.

Provides ``StorageSettings`` (tierstore's keys in SGLang's
``--hicache-storage-backend-extra-config``), ``storage_layout`` (the
``KVLayout`` of one rank's pages, from ``HiCacheStorageConfig`` and the host
pool; configurations whose pages cannot be shared by key are refused with
the reason) and ``host_pages`` (``pages.HostPages`` over an MHA host pool).

No SGLang import: the config and the pool are read by attribute, so this is
tested without SGLang.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch

from tierstore.engines.sglang.pages import HostPages, PageLayoutError, PageShape
from tierstore.keys import KVLayout
from tierstore.memory.memcopy import copy_thread_count

# HiCacheStorageConfig.extra_config keys that are SGLang's, not ours.
_SGLANG_KEYS = frozenset(
    {"backend_name", "module_path", "class_name", "interface_v1", "tp_lcm_size"}
)


@dataclass(frozen=True, slots=True)
class StorageSettings:
    """tierstore's keys in ``--hicache-storage-backend-extra-config``."""

    socket_path: str = ""  # the sidecar's Unix socket; "" = tierstore's config default
    include_peers: bool = False  # lookups and gets also ask the group's other sidecars
    load_deadline_s: float = 5.0  # one get's deadline for fetches from a peer or the bucket
    connect_timeout_s: float = 2.0  # a sidecar that does not answer in time: misses
    call_timeout_s: float = 10.0  # any one control call
    reconnect_s: float = 5.0  # after the sidecar failed, try it again this often
    fast_path: bool = True  # lookups and the hot calls over the sidecar's fast path; false: gRPC
    model_name: str = ""  # the model's name in keys ("" = SGLang's model name)
    tenant_salt: str = ""  # a namespace of its own (e.g. per deployment)
    # Threads for one batch's copies between the host pool and the arena (one
    # memory stream per thread; one does not reach the memory bandwidth on every
    # CPU, see memcopy). 0 = the cores this process may run on, at most 4.
    copy_threads: int = 0

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> StorageSettings:
        ours = {k: v for k, v in (extra or {}).items() if k not in _SGLANG_KEYS}
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(ours) - known)
        if unknown:
            raise ValueError(
                f"unknown tierstore settings {unknown} in the HiCache extra config; "
                f"known: {sorted(known)}"
            )
        settings = cls(**ours)
        for name in ("load_deadline_s", "connect_timeout_s", "call_timeout_s", "reconnect_s"):
            value = getattr(settings, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be a number > 0, got {value!r}")
        copy_thread_count(settings.copy_threads)  # raises for a bad value
        for name in ("include_peers", "fast_path"):
            if not isinstance(getattr(settings, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(settings, name)!r}")
        return settings

    def copy_thread_count(self) -> int:
        """``copy_threads``, with 0 resolved against this process's cores."""
        return copy_thread_count(self.copy_threads)


def storage_layout(config: Any, shape: PageShape, settings: StorageSettings) -> KVLayout:
    """The tierstore namespace of one SGLang rank's pages; ``config`` is
    SGLang's ``HiCacheStorageConfig``."""
    refusals = []
    if config.attn_cp_size > 1:
        refusals.append(f"attention context parallelism (attn_cp_size {config.attn_cp_size})")
    if config.dcp_size > 1:
        refusals.append(f"decode context parallelism (dcp_size {config.dcp_size})")
    if config.should_split_heads:
        refusals.append("heads split across a tp_lcm_size")
    if config.is_mla_model != (shape.planes == 1):
        refusals.append(
            "an MLA config over an MHA host pool, or the reverse"
            f" (is_mla_model {config.is_mla_model}, {shape.planes} planes a page)"
        )
    if shape.planes == 1 and shape.head_dim % 2:
        refusals.append(f"an MLA latent of odd width {shape.head_dim}")
    if refusals:
        raise PageLayoutError("tierstore does not store the pages of " + "; ".join(refusals))
    model = settings.model_name or config.model_name or ""
    if not model:
        raise PageLayoutError(
            "no model name: SGLang gave none and the extra config has no model_name; "
            "tierstore needs one to keep models apart"
        )
    if config.pp_size > 1:
        model = f"{model}#pp{config.pp_rank}/{config.pp_size}"
    dtype = str(shape.dtype).removeprefix("torch.")
    if shape.planes == 1:
        # MLA: one latent per token and layer, the same on every rank (SGLang
        # backs it up from one rank per group). A KVLayout block is K and V:
        # here the two halves of the latent, 1 "head" of half its width, so
        # that block_bytes is the page's size.
        layout = KVLayout(
            model=f"sglang:{model}#mla",
            num_layers=shape.layers,
            num_kv_heads=1,
            head_dim=shape.head_dim // 2,
            dtype=dtype,
            block_tokens=shape.page_size,
            tenant_salt=settings.tenant_salt,
        )
    else:
        layout = KVLayout(
            model=f"sglang:{model}",
            num_layers=shape.layers,
            num_kv_heads=shape.heads,
            head_dim=shape.head_dim,
            dtype=dtype,
            block_tokens=shape.page_size,
            tp_rank=config.tp_rank,
            tp_size=config.tp_size,
            tenant_salt=settings.tenant_salt,
        )
    if layout.block_bytes != shape.block_bytes:  # the arena slot must hold the page exactly
        raise PageLayoutError(
            f"{layout} holds {layout.block_bytes} bytes, a page {shape.block_bytes}"
        )
    return layout


def host_pages(host_pool: Any) -> HostPages:
    """``HostPages`` over an SGLang MHA or MLA host pool
    (``MHATokenToKVPoolHost``, ``MLATokenToKVPoolHost``)."""
    kv = getattr(host_pool, "kv_buffer", None)
    if not isinstance(kv, torch.Tensor):
        raise PageLayoutError(
            f"{type(host_pool).__name__} has no kv_buffer tensor: only MHA and MLA host "
            "pools are served"
        )
    if hasattr(host_pool, "kv_cache_dim"):  # MLA: (.., layers, tokens, 1, latent)
        shape = PageShape(
            layers=host_pool.layer_num,
            page_size=host_pool.page_size,
            heads=1,
            head_dim=host_pool.kv_cache_dim,
            dtype=host_pool.dtype,
            planes=1,
        )
        return HostPages(kv, host_pool.layout, shape)
    v_dim = getattr(host_pool, "v_head_dim", host_pool.head_dim)
    if v_dim != host_pool.head_dim:
        raise PageLayoutError(
            f"K and V head dims differ ({host_pool.head_dim} and {v_dim}): not served"
        )
    shape = PageShape(
        layers=host_pool.layer_num,
        page_size=host_pool.page_size,
        heads=host_pool.head_num,
        head_dim=host_pool.head_dim,
        dtype=host_pool.dtype,
    )
    return HostPages(kv, host_pool.layout, shape)
