"""The router learns from vLLM's own KV events which engine holds a prefix.

vLLM's real ZMQ publisher (``ZmqEventPublisher``, the msgspec-encoded
``KVEventBatch`` of ``--kv-events-config``) on loopback feeds the router's
``EngineIndex``, which chains tierstore's keys over the events' token ids
(vLLM's block hashes are not tierstore keys). Two real sidecars hold
nothing: the turn goes to the host whose engine's events showed its prefix,
and follows when a ``BlockRemoved`` takes half of it back and the other
engine announces all of it. Controls: a prompt no event named is reused
nowhere; an event whose parent the router never saw is not indexed.

Every wait is bounded; sidecars and publishers are stopped at the end.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm")
pytest.importorskip("zmq")

from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    ZmqEventPublisher,
)

from tierstore.config.peer import PeerConfig
from tierstore.config.router import RouterConfig
from tierstore.keys import KVLayout, chain_keys
from tierstore.router.router import Router

from ..conftest import SMALL_LAYOUT
from .test_peers import TOKEN, addr, free_port, start, stop_all

L: KVLayout = SMALL_LAYOUT  # 8 tokens a block
N = 16  # blocks of the prompt
RCFG = RouterConfig(prefill_tokens_per_s=1000.0, router_lookup_timeout_s=2.0)


def wait_for(cond: Callable[[], bool], timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def prompt(seed: int) -> list[int]:
    return (np.arange(N * L.block_tokens + 3, dtype=np.int64) + seed * 100_000).tolist()


def vllm_hash(seed: int, i: int) -> int:
    return seed * 1_000 + i + 1  # opaque to the router, as vLLM's are


def stored(seed: int, lo: int, hi: int, medium: str = "GPU", parent: int | None = None) -> Any:
    """vLLM's BlockStored of blocks [lo, hi) of prompt ``seed``."""
    bt = L.block_tokens
    if parent is None and lo:
        parent = vllm_hash(seed, lo - 1)
    return BlockStored(
        block_hashes=[vllm_hash(seed, i) for i in range(lo, hi)],
        parent_block_hash=parent,
        token_ids=prompt(seed)[lo * bt : hi * bt],
        block_size=bt,
        lora_id=None,
        medium=medium,
        lora_name=None,
    )


class Engine:
    """vLLM's own publisher of one engine's KV events."""

    def __init__(self) -> None:
        self.port = free_port()
        self.pub = ZmqEventPublisher(data_parallel_rank=0, endpoint=f"tcp://*:{self.port}")

    def send(self, *events: Any) -> None:
        self.pub.publish(KVEventBatch(ts=time.time(), events=list(events)))


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[list[str], list[Engine]]]:
    root = tmp_path_factory.mktemp("router-vllm")
    ports = [free_port() for _ in range(2)]
    cars = [start(root / f"h{i}", p, []) for i, p in enumerate(ports)]
    engines = [Engine(), Engine()]
    try:
        yield [addr(p) for p in ports], engines
    finally:
        for e in engines:
            e.pub.shutdown()
        stop_all(*cars)


def router_for(hosts: list[str], engines: list[Engine], tmp_path: Path) -> Router:
    layout = tmp_path / "layout.json"
    layout.write_text(json.dumps(L.to_dict()))
    cfg = RouterConfig(
        router_hosts=tuple(hosts),
        router_vllm_events=tuple(f"{h}=tcp://127.0.0.1:{e.port}" for h, e in zip(hosts, engines)),
        router_vllm_layout=str(layout),
        prefill_tokens_per_s=RCFG.prefill_tokens_per_s,
        router_lookup_timeout_s=RCFG.router_lookup_timeout_s,
    )
    router = Router(cfg, PeerConfig(peer_token=TOKEN))
    # ZMQ drops what is published before a subscription is in: announce
    # nothing (AllBlocksCleared) until each engine's subscriber has a batch.
    assert router.engines is not None
    for sub, engine in zip(router._subscribers, engines):
        wait_for(lambda s=sub, e=engine: e.send(AllBlocksCleared()) or s.counters.batches > 0)
    return router


def held(router: Router, seed: int) -> dict[str, int]:
    """Blocks of the prompt each host holds itself, as the router ranks them
    (the cost model would fetch the others' from a peer)."""
    tokens = prompt(seed)
    plan = router.route(L, chain_keys(L, np.asarray(tokens)), len(tokens))
    return {c.host: c.held_blocks for c in plan.ranked}


def best(router: Router, seed: int) -> str:
    tokens = prompt(seed)
    plan = router.route(L, chain_keys(L, np.asarray(tokens)), len(tokens))
    assert plan.best is not None
    return plan.best.host


def test_a_turn_goes_to_the_engine_whose_vllm_events_showed_its_prefix(
    fleet: tuple[list[str], list[Engine]], tmp_path: Path
) -> None:
    hosts, engines = fleet
    a, b = hosts
    router = router_for(hosts, engines, tmp_path)
    try:
        idx = router.engines
        assert idx is not None
        keys = chain_keys(L, np.asarray(prompt(1)))
        # Engine b's GPU cache holds prompt 1, announced in two events: the
        # second chains from the first's last block (its parent hash).
        engines[1].send(stored(1, 0, 6), stored(1, 6, N))
        wait_for(lambda: len(idx.prefix(b, keys)) == N)
        assert held(router, 1) == {b: N, a: 0}
        assert best(router, 1) == b

        # Controls: a prompt no event named is held nowhere; an event whose
        # parent the router never saw (announced before it subscribed) is skipped.
        before = idx.counters.unknown_parent
        engines[0].send(stored(2, 4, N))
        wait_for(lambda: idx.counters.unknown_parent > before)
        assert held(router, 2) == {a: 0, b: 0}

        # b's engine evicts the second half; a's connector stored all of it in
        # tierstore (medium CPU): the turn now goes to a.
        engines[1].send(BlockRemoved(block_hashes=[vllm_hash(1, i) for i in range(8, N)],
                                     medium="GPU"))  # fmt: skip
        engines[0].send(stored(1, 0, N, medium="CPU"))
        wait_for(lambda: len(idx.prefix(b, keys)) == 8 and len(idx.prefix(a, keys)) == N)
        assert held(router, 1) == {a: N, b: 8}
        assert best(router, 1) == a
        assert router.route(L, keys, len(prompt(1))).ranked[0].source.endswith("+vllm")
        assert all(s.alive() for s in router._subscribers)
    finally:
        router.close()
