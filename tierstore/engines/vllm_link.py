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
    within the step's budget, else None; a later ask with the same key
    collects it. The asks of one scheduler step share one ``budget_s``
    (``new_step`` starts the next), so a step with many waiting requests
    waits at most that long in all, not that long per request. Calls nobody
    asked for in ``forget_s`` are dropped. Not thread-safe: one caller thread."""

    def __init__(self, budget_s: float, forget_s: float) -> None:
        self.budget_s = budget_s
        self.forget_s = forget_s
        self.late = 0  # asks answered None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tierstore-vllm-lookup")
        self._pending: dict[Hashable, tuple[Future[T], float]] = {}  # future, last asked
        self._step_ends: float | None = None  # set by the step's first ask

    def new_step(self) -> None:
        """The scheduler starts another step: its asks get a budget of their own."""
        self._step_ends = None

    def ask(self, key: Hashable, call: Callable[[], T]) -> T | None:
        now = time.monotonic()
        if self._step_ends is None:
            self._step_ends = now + self.budget_s
        entry = self._pending.get(key)
        future = self._pool.submit(call) if entry is None else entry[0]
        self._pending[key] = (future, now)
        try:
            result = future.result(timeout=max(0.0, self._step_ends - now))
        except FutureTimeout:
            # Kept even if it completes right now: the next ask collects it (popping
            # it here on done() would drop an answer nobody read and call again).
            self.late += 1
            self._forget_old(now)
            return None
        except BaseException:
            self._pending.pop(key, None)  # collected: its error, raised to the asker
            raise
        self._pending.pop(key, None)
        return result

    @property
    def pending(self) -> int:
        return len(self._pending)

    def _forget_old(self, now: float) -> None:
        for key, (future, asked) in list(self._pending.items()):
            if now - asked > self.forget_s:
                future.cancel()
                del self._pending[key]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
