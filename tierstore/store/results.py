"""What the tiered store's calls answer: ``Reservation`` (one per key of a
``TieredStore.reserve``) and ``LookupResult`` (a ``TieredStore.lookup``).

Frozen, slotted value types, no behaviour beyond naming the tiers of a
lookup's codes; made on the caller's thread (sidecar process). Both are
importable from ``tierstore.store.tiered`` too.
"""

from __future__ import annotations

from dataclasses import dataclass

from tierstore.keys import BlockKey
from tierstore.store.dram import ReserveStatus
from tierstore.tiers import TIER_BY_CODE, TierName


@dataclass(frozen=True, slots=True)
class Reservation:
    """Outcome of reserving one key: OK with the arena offset to write to,
    EXISTS (the store already holds it: skip the copy), or FULL."""

    key: BlockKey
    status: ReserveStatus
    offset: int = -1


@dataclass(frozen=True, slots=True)
class LookupResult:
    """The longest contiguous prefix of the asked keys that is available,
    and the fastest tier holding each of its blocks, as wire codes
    (``TIER_CODES``, one byte per block: what the services send as is)."""

    num_hits: int
    codes: bytes

    @property
    def tiers(self) -> tuple[TierName, ...]:
        return tuple(TIER_BY_CODE[c] for c in self.codes)
