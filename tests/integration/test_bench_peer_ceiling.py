"""The peer benchmark's verified ceiling (bench/peer/tier.py, bench/peer/rawtcp.py)
checks the bytes it really received: a raw TCP stream between two processes, each 2 MiB piece
hashed on arrival and compared with the digest the sender computed before
sending. A piece corrupted after its digest was taken must be flagged."""

from __future__ import annotations

import pytest

from bench.peer.rawtcp import PIECE_BYTES, raw_stream


@pytest.mark.parametrize("corrupt_piece", [0, 4])
def test_a_piece_corrupted_after_hashing_is_flagged(corrupt_piece: int) -> None:
    # 4 whole pieces and a short fifth one: the last piece is checked too.
    _, bad = raw_stream(4 * PIECE_BYTES + 4096, 2, verify=True, corrupt_piece=corrupt_piece)
    assert bad == [corrupt_piece]


def test_an_intact_stream_passes() -> None:
    seconds, bad = raw_stream(4 * PIECE_BYTES + 4096, 2, verify=True)
    assert bad == [] and seconds > 0
