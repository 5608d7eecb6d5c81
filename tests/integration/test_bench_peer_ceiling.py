"""The peer benchmark's verified ceiling (bench/peer/tier.py, bench/peer/rawtcp.py)
checks the bytes it really received: a raw TCP stream between two processes, each 2 MiB piece
hashed on arrival (on a pool, or call by call on the receiving thread) and
compared with the digest the sender computed before sending. A piece
corrupted after its digest was taken must be flagged, in every way of
reading and checking."""

from __future__ import annotations

import pytest

from bench.peer.rawtcp import CALL_SIZES, PIECE_BYTES, VERIFY_MODES, raw_stream

WAYS = [(mode, call) for mode in VERIFY_MODES for call in CALL_SIZES]


@pytest.mark.parametrize(("mode", "call_bytes"), WAYS)
@pytest.mark.parametrize("corrupt_piece", [0, 4])
def test_a_piece_corrupted_after_hashing_is_flagged(
    mode: str, call_bytes: int, corrupt_piece: int
) -> None:
    # 4 whole pieces and a short fifth one: the last piece is checked too.
    _, bad = raw_stream(4 * PIECE_BYTES + 4096, 2, mode, call_bytes, corrupt_piece)
    assert bad == [corrupt_piece]


@pytest.mark.parametrize(("mode", "call_bytes"), WAYS)
def test_an_intact_stream_passes(mode: str, call_bytes: int) -> None:
    seconds, bad = raw_stream(4 * PIECE_BYTES + 4096, 2, mode, call_bytes)
    assert bad == [] and seconds > 0
