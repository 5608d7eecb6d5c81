"""The vLLM connector's calls to its host's sidecar.

``StoreLink`` (``tierstore.engines.link``, re-exported here) is the
connection that may be gone. ``BudgetedCalls``: a slow call (a lookup that
asks peers or the bucket) runs on one background thread; ``ask`` waits for it at most
``budget_s`` and otherwise answers None, to be asked again (vLLM's next
step), so that the scheduler never waits on the network.

Runs in vLLM's scheduler and worker processes; one link per connector
instance, used from the thread that calls the connector (``BudgetedCalls``'s
calls on its own thread "tierstore-vllm-lookup").
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Generic, TypeVar

from tierstore.engines.link import StoreLink

__all__ = ["BudgetedCalls", "StoreLink"]

T = TypeVar("T")


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
