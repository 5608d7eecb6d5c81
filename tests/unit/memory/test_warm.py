"""tierstore.memory.warm: a touch reads one byte of every page, and only
those bytes."""

from __future__ import annotations

import numpy as np

from tierstore.memory.warm import PAGE_BYTES, touch


def test_touch_reads_one_byte_of_every_page() -> None:
    buf = np.zeros(10 * PAGE_BYTES + 1, np.uint8)
    buf[::PAGE_BYTES] = 1  # the bytes a pass reads: 11 pages, the last one short
    assert touch(buf) == 11
    buf[1::PAGE_BYTES] = 7  # negative control: bytes a pass does not read
    assert touch(buf) == 11
    assert touch(memoryview(buf)) == 11
