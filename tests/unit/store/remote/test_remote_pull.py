"""The remote pull's GET window against a real SeaweedFS: a GET that ends
while an earlier one is still out is replaced at once (the pull never waits
in the order of its blocks with fewer than ``remote_read_depth`` GETs on
the wire), and never more than ``remote_read_depth`` are on the wire."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from tests.conftest import SMALL_LAYOUT
from tierstore.config.remote import RemoteConfig
from tierstore.config.store import StoreConfig
from tierstore.keys import chain_keys
from tierstore.store.tiered import TieredStore

pytestmark = pytest.mark.timeout(120)
L = SMALL_LAYOUT
DEPTH = 2


def test_slow_first_get_does_not_hold_the_others_back(
    store_config: Callable[..., StoreConfig],
    remote_config: Callable[..., RemoteConfig],
    tmp_path: Any,
) -> None:
    rng = np.random.default_rng(5)
    keys = chain_keys(L, rng.integers(0, 32000, 12 * L.block_tokens).tolist())
    blocks = [rng.integers(0, 256, L.block_bytes, dtype=np.uint8).tobytes() for _ in keys]
    with TieredStore(
        store_config(nvme_bytes=0, nvme_dir=str(tmp_path / "nvme")),
        remote=remote_config(remote_read_depth=DEPTH),
    ) as store:
        assert store.remote is not None
        store.put(L, keys, blocks)
        assert store.demote(keys) == len(keys)
        assert store.flush_remote(30)
        assert store.lookup(L, keys).num_hits == 0

        client = store.remote.client
        first = store.remote.path(L.fingerprint, keys[0])
        get = client.get
        others_done = 0
        on_wire = 0
        most_on_wire = 0
        others_done_while_first_out = 0

        async def slow_first_get(path: str) -> Any:
            """Block 0's GET stays out until the GETs after it could finish
            the whole window (or 5 s: the pull waited in order)."""
            nonlocal others_done, on_wire, most_on_wire, others_done_while_first_out
            on_wire += 1
            most_on_wire = max(most_on_wire, on_wire)
            try:
                if path == first:
                    for _ in range(500):
                        if others_done >= 2 * DEPTH - 1:
                            break
                        await asyncio.sleep(0.01)
                    others_done_while_first_out = others_done
                    return await get(path)
                got = await get(path)
                others_done += 1
                return got
            finally:
                on_wire -= 1

        client.get = slow_first_get  # type: ignore[method-assign]
        assert store.pull_remote(L, keys, 30) == len(keys)
        assert store.get(L, keys) == blocks

    # In order with DEPTH in flight, only DEPTH - 1 others could end meanwhile.
    assert others_done_while_first_out == 2 * DEPTH - 1
    assert most_on_wire == DEPTH
