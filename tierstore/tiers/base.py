"""What every tier shares: its name, its counters, and the small protocol the
tiered store drives.

Residency is always answered by the tier itself (``contains``); nothing above
a tier remembers what it once held.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from tierstore.keys import BlockKey


class TierName(str, enum.Enum):
    HBM = "hbm"
    DRAM = "dram"
    NVME = "nvme"
    PEER = "peer"

    def __str__(self) -> str:
        return self.value


# Wire values of the tiers (common.proto's Tier enum; one byte per block in replies).
TIER_CODES = {TierName.HBM: 1, TierName.DRAM: 2, TierName.NVME: 3, TierName.PEER: 4}
TIER_BY_CODE = {v: k for k, v in TIER_CODES.items()}


@dataclass(slots=True)
class TierStats:
    """Counters of one tier. Owned by the tier; read a copy via ``snapshot``."""

    capacity_bytes: int = 0
    used_bytes: int = 0
    num_blocks: int = 0
    hits: int = 0
    misses: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    evictions: int = 0
    verify_failures: int = 0
    write_failures: int = 0
    read_failures: int = 0

    def snapshot(self) -> TierStats:
        return TierStats(**asdict(self))

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        lookups = self.hits + self.misses
        d["hit_rate"] = self.hits / lookups if lookups else 0.0
        return d


class Tier(Protocol):
    """The protocol the tiered store uses for every tier."""

    name: TierName

    def contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Whether each key is held now (committed and readable)."""
        ...

    def remove(self, keys: Sequence[BlockKey]) -> int:
        """Drop the keys that are held and not in use; returns how many went."""
        ...

    def stats(self) -> TierStats:
        """A snapshot of the counters, with capacity and usage filled in."""
        ...

    def close(self) -> None: ...
