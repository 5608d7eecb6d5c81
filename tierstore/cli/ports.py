"""Loopback ports for the processes ``tierstore demo`` (and the tests and
benchmarks) start on one machine.

``free_port()`` picks a port below the kernel's ephemeral range. A port from
``bind(0)`` is itself ephemeral: handed out, freed, it can be taken by the
next process's own ``bind(0)`` (a sidecar's data channel, a connection)
before the sidecar it was meant for listens on it, and that sidecar then
fails to start. Below the range no ``bind(0)`` ever lands. Runs in the
caller's process; thread-safe.
"""

from __future__ import annotations

import random
import socket
import threading
from pathlib import Path

_TRIES = 200
_handed_out: set[int] = set()
_lock = threading.Lock()


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago, below the ephemeral
    range, never the same twice in this process."""
    high = _ephemeral_low()
    low = max(1024, high - 12000)
    rng = random.Random()
    for _ in range(_TRIES):
        port = rng.randrange(low, high)
        with _lock:
            if port in _handed_out:
                continue
            with socket.socket() as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
            _handed_out.add(port)
        return port
    raise RuntimeError(f"no free TCP port on {host} in {low}-{high - 1} after {_TRIES} tries")
