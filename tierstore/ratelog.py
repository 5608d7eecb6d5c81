"""A log line per kind of fault, at most once per interval: faults are
counted per block in metrics, and reported here without flooding the log.

Thread-safe; used by the tiers and the store in the sidecar.
"""

from __future__ import annotations

import logging
import threading
import time


class RateLimitedLog:
    def __init__(self, logger: logging.Logger, interval_s: float = 10.0) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}
        self._lock = threading.Lock()

    def warning(self, kind: str, msg: str, *args: object) -> None:
        """Log ``msg`` unless ``kind`` was logged within the interval; the next
        line of that kind says how many were left out."""
        now = time.monotonic()
        with self._lock:
            if now - self._last.get(kind, -self.interval_s) < self.interval_s:
                self._suppressed[kind] = self._suppressed.get(kind, 0) + 1
                return
            self._last[kind] = now
            skipped = self._suppressed.pop(kind, 0)
        if skipped:
            msg += f" ({skipped} more like this not logged)"
        self.logger.warning(msg, *args)
