"""The peer benchmark's verified ceiling (bench/peer/tier.py, bench/peer/rawtcp.py)
checks the bytes it really received: a raw TCP stream between two processes, each 2 MiB piece
hashed on arrival (on a pool, or call by call on the receiving thread) and
compared with the digest the sender computed before sending. A piece
corrupted after its digest was taken must be flagged, in every way of
reading and checking."""

from __future__ import annotations

import pytest

from bench.peer.rawtcp import CALL_SIZES, PIECE_BYTES, VERIFY_MODES, raw_stream
from harness.netns import Network, run_in_netns

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


@pytest.mark.parametrize("corrupt_piece", [-1, 2])
def test_across_a_link_between_namespaces_the_received_bytes_are_checked(
    corrupt_piece: int,
) -> None:
    """The ceiling at a link's rate (``bench.engines.vllm_load --link``):
    the sender in one namespace, the receiver on a thread in the other;
    the check still flags a piece corrupted after hashing, and only it."""
    with Network(2, subnet="10.203.0", prefix="tsc") as net:
        seconds, bad = run_in_netns(
            net.ns[1],
            lambda: raw_stream(
                4 * PIECE_BYTES, 2, "inline", corrupt_piece=corrupt_piece,
                host=net.addr[1], sender_prefix=net.prefix(0),
            ),
        )  # fmt: skip
    assert seconds > 0 and bad == ([] if corrupt_piece < 0 else [corrupt_piece])
