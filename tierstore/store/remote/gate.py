"""A bound on requests in flight where some go first: ``PriorityGate``.

The remote tier's uploads share one bound (``remote_upload_concurrency``).
Copies of blocks leaving DRAM (write-back) can queue by the ten thousand
when the bucket is slower than the churn; a turn's write-through, which a
durable EndTurn waits on with a deadline of seconds, must not queue behind
them. asyncio's Semaphore wakes its waiters in arrival order, so the gate
keeps two queues of waiters and hands a freed place to an urgent waiter
first. Made and used on one event loop (the remote client's).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator


class PriorityGate:
    """At most ``limit`` holders; urgent waiters are let in before the others,
    each kind in arrival order."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        self._free = limit
        self._waiting: tuple[collections.deque[asyncio.Future[None]], ...] = (
            collections.deque(),  # urgent
            collections.deque(),  # the rest
        )

    def waiting(self) -> tuple[int, int]:
        """Waiters (urgent, other), for tests and gauges."""
        return len(self._waiting[0]), len(self._waiting[1])

    async def acquire(self, urgent: bool) -> None:
        if self._free > 0:
            self._free -= 1
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        line = self._waiting[0 if urgent else 1]
        line.append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()  # the place was handed over as we were cancelled: pass it on
            else:
                with contextlib.suppress(ValueError):
                    line.remove(fut)
            raise

    def release(self) -> None:
        """Hand the place to the first urgent waiter, else the first other, else free it."""
        for line in self._waiting:
            while line:
                fut = line.popleft()
                if not fut.done():
                    fut.set_result(None)
                    return
        self._free += 1

    @contextlib.asynccontextmanager
    async def hold(self, urgent: bool) -> AsyncIterator[None]:
        await self.acquire(urgent)
        try:
            yield
        finally:
            self.release()
