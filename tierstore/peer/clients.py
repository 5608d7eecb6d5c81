"""One ``PeerClient`` per live member of the group.

Provides ``PeerClients``: a client is made when a member first appears and
kept (with its link measurements) if the member leaves and returns. Used by
the peer tier and the router. Thread-safe.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

from tierstore.membership.members import MemberSet
from tierstore.peer.client import PeerClient

KEPT_CLIENTS = 256  # clients of departed members kept for their return (then closed)


class PeerClients:
    """PeerClients of the live members other than ``exclude`` (this host).
    ``clients()`` is cheap while the set is unchanged (one version check)."""

    def __init__(
        self, members: MemberSet, make: Callable[[str], PeerClient], exclude: str = ""
    ) -> None:
        self.members = members
        self._make = make
        self._exclude = exclude
        self._lock = threading.Lock()
        self._known: OrderedDict[str, PeerClient] = OrderedDict()
        self._current: dict[str, PeerClient] = {}
        self._version: int | None = None

    def clients(self) -> dict[str, PeerClient]:
        """address -> client of every live member; do not modify the dict."""
        version = self.members.version  # read first: a change after it rebuilds next time
        with self._lock:
            if version == self._version:
                return self._current
            current: dict[str, PeerClient] = {}
            for addr in self.members.addresses():
                if addr == self._exclude:
                    continue
                client = self._known.get(addr)
                if client is None:
                    client = self._known[addr] = self._make(addr)
                self._known.move_to_end(addr)
                current[addr] = client
            # Live members were moved to the end: the oldest beyond the bound
            # are departed ones, unused for the longest.
            retired = []
            while len(self._known) > max(KEPT_CLIENTS, len(current)):
                retired.append(self._known.popitem(last=False)[1])
            self._current, self._version = current, version
        for client in retired:
            client.close()
        return current

    def close(self) -> None:
        with self._lock:
            clients = list(self._known.values())
            self._known.clear()
            self._current = {}
            self._version = None
        for c in clients:
            c.close()
