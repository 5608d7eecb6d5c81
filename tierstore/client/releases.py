"""Releases of arena pins in flight, and the count of those that failed.

Provides ``PendingReleases``: ``StoreClient`` sends a load's release without
waiting for the reply (a load's copies are done by then, so the round trip
need not be on its path) and ``add``s the call's future here; every later
control call ``settle``s first, waiting for the releases sent before it, so
what that call sees or does comes after them. A failed release is logged and
counted (``errors``) once: its pins stay until the client detaches, when the
sidecar drops them all.

Runs in the engine process, on the threads that call the client. Thread-safe:
one lock guards the list of futures; waiting for them happens outside it.
"""

from __future__ import annotations

import logging
import threading

import grpc

from tierstore.client.results import rpc_error

# The client's logger, as before the split: filters and levels set for it still apply.
log = logging.getLogger("tierstore.client.store_client")


class PendingReleases:
    """See the module docstring."""

    def __init__(self) -> None:
        self._futures: list[grpc.Future] = []
        self._lock = threading.Lock()
        self.errors = 0  # releases that failed (their pins kept until detach)

    def add(self, future: grpc.Future) -> None:
        """Track a release just sent (``Release.future``)."""
        with self._lock:
            self._futures.append(future)

    def settle(self) -> None:
        """Wait for the releases in flight (each within its call's timeout). A
        failed one is logged and counted once, by the thread that takes it
        off the list."""
        if not self._futures:
            return
        with self._lock:
            pending = list(self._futures)
        for future in pending:
            future.exception()  # waits; bounded by the call's own timeout
        with self._lock:
            waited = {id(f) for f in pending}
            mine = [f for f in self._futures if id(f) in waited]
            self._futures = [f for f in self._futures if id(f) not in waited]
        failed = [e for e in (f.exception() for f in mine) if isinstance(e, grpc.RpcError)]
        for error in failed:
            self.failed(rpc_error(error, "release"))

    def failed(self, error: Exception) -> None:
        """Count and log a release that failed (made over the fast path, or
        taken off the list by ``settle``)."""
        with self._lock:
            self.errors += 1
        log.warning("release: %s (pins kept until this client detaches)", error)
