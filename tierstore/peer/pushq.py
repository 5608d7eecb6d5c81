"""The queue of end_turn replica pushes: one in flight per target, oldest first.

Provides ``PushQueue``. The peer tier's replicator threads take pushes from
it; each target (a link) carries at most ``per_target`` pushes at a time
(``replicate_per_target``, 1 by default), and a target's pushes go in the
order their turns ended. Four pushes in flight to one target had shared its
link four ways, so each finished up to four times later than alone: the
next turn of every session behind them found its replica incomplete
(``push_late``). One at a time, the oldest turn's replica is complete
first, and a session whose turn ended last waits for the ones before it
rather than slowing them all. Two at a time, so that one push's set-up
(three round trips behind a busy link's queue) overlaps the bytes of the
one before, measured worse in the switch bench: the two shared the link
again and some pushes came late in the middle of a run, where one at a
time lost none (docs/benchmarks.md, Session switches). Pushes to other
targets are not held up by a slow or dead one: a free replicator takes the
oldest push whose target is free.

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

    def __init__(self, max_items: int, per_target: int = 1) -> None:
        if per_target < 1:
            raise ValueError(f"PushQueue: per_target must be >= 1, got {per_target}")
        self._max_items = max_items
        self._per_target = per_target
        self._queued: dict[str, deque[tuple[int, T]]] = {}  # target -> its pushes, oldest first
        self._busy: dict[str, int] = {}  # target -> its pushes in flight (absent: none)
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
        """The oldest push whose target has fewer than ``per_target`` in
        flight (it is then in flight until ``done``); None once closed."""
        with self._cond:
            while True:
                if self._closed:
                    return None
                ready = [
                    (q[0][0], target)
                    for target, q in self._queued.items()
                    if q and self._busy.get(target, 0) < self._per_target
                ]
                if ready:
                    _, target = min(ready)
                    queue = self._queued[target]
                    _, item = queue.popleft()
                    if not queue:
                        del self._queued[target]
                    self._busy[target] = self._busy.get(target, 0) + 1
                    self._count -= 1
                    return item
                self._cond.wait()

    def done(self, item: T) -> None:
        """``item``'s push ended: its target may carry the next one."""
        with self._cond:
            left = self._busy.get(item.target, 0) - 1
            if left > 0:
                self._busy[item.target] = left
            else:
                self._busy.pop(item.target, None)
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
