"""PriorityGate: the bound on uploads in flight, where a turn's write-through
passes the write-back copies waiting (tierstore/store/remote/gate.py)."""

from __future__ import annotations

import asyncio

import pytest

from tierstore.store.remote.gate import PriorityGate


async def order_of_entry(gate: PriorityGate | asyncio.Semaphore, limit: int) -> list[str]:
    """``limit`` holders in place; then 6 copies and 3 urgent uploads wait (a
    copy first); the holders leave one by one. The names, in the order they got in."""
    entered: list[str] = []
    release = asyncio.Event()

    async def holder() -> None:
        async with _hold(gate, False):
            await release.wait()

    async def waiter(name: str, urgent: bool) -> None:
        async with _hold(gate, urgent):
            entered.append(name)
            await asyncio.sleep(0)

    holders = [asyncio.create_task(holder()) for _ in range(limit)]
    await asyncio.sleep(0)
    names = [("copy0", False), ("copy1", False), ("turn0", True), ("copy2", False),
             ("copy3", False), ("turn1", True), ("copy4", False), ("turn2", True),
             ("copy5", False)]  # fmt: skip
    waiters = []
    for name, urgent in names:
        waiters.append(asyncio.create_task(waiter(name, urgent)))
        await asyncio.sleep(0)  # each queued in this order
    release.set()
    await asyncio.wait_for(asyncio.gather(*holders, *waiters), 5.0)
    return entered


def _hold(gate: PriorityGate | asyncio.Semaphore, urgent: bool):  # type: ignore[no-untyped-def]
    return gate.hold(urgent) if isinstance(gate, PriorityGate) else gate


def test_urgent_waiters_get_in_first_each_kind_in_arrival_order() -> None:
    entered = asyncio.run(order_of_entry(PriorityGate(2), 2))
    assert entered == ["turn0", "turn1", "turn2", "copy0", "copy1", "copy2", "copy3", "copy4",
                       "copy5"]  # fmt: skip


def test_control_a_plain_semaphore_lets_them_in_as_they_came() -> None:
    """The scenario tells the two apart: with asyncio's FIFO semaphore the
    urgent uploads wait behind the copies (what the gate replaced)."""
    entered = asyncio.run(order_of_entry(asyncio.Semaphore(2), 2))
    assert entered[:3] == ["copy0", "copy1", "turn0"]


def test_never_more_holders_than_the_limit() -> None:
    async def run() -> int:
        gate, inside, most = PriorityGate(3), 0, 0

        async def one(i: int) -> None:
            nonlocal inside, most
            async with gate.hold(i % 3 == 0):
                inside += 1
                most = max(most, inside)
                await asyncio.sleep(0.001)
                inside -= 1

        await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(60))), 5.0)
        assert gate.waiting() == (0, 0)
        return most

    assert asyncio.run(run()) == 3


def test_a_cancelled_waiter_gives_its_place_on() -> None:
    async def run() -> list[str]:
        gate, got = PriorityGate(1), []
        await gate.acquire(False)
        cancelled = asyncio.create_task(gate.acquire(True))
        await asyncio.sleep(0)

        async def later() -> None:
            await gate.acquire(False)
            got.append("later")
            gate.release()

        task = asyncio.create_task(later())
        await asyncio.sleep(0)
        gate.release()  # handed to the urgent waiter ...
        cancelled.cancel()  # ... which is cancelled before it runs: the place goes on
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        await asyncio.wait_for(task, 5.0)
        assert gate.waiting() == (0, 0)
        await asyncio.wait_for(gate.acquire(True), 1.0)  # the one place is free again
        return got

    assert asyncio.run(run()) == ["later"]


def test_a_limit_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="limit must be >= 1"):
        PriorityGate(0)
