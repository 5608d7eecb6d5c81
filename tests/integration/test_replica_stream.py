"""Replicas streamed during the turn, the replication policy, and hash once,
between real sidecars on loopback.

- a session's blocks committed with its id reach its spill host before the
  turn ends, so the next turn landing there is warm and ``end_turn`` pushes
  nothing more;
- a turn shorter than ``min_tokens`` is replicated while the link has
  headroom, and not when the link (configured slow) has none; ``min_tokens``
  stays the floor;
- a block's blake3 digest is computed once, on the host that committed it:
  the sender of a fetch and the receiver's store never hash it again.

Sidecars are real ``tierstore serve`` processes (harness/sidecar.py);
every wait is bounded and every process started here is stopped.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from tierstore.cli.ports import free_port
from tierstore.client import StoreClient

from .test_peers import (
    BLOCK,
    MIN_TOKENS,
    L,
    SidecarProcess,
    addr,
    counters,
    fp16_blocks,
    keys_of,
    session_for,
    start,
    stop_all,
    tokens,
)

WAIT_S = 15.0


def wait_for(what: str, check: Callable[[], bool], timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s}s")
        time.sleep(0.05)


class Pair:
    def __init__(self, root: Path, *extra: str) -> None:
        self.ports = [free_port(), free_port()]
        self.addrs = [addr(p) for p in self.ports]
        self.procs: list[SidecarProcess] = []
        try:
            for i, name in enumerate("ab"):
                self.procs.append(start(root / name, self.ports[i], [self.ports[1 - i]], *extra))
        except BaseException:
            stop_all(*self.procs)
            raise

    def client(self, i: int) -> StoreClient:
        return StoreClient(str(self.procs[i].socket))


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    """Default replication: the headroom policy, streaming on."""
    p = Pair(tmp_path_factory.mktemp("stream"), "--set", f"replica_bytes={256 * BLOCK}")
    yield p
    stop_all(*p.procs)


@pytest.fixture(scope="module")
def slow_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    """A link assumed at 1 kB/s: no headroom for any push."""
    p = Pair(tmp_path_factory.mktemp("slow"), "--set", "link_bytes_per_s=1000")
    yield p
    stop_all(*p.procs)


def test_streamed_replica_is_current_when_the_next_turn_lands_there(pair: Pair) -> None:
    n = 40
    toks = tokens(n, 7_000_000)
    keys, data = keys_of(toks), fp16_blocks(n, 70)
    session = session_for(pair.addrs[1], pair.addrs, pair.addrs[0], "stream")
    with pair.client(0) as a, pair.client(1) as b:
        streamed = counters(a)["peer_streamed_blocks"]
        # The turn stores its blocks in two steps, as an engine does while it runs.
        assert all(a.store(L, keys[:24], data[:24], session=session))
        assert all(a.store(L, keys[24:], data[24:], session=session))
        # Before the turn ends, the spill host holds all of it.
        wait_for("streamed replica", lambda: b.lookup(L, keys).num_hits == n)
        assert counters(a)["peer_streamed_blocks"] - streamed == n
        reply = a.end_turn(session, L, keys, len(toks), wait=True)
        assert reply.replica_target == pair.addrs[1]
        assert reply.pushed == 0  # nothing was left to send
        res = b.load(L, keys)  # the next turn, on the other host: warm
        assert res.num_blocks == n and torch.equal(res.blocks, data)


def test_short_turn_is_replicated_with_headroom(pair: Pair) -> None:
    n = 4
    toks = tokens(n, 7_100_000)  # 32 tokens < min_tokens
    assert len(toks) < MIN_TOKENS
    keys = keys_of(toks)
    session = session_for(pair.addrs[1], pair.addrs, pair.addrs[0], "short")
    with pair.client(0) as a, pair.client(1) as b:
        a.store(L, keys, fp16_blocks(n, 71))
        reply = a.end_turn(session, L, keys, len(toks), wait=True)
        assert reply.replicating and reply.pushed == n
        assert b.lookup(L, keys).num_hits == n


def test_short_turn_is_not_replicated_under_pressure(slow_pair: Pair) -> None:
    p = slow_pair
    short, long = tokens(4, 7_200_000), tokens(MIN_TOKENS // 8, 7_300_000)
    session = session_for(p.addrs[1], p.addrs, p.addrs[0], "pressure")
    with p.client(0) as a, p.client(1) as b:
        skipped = counters(a)["peer_pushes_skipped"]
        keys = keys_of(short)
        a.store(L, keys, fp16_blocks(4, 72))
        reply = a.end_turn(session, L, keys, len(short), wait=True)
        assert not reply.replicating and reply.pushed == 0
        assert counters(a)["peer_pushes_skipped"] - skipped == 1
        assert b.lookup(L, keys).num_hits == 0
        # min_tokens is the floor: a turn that long is replicated whatever the link.
        keys = keys_of(long)
        a.store(L, keys, fp16_blocks(len(keys), 73))
        reply = a.end_turn(session + "-long", L, keys, len(long), wait=True)
        assert reply.replicating


def test_streaming_under_pressure_leaves_the_turn_to_end_turn(slow_pair: Pair) -> None:
    p = slow_pair
    toks = tokens(4, 7_400_000)
    keys = keys_of(toks)
    session = session_for(p.addrs[1], p.addrs, p.addrs[0], "nostream")
    with p.client(0) as a:
        skipped = counters(a)["peer_stream_skipped_blocks"]
        a.store(L, keys, fp16_blocks(4, 74), session=session)
        assert counters(a)["peer_stream_skipped_blocks"] - skipped == 4


def test_digest_is_computed_once(pair: Pair) -> None:
    n = 24
    keys, data = keys_of(tokens(n, 7_500_000)), fp16_blocks(n, 75)
    with pair.client(0) as a, pair.client(1) as b:
        before_a, before_b = counters(a), counters(b)
        assert all(a.store(L, keys, data))
        # Hashed once, in the background, after the commit.
        wait_for(
            "digests on commit",
            lambda: counters(a)["digests_computed"] - before_a["digests_computed"] == n,
        )
        res = b.load(L, keys, include_peers=True, deadline_s=10.0)  # pull on switch
        assert res.num_blocks == n and torch.equal(res.blocks, data)
        after_a, after_b = counters(a), counters(b)
        assert after_a["digests_computed"] - before_a["digests_computed"] == n
        assert after_a["peer_send_hashes"] == before_a["peer_send_hashes"]  # the sender: none
        assert after_b["peer_fetched_blocks"] - before_b["peer_fetched_blocks"] == n
        assert after_b["digests_computed"] == before_b["digests_computed"]  # verified, kept
        assert after_b["peer_fetch_verify_failures"] == before_b["peer_fetch_verify_failures"]
