"""The engine side: what an inference engine's process imports.

``StoreClient`` (``store_client``) talks to the host's sidecar over its Unix
socket (control) and maps its shared arena (data); ``results`` holds what its
calls return; ``copier`` copies blocks between tensors and arena slots;
``hbm`` is the engine's device block pool; ``cuda`` the only CUDA-specific
calls; ``fastpath`` the lookup fast-path client. The client's collaborators:
``control`` (channel, attach, control calls), ``arena_writer`` (reserve, copy,
commit), ``arena_reader`` (lookups, pins, loads), ``hbm_writer`` (the pool's
fills, evictions and write-downs), ``releases`` (releases in flight),
``prefetch`` and ``tier_report``.

Never imports the sidecar's store, its services or lmdb: an engine process
carries only this package, ``tierstore.memory`` and the shared vocabulary
(keys, config, errors, tiers, wire).
"""

from tierstore.client.results import (
    ClientLookup,
    LoadResult,
    Pinned,
    PrefetchResult,
    Reserved,
    ReserveStatus,
    SidecarUnavailable,
)
from tierstore.client.store_client import StoreClient

__all__ = [
    "ClientLookup",
    "LoadResult",
    "Pinned",
    "PrefetchResult",
    "ReserveStatus",
    "Reserved",
    "SidecarUnavailable",
    "StoreClient",
]
