"""The data channel's stall limit over socket pairs: a read on which no
byte comes for ``stall_s`` ends with ``TransferStalled`` before the
deadline; bytes that keep coming re-arm it; with the limit off (0) the same
silence lasts until the deadline (the control: the oracle tells the two
apart)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from tierstore.peer.client import TransferError, TransferStalled, step_timeout_s
from tierstore.peer.data import recv_into_exact

STALL_S = 0.3


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    yield a, b
    a.close()
    b.close()


def test_silent_sender_is_a_stall_before_the_deadline(pair) -> None:
    sender, receiver = pair
    sender.sendall(b"x" * 10)
    view = memoryview(bytearray(20))
    t0 = time.monotonic()
    with pytest.raises(TransferStalled, match=r"after 10 of 20 bytes"):
        recv_into_exact(receiver, view, time.monotonic() + 10.0, STALL_S)
    took = time.monotonic() - t0
    assert STALL_S - 0.05 <= took < STALL_S + 1.0, took
    assert bytes(view[:10]) == b"x" * 10  # what came is kept


def test_without_the_limit_the_same_silence_lasts_until_the_deadline(pair) -> None:
    sender, receiver = pair
    sender.sendall(b"x" * 10)
    deadline_s = 3 * STALL_S
    t0 = time.monotonic()
    with pytest.raises((TimeoutError, TransferError)) as info:
        recv_into_exact(receiver, memoryview(bytearray(20)), time.monotonic() + deadline_s, 0.0)
    assert not isinstance(info.value, TransferStalled)
    assert time.monotonic() - t0 >= deadline_s - 0.05


def test_dripping_bytes_re_arm_the_limit(pair) -> None:
    sender, receiver = pair
    n, interval_s = 8, STALL_S / 3  # 8 drips: the whole read takes ~2.7x STALL_S

    def drip() -> None:
        for _ in range(n):
            time.sleep(interval_s)
            sender.sendall(b"y")

    t = threading.Thread(target=drip)
    t.start()
    view = memoryview(bytearray(n))
    t0 = time.monotonic()
    recv_into_exact(receiver, view, time.monotonic() + 10.0, STALL_S)
    took = time.monotonic() - t0
    t.join()
    assert bytes(view) == b"y" * n
    assert took > 2 * STALL_S, took  # longer than one stall window: each byte re-armed it


def test_a_step_waits_for_the_sooner_of_deadline_and_stall() -> None:
    now = time.monotonic()
    assert step_timeout_s(now + 10.0, 0.5) == 0.5
    assert 0.1 < step_timeout_s(now + 0.2, 0.5) <= 0.2
    assert 9.0 < step_timeout_s(now + 10.0, 0.0) <= 10.0  # 0: the limit is off
    assert step_timeout_s(now - 1.0, 0.5) == 0.001  # past the deadline: the least wait
