"""A HiCache backend with no store behind it, for the SGLang bench's limit.

``CopyStorage`` makes the v1 path's copies as ``TierstoreStorage`` makes
them (``HostPages`` runs on the backend's ``copy_threads``), between the
host pool and a plain buffer of this process, one block a key in a ring of
``capacity_pages`` blocks (the oldest key's block is reused), shared by
every rank of the process with the same block shape, as a host's ranks
share its sidecar. No lookup, no
sidecar call, no hashing: through SGLang's controller it is the most a
backend that copies the bytes can do there, the limit
``bench/engines/sglang_hicache.py`` sets tierstore's end-to-end figures
against (its ``copy`` runs, through ``driver``). The v1 path only; run in
SGLang's environment.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

from tierstore.engines.sglang.layout import StorageSettings, host_pages
from tierstore.engines.sglang.storage import page_starts


class Ring:
    """The blocks every ``CopyStorage`` of one shape in this process shares
    (as the ranks of a host share its sidecar): ``capacity`` blocks of
    ``block_bytes``, the oldest key's block reused for a new key."""

    def __init__(self, capacity: int, block_bytes: int) -> None:
        self.capacity, self.block_bytes = capacity, block_bytes
        # Written once, as a store's memory is before it serves.
        self.buf = torch.ones(capacity * block_bytes, dtype=torch.uint8).numpy()
        self._slot: dict[str, int] = {}  # key -> its block
        self._key_at: list[str | None] = [None] * capacity
        self._next = 0
        self._lock = threading.Lock()

    def place(self, keys: list[str]) -> list[int]:
        """Byte offsets of new blocks for ``keys``."""
        with self._lock:
            out = []
            for key in keys:
                slot = self._next
                self._next = (slot + 1) % self.capacity
                old = self._key_at[slot]
                if old is not None:
                    del self._slot[old]
                self._key_at[slot], self._slot[key] = key, slot
                out.append(slot * self.block_bytes)
            return out

    def offsets(self, keys: list[str]) -> list[int]:
        """Byte offsets of the leading run of ``keys`` held."""
        with self._lock:
            out = []
            for key in keys:
                slot = self._slot.get(key)
                if slot is None:
                    break
                out.append(slot * self.block_bytes)
            return out


_RINGS: dict[tuple[int, int], Ring] = {}  # (capacity, block_bytes) -> its ring
_RINGS_LOCK = threading.Lock()


class CopyStorage(HiCacheStorage):
    """See the module docstring. ``capacity_pages`` (and ``copy_threads``)
    from the extra config, which must ask for ``interface_v1``."""

    def __init__(self, storage_config: Any, kwargs: Any = None) -> None:
        self.config = storage_config
        extra = dict(storage_config.extra_config or {})
        if not extra.get("interface_v1"):
            raise ValueError("CopyStorage serves SGLang's v1 path only: set interface_v1 to 1")
        self.capacity = int(extra["capacity_pages"])
        ours = {k: v for k, v in extra.items() if k == "copy_threads"}
        self.copy_threads = StorageSettings.from_extra(ours).copy_thread_count()
        self.pages: Any = None
        self.ring: Ring | None = None

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self.pages = host_pages(mem_pool_host)
        shape = (self.capacity, self.pages.shape.block_bytes)
        with _RINGS_LOCK:
            if shape not in _RINGS:
                _RINGS[shape] = Ring(*shape)
            self.ring = _RINGS[shape]

    def _ready(self) -> Ring:
        if self.ring is None:
            raise RuntimeError("CopyStorage: register_mem_pool_host was not called")
        return self.ring

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        return len(self._ready().offsets(keys))

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        ring = self._ready()
        starts = page_starts(host_indices, len(keys), self.pages.shape.page_size)
        self.pages.store_runs(ring.buf, ring.place(keys), starts, self.copy_threads)
        return [True] * len(keys)

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        ring = self._ready()
        at = ring.offsets(keys)
        starts = page_starts(host_indices, len(keys), self.pages.shape.page_size)
        self.pages.load_runs(ring.buf, at, starts[: len(at)], self.copy_threads)
        return [True] * len(at) + [False] * (len(keys) - len(at))

    def _generic_path(self, *args: Any, **kwargs: Any) -> Any:
        # Refused at construction without interface_v1, so SGLang never calls these.
        raise RuntimeError("CopyStorage serves SGLang's v1 path only (interface_v1)")

    get = set = batch_get = batch_set = _generic_path
