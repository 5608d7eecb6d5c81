"""Background worker threads that cannot die silently.

``Workers.start(name, loop)`` runs ``loop`` on a daemon thread. A loop
catches and counts what it expects itself; anything that escapes it is a
bug: it is logged once with its traceback, counted (``worker_failures``),
remembered by name, and every ``on_failure`` callback runs (the sidecar
turns its gRPC health status to NOT_SERVING there), so a dead demoter or
replicator is visible in health checks and ``tierstore stat``.

One ``Workers`` per store or sidecar (tests run several in one process).
Thread-safe.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)


class Workers:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._failed: dict[str, str] = {}  # worker name -> the exception, one line
        self._callbacks: list[Callable[[str, BaseException], None]] = []
        self.failures = 0

    def on_failure(self, callback: Callable[[str, BaseException], None]) -> None:
        """Call ``callback(name, exc)`` when a worker dies (and at once for
        any that died before)."""
        with self._lock:
            self._callbacks.append(callback)
            died = list(self._failed)
        for name in died:
            callback(name, RuntimeError(self._failed[name]))

    def start(self, name: str, loop: Callable[[], None]) -> threading.Thread:
        thread = threading.Thread(target=self._run, args=(name, loop), name=name, daemon=True)
        thread.start()
        return thread

    def _run(self, name: str, loop: Callable[[], None]) -> None:
        try:
            loop()
        except BaseException as e:  # a bug: make it visible, then let the thread end
            log.exception("worker %s died of an unexpected error; the sidecar is NOT_SERVING", name)
            with self._lock:
                self.failures += 1
                self._failed[name] = f"{type(e).__name__}: {e}"
                callbacks = list(self._callbacks)
            for cb in callbacks:
                cb(name, e)

    def failed(self) -> dict[str, str]:
        """The workers that died, with their error (empty: all healthy)."""
        with self._lock:
            return dict(self._failed)
