"""Two pulls of one prefix at once (a gateway's pre-positioning, then the
engine's own load of the same turn) fetch each block once: the second waits
for the blocks the first is fetching and fetches only the rest."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from tierstore.config.peer import PeerConfig
from tierstore.config.store import StoreConfig
from tierstore.keys import chain_keys
from tierstore.peer.data import ReceiveResult
from tierstore.peer.tier import PeerTier
from tierstore.store.tiered import TieredStore

from ...conftest import SMALL_LAYOUT as L


def test_a_second_pull_of_the_same_prefix_joins_the_first(
    store_config: Callable[..., StoreConfig],
) -> None:
    keys = chain_keys(L, np.arange(6 * L.block_tokens))
    with TieredStore(store_config()) as store:
        tier = PeerTier(store, PeerConfig(peer_port=7700, peer_token="t"), "me:1")
        fetching, release = threading.Event(), threading.Event()
        fetched: list[int] = []

        def fetch(peer: Any, layout: Any, ks: list[Any], deadline: float) -> ReceiveResult:
            fetching.set()
            release.wait(10)
            store.put(layout, ks, np.zeros((len(ks), L.block_bytes), dtype=np.uint8))
            fetched.append(len(ks))
            return ReceiveResult(received=len(ks))

        tier.lookup = lambda layout, ks, timeout_s: (object(), len(ks))  # type: ignore[method-assign]
        tier._fetch = fetch  # type: ignore[method-assign]
        results: dict[str, int] = {}
        first = threading.Thread(target=lambda: results.update(a=tier.pull(L, keys, 10)))
        first.start()
        assert fetching.wait(10)
        second = threading.Thread(target=lambda: results.update(b=tier.pull(L, keys, 10)))
        second.start()
        release.set()
        first.join(10)
        second.join(10)
        assert fetched == [6]  # one transfer
        assert results == {"a": 6, "b": 6}
        assert tier.counters.snapshot()["pulls_joined"] == 1
        assert tier._pulling == {}  # nothing left registered
        # A longer chain whose head is being fetched: the head is waited for,
        # only the rest is fetched.
        longer = chain_keys(L, np.arange(9 * L.block_tokens) + 10_000)
        fetching.clear()
        release.clear()
        first = threading.Thread(target=lambda: results.update(c=tier.pull(L, longer[:4], 10)))
        first.start()
        assert fetching.wait(10)
        second = threading.Thread(target=lambda: results.update(d=tier.pull(L, longer, 10)))
        second.start()
        release.set()
        first.join(10)
        second.join(10)
        assert fetched == [6, 4, 5] and results["c"] == 4 and results["d"] == 9
        assert tier.counters.snapshot()["pulls_joined"] == 2
        assert tier.pull(L, longer, 10) == 9 and fetched == [6, 4, 5]  # all held: no fetch
        tier.close()
