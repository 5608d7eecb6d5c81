"""The load of the fault bench (bench/reliability/faults.py): engines and a
writer, each a worker process the bench SIGKILLs and starts again.

- ``engine``: multi-turn sessions over two hosts' sidecars. Each turn loads
  the session's prefix (``include_peers``: DRAM, NVMe, the other host, the
  bucket), checks every block that came back against the bytes derived from
  its key (``harness.reliability.block_of``), stores the blocks that were
  not served (what the engine would have recomputed) and the turn's new
  ones, and ends the turn; every ``durable_every``-th turn waits for the
  bucket (a durable EndTurn). A session's next turn moves to the other host
  with probability ``switch_p``. A restarted engine resumes its sessions
  where its predecessor's log says they were, as users who reconnect.
- ``writer``: two-phase writes (reserve, write each slot in two halves as a
  layer-by-layer copy does, commit or abort) of fresh chains, logging each
  chain reserved before writing, so that a writer killed mid-copy leaves
  half-written slots the sidecar must never serve.

Both report one JSON line per event to their own log (appended across
restarts), with a wall-clock time ``t`` that the bench matches against its
fault windows. A call that raises is logged (``op: error``) with where it
happened, the client is dropped and made again for the next call; a host
whose sidecar is down is logged as ``unavailable`` and skipped for a moment.
Every call has a deadline (the client's connect and call timeouts, the
load's ``deadline_s``, the durable EndTurn's timeout).
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .reliability import (
    BLOCK,
    LAYOUT,
    EventLog,
    block_of,
    blocks_of,
    chain,
    count_wrong,
    read_events,
)

LOAD_DEADLINE_S = 3.0  # a moved turn's pull gives up after this (the rest is prefilled)
DURABLE_TIMEOUT_S = 3.0  # a durable EndTurn waits this long for the bucket
DOWN_PAUSE_S = 0.2  # a host found down is not tried again for this long
CONNECT_TIMEOUT_S, CALL_TIMEOUT_S = 2.0, 10.0


class Hosts:
    """One StoreClient per host, made on first use and dropped on any error."""

    def __init__(self, sockets: Sequence[str], name: str, log: EventLog) -> None:
        self.sockets = list(sockets)
        self.name = name
        self.log = log
        self.clients: list[Any] = [None] * len(sockets)
        self.down_until = [0.0] * len(sockets)

    def get(self, h: int) -> Any:
        """The client of host ``h``, or None while its sidecar does not answer."""
        from tierstore.client import StoreClient
        from tierstore.errors import TierstoreError

        if self.clients[h] is None:
            if time.monotonic() < self.down_until[h]:
                return None
            try:
                self.clients[h] = StoreClient(
                    self.sockets[h], name=f"{self.name}-h{h}",
                    connect_timeout_s=CONNECT_TIMEOUT_S, call_timeout_s=CALL_TIMEOUT_S,
                )  # fmt: skip
            except (TierstoreError, OSError) as e:
                self.down_until[h] = time.monotonic() + DOWN_PAUSE_S
                self.log(op="unavailable", t=time.time(), host=h, error=str(e)[:200])
                return None
        return self.clients[h]

    def drop(self, h: int) -> None:
        client, self.clients[h] = self.clients[h], None
        if client is not None:
            with contextlib.suppress(Exception):  # a dead sidecar's client may fail to close
                client.close()


def _sessions(log_path: str, slots: int) -> dict[int, dict[str, int]]:
    """Each slot's last completed turn in an earlier life of this engine."""
    last: dict[int, dict[str, int]] = {}
    for e in read_events(Path(log_path)):
        if e.get("op") == "turn":
            last[e["slot"]] = {"gen": e["gen"], "turn": e["turn"], "host": e["host"]}
    return {i: last[i] for i in range(slots) if i in last}


def check(keys: Sequence[bytes], rows: Any, n: int) -> tuple[int, int]:
    """Of the first ``n`` loaded rows: how many differ from their key's bytes, and
    how many bytes differ in all."""
    import numpy as np

    wrong = count_wrong(keys, rows, n)
    if not wrong:
        return 0, 0
    true = np.frombuffer(b"".join(block_of(k) for k in keys[:n]), np.uint8).reshape(n, BLOCK)
    return wrong, int((rows[:n].numpy() != true).sum())


def session_seed(engine_id: int, slot: int, gen: int) -> int:
    return (engine_id + 1) * 10_000_000 + slot * 10_000 + gen


def engine(
    sockets: Sequence[str],
    log_path: str,
    engine_id: int,
    duration_s: float,
    slots: int = 4,
    turn_blocks: int = 16,
    max_turns: int = 8,
    switch_p: float = 0.3,
    durable_every: int = 3,
) -> None:
    """Run ``slots`` sessions' turns, one at a time, until ``duration_s`` passes."""
    from tierstore.errors import TierstoreError

    log = EventLog(log_path)
    hosts = Hosts(sockets, f"engine{engine_id}", log)
    state = {i: {"gen": 0, "turn": -1, "host": -1} for i in range(slots)}
    state.update(_sessions(log_path, slots))
    end = time.monotonic() + duration_s
    slot = 0
    while time.monotonic() < end:
        st = state[slot]
        gen, turn = st["gen"], st["turn"] + 1
        if turn >= max_turns:  # the conversation ended: a new one in this slot
            gen, turn = gen + 1, 0
        seed = session_seed(engine_id, slot, gen)
        rng = random.Random(seed * 1000 + turn)
        host = st["host"]
        if turn == 0 or host < 0:
            host = rng.randrange(len(sockets))
        elif rng.random() < switch_p:
            host = 1 - host
        moved = turn > 0 and host != st["host"]
        client = hosts.get(host)
        if client is None:
            time.sleep(0.05)
            slot = (slot + 1) % slots
            continue
        keys = chain(seed, (turn + 1) * turn_blocks)
        prefix = keys[: turn * turn_blocks]
        stage = "load"
        t0 = time.monotonic()
        try:
            served, wrong, wrong_bytes = 0, 0, 0
            tiers: dict[str, int] = {}
            if prefix:
                res = client.load(LAYOUT, prefix, include_peers=True, deadline_s=LOAD_DEADLINE_S)
                served = res.num_blocks
                wrong, wrong_bytes = check(prefix, res.blocks, served)
                for tier in res.tiers[:served]:
                    tiers[tier.name.lower()] = tiers.get(tier.name.lower(), 0) + 1
            stage = "store"
            rest = keys[served:]
            client.store(LAYOUT, rest, blocks_of(rest))
            stage = "end_turn"
            durable = (turn + 1) % durable_every == 0
            reply = client.end_turn(
                f"e{engine_id}s{slot}g{gen}", LAYOUT, keys, len(keys) * LAYOUT.block_tokens,
                durable=durable, durable_timeout_s=DURABLE_TIMEOUT_S if durable else 0.0,
            )  # fmt: skip
        except TierstoreError as e:
            log(op="error", t=time.time(), host=host, stage=stage, error=str(e)[:200])
            hosts.drop(host)
            slot = (slot + 1) % slots
            continue
        log(
            op="turn", t=time.time(), slot=slot, gen=gen, turn=turn, seed=seed, host=host,
            moved=moved, asked=len(prefix), served=served, wrong=wrong, wrong_bytes=wrong_bytes,
            tiers=tiers,
            blocks=len(keys), durable=bool(durable and reply.durable), asked_durable=durable,
            s=round(time.monotonic() - t0, 4),
        )  # fmt: skip
        state[slot] = {"gen": gen, "turn": turn, "host": host}
        slot = (slot + 1) % slots


def writer(
    sockets: Sequence[str], log_path: str, writer_id: int, duration_s: float, chain_blocks: int = 32
) -> None:
    """Two-phase writes of fresh chains on either host until ``duration_s`` passes."""
    import numpy as np

    from tierstore.client import ReserveStatus
    from tierstore.errors import TierstoreError

    log = EventLog(log_path)
    hosts = Hosts(sockets, f"writer{writer_id}", log)
    rng = random.Random(writer_id * 7919 + int(time.time()))
    end = time.monotonic() + duration_s
    half = BLOCK // 2
    while time.monotonic() < end:
        host = rng.randrange(len(sockets))
        client = hosts.get(host)
        if client is None:
            time.sleep(0.05)
            continue
        cid = (writer_id + 1) * 100_000_000 + rng.randrange(100_000_000)
        keys = chain(cid, chain_blocks)
        try:
            got = client.reserve(LAYOUT, keys)
            ok = [k for k, s in zip(got.keys, got.statuses) if s == ReserveStatus.OK]
            log(op="reserved", t=time.time(), host=host, chain=cid, n=len(got.keys))
            arena = client.arena_tensor.numpy()
            offsets = [o for o, s in zip(got.offsets, got.statuses) if s == ReserveStatus.OK]
            for key, off in zip(ok, offsets):  # first halves, then second halves
                arena[off : off + half] = np.frombuffer(block_of(key)[:half], np.uint8)
            for key, off in zip(ok, offsets):
                arena[off + half : off + BLOCK] = np.frombuffer(block_of(key)[half:], np.uint8)
            if rng.random() < 0.2:
                client.abort(LAYOUT, ok)
                log(op="aborted", t=time.time(), host=host, chain=cid)
            else:
                done = client.commit(LAYOUT, ok)
                log(op="committed", t=time.time(), host=host, chain=cid, n=sum(done))
        except TierstoreError as e:
            log(op="error", t=time.time(), host=host, stage="write", error=str(e)[:200])
            hosts.drop(host)
