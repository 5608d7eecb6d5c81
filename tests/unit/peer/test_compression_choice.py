"""``compress_transfer``: compression is chosen when it has delivered more
bytes per second than raw transfers, measured on this host as it is now;
the codec's idle speed only says whether it is worth trying."""

from __future__ import annotations

import pytest

from tierstore.policies.compression import compress_transfer

CODEC = 1e9  # this host's byte-split zstd at start, bytes/s


@pytest.mark.parametrize(
    ("raw", "packed", "probe", "want"),
    [
        (0.0, 0.0, False, False),  # the link not timed yet: raw first
        (0.0, 0.0, True, False),
        (5e9, 0.0, False, False),  # a link faster than the codec: never compressed
        (5e9, 0.0, True, False),
        (5e9, 9e9, True, False),
        (2e8, 0.0, False, True),  # a slow link, compression untried: try it
        (2e8, 4e8, False, True),  # compression delivered more: keep it
        (2e8, 4e8, True, False),  # ... re-timing raw now and then
        # A CPU-bound host: the link reads slow, compressing made it slower still.
        (2e8, 5e7, False, False),
        (2e8, 5e7, True, True),  # ... and compression is re-timed now and then
    ],
)
def test_compress_transfer(raw: float, packed: float, probe: bool, want: bool) -> None:
    assert compress_transfer(raw, packed, CODEC, probe) is want


def test_a_slow_compressed_transfer_turns_compression_off_for_the_next_ones() -> None:
    """The fleet's case, as a sequence: the link timed slow on a busy host,
    one compressed transfer timed slower still; the next seven go raw, the
    eighth re-times compression."""
    raw, packed = 2e8, 0.0
    assert compress_transfer(raw, packed, CODEC, probe=False)
    packed = 3e7  # what that compressed transfer delivered
    choices = [compress_transfer(raw, packed, CODEC, probe=i % 8 == 7) for i in range(8)]
    assert choices == [False] * 7 + [True]
