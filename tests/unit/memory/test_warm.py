"""tierstore.memory.warm: a pass reads one byte of every page, the thread
passes over what was added, and a pass that fails is kept, not hidden."""

from __future__ import annotations

import time

import numpy as np
import pytest

from tierstore.memory.warm import PAGE_BYTES, KeepWarm, touch


def test_touch_reads_one_byte_of_every_page() -> None:
    buf = np.zeros(10 * PAGE_BYTES + 1, np.uint8)
    buf[::PAGE_BYTES] = 1  # the bytes a pass reads: 11 pages, the last one short
    assert touch(buf) == 11
    buf[1::PAGE_BYTES] = 7  # negative control: bytes a pass does not read
    assert touch(buf) == 11
    assert touch(memoryview(buf)) == 11


def test_the_thread_passes_over_what_was_added_until_closed() -> None:
    warm = KeepWarm(0.01)
    try:
        warm.add(np.ones(64 * PAGE_BYTES, np.uint8))
        deadline = time.monotonic() + 10
        while warm.passes < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert warm.passes >= 3 and warm.error is None
    finally:
        warm.close()
    done = warm.passes
    time.sleep(0.05)
    assert warm.passes == done  # stopped


def test_a_failed_pass_is_kept_and_ends_the_thread() -> None:
    warm = KeepWarm(0.01)
    try:
        warm.add(object())  # not a buffer
        deadline = time.monotonic() + 10
        while warm.error is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert isinstance(warm.error, TypeError) and warm.passes == 0
    finally:
        warm.close()
    with pytest.raises(ValueError, match="period_s"):
        KeepWarm(0)
