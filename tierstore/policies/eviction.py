"""Eviction policies: the order in which a tier gives up its blocks.

Provides the ``EvictionPolicy`` protocol and two implementations,
``LruPolicy`` (the default) and ``S3FifoPolicy`` (small/main FIFO queues
with a ghost queue; resists one-hit scans such as a long prompt read once),
and ``make_eviction_policy`` by config name (``eviction_policy``).

Pure: no I/O, no locks, no torch. The tier that owns a policy (the HBM pool
in the engine process, DRAM and NVMe in the sidecar) serialises every call
under its own lock. ``evict`` is atomic: it returns a victim that is removed
from the policy, or None and the set of tracked keys is unchanged.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Protocol

from tierstore.errors import ConfigError
from tierstore.keys import BlockKey

CanEvict = Callable[[BlockKey], bool]


class EvictionPolicy(Protocol):
    """Orders the keys a tier holds for eviction."""

    def insert(self, key: BlockKey) -> None: ...

    def touch(self, key: BlockKey) -> None: ...

    def remove(self, key: BlockKey) -> None: ...

    def readmit(self, key: BlockKey) -> None:
        """A key back from use (its last pin dropped): tracked again as just
        used; a key still tracked (a quiet pin left it in place) stays put."""
        ...

    def evict(self, can_evict: CanEvict) -> BlockKey | None:
        """Remove and return the first victim for which ``can_evict`` is true."""
        ...

    def candidates(self) -> Iterator[BlockKey]:
        """Keys in eviction order, without changing anything."""
        ...

    def __len__(self) -> int: ...

    def __contains__(self, key: object) -> bool: ...


class LruPolicy:
    """Least recently used first."""

    def __init__(self) -> None:
        self._order: OrderedDict[BlockKey, None] = OrderedDict()

    def insert(self, key: BlockKey) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def touch(self, key: BlockKey) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: BlockKey) -> None:
        self._order.pop(key, None)

    def readmit(self, key: BlockKey) -> None:
        if key not in self._order:
            self._order[key] = None  # a new key goes to the most recent end

    def evict(self, can_evict: CanEvict) -> BlockKey | None:
        for key in self._order:
            if can_evict(key):
                del self._order[key]
                return key
        return None

    def candidates(self) -> Iterator[BlockKey]:
        return iter(list(self._order))

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order


class S3FifoPolicy:
    """S3-FIFO (Yang et al., SOSP'23): a small probationary FIFO, a main FIFO
    and a ghost FIFO of recently evicted keys.

    New keys enter the small queue (or main, if the ghost remembers them).
    A key leaving the small queue moves to main if it was touched, else it is
    evicted. Main is a FIFO with reinsertion of touched keys (frequency capped
    at 3). ``small_fraction`` is the share of tracked keys kept in small.
    """

    _MAX_FREQ = 3

    def __init__(self, small_fraction: float = 0.1, ghost_keys: int = 65536) -> None:
        if not 0.0 < small_fraction < 1.0:
            raise ConfigError(f"small_fraction must be in (0, 1), got {small_fraction}")
        self.small_fraction = small_fraction
        self._small: OrderedDict[BlockKey, None] = OrderedDict()
        self._main: OrderedDict[BlockKey, None] = OrderedDict()
        self._ghost: OrderedDict[BlockKey, None] = OrderedDict()
        self._ghost_keys = ghost_keys
        self._freq: dict[BlockKey, int] = {}

    def insert(self, key: BlockKey) -> None:
        if key in self._freq:
            self.touch(key)
            return
        self._freq[key] = 0
        if self._ghost.pop(key, False) is None:
            self._main[key] = None
        else:
            self._small[key] = None

    def touch(self, key: BlockKey) -> None:
        freq = self._freq.get(key)
        if freq is not None:
            self._freq[key] = min(freq + 1, self._MAX_FREQ)

    def remove(self, key: BlockKey) -> None:
        if self._freq.pop(key, None) is not None:
            self._small.pop(key, None)
            self._main.pop(key, None)

    def readmit(self, key: BlockKey) -> None:
        if key not in self._freq:
            self.insert(key)
            self.touch(key)

    def evict(self, can_evict: CanEvict) -> BlockKey | None:
        # Each key is looked at a bounded number of times: at most one move
        # from small to main and _MAX_FREQ reinsertions in main.
        budget = (2 + self._MAX_FREQ) * len(self._freq) + 1
        skipped: list[tuple[OrderedDict[BlockKey, None], BlockKey]] = []
        victim: BlockKey | None = None
        while budget > 0 and (self._small or self._main):
            budget -= 1
            use_small = self._small and (
                len(self._small) >= self.small_fraction * len(self._freq) or not self._main
            )
            queue = self._small if use_small else self._main
            key, _ = queue.popitem(last=False)
            freq = self._freq[key]
            if not can_evict(key):
                skipped.append((queue, key))
                continue
            if queue is self._small and freq > 0:
                self._freq[key] = 0
                self._main[key] = None
                continue
            if queue is self._main and freq > 0:
                self._freq[key] = freq - 1
                self._main[key] = None
                continue
            victim = key
            break
        for queue, key in reversed(skipped):
            queue[key] = None
            queue.move_to_end(key, last=False)
        if victim is None:
            return None
        del self._freq[victim]
        self._ghost[victim] = None
        while len(self._ghost) > self._ghost_keys:
            self._ghost.popitem(last=False)
        return victim

    def candidates(self) -> Iterator[BlockKey]:
        return iter([*self._small, *self._main])

    def __len__(self) -> int:
        return len(self._freq)

    def __contains__(self, key: object) -> bool:
        return key in self._freq


EVICTION_POLICIES: dict[str, Callable[[], EvictionPolicy]] = {
    "lru": LruPolicy,
    "s3fifo": S3FifoPolicy,
}


def make_eviction_policy(name: str) -> EvictionPolicy:
    try:
        return EVICTION_POLICIES[name]()
    except KeyError:
        raise ConfigError(
            f"unknown eviction policy {name!r}; choose one of {sorted(EVICTION_POLICIES)}"
        ) from None
