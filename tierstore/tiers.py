"""The names of the tiers, their wire codes and their counters: vocabulary that
the engine, the sidecar, peers and the router share (the protocol the tiered
store drives each tier through is ``tierstore.store.base.Tier``).

Residency is always answered by the tier itself (``contains``); nothing above
a tier remembers what it once held.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass
from typing import Any


class TierName(str, enum.Enum):
    HBM = "hbm"
    DRAM = "dram"
    NVME = "nvme"
    PEER = "peer"
    REMOTE = "remote"

    def __str__(self) -> str:
        return self.value


# Wire values of the tiers (common.proto's Tier enum; one byte per block in replies).
TIER_CODES = {
    TierName.HBM: 1,
    TierName.DRAM: 2,
    TierName.NVME: 3,
    TierName.PEER: 4,
    TierName.REMOTE: 5,
}
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
