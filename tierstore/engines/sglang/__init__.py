"""tierstore as SGLang's HiCache L3 storage backend.

SGLang loads it by module path and class name (``--hicache-storage-backend
dynamic``)::

    {"backend_name": "tierstore", "module_path": "tierstore.engines.sglang",
     "class_name": "TierstoreStorage", "interface_v1": 1}

- ``storage``: ``TierstoreStorage``, the ``HiCacheStorage`` SGLang builds;
- ``pages``: host-pool pages as blocks, one byte order for every layout;
- ``driver``: SGLang's real ``HiCacheController`` on the CPU against a
  sidecar (tests and ``bench/engines/sglang_hicache.py``; run from SGLang's environment).
- ``copystorage``: a backend with no store (the same copies into a plain
  buffer), which ``driver`` runs as the bench's limit.

The class is imported on first use, so that ``pages`` needs no SGLang.
"""

from __future__ import annotations

from typing import Any

__all__ = ["TierstoreStorage"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from tierstore.engines.sglang import storage

        return getattr(storage, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
