"""The vLLM connector's link to its host's sidecar, which may be gone.

Provides ``StoreLink``: ``client()`` returns a connected ``StoreClient`` or
None while the sidecar is unreachable; ``failed(err)`` drops the client
after an error, and the link tries again at most every ``reconnect_s``
(with ``connect_timeout_s`` per try), so an engine whose sidecar died keeps
serving cold and never waits on it for longer than one timeout. The state
changes are logged once each (down, up again), never per call.

Also ``BudgetedCalls``: a slow call (a lookup that asks peers or the
bucket) runs on one background thread; ``ask`` waits for it at most
``budget_s`` and otherwise answers None, to be asked again (vLLM's next
step), so that the scheduler never waits on the network.

Runs in vLLM's scheduler and worker processes; one link per connector
instance, used from the thread that calls the connector (``BudgetedCalls``'s
calls on its own thread "tierstore-vllm-lookup").
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Generic, TypeVar

from tierstore.client import StoreClient
from tierstore.engines.vllm_layout import ConnectorSettings
from tierstore.errors import TierstoreError

log = logging.getLogger("tierstore.engines.vllm")

T = TypeVar("T")


@dataclass(slots=True)
class LinkCounters:
    connects: int = 0
    connect_failures: int = 0
    call_failures: int = 0


class StoreLink:
    def __init__(self, settings: ConnectorSettings, name: str) -> None:
        self.settings = settings
        self.name = name
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
            )
        except (TierstoreError, OSError) as e:
            self.counters.connect_failures += 1
            self._down(str(e))
            return None
        self.counters.connects += 1
        if self._down_logged:
            log.warning("tierstore connector %s: sidecar reachable again", self.name)
            self._down_logged = False
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
                "tierstore connector %s: sidecar unavailable (%s); serving without the "
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


class BudgetedCalls(Generic[T]):
    """See the module docstring. ``ask(key, call)`` starts ``call`` once per
    ``key`` and returns its result (or raises its error) when it is done
    within ``budget_s`` of this ask, else None; a later ask with the same key
    collects it. Calls nobody asked for again are dropped after
    ``forget_s``. Not thread-safe: one caller thread."""

    def __init__(self, budget_s: float, forget_s: float) -> None:
        self.budget_s = budget_s
        self.forget_s = forget_s
        self.late = 0  # asks answered None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tierstore-vllm-lookup")
        self._pending: dict[Hashable, tuple[Future[T], float]] = {}

    def ask(self, key: Hashable, call: Callable[[], T]) -> T | None:
        now = time.monotonic()
        entry = self._pending.get(key)
        if entry is None:
            entry = (self._pool.submit(call), now)
            self._pending[key] = entry
        future = entry[0]
        try:
            result = future.result(timeout=self.budget_s)
        except FutureTimeout:
            self.late += 1
            self._forget_old(now)
            return None
        finally:
            if future.done():
                self._pending.pop(key, None)
        return result

    @property
    def pending(self) -> int:
        return len(self._pending)

    def _forget_old(self, now: float) -> None:
        for key, (future, started) in list(self._pending.items()):
            if now - started > self.forget_s:
                future.cancel()
                del self._pending[key]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
