"""The queue of end_turn replica pushes: one push in flight per target, oldest first.

Provides ``PushQueue``. The peer tier's replicator threads take pushes from
it; each target (a link) carries one push at a time, and a target's pushes
go in the order their turns ended. Four pushes in flight to one target had
shared its link four ways, so each finished up to four times later than
alone: the next turn of every session behind them found its replica
incomplete (``push_late``). One at a time, the oldest turn's replica is
complete first, and a session whose turn ended last waits for the ones
before it rather than slowing them all. Pushes to other targets are not
held up by a slow or dead one: a free replicator takes the oldest push
whose target is free.

Bounds: at most ``max_items`` pushes queued (``put`` says False beyond);
every wait of ``get`` is a wait for work or for ``close``.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Generic, Protocol, TypeVar


class _HasTarget(Protocol):
    target: str


T = TypeVar("T", bound=_HasTarget)


class PushQueue(Generic[T]):
    """See the module docstring."""

    def __init__(self, max_items: int) -> None:
        self._max_items = max_items
        self._queued: dict[str, deque[tuple[int, T]]] = {}  # target -> its pushes, oldest first
        self._busy: set[str] = set()  # targets with a push in flight
        self._count = 0
        self._seq = 0
        self._closed = False
        self._cond = threading.Condition()

    def put(self, item: T) -> bool:
        """Queue ``item``; False (nothing queued) when ``max_items`` are."""
        with self._cond:
            if self._closed or self._count >= self._max_items:
                return False
            self._seq += 1
            self._queued.setdefault(item.target, deque()).append((self._seq, item))
            self._count += 1
            self._cond.notify()
            return True

    def get(self) -> T | None:
        """The oldest push whose target has none in flight (it is then in
        flight until ``done``); None once closed."""
        with self._cond:
            while True:
                if self._closed:
                    return None
                ready = [
                    (q[0][0], target)
                    for target, q in self._queued.items()
                    if q and target not in self._busy
                ]
                if ready:
                    _, target = min(ready)
                    queue = self._queued[target]
                    _, item = queue.popleft()
                    if not queue:
                        del self._queued[target]
                    self._busy.add(target)
                    self._count -= 1
                    return item
                self._cond.wait()

    def done(self, item: T) -> None:
        """``item``'s push ended: its target may carry the next one."""
        with self._cond:
            self._busy.discard(item.target)
            self._cond.notify_all()

    def drain(self) -> list[T]:
        """Remove and return everything queued (not what is in flight)."""
        with self._cond:
            items = [item for q in self._queued.values() for _, item in q]
            self._queued.clear()
            self._count = 0
            return items

    def close(self) -> None:
        """Wake every ``get`` with None, now and from now on."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def __len__(self) -> int:
        with self._cond:
            return self._count
