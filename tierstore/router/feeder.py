"""Keeps a ``FleetIndex`` current from the hosts' ``WatchBlocks`` streams.

Provides ``IndexFeeder``: one thread per host reads its stream into the
index. A gap (``GapError``) drops the host's state and resubscribes with
epoch 0, so the sidecar sends a fresh snapshot; an error or a stream that
stays silent past ``stale_s`` (a watchdog cancels it) reconnects with a
bounded backoff. Until the host is synced again the router asks it directly.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import grpc

from tierstore.counters import Counters
from tierstore.router.index import FleetIndex, GapError
from tierstore.workers import Workers

log = logging.getLogger(__name__)

BACKOFF_MIN_S = 0.1
BACKOFF_MAX_S = 2.0

# (host, epoch, from_seq) -> an iterable of BlockEvents with cancel()
OpenStream = Callable[[str, int, int], Any]


class IndexFeeder:
    def __init__(
        self,
        index: FleetIndex,
        hosts: Iterable[str],
        open_stream: OpenStream,
        workers: Workers | None = None,
    ) -> None:
        self.index = index
        self.hosts = list(hosts)
        self._open = open_stream
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._calls: dict[str, tuple[Any, float]] = {}  # host -> (stream, opened at)
        self.counters = Counters(("streams_opened", "gaps", "stream_errors", "stale_cancels"))
        self.workers = workers if workers is not None else Workers()
        self._threads = [
            self.workers.start(f"router-feed-{h}", functools.partial(self._run, h))
            for h in self.hosts
        ]
        self._threads.append(self.workers.start("router-feed-watchdog", self._watchdog))

    def _run(self, host: str) -> None:
        backoff = BACKOFF_MIN_S
        while not self._stop.is_set():
            epoch, seq = self.index.cursor(host)
            try:
                call = self._open(host, epoch, seq)
            except Exception as e:  # a bad address, closed channel: retry later
                log.warning("cannot watch %s: %s", host, e)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, BACKOFF_MAX_S)
                continue
            self.counters.add("streams_opened")
            with self._lock:
                self._calls[host] = (call, time.monotonic())
            try:
                for msg in call:
                    self.index.apply(host, msg, time.monotonic())
                    backoff = BACKOFF_MIN_S
                    if self._stop.is_set():
                        break
            except GapError as e:
                self.counters.add("gaps")
                log.info("resynchronising %s: %s", host, e)
                # Soon, not at once: a stream that breaks every time must not
                # become a loop of snapshots.
                backoff = BACKOFF_MIN_S
            except grpc.RpcError as e:
                if not self._stop.is_set():
                    self.counters.add("stream_errors")
                    log.debug("watch of %s ended: %s", host, e)
            finally:
                with self._lock:
                    self._calls.pop(host, None)
                _cancel(call)
            self._stop.wait(backoff)
            backoff = min(max(backoff * 2, BACKOFF_MIN_S), BACKOFF_MAX_S)

    def _watchdog(self) -> None:
        """Cancel streams that went silent (a stalled host, a dead link):
        heartbeats come every watch_heartbeat_s, so silence past stale_s is a fault."""
        period = max(self.index.stale_s / 4, 0.05)
        while not self._stop.wait(period):
            now = time.monotonic()
            with self._lock:
                calls = list(self._calls.items())
            for host, (call, opened) in calls:
                if now - opened > self.index.stale_s and self.index.silent(host, now):
                    self.counters.add("stale_cancels")
                    _cancel(call)

    def synced(self) -> Mapping[str, bool]:
        now = time.monotonic()
        return {h: self.index.fresh(h, now) for h in self.hosts}

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            calls = [c for c, _ in self._calls.values()]
        for call in calls:
            _cancel(call)
        for t in self._threads:
            t.join(timeout=5)


def _cancel(call: Any) -> None:
    cancel = getattr(call, "cancel", None)
    if cancel is not None:
        cancel()
