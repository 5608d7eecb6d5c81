"""Counters (one mechanism for every counter) and Workers (no silent deaths)."""

from __future__ import annotations

import threading

import pytest

from tierstore.counters import Counters
from tierstore.workers import Workers


def test_adds_from_many_threads_are_not_lost() -> None:
    c = Counters(("a", "b"))

    def work() -> None:
        for _ in range(5000):
            c.add("a")
            c.add_many({"a": 1, "b": 2})

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert c.snapshot() == {"a": 80_000, "b": 80_000}
    assert c.a == 80_000 and c["b"] == 80_000


def test_names_are_declared_and_writes_go_through_add() -> None:
    c = Counters(("hits",))
    with pytest.raises(KeyError):
        c.add("hit")  # a typo fails at once instead of counting nowhere
    with pytest.raises(KeyError):
        c.set("miss", 1)
    with pytest.raises(AttributeError, match="add"):
        c.hits = 3  # type: ignore[misc]
    with pytest.raises(AttributeError):
        _ = c.misses
    c.set("hits", 7)
    c.add("hits", -2)
    assert c.hits == 5 and c.names() == ("hits",)


def test_a_worker_that_dies_is_logged_counted_and_reported(caplog) -> None:
    workers = Workers()
    seen: list[str] = []
    died = threading.Event()

    def on_failure(name: str, error: BaseException) -> None:
        seen.append(f"{name}: {error}")
        died.set()

    workers.on_failure(on_failure)

    def loop() -> None:
        raise ZeroDivisionError("injected bug")

    with caplog.at_level("ERROR", logger="tierstore.workers"):
        workers.start("test-worker", loop).join(timeout=5)
    assert died.wait(5)
    assert seen == ["test-worker: injected bug"]
    assert workers.failed() == {"test-worker": "ZeroDivisionError: injected bug"}
    assert workers.failures == 1
    assert "test-worker died" in caplog.text and "ZeroDivisionError" in caplog.text
    late: list[str] = []
    workers.on_failure(lambda name, e: late.append(name))  # registered after the death
    assert late == ["test-worker"]


def test_a_worker_that_returns_is_not_a_failure() -> None:
    workers = Workers()
    workers.start("fine", lambda: None).join(timeout=5)
    assert workers.failed() == {} and workers.failures == 0
