"""What ``StoreClient``'s calls return and raise.

Provides ``SidecarUnavailable`` (the sidecar cannot be reached), the result
types ``ClientLookup``, ``LoadResult``, ``PrefetchResult``, ``Reserved``
(with ``ReserveStatus``), the ``Pinned`` handle of blocks pinned in the
arena, and ``rpc_error``, which maps a gRPC error of the local service to
tierstore's errors. ``tierstore.client`` re-exports them.

Runs in the engine process.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import torch

from tierstore.errors import LayoutError, TierstoreError
from tierstore.keys import BlockKey, KVLayout
from tierstore.tiers import TierName


class SidecarUnavailable(TierstoreError, ConnectionError):
    """The sidecar cannot be reached (not running, wrong socket, gone)."""


@dataclass(frozen=True, slots=True)
class ClientLookup:
    num_hits: int
    tiers: tuple[TierName, ...]


@dataclass(frozen=True, slots=True)
class LoadResult:
    """``blocks[:num_blocks]`` holds the loaded prefix, one row per block."""

    num_blocks: int
    tiers: tuple[TierName, ...]
    blocks: torch.Tensor


@dataclass(frozen=True, slots=True)
class PrefetchResult:
    outcome: str  # started | done | late | cancelled
    ready_blocks: int
    available_blocks: int


class ReserveStatus(enum.IntEnum):
    """Per key outcome of ``StoreClient.reserve`` (local.proto's ReserveStatus)."""

    OK = 0  # write layout.block_bytes at the offset, then commit
    EXISTS = 1  # already held: skip the copy
    FULL = 2  # no room even after eviction


@dataclass(frozen=True, slots=True)
class Reserved:
    """Arena slots reserved by ``StoreClient.reserve``: ``offsets[i]`` is the
    slot of ``keys[i]`` when ``statuses[i]`` is OK, else -1."""

    keys: list[BlockKey]
    statuses: tuple[ReserveStatus, ...]
    offsets: tuple[int, ...]


class Pinned:
    """Blocks pinned in the arena; ``views[i]`` is a zero-copy uint8 tensor.
    Release them (or use ``with``) so the sidecar may evict them again.

    On a CUDA client the arena is pinned memory, so a ``non_blocking`` copy
    from a view is still running when it returns: ``release`` first waits
    for the releasing thread's current stream (queue the copies there), as
    the sidecar may reuse the slots at once. ``engine_copies=False`` is the
    client's own use, whose copies it has waited for already.

    Built by the client with what releasing needs: the arena's tensor (the
    views), ``release_pins`` (the Release call) and ``before_release`` (the
    copier's wait for the engine's copies)."""

    def __init__(
        self,
        arena_tensor: torch.Tensor,
        release_pins: Callable[[KVLayout, list[BlockKey]], None],
        before_release: Callable[[], None],
        layout: KVLayout,
        keys: list[BlockKey],
        offsets: list[int],
        engine_copies: bool = True,
        tiers: tuple[TierName, ...] = (),
    ) -> None:
        self.layout = layout
        self.keys = keys
        self.offsets = offsets
        self.tiers = tiers  # where each block was found (DRAM, NVMe, PEER)
        n = layout.block_bytes
        self.views = [arena_tensor[o : o + n] for o in offsets]
        self._release_pins = release_pins
        self._before_release = before_release
        self._engine_copies = engine_copies
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.views = []
            if self._engine_copies and self.keys:
                self._before_release()
            self._release_pins(self.layout, self.keys)

    def __enter__(self) -> Pinned:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def rpc_error(e: grpc.RpcError, what: str) -> TierstoreError:
    code = e.code() if hasattr(e, "code") else None
    detail = e.details() if hasattr(e, "details") else str(e)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
        return SidecarUnavailable(f"{what}: sidecar unavailable: {detail}")
    if code == grpc.StatusCode.NOT_FOUND:
        return LayoutError(f"{what}: {detail}")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return SidecarUnavailable(f"{what}: no answer within the deadline")
    return TierstoreError(f"{what}: {code.name if code else 'error'}: {detail}")
