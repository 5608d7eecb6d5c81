"""The NVMe tier on a full disk: the cap, and when to look at the free space again.

Provides ``DiskFull`` for ``NvmeTier`` (``tier``). A write that hits ENOSPC
caps the tier at what its data file holds (``capped``): new blocks evict old
ones, whose slots are on disk, and the index keeps ``index_reserve_bytes``
allocated for its commits (see ``index``). While capped, the first write that
comes ``full_backoff_s`` after the cap (then after each look, doubling to 16x
while the disk stays full) checks the filesystem's free space and lifts the
cap when there is room (``maybe_lift``), so spills grow the tier again
without a restart. The schedule counts from the cap and from the looks only:
another ENOSPC while capped lowers the cap but does not postpone the look
(writes that kept failing would otherwise keep the tier capped for good). So
once room is freed, the cap lifts at the first write at most
``16 * full_backoff_s`` later.

Runs in the sidecar process, on the thread that calls ``NvmeTier.write_many``:
every method is called under the tier's write lock, which guards its state.
It counts into the tier's counters (``nvme_disk_full``, ``nvme_full_*``) and
logs on the tier's logger.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from tierstore.counters import Counters

logger = logging.getLogger("tierstore.store.nvme.tier")

FULL_COUNTERS = (  # the NVMe tier's counters of this module
    "nvme_disk_full",  # gauge: 1 while the tier is capped by a full filesystem
    "nvme_full_events",  # writes that found the filesystem full (ENOSPC)
    "nvme_full_rechecks",  # looks at the free space while capped
    "nvme_full_resumed",  # caps lifted: the disk had room again
)
FULL_GAUGES = frozenset({"nvme_disk_full"})
FULL_BACKOFF_MAX_FACTOR = 16


class DiskFull:
    """The cap of an NvmeTier whose filesystem filled up, and its look schedule."""

    def __init__(
        self,
        root: Path,
        counters: Counters,
        *,
        backoff_s: float,
        room_bytes: int,
        top_up_reserve: Callable[[], object],
    ) -> None:
        """``room_bytes``: the free space that lifts the cap (the index reserve
        plus a segment); ``top_up_reserve``: the index's, called at each look."""
        self.cap_bytes: int | None = None  # set when the filesystem filled up first
        self._root = root
        self._counters = counters
        self._backoff_s = backoff_s
        self._wait_s = backoff_s  # current backoff (doubles while still full)
        self._check_at = 0.0  # monotonic time of the next look, while capped
        self._room_bytes = room_bytes
        self._top_up_reserve = top_up_reserve

    def fits(self, used_bytes: int, slot_bytes: int) -> bool:
        """Whether a slot may be allocated with ``used_bytes`` in use."""
        return self.cap_bytes is None or used_bytes + slot_bytes <= self.cap_bytes

    def capped(self, held_bytes: int) -> None:
        """A write hit ENOSPC: cap the tier at the ``held_bytes`` its data file
        holds, so new blocks evict old ones instead of failing from now on."""
        newly_capped = self.cap_bytes is None
        self.cap_bytes = held_bytes
        if newly_capped:  # already capped: the look stays when it was due
            self._check_at = time.monotonic() + self._wait_s
        self._counters.add("nvme_full_events")
        self._counters.set("nvme_disk_full", 1)

    def maybe_lift(self) -> None:
        """While capped: once the look is due, lift the cap if the filesystem
        has room again, else look again after twice the wait."""
        if self.cap_bytes is None:
            return
        now = time.monotonic()
        if now < self._check_at:
            return
        self._counters.add("nvme_full_rechecks")
        try:
            st = os.statvfs(self._root)
            free = st.f_bavail * st.f_frsize
        except OSError:
            free = 0
        self._top_up_reserve()
        if free >= self._room_bytes:
            self.cap_bytes = None
            self._wait_s = self._backoff_s
            self._counters.add("nvme_full_resumed")
            self._counters.set("nvme_disk_full", 0)
            logger.info(
                "NVMe tier %s: the disk has room again (%.1f MiB free); spills grow the tier again",
                self._root,
                free / 2**20,
            )
            return
        self._wait_s = min(self._wait_s * 2, self._backoff_s * FULL_BACKOFF_MAX_FACTOR)
        self._check_at = now + self._wait_s
