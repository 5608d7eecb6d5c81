"""What this host remembers about the remote tier's bucket, shared by the
remote tier's lookups, reads, uploads and GC.

Provides:
- ``Answers``: which keys the bucket holds, as last answered (bounded to
  ``remote_cache_keys``, trusted for ``remote_cache_ttl_s``); lookups and
  uploads fill it, reads of missing or bad objects and deletions forget;
- ``LastUse``: when this host last used each object (read or uploaded it),
  bounded to ``remote_cache_keys``; GC deletes the least recently used first.

Pure bookkeeping, no I/O. Thread-safe: used from callers' threads, the
``tierstore-remote-io`` loop thread, the writer and the GC thread.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence

from tierstore.keys import BlockKey


class Answers:
    """Bounded, expiring memory of which keys the bucket holds (thread-safe)."""

    def __init__(self, max_keys: int, ttl_s: float) -> None:
        self._max, self._ttl = max_keys, ttl_s
        self._d: OrderedDict[BlockKey, tuple[bool, float]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: BlockKey, now: float) -> bool | None:
        with self._lock:
            got = self._d.get(key)
            if got is None or now - got[1] > self._ttl:
                return None
            return got[0]

    def put(self, keys: Sequence[BlockKey], present: bool, now: float) -> None:
        with self._lock:
            for key in keys:
                self._d[key] = (present, now)
                self._d.move_to_end(key)
            while len(self._d) > self._max:
                self._d.popitem(last=False)

    def forget(self, keys: Sequence[BlockKey]) -> None:
        with self._lock:
            for key in keys:
                self._d.pop(key, None)


class LastUse:
    """Object path -> this host's last use of it (wall-clock seconds), the
    most recent ``max_paths`` only (thread-safe)."""

    def __init__(self, max_paths: int) -> None:
        self._max = max_paths
        self._used: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.Lock()

    def note(self, paths: Sequence[str]) -> None:
        now = time.time()
        with self._lock:
            for p in paths:
                self._used[p] = now
                self._used.move_to_end(p)
            while len(self._used) > self._max:
                self._used.popitem(last=False)

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return dict(self._used)
