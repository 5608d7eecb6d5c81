"""Keeps a ``FleetIndex`` current from the hosts' ``WatchBlocks`` streams.

Provides ``IndexFeeder``: one thread per host reads its stream into the
index; ``set_hosts`` follows a fleet that changes (group membership). A gap
(``GapError``) drops the host's state and resubscribes with epoch 0, so the
sidecar sends a fresh snapshot; an error or a stream that
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
        self.hosts: list[str] = []
        self._open = open_stream
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._calls: dict[str, tuple[Any, float]] = {}  # host -> (stream, opened at)
        self._gone: dict[str, threading.Event] = {}  # host -> set when it left the fleet
        self.counters = Counters(("streams_opened", "gaps", "stream_errors", "stale_cancels"))
        self.workers = workers if workers is not None else Workers()
        self._threads = [self.workers.start("router-feed-watchdog", self._watchdog)]
        self.set_hosts(hosts)

    def set_hosts(self, hosts: Iterable[str]) -> None:
        """Follow the fleet as it changes: a stream for each new host; a host
        that left has its stream cancelled and its state dropped."""
        wanted = list(dict.fromkeys(hosts))
        with self._lock:
            if self._stop.is_set():
                return
            left = [h for h in self.hosts if h not in wanted]
            joined = [h for h in wanted if h not in self._gone]
            for h in left:
                self._gone.pop(h).set()
            calls = [self._calls[h][0] for h in left if h in self._calls]
            self.hosts = wanted
            for h in joined:
                self._gone[h] = threading.Event()
            self._threads = [t for t in self._threads if t.is_alive()]
            for h in joined:
                run = functools.partial(self._run, h, self._gone[h])
                self._threads.append(self.workers.start(f"router-feed-{h}", run))
        for call in calls:
            _cancel(call)
        for h in left:
            self.index.forget(h)

    def _run(self, host: str, gone: threading.Event) -> None:
        backoff = BACKOFF_MIN_S
        while not self._stop.is_set() and not gone.is_set():
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
            if gone.is_set():  # left while the stream was opening
                _cancel(call)
            try:
                for msg in call:
                    self.index.apply(host, msg, time.monotonic())
                    backoff = BACKOFF_MIN_S
                    if self._stop.is_set() or gone.is_set():
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
                    if self._calls.get(host, (None,))[0] is call:
                        self._calls.pop(host, None)
                _cancel(call)
            if gone.is_set():
                break
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
        with self._lock:
            hosts = list(self.hosts)
        return {h: self.index.fresh(h, now) for h in hosts}

    def close(self) -> None:
        with self._lock:
            self._stop.set()
            calls = [c for c, _ in self._calls.values()]
        for call in calls:
            _cancel(call)
        with self._lock:
            threads = list(self._threads)
        for t in threads:
            t.join(timeout=5)


def _cancel(call: Any) -> None:
    cancel = getattr(call, "cancel", None)
    if cancel is not None:
        cancel()
