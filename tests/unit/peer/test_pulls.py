"""Two pulls of one prefix at once (a gateway's pre-positioning, then the
engine's own load of the same turn) fetch it once: the second waits for the
first and answers what is held then."""

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
        # Once it is done, a new pull of the prefix fetches again (nothing is left registered).
        fetching.clear()
        assert tier.pull(L, keys, 10) == 6 and fetched == [6, 6]
        tier.close()
