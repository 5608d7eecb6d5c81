"""Write policies: which DRAM blocks are also written to NVMe before they are evicted.

Provides the ``WritePolicy`` protocol: ``WriteBack`` (only when evicted),
``WriteThrough`` (every committed block, through the store's bounded write
queue), ``WriteThroughSelective`` (blocks read again after their commit, and
the blocks of turns of at least ``min_tokens``); ``WRITE_POLICIES``, their
config names (``write_policy``), and ``make_write_policy``.

Pure: no I/O, no locks, no torch. The sidecar's NVMe writer asks, and does
the I/O.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Protocol

from tierstore.errors import ConfigError
from tierstore.keys import BlockKey


class WritePolicy(Protocol):
    """Which DRAM blocks are queued for NVMe before they are evicted (write
    through). Eviction still spills whatever is not on NVMe yet (write back),
    whatever the policy. Pure: the store's writer asks, and does the I/O."""

    name: str
    watches_hits: bool  # whether ``on_hit`` can answer True (the store skips the call if not)

    def on_commit(self, key: BlockKey) -> bool: ...

    def on_hit(self, key: BlockKey) -> bool: ...

    def on_turn(self, num_tokens: int) -> bool:
        """Whether the keys of a finished turn of ``num_tokens`` tokens are written through."""
        ...


class WriteBack:
    """Blocks reach NVMe when DRAM evicts them (and on a graceful stop's drain)."""

    name = "write_back"
    watches_hits = False

    def on_commit(self, key: BlockKey) -> bool:
        return False

    def on_hit(self, key: BlockKey) -> bool:
        return False

    def on_turn(self, num_tokens: int) -> bool:
        return False


class WriteThrough:
    """Every committed block is queued for NVMe at once."""

    name = "write_through"
    watches_hits = False

    def on_commit(self, key: BlockKey) -> bool:
        return True

    def on_hit(self, key: BlockKey) -> bool:
        return False

    def on_turn(self, num_tokens: int) -> bool:
        return False


class WriteThroughSelective:
    """Write through what is likely to be used again: a block read from DRAM
    after its commit (seen twice; each key queued once per ``history_keys``
    hits), and every block of a turn of at least ``min_tokens`` tokens
    (a long session, whose prefill is the most expensive to lose)."""

    name = "write_through_selective"
    watches_hits = True

    def __init__(self, min_tokens: int = 8192, history_keys: int = 65536) -> None:
        self.min_tokens = min_tokens
        self._queued: OrderedDict[BlockKey, None] = OrderedDict()
        self._history_keys = history_keys

    def on_commit(self, key: BlockKey) -> bool:
        return False

    def on_hit(self, key: BlockKey) -> bool:
        if key in self._queued:
            return False
        self._queued[key] = None
        while len(self._queued) > self._history_keys:
            self._queued.popitem(last=False)
        return True

    def on_turn(self, num_tokens: int) -> bool:
        return num_tokens >= self.min_tokens


WRITE_POLICIES = ("write_back", "write_through", "write_through_selective")


def make_write_policy(name: str, min_tokens: int = 8192) -> WritePolicy:
    """The write policy named ``name``; ``min_tokens`` is the selective one's long turn."""
    if name == "write_back":
        return WriteBack()
    if name == "write_through":
        return WriteThrough()
    if name == "write_through_selective":
        return WriteThroughSelective(min_tokens)
    raise ConfigError(f"unknown write policy {name!r}; choose one of {list(WRITE_POLICIES)}")
