"""The KV layouts a store has seen, by fingerprint.

Provides ``LayoutRegistry``: ``register`` (the first layout registered
under a fingerprint is kept; the fingerprint is the blake3 of the whole
layout), ``get`` (LayoutError for an unknown fingerprint), ``all`` and
``len``.
One lock, held only for the dict operation; called from any caller thread
of the store (sidecar process).
"""

from __future__ import annotations

import threading

from tierstore.errors import LayoutError
from tierstore.keys import KVLayout


class LayoutRegistry:
    def __init__(self) -> None:
        self._layouts: dict[bytes, KVLayout] = {}
        self._lock = threading.Lock()

    def register(self, layout: KVLayout) -> bytes:
        """Remember ``layout``; returns its fingerprint."""
        with self._lock:
            self._layouts.setdefault(layout.fingerprint, layout)
        return layout.fingerprint

    def get(self, fingerprint: bytes) -> KVLayout:
        """The registered layout with this fingerprint, or LayoutError."""
        with self._lock:
            layout = self._layouts.get(bytes(fingerprint))
        if layout is None:
            raise LayoutError(
                f"unknown layout fingerprint {bytes(fingerprint).hex()[:16]}...; register it first"
            )
        return layout

    def all(self) -> list[KVLayout]:
        with self._lock:
            return list(self._layouts.values())

    def __len__(self) -> int:
        return len(self._layouts)
