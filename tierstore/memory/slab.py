"""Slab allocator: fixed-size slots carved from equal segments of a byte range.

Used for the DRAM arena (offsets into shared memory) and for the NVMe block
file (offsets into the file). Pure bookkeeping: no I/O, no locks; the owning
tier serialises calls.

A segment, when first needed, is given to one slot size (a *size class*) and
split into as many slots as fit. A slot size larger than a segment takes a run
of contiguous segments holding one slot. When every slot of a run is free the
run returns to the free segments, so the space serves any size class again.
Every slot starts at a multiple of ``align_bytes`` (O_DIRECT and page-aligned
views need that). alloc and free are O(1) except for multi-segment runs,
which search a bitmap in C (``bytearray.find``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tierstore.errors import ConfigError

_FREE = 0
_USED = 1


def round_up(n: int, align: int) -> int:
    return -(-n // align) * align


@dataclass(slots=True)
class _Run:
    """A run of contiguous segments given to one slot size."""

    first_segment: int
    num_segments: int
    slot_bytes: int
    free_offsets: dict[int, None]  # insertion-ordered; popitem() takes the last
    num_slots: int
    used: int = 0


@dataclass(slots=True)
class _SizeClass:
    runs_with_space: dict[int, None] = field(default_factory=dict)  # insertion-ordered set


class SlabAllocator:
    """Allocates aligned slots of any size inside ``capacity_bytes``."""

    def __init__(self, capacity_bytes: int, segment_bytes: int, align_bytes: int = 4096) -> None:
        if align_bytes < 1 or align_bytes & (align_bytes - 1):
            raise ConfigError(f"align_bytes must be a power of two, got {align_bytes}")
        if segment_bytes < align_bytes or segment_bytes % align_bytes:
            raise ConfigError(
                f"segment_bytes ({segment_bytes}) must be a positive multiple of "
                f"align_bytes ({align_bytes})"
            )
        if capacity_bytes < segment_bytes:
            raise ConfigError(
                f"capacity_bytes ({capacity_bytes}) must hold at least one segment "
                f"of {segment_bytes} bytes"
            )
        self.segment_bytes = segment_bytes
        self.align_bytes = align_bytes
        self.num_segments = capacity_bytes // segment_bytes
        self.capacity_bytes = self.num_segments * segment_bytes
        self._segment_state = bytearray(self.num_segments)  # _FREE / _USED
        self._runs: dict[int, _Run] = {}  # first segment -> run
        self._run_of_segment: list[int] = [-1] * self.num_segments
        self._classes: dict[int, _SizeClass] = {}
        self._free_segments = self.num_segments
        self.used_bytes = 0  # bytes of allocated slots (slot-rounded)
        self.num_allocated = 0

    def slot_bytes(self, nbytes: int) -> int:
        """The slot size that holds ``nbytes`` (aligned up)."""
        return round_up(max(nbytes, 1), self.align_bytes)

    def can_alloc(self, nbytes: int) -> bool:
        slot = self.slot_bytes(nbytes)
        cls = self._classes.get(slot)
        if cls is not None and cls.runs_with_space:
            return True
        return self._find_segments(self._segments_for(slot)) >= 0

    def alloc(self, nbytes: int) -> int | None:
        """Offset of a free slot for ``nbytes``, or None when none is free."""
        slot = self.slot_bytes(nbytes)
        cls = self._classes.setdefault(slot, _SizeClass())
        if cls.runs_with_space:
            run = self._runs[next(iter(cls.runs_with_space))]
        else:
            new_run = self._new_run(slot)
            if new_run is None:
                return None
            run = new_run
            cls.runs_with_space[run.first_segment] = None
        offset, _ = run.free_offsets.popitem()
        run.used += 1
        if not run.free_offsets:
            del cls.runs_with_space[run.first_segment]
        self.used_bytes += slot
        self.num_allocated += 1
        return offset

    def claim(self, offset: int, nbytes: int) -> bool:
        """Mark the slot at ``offset`` used (rebuilding state from an index).

        Returns False if that slot cannot be claimed (misaligned for its size
        class, out of range, or overlapping another size class).
        """
        slot = self.slot_bytes(nbytes)
        if offset < 0 or offset + slot > self.capacity_bytes or offset % self.align_bytes:
            return False
        seg = offset // self.segment_bytes
        first = self._run_of_segment[seg]
        if first < 0:
            span = self._segments_for(slot)
            # Runs start on multiples of their span so claims are deterministic.
            first = seg - seg % span
            if first + span > self.num_segments or any(self._segment_state[first : first + span]):
                return False
            run = self._make_run(first, span, slot)
            self._classes.setdefault(slot, _SizeClass()).runs_with_space[first] = None
        run = self._runs[first]
        if (
            run.slot_bytes != slot
            or (offset - first * self.segment_bytes) % slot
            or offset not in run.free_offsets
        ):
            if run.used == 0:  # made for this claim: give the segments back
                self._classes[run.slot_bytes].runs_with_space.pop(first, None)
                self._release_run(run)
            return False
        del run.free_offsets[offset]
        run.used += 1
        if not run.free_offsets:
            self._classes[slot].runs_with_space.pop(first, None)
        self.used_bytes += slot
        self.num_allocated += 1
        return True

    def free(self, offset: int) -> None:
        """Return the slot at ``offset``. Freeing an unknown offset is a bug: raises."""
        seg = offset // self.segment_bytes
        if not 0 <= seg < self.num_segments or self._run_of_segment[seg] < 0:
            raise ValueError(f"free of offset {offset} that is not allocated")
        run = self._runs[self._run_of_segment[seg]]
        if (
            offset in run.free_offsets
            or (offset - run.first_segment * self.segment_bytes) % run.slot_bytes
        ):
            raise ValueError(f"free of offset {offset} that is not allocated")
        run.free_offsets[offset] = None
        run.used -= 1
        self.used_bytes -= run.slot_bytes
        self.num_allocated -= 1
        cls = self._classes[run.slot_bytes]
        if run.used == 0:
            cls.runs_with_space.pop(run.first_segment, None)
            self._release_run(run)
        else:
            cls.runs_with_space[run.first_segment] = None

    # -- segments -------------------------------------------------------------

    def _segments_for(self, slot: int) -> int:
        return max(1, -(-slot // self.segment_bytes))

    def _find_segments(self, span: int) -> int:
        if span > self._free_segments:
            return -1
        if span == 1:
            return self._segment_state.find(_FREE)
        # Multi-segment runs start on multiples of their span, so that claim()
        # can find a run's start from any offset after a restart.
        pattern, start = bytes(span), 0
        while (pos := self._segment_state.find(pattern, start)) >= 0:
            if pos % span == 0:
                return pos
            start = round_up(pos, span)
        return -1

    def _new_run(self, slot: int) -> _Run | None:
        span = self._segments_for(slot)
        first = self._find_segments(span)
        if first < 0:
            return None
        return self._make_run(first, span, slot)

    def _make_run(self, first: int, span: int, slot: int) -> _Run:
        base = first * self.segment_bytes
        num_slots = (span * self.segment_bytes) // slot
        # Reversed so that popitem() hands out the lowest offsets first.
        offsets = dict.fromkeys(base + i * slot for i in reversed(range(num_slots)))
        run = _Run(first, span, slot, offsets, num_slots)
        self._runs[first] = run
        self._segment_state[first : first + span] = bytes([_USED]) * span
        for s in range(first, first + span):
            self._run_of_segment[s] = first
        self._free_segments -= span
        return run

    def _release_run(self, run: _Run) -> None:
        first, span = run.first_segment, run.num_segments
        del self._runs[first]
        self._segment_state[first : first + span] = bytes(span)
        for s in range(first, first + span):
            self._run_of_segment[s] = -1
        self._free_segments += span
