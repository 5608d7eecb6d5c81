"""The first phase of a two-phase write: reserving DRAM slots for a batch.

Provides ``reserve_slots``, what ``TieredStore.reserve`` does across the
tiers: per key EXISTS when a tier holds it already (the tier below DRAM is
asked first, DRAM at the reserve), OK with the arena offset of a fresh DRAM
slot, or FULL when no room could be made. One DRAM lock per pass, not per
key; a pass that runs out of room evicts once (``make_room``) for
everything still to reserve, then the rest goes on.

Its collaborators are explicit (the DRAM tier, the ``contains`` of the tier
below it, the store's ``make_room``), as the promoter's are: it never calls
back into the store. Runs on the caller's thread (any thread of the store,
sidecar process).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tierstore.keys import BlockKey
from tierstore.store.dram import DramTier, ReserveStatus
from tierstore.store.results import Reservation


def reserve_slots(
    dram: DramTier,
    below: Callable[[Sequence[BlockKey]], list[bool]] | None,
    keys: Sequence[BlockKey],
    layout_fp: bytes,
    nbytes: int,
    owner: int,
    make_room: Callable[[int, int], bool],
) -> list[Reservation]:
    """One reservation per key, in order. ``below``: the ``contains`` of the
    tier under DRAM (None without one); ``make_room(nbytes, count)`` evicts
    synchronously, False when no slot of ``nbytes`` fits."""
    out: list[Reservation | None] = [None] * len(keys)
    todo: list[int] = []
    if below is not None:
        for i, elsewhere in enumerate(below(keys)):
            if elsewhere:
                out[i] = Reservation(keys[i], ReserveStatus.EXISTS)
            else:
                todo.append(i)
    else:
        todo = list(range(len(keys)))
    made_room = False
    while todo:
        results = dram.reserve_many([keys[i] for i in todo], layout_fp, nbytes, owner)
        for i, (status, entry) in zip(todo, results):
            if status != ReserveStatus.FULL:
                offset = entry.offset if status == ReserveStatus.OK and entry else -1
                out[i] = Reservation(keys[i], status, offset)
        if results[-1][0] != ReserveStatus.FULL:
            break
        todo = todo[len(results) - 1 :]
        # A pass right after making room that placed nothing (the arena's
        # pages refused, say): the rest is FULL, as without a retry loop.
        stalled = made_room and len(results) == 1
        made_room = True
        if stalled or not make_room(nbytes, len(todo)):
            for i in todo:
                # Spilled meanwhile, by this batch's own reservations: still held.
                held = below is not None and below([keys[i]])[0]
                out[i] = Reservation(keys[i], ReserveStatus.EXISTS if held else ReserveStatus.FULL)
            break
    return [r for r in out if r is not None]
