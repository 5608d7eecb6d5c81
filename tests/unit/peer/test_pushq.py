"""PushQueue: one push (or ``per_target``) in flight per target, the oldest
first, a busy target not holding up the others, the bound, and close waking
every waiter."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import pytest

from tierstore.config.peer import PeerConfig
from tierstore.errors import ConfigError
from tierstore.peer.pushq import PushQueue

WAIT_S = 10.0


@dataclass
class P:
    target: str
    name: str


def test_one_in_flight_per_target_oldest_first() -> None:
    q: PushQueue[P] = PushQueue(8)
    for name in ("a1", "a2", "a3"):
        assert q.put(P("A", name))
    first = q.get()
    assert first is not None and first.name == "a1"
    got: list[P | None] = []
    waiter = threading.Thread(target=lambda: got.append(q.get()))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive() and not got  # A carries a1: a2 waits for it
    q.done(first)
    waiter.join(WAIT_S)
    assert [p.name for p in got if p] == ["a2"]
    q.close()


def test_per_target_pushes_in_flight_and_no_more() -> None:
    q: PushQueue[P] = PushQueue(8, per_target=2)
    for name in ("a1", "a2", "a3"):
        assert q.put(P("A", name))
    q.put(P("B", "b1"))
    a1, a2, b1 = q.get(), q.get(), q.get()  # two to A, then B: A is full although a3 is older
    assert [p.name for p in (a1, a2, b1) if p] == ["a1", "a2", "b1"]
    got: list[P | None] = []
    waiter = threading.Thread(target=lambda: got.append(q.get()))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive() and not got  # a3 waits for one of A's two
    assert a2 is not None
    q.done(a2)
    waiter.join(WAIT_S)
    assert [p.name for p in got if p] == ["a3"]
    q.close()
    with pytest.raises(ValueError, match="per_target"):
        PushQueue(8, per_target=0)


def test_the_setting_is_bounded() -> None:
    assert PeerConfig(replicate_per_target=8).replicate_per_target == 8
    for bad in (0, 9):
        with pytest.raises(ConfigError, match="replicate_per_target must be 1-8"):
            PeerConfig(replicate_per_target=bad)


def test_a_busy_target_does_not_hold_up_another() -> None:
    q: PushQueue[P] = PushQueue(8)
    q.put(P("A", "a1"))
    q.put(P("A", "a2"))
    q.put(P("B", "b1"))
    a1 = q.get()
    b1 = q.get()  # a2 is older, but A is busy
    assert a1 is not None and b1 is not None and (a1.name, b1.name) == ("a1", "b1")
    q.done(a1)
    a2 = q.get()
    assert a2 is not None and a2.name == "a2" and len(q) == 0


def test_bounded_and_drained() -> None:
    q: PushQueue[P] = PushQueue(2)
    assert q.put(P("A", "1")) and q.put(P("B", "2"))
    assert not q.put(P("C", "3"))  # full: the caller counts a dropped push
    assert sorted(p.name for p in q.drain()) == ["1", "2"] and len(q) == 0
    assert q.put(P("C", "3"))


def test_close_wakes_every_waiter() -> None:
    q: PushQueue[P] = PushQueue(2)
    got: list[P | None] = []
    waiters = [threading.Thread(target=lambda: got.append(q.get())) for _ in range(3)]
    for w in waiters:
        w.start()
    q.close()
    for w in waiters:
        w.join(WAIT_S)
        assert not w.is_alive()
    assert got == [None, None, None]
    assert not q.put(P("A", "late"))
