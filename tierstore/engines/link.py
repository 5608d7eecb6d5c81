"""An engine's link to its host's sidecar, which may be gone.

Provides ``StoreLink``: ``client()`` returns a connected ``StoreClient`` or
None while the sidecar is unreachable; ``failed(err)`` drops the client
after an error, and the link tries again at most every ``reconnect_s``
(with ``connect_timeout_s`` per try), so an engine whose sidecar died keeps
serving cold and never waits on it for longer than one timeout. The state
changes are logged once each (down, up again), never per call.

Used by the vLLM connector and the SGLang storage backend; one link per
thread that calls the sidecar (a ``StoreClient`` is used from one thread).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from tierstore.client import StoreClient
from tierstore.errors import TierstoreError
from tierstore.keys import KVLayout

log = logging.getLogger("tierstore.engines")


class LinkSettings(Protocol):
    @property
    def socket_path(self) -> str: ...
    @property
    def connect_timeout_s(self) -> float: ...
    @property
    def call_timeout_s(self) -> float: ...
    @property
    def reconnect_s(self) -> float: ...
    @property
    def fast_path(self) -> bool: ...


@dataclass(slots=True)
class LinkCounters:
    connects: int = 0
    connect_failures: int = 0
    call_failures: int = 0


class StoreLink:
    """See the module docstring. ``settings`` has ``socket_path`` ("" for
    the config's default), ``connect_timeout_s``, ``call_timeout_s``,
    ``reconnect_s`` and ``fast_path`` (``StoreClient``'s); ``name`` is the
    client's name in ``tierstore stat``; ``layouts`` are registered on every
    connect, so that the sidecar names them (to a gateway keying prompts)
    before the engine's first request."""

    def __init__(self, settings: LinkSettings, name: str, layouts: Sequence[KVLayout] = ()) -> None:
        self.settings = settings
        self.name = name
        self.layouts = tuple(layouts)
        self.counters = LinkCounters()
        self._client: StoreClient | None = None
        self._retry_at = 0.0
        self._down_logged = False

    def client(self) -> StoreClient | None:
        if self._client is not None:
            if self._client.connected:
                return self._client
            self.failed(TierstoreError("the sidecar closed the attach stream"))
        if time.monotonic() < self._retry_at:
            return None
        socket_path = self.settings.socket_path or None
        if socket_path is not None and not os.path.exists(socket_path):
            self._down("no socket at " + socket_path)
            return None
        try:
            self._client = StoreClient(
                socket_path,
                name=self.name,
                connect_timeout_s=self.settings.connect_timeout_s,
                call_timeout_s=self.settings.call_timeout_s,
                fast_path=self.settings.fast_path,
            )
        except (TierstoreError, OSError) as e:
            self.counters.connect_failures += 1
            self._down(str(e))
            return None
        try:  # the sidecar lists the engine's layouts (PeerStat) from its start
            for layout in self.layouts:
                self._client.register(layout)
        except TierstoreError as e:
            self.failed(e)
            return None
        self.counters.connects += 1
        if self._down_logged:
            log.warning("tierstore %s: sidecar reachable again", self.name)
            self._down_logged = False
        return self._client

    @property
    def current(self) -> StoreClient | None:
        """The connected client, if any, without trying to connect."""
        return self._client

    def failed(self, err: BaseException) -> None:
        """A call failed: drop the client; run cold until the next retry."""
        self.counters.call_failures += 1
        client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except (TierstoreError, OSError) as e:  # closing a dead link may fail too
                log.debug("closing the store client: %s", e)
        self._down(str(err))

    def _down(self, why: str) -> None:
        self._retry_at = time.monotonic() + self.settings.reconnect_s
        if not self._down_logged:
            log.warning(
                "tierstore %s: sidecar unavailable (%s); serving without the "
                "store, retrying every %.1fs",
                self.name,
                why,
                self.settings.reconnect_s,
            )
            self._down_logged = True

    def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            client.close()
