"""The protocol the tiered store drives every tier through (DRAM, NVMe).

Residency is always answered by the tier itself (``contains``); nothing above
a tier remembers what it once held. Only ``tierstore.store.tiered`` knows
more than one tier.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from tierstore.keys import BlockKey
from tierstore.tiers import TierName, TierStats

if TYPE_CHECKING:
    from typing_extensions import Buffer  # collections.abc.Buffer from Python 3.12
else:
    Buffer = object


class BlockMeta(Protocol):
    """What a tier below DRAM knows of one held block."""

    @property
    def nbytes(self) -> int: ...

    @property
    def layout_fp(self) -> bytes: ...

    @property
    def digest(self) -> bytes: ...


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
