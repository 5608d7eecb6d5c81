"""tierstore as SGLang's HiCache L3 storage: ``TierstoreStorage(HiCacheStorage)``.

SGLang loads it with no change to SGLang::

    python -m sglang.launch_server --model-path MODEL --page-size 64 \\
        --enable-hierarchical-cache --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "tierstore",
            "module_path": "tierstore.engines.sglang", "class_name": "TierstoreStorage",
            "interface_v1": 1, "socket_path": "/run/tierstore/tierstore.sock"}'

SGLang's factory builds ``TierstoreStorage(storage_config, kwargs)`` and
then calls ``register_mem_pool_host(host_pool)``; from then on its
``HiCacheController`` calls it from three threads (the backup thread, the
prefetch hit query, the prefetch transfer), each with a sidecar link of its
own (``StoreLink``: a sidecar that is gone gives misses within
``connect_timeout_s`` and is tried again every ``reconnect_s``).

- ``batch_exists(keys)``: one sidecar lookup for the batch (at most 128
  pages), the length of the leading run held (DRAM, NVMe, and with
  ``include_peers`` the group's other sidecars and the bucket).
- ``batch_set_v1`` / ``batch_get_v1(keys, host_indices)`` (``interface_v1``):
  reserve (or pin) the batch's blocks in the sidecar's arena and copy the
  pages between the host pool and the arena directly, the whole batch in one
  GIL-free call (``pages.HostPages``) on ``copy_threads`` threads (default:
  the process's cores, at most 4).
  A get pins the longest prefix held (promoting from NVMe, fetching from a
  peer or the bucket within ``load_deadline_s``), verified by the sidecar on
  the way in, and reports the rest as misses: SGLang recomputes them.
- ``batch_set`` / ``batch_get`` and ``set`` / ``get`` / ``exists``: SGLang's
  generic path, with flat page tensors; the same blocks as the v1 path.
- ``get_stats``: SGLang's ``StorageMetrics`` (pages and GB/s per batch);
  ``stats`` the counters since start.

Namespace: a ``KVLayout`` from ``HiCacheStorageConfig`` and the host pool
(model, layers, KV heads, head_dim, dtype, page size, tensor-parallel rank
and size; pipeline stage in the model name). SGLang's page key (a sha256
chain over the page's tokens) maps to ``blake3(layout fingerprint || key)``:
deterministic on every host, and never shared across models or ranks.
Blocks are stored in one byte order for every host layout (``pages``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig

from tierstore.client import ReserveStatus, StoreClient
from tierstore.engines.link import StoreLink
from tierstore.engines.sglang.keys import block_keys
from tierstore.engines.sglang.layout import StorageSettings, host_pages, storage_layout
from tierstore.engines.sglang.pages import HostPages
from tierstore.errors import TierstoreError
from tierstore.keys import KVLayout

log = logging.getLogger("tierstore.engines.sglang")


@dataclass
class StorageStats:
    """What this backend did since it started (``TierstoreStorage.stats``)."""

    queried_pages: int = 0
    hit_pages: int = 0
    stored_pages: int = 0  # written into the arena and committed
    existing_pages: int = 0  # asked to store, already held
    refused_pages: int = 0  # the sidecar had no room
    loaded_pages: int = 0
    missed_pages: int = 0  # asked to load, not there (recomputed by SGLang)
    errors: int = 0  # calls that failed (sidecar gone): answered as misses
    stored_bytes: int = 0
    loaded_bytes: int = 0
    lookup_s: float = 0.0  # wall time in batch_exists, summed over the calling threads
    store_s: float = 0.0  # in the sets (reserve, copies, commit)
    load_s: float = 0.0  # in the gets (pin, copies, release)
    store_copy_s: float = 0.0  # of store_s, in the copies into the arena
    load_copy_s: float = 0.0  # of load_s, in the copies out of it
    hit_tiers: dict[str, int] = field(default_factory=dict)  # by the tier that held them


class TierstoreStorage(HiCacheStorage):
    """See the module docstring."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Any = None) -> None:
        self.config = storage_config
        self.settings = StorageSettings.from_extra(storage_config.extra_config)
        self.copy_threads = self.settings.copy_thread_count()
        self.layout: KVLayout | None = None
        self.pages: HostPages | None = None
        self.stats = StorageStats()
        self._lock = threading.Lock()  # stats and the metrics lists
        self._local = threading.local()  # one link per calling thread
        self._links: list[StoreLink] = []
        self._metrics: dict[str, list[float]] = {
            "prefetch_pgs": [], "backup_pgs": [], "prefetch_bandwidth": [], "backup_bandwidth": []
        }  # fmt: skip
        self._closed = False

    # -- setup ----------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        pages = host_pages(mem_pool_host)
        self.layout = storage_layout(self.config, pages.shape, self.settings)
        self.pages = pages
        log.info(
            "tierstore HiCache storage: %s, %s pages of %d tokens (%d KiB a block)",
            self.layout.model,
            pages.layout,
            pages.shape.page_size,
            pages.shape.block_bytes // 1024,
        )

    def _client(self) -> StoreClient | None:
        if self._closed:
            return None
        link = getattr(self._local, "link", None)
        if link is None:
            name = f"sglang-tp{self.config.tp_rank}-{threading.current_thread().name}"
            link = self._local.link = StoreLink(self.settings, name)
            with self._lock:
                self._links.append(link)
        return link.client()

    def _ready(self) -> tuple[KVLayout, HostPages]:
        if self.layout is None or self.pages is None:
            raise RuntimeError("TierstoreStorage: register_mem_pool_host was not called")
        return self.layout, self.pages

    def _failed(self, err: BaseException) -> None:
        with self._lock:
            self.stats.errors += 1
        self._local.link.failed(err)

    # -- lookups --------------------------------------------------------------------

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        layout, _ = self._ready()
        t0 = time.perf_counter()
        client = self._client()
        found = 0
        tiers: tuple[Any, ...] = ()
        if client is not None and keys:
            try:
                hit = client.lookup(
                    layout, block_keys(layout, keys), include_peers=self.settings.include_peers
                )
                found, tiers = hit.num_hits, hit.tiers
            except (TierstoreError, OSError) as e:
                self._failed(e)
        with self._lock:
            self.stats.queried_pages += len(keys)
            self.stats.hit_pages += found
            self.stats.lookup_s += time.perf_counter() - t0
            for tier in tiers:
                name = str(getattr(tier, "value", tier))
                self.stats.hit_tiers[name] = self.stats.hit_tiers.get(name, 0) + 1
        return found

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # -- the v1 path: host pool <-> arena -------------------------------------------

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        layout, pages = self._ready()
        starts = page_starts(host_indices, len(keys), pages.shape.page_size)
        threads = self.copy_threads

        def copy(client: StoreClient, slots: list[int], pages_at: list[int]) -> None:
            pages.store_runs(client.arena.buf, slots, [starts[i] for i in pages_at], threads)

        return self._store(layout, keys, copy)

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        layout, pages = self._ready()
        starts = page_starts(host_indices, len(keys), pages.shape.page_size)
        threads = self.copy_threads

        def copy(client: StoreClient, slots: list[int], pages_at: list[int]) -> None:
            pages.load_runs(client.arena.buf, slots, [starts[i] for i in pages_at], threads)

        return self._load(layout, keys, copy)

    # -- SGLang's generic path: flat page tensors -----------------------------------

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        layout, pages = self._ready()
        if values is None or len(values) != len(keys):
            raise ValueError(f"batch_set: {len(keys)} keys need as many pages")
        return all(
            self._store(
                layout, keys, _copy_views([pages.flat_view(v) for v in values], pages, True)
            )
        )

    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool:
        return self.batch_set([key], [value])

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        layout, pages = self._ready()
        if target_locations is None or len(target_locations) != len(keys):
            raise ValueError(f"batch_get: {len(keys)} keys need as many target pages")
        views = [pages.flat_view(t) for t in target_locations]
        got = self._load(layout, keys, _copy_views(views, pages, False))
        return [t if ok else None for t, ok in zip(target_locations, got)]

    def get(
        self, key: str, target_location: Any = None, target_sizes: Any = None
    ) -> torch.Tensor | None:
        if target_location is None:
            _, pages = self._ready()
            n = pages.shape.block_bytes // pages.shape.dtype.itemsize
            target_location = torch.empty(n, dtype=pages.shape.dtype)
        return self.batch_get([key], [target_location])[0]

    # -- the copies -----------------------------------------------------------------

    def _store(self, layout: KVLayout, keys: list[str], copy: PageCopy) -> list[bool]:
        """Store the batch's pages under ``keys``: reserve, ``copy`` the
        pages into the reserved slots, commit."""
        done = [False] * len(keys)
        t0 = time.perf_counter()
        client = self._client()
        if client is None or not keys:
            return done
        bkeys = block_keys(layout, keys)
        stored = existing = refused = 0
        copy_s = 0.0
        try:
            for lo in range(0, len(keys), client.max_batch_keys):
                hi = min(len(keys), lo + client.max_batch_keys)
                reserved = client.reserve(layout, bkeys[lo:hi])
                fill = [lo + i for i, st in enumerate(reserved.statuses) if st == ReserveStatus.OK]
                for i in fill:  # this process's page tables of a fresh unit, once
                    client.arena.ensure_ready(reserved.offsets[i - lo], layout.block_bytes)
                for i, status in enumerate(reserved.statuses):
                    if status == ReserveStatus.EXISTS:
                        done[lo + i] = True
                        existing += 1
                    elif status != ReserveStatus.OK:
                        refused += 1
                try:
                    c0 = time.perf_counter()
                    copy(client, [reserved.offsets[i - lo] for i in fill], fill)
                    copy_s += time.perf_counter() - c0
                except BaseException:  # no half-written block is ever committed
                    client.abort(layout, [bkeys[i] for i in fill])
                    raise
                if fill:
                    committed = client.commit(layout, [bkeys[i] for i in fill])
                    for i, ok in zip(fill, committed):
                        done[i] = ok
                        stored += ok
        except (TierstoreError, OSError) as e:
            self._failed(e)
        dt = time.perf_counter() - t0
        with self._lock:
            self.stats.stored_pages += stored
            self.stats.existing_pages += existing
            self.stats.refused_pages += refused
            self.stats.stored_bytes += stored * layout.block_bytes
            self.stats.store_s += dt
            self.stats.store_copy_s += copy_s
            if self.config.enable_storage_metrics and stored:
                self._metrics["backup_pgs"].append(stored)
                self._metrics["backup_bandwidth"].append(stored * layout.block_bytes / dt / 1e9)
        return done

    def _load(self, layout: KVLayout, keys: list[str], copy: PageCopy) -> list[bool]:
        """Bring the longest prefix of ``keys`` held into the batch's pages:
        pin, ``copy`` out of the pinned slots, release."""
        t0 = time.perf_counter()
        client = self._client()
        loaded = 0
        copy_s = 0.0
        if client is not None and keys:
            bkeys = block_keys(layout, keys)
            try:
                while loaded < len(keys):
                    run = bkeys[loaded : loaded + client.max_batch_keys]
                    with client.acquire(
                        layout,
                        run,
                        include_peers=self.settings.include_peers,
                        deadline_s=self.settings.load_deadline_s,
                    ) as pinned:
                        got = len(pinned.offsets)
                        c0 = time.perf_counter()
                        copy(client, list(pinned.offsets), list(range(loaded, loaded + got)))
                        copy_s += time.perf_counter() - c0
                    loaded += got
                    if got < len(run):
                        break
            except (TierstoreError, OSError) as e:
                self._failed(e)
        dt = time.perf_counter() - t0
        with self._lock:
            self.stats.loaded_pages += loaded
            self.stats.missed_pages += len(keys) - loaded
            self.stats.loaded_bytes += loaded * layout.block_bytes
            self.stats.load_s += dt
            self.stats.load_copy_s += copy_s
            if self.config.enable_storage_metrics and loaded:
                self._metrics["prefetch_pgs"].append(loaded)
                self._metrics["prefetch_bandwidth"].append(loaded * layout.block_bytes / dt / 1e9)
        return [i < loaded for i in range(len(keys))]

    # -- housekeeping ---------------------------------------------------------------

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` since the last call (then cleared)."""
        from sglang.srt.observability.metrics_collector import StorageMetrics

        with self._lock:
            drained = {k: list(v) for k, v in self._metrics.items()}
            for v in self._metrics.values():
                v.clear()
        return StorageMetrics(**drained)

    def clear(self) -> None:
        """SGLang's ``/clear_hicache_storage`` asks the L3 to drop everything.
        tierstore's blocks are shared with the host's other engines and with
        other hosts, so nothing is deleted here (they age out by the sidecar's
        eviction); the warning says so, once per call."""
        log.warning(
            "tierstore HiCache storage: clear() deletes nothing: the store is shared "
            "with other engines and hosts, and its blocks age out by eviction"
        )

    def wait_arena_tables(self, timeout_s: float) -> bool:
        """Wait, at most ``timeout_s`` in all, until every sidecar client of
        this backend has built its page tables of the arena (see
        ``StoreClient.wait_arena_tables``; for benchmarks)."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            links = list(self._links)
        clients = [link.current for link in links if link.current is not None]
        return all(c.wait_arena_tables(max(0.0, deadline - time.monotonic())) for c in clients)

    def close(self) -> None:
        self._closed = True
        with self._lock:
            links, self._links = self._links, []
        for link in links:
            link.close()


PageCopy = Callable[[StoreClient, list[int], list[int]], None]
"""Copies pages ``pages_at`` of a batch into (a store) or out of (a load)
the arena slots at byte offsets ``slots``, through ``client``'s arena."""


def _copy_views(views: list[torch.Tensor], pages: HostPages, into_arena: bool) -> PageCopy:
    """The generic path's copy: one page tensor (in the block order) each."""

    def copy(client: StoreClient, slots: list[int], pages_at: list[int]) -> None:
        arena, n = client.arena_tensor, pages.shape.block_bytes
        for slot, i in zip(slots, pages_at):
            block = pages.as_block(arena[slot : slot + n])
            if into_arena:
                block.copy_(views[i])
            else:
                views[i].copy_(block)

    return copy


def page_starts(host_indices: torch.Tensor, num_keys: int, page_size: int) -> list[int]:
    if host_indices.numel() != num_keys * page_size:
        raise ValueError(
            f"{num_keys} pages of {page_size} tokens need {num_keys * page_size} host "
            f"indices, got {host_indices.numel()}"
        )
    return host_indices[::page_size].tolist()
