"""Moving blocks up from the remote tier: remote -> DRAM.

Provides ``pull_prefix``, which brings the longest prefix of a request's
keys that this host lacks from the bucket into DRAM, with up to
``remote_read_depth`` GETs in flight: while one block is verified (blake3)
and copied into its slot, the next ones are on the wire, and the loop
starts a queued GET as soon as any other ends (the pull takes the blocks
in order, their GETs need not end in order). A DRAM slot is
reserved only once a block's bytes arrived and verified, so a deadline or
an unreachable store never leaves a reservation or a pin behind; the
pulled blocks are committed unpinned (the caller's ``acquire`` pins them).

Like the promoter, it gets its collaborators explicitly (the remote tier,
the DRAM tier, the arena, ``make_room``, ``on_pulled``) and never calls back
into the store. Runs on the calling thread (a gRPC handler or a prefetch
worker); the GETs run on the remote client's loop thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from tierstore.keys import BlockKey, KVLayout
from tierstore.memory.arena import Arena
from tierstore.memory.memcopy import copy_into
from tierstore.store.dram import STORE_OWNER, DramTier, ReserveStatus
from tierstore.store.remote.tier import RemoteTier


def pull_prefix(
    remote: RemoteTier,
    dram: DramTier,
    arena: Arena,
    layout: KVLayout,
    keys: Sequence[BlockKey],
    held: list[bool],
    timeout_s: float,
    *,
    make_room: Callable[[int], bool],
    on_pulled: Callable[[], None],
) -> int:
    """Pull the blocks of ``keys`` that are not ``held`` here, in order,
    until the first that the bucket lacks, fails verification, or misses
    the deadline, and at most half of DRAM's worth. Returns how many leading
    keys are held afterwards (here or pulled)."""
    if not keys:
        return 0
    deadline = time.monotonic() + timeout_s
    held = list(held)
    fp, nbytes = layout.fingerprint, layout.block_bytes
    # At most half of DRAM per pull: more would only push its own first blocks out.
    limit = max(1, dram.allocator.capacity_bytes // nbytes // 2)
    todo = [i for i, h in enumerate(held) if not h][:limit]
    if not todo:
        return len(keys)
    remote.counters.add("remote_pulls")
    waiting = iter(todo)
    in_flight: deque[tuple[int, concurrent.futures.Future[Any]]] = deque()
    # ``remote_read_depth`` GETs on the wire, kept there by the loop: twice
    # as many are queued ahead of the block waited for, so a GET that ends
    # while an earlier one is still out (or while one is verified and copied
    # here) is replaced at once, not when its turn in the order comes. The
    # window bounds the finished bytes waiting here to 2 x depth blocks.
    depth = remote.cfg.remote_read_depth
    on_wire = asyncio.Semaphore(depth)

    def submit_next() -> None:
        i = next(waiting, None)
        if i is not None:
            in_flight.append((i, remote.get(fp, keys[i], on_wire)))

    for _ in range(2 * depth):
        submit_next()
    pulled = 0
    try:
        while in_flight:
            i, fut = in_flight.popleft()
            try:
                result = fut.result(max(0.0, deadline - time.monotonic()))
            except concurrent.futures.TimeoutError:
                remote.counters.add("remote_pull_timeouts")
                return _held_prefix(held)
            payload = remote.verify(result, fp, keys[i], nbytes)
            if payload is None or not _commit(dram, arena, layout, keys[i], payload, make_room):
                return _held_prefix(held)
            held[i] = True
            pulled += 1
            on_pulled()
            submit_next()
        return _held_prefix(held)
    finally:
        for _, fut in in_flight:
            fut.cancel()  # their results are dropped: nothing was reserved for them
        remote.counters.add("remote_pulled_blocks", pulled)


def _held_prefix(held: list[bool]) -> int:
    n = 0
    while n < len(held) and held[n]:
        n += 1
    return n


def _commit(
    dram: DramTier,
    arena: Arena,
    layout: KVLayout,
    key: BlockKey,
    payload: memoryview,
    make_room: Callable[[int], bool],
) -> bool:
    fp, nbytes = layout.fingerprint, layout.block_bytes
    status, entry = dram.reserve(key, fp, nbytes, STORE_OWNER)
    if status == ReserveStatus.FULL and make_room(nbytes):
        status, entry = dram.reserve(key, fp, nbytes, STORE_OWNER)
    if status == ReserveStatus.EXISTS:
        return True  # another request brought it meanwhile
    if status != ReserveStatus.OK or entry is None:
        return False
    try:
        copy_into(arena.view(entry.offset, nbytes), payload)
    except BaseException:
        dram.abort([key], STORE_OWNER)
        raise
    dram.commit([key], STORE_OWNER)
    return True
