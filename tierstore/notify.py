"""systemd's readiness protocol (``Type=notify``): tell the service manager
when a process serves and when it stops.

Provides ``notify(state)``: one datagram (``READY=1``, ``STOPPING=1``,
``STATUS=...``) to the socket named by ``$NOTIFY_SOCKET`` (a path, or an
abstract name written ``@name``); nothing when the variable is unset (not
run by systemd, or not ``Type=notify``). Returns whether it was sent. A
failure to send is logged and never raised: readiness is a courtesy to the
service manager, not a reason to stop serving. Any process, any thread.
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger(__name__)


def notify(state: str) -> bool:
    target = os.environ.get("NOTIFY_SOCKET", "")
    if not target:
        return False
    address = "\0" + target[1:] if target.startswith("@") else target
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.connect(address)
            s.sendall(state.encode())
    except OSError as e:
        log.warning("could not tell systemd %r on %s: %s", state, target, e)
        return False
    return True
