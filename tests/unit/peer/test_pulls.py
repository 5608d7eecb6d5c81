"""Two pulls of one prefix at once (a gateway's pre-positioning, then the
engine's own load of the same turn) fetch each block once: the second waits
for the blocks the first is fetching and fetches only the rest."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from tierstore.config.peer import PeerConfig
from tierstore.config.store import StoreConfig
from tierstore.keys import chain_keys
from tierstore.peer.data import ReceiveResult
from tierstore.peer.tier import PeerTier, _Claim
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

        def fetch(
            peer: Any, layout: Any, ks: list[Any], deadline: float, claim: _Claim, background: bool
        ) -> ReceiveResult:
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


class _Transfers:
    """Stands in for ``PeerTier._fetch``: the first transfer blocks until
    released, then each stores its blocks; records how many blocks each one
    carried, in the order they ended."""

    def __init__(self, store: TieredStore) -> None:
        self.store = store
        self.started = threading.Event()
        self.release = threading.Event()
        self.sizes: list[int] = []

    def __call__(
        self,
        peer: Any,
        layout: Any,
        ks: list[Any],
        deadline: float,
        claim: _Claim,
        background: bool,
    ) -> ReceiveResult:
        if not self.started.is_set():
            self.started.set()
            self.release.wait(10)
        self.store.put(layout, ks, np.zeros((len(ks), L.block_bytes), dtype=np.uint8))
        self.sizes.append(len(ks))
        return ReceiveResult(received=len(ks), keys=list(ks))


def _tier(store: TieredStore, transfers: _Transfers) -> PeerTier:
    # A real client for the source (gRPC channels connect lazily: nothing is dialled).
    tier = PeerTier(store, PeerConfig(peer_port=7700, peer_token="t", peers=["src:1"]), "me:1")
    tier.lookup = lambda layout, ks, timeout_s: (object(), len(ks))  # type: ignore[method-assign]
    tier._fetch = transfers  # type: ignore[method-assign]
    return tier


def _import_then_pull(tier: PeerTier, transfers: _Transfers, keys: list[Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    push = threading.Thread(
        target=lambda: out.update(reply=tier.import_replica(L, keys, "src:1", 10))
    )
    push.start()
    assert transfers.started.wait(10)
    pull = threading.Thread(target=lambda: out.update(pulled=tier.pull(L, keys, 10)))
    pull.start()
    time.sleep(0.05)  # the pull is waiting (or, without the claim, fetching) now
    transfers.release.set()
    push.join(10)
    pull.join(10)
    return out


def test_a_pull_joins_a_replica_import_of_the_same_blocks(
    store_config: Callable[..., StoreConfig],
) -> None:
    """A turn that moves while its replica is being pushed here: the engine's
    load waits for the import instead of fetching the blocks a second time
    (and racing it for their slots)."""
    keys = chain_keys(L, np.arange(6 * L.block_tokens) + 20_000)
    with TieredStore(store_config()) as store:
        transfers = _Transfers(store)
        tier = _tier(store, transfers)
        out = _import_then_pull(tier, transfers, keys)
        assert transfers.sizes == [6]  # one transfer: the import's
        assert out["reply"].imported == 6 and out["pulled"] == 6
        counters = tier.counters.snapshot()
        assert counters["pulls_joined"] == 1 and counters["pulls"] == 1
        assert tier._pulling == {}
        tier.close()


def test_an_import_leaves_to_a_running_pull_the_blocks_it_fetches(
    store_config: Callable[..., StoreConfig],
) -> None:
    keys = chain_keys(L, np.arange(6 * L.block_tokens) + 30_000)
    with TieredStore(store_config()) as store:
        transfers = _Transfers(store)
        tier = _tier(store, transfers)
        out: dict[str, Any] = {}
        pull = threading.Thread(target=lambda: out.update(pulled=tier.pull(L, keys[:4], 10)))
        pull.start()
        assert transfers.started.wait(10)
        push = threading.Thread(
            target=lambda: out.update(reply=tier.import_replica(L, keys, "src:1", 10))
        )
        push.start()
        push.join(10)  # does not wait for the pull: fetches only the two it lacks
        assert transfers.sizes == [2] and out["reply"].imported == 2
        transfers.release.set()
        pull.join(10)
        assert transfers.sizes == [2, 4] and out["pulled"] == 4
        assert tier.counters.snapshot()["replicas_joined"] == 4
        assert store.held(keys) == [True] * 6
        tier.close()


def test_negative_control_without_the_claim_the_pull_fetches_again(
    store_config: Callable[..., StoreConfig],
) -> None:
    """The oracle above (one transfer) fails when the import does not
    register what it fetches: the pull then fetches the same blocks again."""
    keys = chain_keys(L, np.arange(6 * L.block_tokens) + 40_000)
    with TieredStore(store_config()) as store:
        transfers = _Transfers(store)
        tier = _tier(store, transfers)
        claim = tier._claim
        registered = iter([False, True])  # the import's claim not registered, the pull's is

        def forgetful(ks: Any, kind: str) -> tuple[Any, list[Any]]:
            return claim(ks, kind) if next(registered) else (_Claim(kind), list(ks))

        tier._claim = forgetful  # type: ignore[method-assign]
        _import_then_pull(tier, transfers, keys)
        assert transfers.sizes == [6, 6]  # the defect the claim prevents: two transfers
        assert tier.counters.snapshot()["pulls_joined"] == 0
        tier.close()


def test_a_pull_of_the_head_returns_once_the_head_has_landed(
    store_config: Callable[..., StoreConfig],
) -> None:
    """An engine's prefetch pulls a whole prefix; its loads of the first
    blocks return as soon as those landed, while the transfer still runs
    (the load copies them meanwhile), not when the transfer ends."""
    keys = chain_keys(L, np.arange(6 * L.block_tokens) + 50_000)
    with TieredStore(store_config()) as store:
        head_landed, finish = threading.Event(), threading.Event()
        fetched: list[int] = []

        def fetch(
            peer: Any, layout: Any, ks: list[Any], deadline: float, claim: _Claim, background: bool
        ) -> ReceiveResult:
            for lo, hi in ((0, 2), (2, len(ks))):  # two batches land, the second held back
                if lo:
                    finish.wait(10)
                store.put(layout, ks[lo:hi], np.zeros((hi - lo, L.block_bytes), dtype=np.uint8))
                claim.land(ks[lo:hi])
                if not lo:
                    head_landed.set()
            fetched.append(len(ks))
            return ReceiveResult(received=len(ks), keys=list(ks))

        tier = PeerTier(store, PeerConfig(peer_port=7700, peer_token="t"), "me:1")
        tier.lookup = lambda layout, ks, timeout_s: (object(), len(ks))  # type: ignore[method-assign]
        tier._fetch = fetch  # type: ignore[method-assign]
        whole = threading.Thread(target=lambda: tier.pull(L, keys, 10))
        whole.start()
        assert head_landed.wait(10)
        t0 = time.monotonic()
        got = tier.pull(L, keys[:2], 5)  # joins the running transfer
        waited = time.monotonic() - t0
        still_running = not finish.is_set() and fetched == []
        finish.set()
        whole.join(10)
        assert got == 2 and still_running and waited < 5  # not held to the transfer's end
        assert fetched == [6] and tier.counters.snapshot()["pulls_joined"] == 1
        tier.close()
