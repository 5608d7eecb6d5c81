"""StoreClient.reserve / commit / abort: filling arena slots in place (the
vLLM connector copies each layer of a block into its slot as vLLM computes it)."""

from __future__ import annotations

import pytest

from harness.sidecar import SidecarProcess
from tierstore.client import ReserveStatus, StoreClient
from tierstore.errors import TierstoreError
from tierstore.keys import KVLayout, chain_keys

from ..conftest import SidecarFactory

LAYOUT = KVLayout("reserve-test", 2, 2, 64, "float16", 8)  # 8 KiB blocks


@pytest.fixture
def sidecar(sidecar_factory: SidecarFactory) -> SidecarProcess:
    return sidecar_factory("--set", "shutdown_grace_s=0.5", dram="1MiB")


def test_reserved_slots_filled_in_place_commit_and_abort(sidecar: SidecarProcess) -> None:
    keys = chain_keys(LAYOUT, list(range(4 * 8)))
    n = LAYOUT.block_bytes
    with StoreClient(str(sidecar.socket)) as c:
        got = c.reserve(LAYOUT, keys[:3])
        assert got.statuses == (ReserveStatus.OK,) * 3
        assert all(o >= 0 for o in got.offsets)
        arena = c.arena_tensor.numpy()
        for i, off in enumerate(got.offsets[:2]):  # in two halves, like two layers
            arena[off : off + n // 2] = i + 1
            arena[off + n // 2 : off + n] = i + 10
        assert c.lookup(LAYOUT, keys).num_hits == 0  # reserved is not readable
        assert c.commit(LAYOUT, keys[:2]) == [True, True]
        assert c.abort(LAYOUT, keys[2:3]) == 1
        assert c.lookup(LAYOUT, keys).num_hits == 2
        loaded = c.load(LAYOUT, keys).blocks.numpy()
        assert (loaded[0, : n // 2] == 1).all() and (loaded[1, n // 2 :] == 11).all()
        again = c.reserve(LAYOUT, keys)
        assert again.statuses[:2] == (ReserveStatus.EXISTS,) * 2
        assert again.offsets[:2] == (-1, -1)
        assert again.statuses[2:] == (ReserveStatus.OK,) * 2
        assert c.abort(LAYOUT, keys[2:]) == 2
        assert c.commit(LAYOUT, []) == [] and c.abort(LAYOUT, []) == 0


def test_commit_of_what_was_not_reserved_is_refused(sidecar: SidecarProcess) -> None:
    keys = chain_keys(LAYOUT, list(range(8)))
    with StoreClient(str(sidecar.socket)) as c, StoreClient(str(sidecar.socket)) as other:
        c.reserve(LAYOUT, keys)
        with pytest.raises(TierstoreError, match="not reserved"):
            other.commit(LAYOUT, keys)
        assert c.commit(LAYOUT, keys) == [True]
        assert other.lookup(LAYOUT, keys).num_hits == 1
