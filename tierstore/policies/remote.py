"""Remote tier policies: what the bucket receives, and what its garbage
collection deletes.

Provides ``RemotePlacement`` (DRAM/NVMe victims written back, long turns
written through: ``remote_placement``), ``RemoteObject`` (an object as a
listing shows it) and ``remote_gc_victims`` (which objects a byte budget
deletes: least recently used first).

Pure: no I/O, no locks, no torch. The sidecar's remote tier and its GC
thread ask.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tierstore.errors import ConfigError
from tierstore.keys import BlockKey


@dataclass(frozen=True)
class RemotePlacement:
    """What the remote tier receives. ``write_back``: a block leaving DRAM
    (spilled to NVMe, or dropped) is uploaded too, so NVMe's later eviction
    loses nothing. ``write_through``: the blocks of a turn of at least
    ``min_tokens`` are uploaded at the end of the turn, so a host crash
    loses none of a long session. ``both``: the two."""

    mode: str = "both"  # write_back | write_through | both
    min_tokens: int = 8192

    def __post_init__(self) -> None:
        if self.mode not in ("write_back", "write_through", "both"):
            raise ConfigError(
                f"remote placement must be write_back, write_through or both, got {self.mode!r}"
            )

    def on_demote(self, key: BlockKey) -> bool:
        """Upload a block that is leaving DRAM?"""
        return self.mode != "write_through"

    def on_end_turn(self, num_tokens: int) -> bool:
        """Upload a finished turn's blocks?"""
        return self.mode != "write_back" and num_tokens >= self.min_tokens


@dataclass(frozen=True, slots=True)
class RemoteObject:
    """One object as a listing shows it, with this host's last use of it."""

    path: str
    size: int
    last_modified_s: float
    last_used_s: float = 0.0  # when this host last read or wrote it (0: not known)

    @property
    def recency_s(self) -> float:
        return max(self.last_modified_s, self.last_used_s)


def remote_gc_victims(
    objects: Sequence[RemoteObject], budget_bytes: int, low_watermark: float
) -> list[RemoteObject]:
    """The objects to delete so the total is at most ``low_watermark *
    budget_bytes``, least recently used first (the later of the store's
    write time and this host's last use); none while the total is within
    the budget."""
    total = sum(o.size for o in objects)
    if total <= budget_bytes:
        return []
    target = int(budget_bytes * low_watermark)
    victims = []
    for obj in sorted(objects, key=lambda o: (o.recency_s, o.path)):
        if total <= target:
            break
        victims.append(obj)
        total -= obj.size
    return victims
