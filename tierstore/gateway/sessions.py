"""Which conversation a request continues, and where its last turn ran.

Provides ``Sessions``: after a turn is placed, its last block key is
remembered with the session's id and the host. A later request whose
prompt starts with that turn's prompt (the next turn of a chat: the history
grows, the prefix stays) finds it by its longest remembered key, so no
session header is needed; an ``x-session-id`` header, when a client sends
one, names the session directly. The id keeps the session's spill host
stable (rendezvous hashing) and ``last_host`` says whether a turn moved.

This is not residency: where the KV is comes from the tiers and the
engines' events; this only says where the conversation was. Bounded (LRU
over ``max_entries``); thread-safe.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from tierstore.keys import BlockKey


@dataclass(frozen=True, slots=True)
class Seen:
    session: str
    host: str  # where its last turn ran ("" when it has not run yet)


class Sessions:
    def __init__(self, max_entries: int) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.max_entries = max_entries
        self._lock = threading.Lock()
        self._by_key: OrderedDict[BlockKey, Seen] = OrderedDict()
        self._by_id: OrderedDict[str, str] = OrderedDict()  # header id -> host

    def find(self, keys: Sequence[BlockKey], header_id: str = "") -> Seen:
        """The session this prompt continues: the header's, else the one whose
        remembered key is the longest prefix of ``keys``, else a new one named
        by the prompt's last key (its first turn)."""
        with self._lock:
            if header_id:
                return Seen(header_id, self._by_id.get(header_id, ""))
            for key in reversed(keys):
                seen = self._by_key.get(key)
                if seen is not None:
                    self._by_key.move_to_end(key)
                    return seen
        return Seen(keys[-1].hex()[:32] if keys else "", "")

    def ran(self, session: str, host: str, keys: Sequence[BlockKey], header_id: str = "") -> None:
        """A turn of ``session`` with these keys was sent to ``host``."""
        with self._lock:
            if header_id:
                self._by_id[header_id] = host
                self._by_id.move_to_end(header_id)
                while len(self._by_id) > self.max_entries:
                    self._by_id.popitem(last=False)
            if keys:
                self._by_key[keys[-1]] = Seen(session, host)
                self._by_key.move_to_end(keys[-1])
                while len(self._by_key) > self.max_entries:
                    self._by_key.popitem(last=False)
