"""``compress_transfer``: compression is chosen when it has delivered more
bytes per second than raw transfers, measured on this host as it is now;
the codec's idle speed only says whether it is worth trying."""

from __future__ import annotations

import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest

from tierstore.config.peer import PeerConfig
from tierstore.config.store import StoreConfig
from tierstore.load import RateMeter
from tierstore.peer.data import ReceiveResult
from tierstore.peer.tier import PeerTier, _Claim
from tierstore.policies.compression import compress_transfer
from tierstore.store.tiered import TieredStore

from ...conftest import SMALL_LAYOUT as L

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


def test_only_replica_imports_re_time_the_slower_way(
    store_config: Callable[..., StoreConfig],
) -> None:
    """An engine's load never pays for a probe: with compression timed
    slower than raw, pulls stay raw; every 8th import re-times compression."""
    with TieredStore(store_config()) as store:
        tier = PeerTier(store, PeerConfig(peer_port=7700, peer_token="t"), "me:1")
        tier._codec_bytes_per_s = CODEC
        peer = SimpleNamespace(link=RateMeter(), packed=RateMeter(), background_transfers=0)
        peer.link.add(200 << 20, 1.0)  # a slow raw link: compression worth trying
        peer.packed.add(30 << 20, 1.0)  # ... and timed slower still
        asked: list[bool] = []

        def receive(
            peer: Any, layout: Any, keys: Any, deadline: float, compress: bool, claim: Any
        ) -> Any:
            asked.append(compress)
            return ReceiveResult()

        tier._receive = receive  # type: ignore[method-assign]
        for background in (False, True):
            for _ in range(16):
                tier._fetch(peer, L, [], time.monotonic() + 1, _Claim("pull"), background)  # type: ignore[arg-type]
        pulls, imports = asked[:16], asked[16:]
        assert pulls == [False] * 16
        assert imports == ([False] * 7 + [True]) * 2
        assert tier.counters.snapshot()["fetches_compressed"] == 2
        tier.close()
