"""The vLLM connector's worker against a real sidecar, with CPU-layout pages
(no engine): saves land byte for byte, loads restore them, and every failure
(a missing block, a save missing a layer, a dead sidecar) is a reported miss."""

from __future__ import annotations

import signal
import time

import pytest
import torch

from harness.sidecar import SidecarProcess
from tierstore.client import StoreClient
from tierstore.engines.vllm.layout import ConnectorSettings
from tierstore.engines.vllm.link import StoreLink
from tierstore.engines.vllm.plan import LoadSpec, SaveSpec
from tierstore.engines.vllm.worker import ConnectorWorker
from tierstore.keys import KVLayout, chain_keys

from ..conftest import SidecarFactory

LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(3)]
BT, HEADS, HD = 16, 2, 8
LAYOUT = KVLayout("vllm:worker-test", len(LAYERS), HEADS, HD, "bfloat16", BT)
LAYER_BYTES = LAYOUT.block_bytes // len(LAYERS)


def caches(fill: bool, num_blocks: int = 8) -> dict[str, torch.Tensor]:
    make = torch.randn if fill else torch.zeros
    return {n: make(num_blocks, HEADS, BT, 2 * HD).to(torch.bfloat16) for n in LAYERS}


def worker(
    sidecar: SidecarProcess, kv: dict[str, torch.Tensor], **settings: object
) -> ConnectorWorker:
    s = ConnectorSettings(socket_path=str(sidecar.socket), **settings)  # type: ignore[arg-type]
    w = ConnectorWorker(StoreLink(s, "test"), s, lambda salt: (LAYOUT,), tp_rank=0)
    w.register(kv, LAYERS, LAYER_BYTES)
    return w


@pytest.fixture
def sidecar(sidecar_factory: SidecarFactory) -> SidecarProcess:
    return sidecar_factory("--set", "shutdown_grace_s=0.5", dram="4MiB")


def save(w: ConnectorWorker, keys: list, block_ids: tuple[int, ...], layers: list[str]) -> None:
    w.reserve([SaveSpec("r", "", (tuple(keys),), (block_ids,))])
    for name in layers:
        w.save_layer(name)
    w.end_step()


def test_saved_blocks_load_back_into_other_pages(sidecar: SidecarProcess) -> None:
    src, dst = caches(True), caches(False)
    keys = chain_keys(LAYOUT, list(range(4 * BT)))
    a = worker(sidecar, src)
    save(a, keys, (5, 1, 6, 2), LAYERS)
    assert a.counters.saved_blocks == 4
    save(a, keys[:2], (5, 1), LAYERS)  # already held: no copy, nothing reserved
    assert a.counters.save_exists_blocks == 2
    b = worker(sidecar, dst)
    b.reserve([])
    b.load([LoadSpec("r", "", (tuple(keys[:3]),), ((4, 3, 7),))])
    b.end_step()
    assert b.take_load_errors() == set()
    for n in LAYERS:
        for s, d in ((5, 4), (1, 3), (6, 7)):
            assert torch.equal(dst[n][d], src[n][s])
        assert not dst[n][[0, 1, 2, 5, 6]].any()
    a.link.close()
    b.link.close()


def test_missing_blocks_and_incomplete_saves_are_misses(sidecar: SidecarProcess) -> None:
    src, dst = caches(True), caches(False)
    keys = chain_keys(LAYOUT, list(range(3 * BT)))
    a = worker(sidecar, src)
    save(a, keys[:1], (0,), LAYERS)
    save(a, keys[1:3], (1, 2), LAYERS[:2])  # a layer never came: given back
    assert a.counters.save_aborted_blocks == 2
    with StoreClient(str(sidecar.socket)) as c:
        assert c.lookup(LAYOUT, keys).num_hits == 1
    b = worker(sidecar, dst)
    b.load([LoadSpec("r", "", (tuple(keys),), ((4, 5, 6),))])
    b.end_step()
    assert b.take_load_errors() == {5, 6}
    assert b.take_load_errors() == set()  # reported once
    assert torch.equal(dst[LAYERS[2]][4], src[LAYERS[2]][0])
    a.link.close()
    b.link.close()


def test_a_dead_sidecar_turns_loads_into_errors_and_saves_into_nothing(
    sidecar: SidecarProcess,
) -> None:
    src = caches(True)
    keys = chain_keys(LAYOUT, list(range(2 * BT)))
    w = worker(sidecar, src, reconnect_s=0.2, connect_timeout_s=0.5)
    save(w, keys, (0, 1), LAYERS)
    sidecar.proc.send_signal(signal.SIGKILL)
    sidecar.proc.wait(10)
    w.load([LoadSpec("r", "", (tuple(keys),), ((2, 3),))])
    save(w, chain_keys(LAYOUT, list(range(100, 100 + BT))), (4,), LAYERS)
    w.end_step()
    assert w.take_load_errors() == {2, 3}
    assert w.link.counters.call_failures >= 1
    assert w.link.client() is None  # still down: the engine runs without the store
    w.link.close()


def test_hybrid_groups_copy_each_layer_through_its_groups_blocks(sidecar: SidecarProcess) -> None:
    """vLLM's hybrid manager: layer 1 is a sliding-window group's, with block
    ids of its own and the null block (0) before its window. A load skips
    the null block; a load that misses blocks fails its request whole (vLLM
    takes no failed block ids from a multi-group engine)."""
    src, dst = caches(True), caches(False)
    keys = chain_keys(LAYOUT, list(range(4 * BT)))
    group_of = (0, 1, 0)
    s = ConnectorSettings(socket_path=str(sidecar.socket), async_load_timeout_s=10.0)
    a = ConnectorWorker(StoreLink(s, "test"), s, lambda salt: (LAYOUT,), tp_rank=0)
    a.register(src, LAYERS, LAYER_BYTES, group_of)
    a.reserve([SaveSpec("r", "", (tuple(keys),), ((5, 1, 6, 2), (3, 7, 4, 1)))])
    for name in LAYERS:
        a.save_layer(name)
    a.end_step()
    assert a.counters.saved_blocks == 4
    b = ConnectorWorker(StoreLink(s, "test"), s, lambda salt: (LAYOUT,), tp_rank=0)
    b.register(dst, LAYERS, LAYER_BYTES, group_of)
    b.reserve([])
    b.load([LoadSpec("r", "", (tuple(keys[:3]),), ((4, 3, 7), (0, 5, 6)))])
    b.end_step()
    for n in (LAYERS[0], LAYERS[2]):
        for s_id, d_id in ((5, 4), (1, 3), (6, 7)):
            assert torch.equal(dst[n][d_id], src[n][s_id])
    for s_id, d_id in ((7, 5), (4, 6)):
        assert torch.equal(dst[LAYERS[1]][d_id], src[LAYERS[1]][s_id])
    assert not dst[LAYERS[1]][[0, 1, 2, 3, 4, 7]].any()  # block 0 is null: nothing copied
    # In the background, with a block the store never had: the request fails whole.
    missing = chain_keys(LAYOUT, list(range(5 * BT)))
    b.load([LoadSpec("q", "", (tuple(missing),), ((1, 2, 3, 4, 5), (0, 0, 0, 6, 7)), True)])
    finished: set[str] = set()
    failed: set[str] = set()
    for _ in range(400):
        done, bad = b.finished_loads()
        finished |= done
        failed |= bad
        if finished:
            break
        time.sleep(0.025)
    assert finished == {"q"} and failed == {"q"}
    assert b.take_load_errors() == set()  # no block ids: vLLM would raise on them
    b.close()
    a.link.close()
    b.link.close()
