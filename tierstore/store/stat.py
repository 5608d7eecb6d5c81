"""What ``TieredStore.stat`` reports: per-tier stats, the store's figures,
a few facts about its setup and the number of layouts registered.

Provides ``store_stat``, which gathers them from the parts it is given (the
local tiers, the store's counters, the NVMe tier's, the writer's and the
remote tier's, the last drain's report, the arena), and ``STORE_GAUGES``:
which of the figures under "store" can go down (gauges, not counters, for
/metrics). Reads only: no locks of its own, no I/O but /proc (the arena's
locked and huge-page memory). Runs on the thread that asks (a gRPC handler
or a metrics scrape, sidecar process).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tierstore.counters import Counters
from tierstore.memory.arena import Arena, locked_bytes
from tierstore.store.base import Tier
from tierstore.store.nvme.tier import NVME_GAUGES, NvmeTier
from tierstore.store.nvme.writer import WRITER_GAUGES, DrainReport, NvmeWriter
from tierstore.store.remote.tier import RemoteTier
from tierstore.tiers import TierName, TierStats

# stat()["store"] figures that go down too (gauges for /metrics).
STORE_GAUGES = (
    WRITER_GAUGES
    | NVME_GAUGES
    | {
        "write_queue_bound_bytes",
        "arena_bytes",
        "arena_populated_bytes",
        "arena_page_bytes",
        "arena_locked_bytes",
        "arena_huge_bytes",
        "last_drain_blocks",
        "last_drain_bytes",
        "last_drain_dropped_blocks",
        "last_drain_dropped_bytes",
        "last_drain_ms",
        "last_drain_budget_ms",
    }
)


def store_stat(
    tiers: Sequence[Tier],
    counters: Counters,
    *,
    arena: Arena,
    nvme: NvmeTier | None,
    writer: NvmeWriter | None,
    remote: RemoteTier | None,
    last_drain: DrainReport | None,
    write_queue_bytes: int,
    write_policy: str,
    num_layouts: int,
) -> dict[str, Any]:
    """The stat dictionary: "tiers" (``tiers`` fastest first, then the remote
    tier), "store" (counters and ``STORE_GAUGES``), "info", "layouts"."""
    by_tier: dict[str, TierStats] = {str(t.name): t.stats() for t in tiers}
    figures = counters.snapshot()
    if writer is not None:
        figures.update(writer.counters.snapshot())
    if nvme is not None:
        figures.update(nvme.counters.snapshot())
    if last_drain is not None:
        figures.update(last_drain.counters())
    if writer is not None:
        figures["write_queue_bound_bytes"] = write_queue_bytes
    figures["arena_bytes"] = arena.size_bytes
    figures["arena_populated_bytes"] = arena.populated_bytes
    figures["arena_page_bytes"] = arena.page_bytes
    figures["arena_locked_bytes"] = locked_bytes() if arena.locked else 0
    figures["arena_huge_bytes"] = arena.huge_bytes()
    if remote is not None:  # remote tier (outside tiers: it is asked per layout)
        by_tier[str(TierName.REMOTE)] = remote.stats()
        figures.update(remote.counters.snapshot())
    return {
        "tiers": {name: s.to_dict() for name, s in by_tier.items()},
        "store": figures,
        "info": {
            "write_policy": write_policy,
            "arena_page": f"{arena.page_bytes >> 10} KiB, {arena.page_kind}",
            "arena_lock": "locked as faulted in" if arena.locked else "NOT locked",
        },
        "layouts": num_layouts,
    }
