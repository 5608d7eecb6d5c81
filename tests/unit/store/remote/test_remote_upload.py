"""RemoteUploader's writer thread at close, without a bucket: the queued
write-through turns stay local and the thread ends after its current job,
even when the job queue had no room for the stop signal."""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Sequence
from types import SimpleNamespace
from typing import cast

from tests.conftest import SMALL_LAYOUT
from tierstore.config.remote import RemoteConfig
from tierstore.counters import Counters
from tierstore.keys import BlockKey, chain_keys
from tierstore.store.remote.cache import Answers, LastUse
from tierstore.store.remote.client import RemoteClient
from tierstore.store.remote.upload import UPLOAD_COUNTERS, RemoteUploader
from tierstore.workers import Workers

WAIT_S = 10.0


def test_close_with_a_full_job_queue_ends_the_writer_after_its_current_job() -> None:
    busy, go_on = threading.Event(), threading.Event()
    asked: list[int] = []

    def contains(fp: bytes, keys: Sequence[BlockKey], timeout_s: float) -> list[bool]:
        asked.append(len(keys))
        busy.set()
        assert go_on.wait(WAIT_S)
        return [True] * len(keys)  # all in the bucket: nothing to upload

    workers = Workers()
    counters = Counters(UPLOAD_COUNTERS)
    client = cast(RemoteClient, SimpleNamespace(prefix="p"))
    uploader = RemoteUploader(
        RemoteConfig(remote_manifest_every_blocks=1 << 20, remote_write_through_queue_turns=4),
        client, counters,
        Answers(16, 60.0), LastUse(16), contains, workers,
    )  # fmt: skip
    keys = chain_keys(SMALL_LAYOUT, list(range(8)))
    assert uploader.queue_turn(SMALL_LAYOUT, keys)
    assert busy.wait(WAIT_S)  # the writer is inside the first turn
    queued = 0
    while uploader.queue_turn(SMALL_LAYOUT, keys):
        queued += 1
    assert queued == 4  # the queue is full now: no room for the stop signal
    uploader.stop()
    go_on.set()
    uploader.join(WAIT_S)
    assert not uploader._writer.is_alive() and not workers.failed()
    assert asked == [len(keys)]  # the queued turns were not written
    dropped = counters.snapshot()["remote_write_through_dropped"]
    assert dropped == queued + 1  # the queued ones, and the one refused when it was full
    assert uploader.flush(0.0)  # nothing left pending


def test_a_job_cancelled_by_the_client_closing_ends_the_writer_quietly() -> None:
    """At close the client cancels what is in flight: the writer ends, and
    is not reported as a dead worker (the sidecar would turn NOT_SERVING)."""

    def contains(fp: bytes, keys: Sequence[BlockKey], timeout_s: float) -> list[bool]:
        raise concurrent.futures.CancelledError

    workers = Workers()
    uploader = RemoteUploader(
        RemoteConfig(), cast(RemoteClient, SimpleNamespace(prefix="p")), Counters(UPLOAD_COUNTERS),
        Answers(16, 60.0), LastUse(16), contains, workers,
    )  # fmt: skip
    assert uploader.queue_turn(SMALL_LAYOUT, chain_keys(SMALL_LAYOUT, list(range(8))))
    uploader.join(WAIT_S)
    assert not uploader._writer.is_alive() and not workers.failed()
    assert uploader.flush(0.0)
    uploader.stop()
    assert not uploader.queue_turn(SMALL_LAYOUT, chain_keys(SMALL_LAYOUT, list(range(8))))
