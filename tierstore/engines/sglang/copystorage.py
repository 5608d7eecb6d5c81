"""A HiCache backend with no store behind it, for the SGLang bench's limit.

``CopyStorage`` makes the v1 path's copies as ``TierstoreStorage`` makes
them (``HostPages`` runs on the backend's ``copy_threads``), between the
host pool and a plain buffer of this process, one block a key in a ring of
``capacity_pages`` blocks (the oldest key's block is reused), shared by
every rank of the process, as a host's ranks share its sidecar. No lookup, no
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


class Ring:
    """The blocks of every ``CopyStorage`` of one name in this process (a
    sidecar's part, shared by the ranks of a host): ``capacity`` blocks of
    ``block_bytes``, the oldest key's block reused for a new key."""

    def __init__(self, capacity: int, block_bytes: int) -> None:
        self.capacity, self.block_bytes = capacity, block_bytes
        # Written once, as a store's memory is before it serves.
        self.buf = torch.ones(capacity * block_bytes, dtype=torch.uint8).numpy()
        self._slot: dict[str, int] = {}  # key -> its block
        self._key_at: list[str | None] = [None] * capacity
        self._next = 0
        self._lock = threading.Lock()

    def held(self, keys: list[str]) -> int:
        """The length of the leading run of ``keys`` held."""
        with self._lock:
            n = 0
            while n < len(keys) and keys[n] in self._slot:
                n += 1
            return n

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


_RINGS: dict[str, Ring] = {}
_RINGS_LOCK = threading.Lock()


class CopyStorage(HiCacheStorage):
    """See the module docstring. ``capacity_pages`` and ``ring`` (its
    name; default "copy") from the extra config."""

    def __init__(self, storage_config: Any, kwargs: Any = None) -> None:
        self.config = storage_config
        extra = dict(storage_config.extra_config or {})
        self.capacity = int(extra["capacity_pages"])
        self.ring_name = str(extra.get("ring", "copy"))
        ours = {k: v for k, v in extra.items() if k == "copy_threads"}
        self.copy_threads = StorageSettings.from_extra(ours).copy_thread_count()
        self.pages: Any = None
        self.ring: Ring | None = None

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self.pages = host_pages(mem_pool_host)
        block_bytes = self.pages.shape.block_bytes
        with _RINGS_LOCK:
            ring = _RINGS.get(self.ring_name)
            if ring is None:
                ring = _RINGS[self.ring_name] = Ring(self.capacity, block_bytes)
        if (ring.capacity, ring.block_bytes) != (self.capacity, block_bytes):
            raise ValueError(
                f"CopyStorage ring {self.ring_name!r} holds {ring.capacity} blocks of "
                f"{ring.block_bytes} bytes; this pool asks {self.capacity} of {block_bytes}"
            )
        self.ring = ring

    def _ready(self) -> Ring:
        if self.ring is None:
            raise RuntimeError("CopyStorage: register_mem_pool_host was not called")
        return self.ring

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        return self._ready().held(keys)

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        ring = self._ready()
        starts = host_indices[:: self.pages.shape.page_size].tolist()
        self.pages.store_runs(ring.buf, ring.place(keys), starts, self.copy_threads)
        return [True] * len(keys)

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        ring = self._ready()
        at = ring.offsets(keys)
        starts = host_indices[:: self.pages.shape.page_size].tolist()
        self.pages.load_runs(ring.buf, at, starts[: len(at)], self.copy_threads)
        return [True] * len(at) + [False] * (len(keys) - len(at))

    def _v1_only(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("CopyStorage serves SGLang's v1 path only (interface_v1)")

    get = set = batch_get = batch_set = _v1_only
