"""Finished turns on their way to the bucket: what a crash would lose now,
and how long a turn takes from EndTurn to durable.

Provides, for ``tierstore.store.remote.upload``:
- ``TurnJob``: one turn accepted for write-through (its chain, when it was
  accepted, and the future a durable EndTurn waits on);
- ``TurnLedger``: the turns accepted and not yet durable (the gauges
  ``remote_turns_not_durable`` and ``remote_turn_blocks_not_durable``: what
  a SIGKILL of the sidecar, or the loss of the host, would lose of them right
  now), the EndTurn -> durable time of the last ``window_turns`` turns
  written through (``remote_turn_durable_p50_us`` / ``_p99_us`` gauges, and
  ``_us_total`` / ``_us_max`` over all), and ``wait``: a durable EndTurn's
  bounded wait for its turn;
- ``Durability``: what that wait found.

A turn is durable when the bucket acknowledged every block of its chain:
a PUT answered, or a HEAD saying the object is there (or such an answer
remembered for ``remote_cache_ttl_s``: a GC pass of another host inside
that time can make it stale, as it can any lookup's). Manifests are not
needed: they speed lookups up, a lookup without them still finds every block.

Pure bookkeeping over the tier's counters, no I/O. Thread-safe: ``accept``
on gRPC handler threads, ``finish`` on the ``tierstore-remote-writer``
thread, ``wait`` on the thread of a durable EndTurn.
"""

from __future__ import annotations

import concurrent.futures
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from tierstore.counters import Counters
from tierstore.keys import BlockKey, KVLayout

TURN_COUNTERS = (
    "remote_turns_not_durable", "remote_turn_blocks_not_durable",  # gauges: a crash loses these
    "remote_turns_durable", "remote_turns_not_written",
    "remote_turn_durable_us_total", "remote_turn_durable_us_max",  # mean = total / durable
    "remote_turn_durable_p50_us", "remote_turn_durable_p99_us",  # gauges, recent turns
    "remote_durable_end_turns", "remote_durable_end_turns_failed",
)  # fmt: skip
TURN_GAUGES = frozenset(
    {
        "remote_turns_not_durable",
        "remote_turn_blocks_not_durable",
        "remote_turn_durable_us_max",
        "remote_turn_durable_p50_us",
        "remote_turn_durable_p99_us",
    }
)


@dataclass(slots=True)
class TurnJob:
    """One turn accepted for write-through. ``done`` ends with (leading
    blocks the bucket acknowledged, why not all: "" when all)."""

    layout: KVLayout
    keys: list[BlockKey]
    accepted_s: float = field(default_factory=time.monotonic)
    done: concurrent.futures.Future[tuple[int, str]] = field(
        default_factory=concurrent.futures.Future
    )


@dataclass(frozen=True, slots=True)
class Durability:
    """What a durable EndTurn found: ``durable_blocks`` of the turn's
    ``num_blocks``, from the first, are in the bucket; ``reason`` says why
    not all ("" when all)."""

    num_blocks: int
    durable_blocks: int
    wait_s: float
    reason: str = ""

    @property
    def durable(self) -> bool:
        return self.durable_blocks == self.num_blocks and not self.reason


def percentile(sorted_values: list[int], q: float) -> int:
    """Nearest-rank percentile (``q`` in [0, 1]) of a sorted, non-empty list."""
    rank = max(0, min(len(sorted_values) - 1, math.ceil(q * len(sorted_values)) - 1))
    return sorted_values[rank]


class TurnLedger:
    """See the module docstring. Writes the tier's counters."""

    def __init__(self, counters: Counters, window_turns: int = 1024) -> None:
        self.counters = counters
        self._lock = threading.Lock()
        self._turns = 0
        self._blocks = 0
        self._recent: deque[int] = deque(maxlen=window_turns)  # EndTurn -> durable, us

    def accept(self, job: TurnJob) -> None:
        """``job`` was queued: until ``finish`` a crash loses it."""
        with self._lock:
            self._turns += 1
            self._blocks += len(job.keys)
            self._gauges()

    def finish(self, job: TurnJob, durable_blocks: int, reason: str = "") -> None:
        """``job`` ended: written through (``durable_blocks`` of it), dropped
        or failed (``reason``). Idempotent per job: only the first counts."""
        whole = durable_blocks == len(job.keys) and not reason
        if not whole and not reason:
            reason = f"only {durable_blocks} of {len(job.keys)} blocks reached the bucket"
        us = int((time.monotonic() - job.accepted_s) * 1e6)
        with self._lock:
            if job.done.done():
                return
            self._turns -= 1
            self._blocks -= len(job.keys)
            if whole:
                self._recent.append(us)
                ordered = sorted(self._recent)
                self.counters.set("remote_turn_durable_p50_us", percentile(ordered, 0.5))
                self.counters.set("remote_turn_durable_p99_us", percentile(ordered, 0.99))
                if us > self.counters.remote_turn_durable_us_max:
                    self.counters.set("remote_turn_durable_us_max", us)
                self.counters.add_many(
                    {"remote_turns_durable": 1, "remote_turn_durable_us_total": us}
                )
            else:
                self.counters.add("remote_turns_not_written")
            self._gauges()
            job.done.set_result((durable_blocks, reason))

    def _gauges(self) -> None:  # under _lock
        self.counters.set("remote_turns_not_durable", self._turns)
        self.counters.set("remote_turn_blocks_not_durable", self._blocks)

    def wait(self, job: TurnJob | None, num_blocks: int, timeout_s: float, why: str) -> Durability:
        """A durable EndTurn: wait up to ``timeout_s`` for ``job`` (None: it
        was not accepted, ``why``). Counted; the write goes on past the deadline."""
        t0 = time.monotonic()
        if job is None:
            got = Durability(num_blocks, 0, 0.0, why)
        else:
            try:
                blocks, reason = job.done.result(timeout_s)
            except concurrent.futures.TimeoutError:
                blocks, reason = 0, f"the bucket had not acknowledged it in {timeout_s:.3g} s"
            got = Durability(num_blocks, blocks, time.monotonic() - t0, reason)
        self.counters.add_many(
            {"remote_durable_end_turns": 1, "remote_durable_end_turns_failed": int(not got.durable)}
        )
        return got
