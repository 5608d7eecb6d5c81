"""Eviction, admission and write policies: pure objects, no I/O, no locks, no torch.

Provides:
- ``EvictionPolicy`` protocol and two implementations, ``LruPolicy`` (default)
  and ``S3FifoPolicy`` (small/main FIFO queues with a ghost queue; resists
  one-hit scans such as a long prompt read once).
- ``AdmissionPolicy`` protocol with ``AlwaysAdmit`` and ``SeenTwiceAdmit``
  (admit to the slower tier only keys seen at least twice).
- ``WritePolicy`` protocol: when a DRAM block is also written to NVMe before
  it is evicted: ``WriteBack`` (only when evicted), ``WriteThrough`` (every
  committed block, through the store's bounded write queue),
  ``WriteThroughSelective`` (blocks read again after their commit, and the
  blocks of turns of at least ``min_tokens``).
- ``make_eviction_policy`` / ``make_admission_policy`` / ``make_write_policy``:
  by config name.
- ``rendezvous_target``: the spill host of a session (kv_share's target).
- ``RemotePlacement`` (which blocks go to the remote tier: DRAM/NVMe victims
  written back, long turns written through) and ``remote_gc_victims``
  (which objects a byte budget deletes: least recently used first).
- ``ReplicationPolicy`` protocol with ``KvShareRule`` (replicate turns of at
  least ``min_tokens``) and ``HeadroomRule`` (also shorter turns while the
  link and the target's replica budget have headroom; ``min_tokens`` stays
  the floor under pressure); ``make_replication_policy`` by config name.
- ``ReplicaRetention``: which replicas leave DRAM before the host's own
  blocks (those not pushed within ``live_s``: their session has likely
  ended) and which keep their recency place (live ones: the session may
  switch any moment).

The tier that owns a policy serialises every call (its own lock). ``evict``
is atomic: it returns a victim that is removed from the policy, or None and
the set of tracked keys is unchanged.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import blake3

from tierstore.errors import ConfigError
from tierstore.keys import BlockKey

CanEvict = Callable[[BlockKey], bool]


class EvictionPolicy(Protocol):
    """Orders the keys a tier holds for eviction."""

    def insert(self, key: BlockKey) -> None: ...

    def touch(self, key: BlockKey) -> None: ...

    def remove(self, key: BlockKey) -> None: ...

    def readmit(self, key: BlockKey) -> None:
        """A key back from use (its last pin dropped): tracked again as just
        used; a key still tracked (a quiet pin left it in place) stays put."""
        ...

    def evict(self, can_evict: CanEvict) -> BlockKey | None:
        """Remove and return the first victim for which ``can_evict`` is true."""
        ...

    def candidates(self) -> Iterator[BlockKey]:
        """Keys in eviction order, without changing anything."""
        ...

    def __len__(self) -> int: ...

    def __contains__(self, key: object) -> bool: ...


class LruPolicy:
    """Least recently used first."""

    def __init__(self) -> None:
        self._order: OrderedDict[BlockKey, None] = OrderedDict()

    def insert(self, key: BlockKey) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def touch(self, key: BlockKey) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: BlockKey) -> None:
        self._order.pop(key, None)

    def readmit(self, key: BlockKey) -> None:
        if key not in self._order:
            self._order[key] = None  # a new key goes to the most recent end

    def evict(self, can_evict: CanEvict) -> BlockKey | None:
        for key in self._order:
            if can_evict(key):
                del self._order[key]
                return key
        return None

    def candidates(self) -> Iterator[BlockKey]:
        return iter(list(self._order))

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order


class S3FifoPolicy:
    """S3-FIFO (Yang et al., SOSP'23): a small probationary FIFO, a main FIFO
    and a ghost FIFO of recently evicted keys.

    New keys enter the small queue (or main, if the ghost remembers them).
    A key leaving the small queue moves to main if it was touched, else it is
    evicted. Main is a FIFO with reinsertion of touched keys (frequency capped
    at 3). ``small_fraction`` is the share of tracked keys kept in small.
    """

    _MAX_FREQ = 3

    def __init__(self, small_fraction: float = 0.1, ghost_keys: int = 65536) -> None:
        if not 0.0 < small_fraction < 1.0:
            raise ConfigError(f"small_fraction must be in (0, 1), got {small_fraction}")
        self.small_fraction = small_fraction
        self._small: OrderedDict[BlockKey, None] = OrderedDict()
        self._main: OrderedDict[BlockKey, None] = OrderedDict()
        self._ghost: OrderedDict[BlockKey, None] = OrderedDict()
        self._ghost_keys = ghost_keys
        self._freq: dict[BlockKey, int] = {}

    def insert(self, key: BlockKey) -> None:
        if key in self._freq:
            self.touch(key)
            return
        self._freq[key] = 0
        if self._ghost.pop(key, False) is None:
            self._main[key] = None
        else:
            self._small[key] = None

    def touch(self, key: BlockKey) -> None:
        freq = self._freq.get(key)
        if freq is not None:
            self._freq[key] = min(freq + 1, self._MAX_FREQ)

    def remove(self, key: BlockKey) -> None:
        if self._freq.pop(key, None) is not None:
            self._small.pop(key, None)
            self._main.pop(key, None)

    def readmit(self, key: BlockKey) -> None:
        if key not in self._freq:
            self.insert(key)
            self.touch(key)

    def evict(self, can_evict: CanEvict) -> BlockKey | None:
        # Each key is looked at a bounded number of times: at most one move
        # from small to main and _MAX_FREQ reinsertions in main.
        budget = (2 + self._MAX_FREQ) * len(self._freq) + 1
        skipped: list[tuple[OrderedDict[BlockKey, None], BlockKey]] = []
        victim: BlockKey | None = None
        while budget > 0 and (self._small or self._main):
            budget -= 1
            use_small = self._small and (
                len(self._small) >= self.small_fraction * len(self._freq) or not self._main
            )
            queue = self._small if use_small else self._main
            key, _ = queue.popitem(last=False)
            freq = self._freq[key]
            if not can_evict(key):
                skipped.append((queue, key))
                continue
            if queue is self._small and freq > 0:
                self._freq[key] = 0
                self._main[key] = None
                continue
            if queue is self._main and freq > 0:
                self._freq[key] = freq - 1
                self._main[key] = None
                continue
            victim = key
            break
        for queue, key in reversed(skipped):
            queue[key] = None
            queue.move_to_end(key, last=False)
        if victim is None:
            return None
        del self._freq[victim]
        self._ghost[victim] = None
        while len(self._ghost) > self._ghost_keys:
            self._ghost.popitem(last=False)
        return victim

    def candidates(self) -> Iterator[BlockKey]:
        return iter([*self._small, *self._main])

    def __len__(self) -> int:
        return len(self._freq)

    def __contains__(self, key: object) -> bool:
        return key in self._freq


class AdmissionPolicy(Protocol):
    """Decides whether a block is written to a slower tier at all."""

    def admit(self, key: BlockKey) -> bool: ...


class AlwaysAdmit:
    def admit(self, key: BlockKey) -> bool:
        return True


class SeenTwiceAdmit:
    """Admit a key the second time it is offered within the last
    ``history_keys`` offers; one-hit blocks never cost a disk write."""

    def __init__(self, history_keys: int = 65536) -> None:
        self._seen: OrderedDict[BlockKey, None] = OrderedDict()
        self._history_keys = history_keys

    def admit(self, key: BlockKey) -> bool:
        if self._seen.pop(key, False) is None:
            return True
        self._seen[key] = None
        while len(self._seen) > self._history_keys:
            self._seen.popitem(last=False)
        return False


class WritePolicy(Protocol):
    """Which DRAM blocks are queued for NVMe before they are evicted (write
    through). Eviction still spills whatever is not on NVMe yet (write back),
    whatever the policy. Pure: the store's writer asks, and does the I/O."""

    name: str
    watches_hits: bool  # whether ``on_hit`` can answer True (the store skips the call if not)

    def on_commit(self, key: BlockKey) -> bool: ...

    def on_hit(self, key: BlockKey) -> bool: ...

    def on_turn(self, num_tokens: int) -> bool:
        """Whether the keys of a finished turn of ``num_tokens`` tokens are written through."""
        ...


class WriteBack:
    """Blocks reach NVMe when DRAM evicts them (and on a graceful stop's drain)."""

    name = "write_back"
    watches_hits = False

    def on_commit(self, key: BlockKey) -> bool:
        return False

    def on_hit(self, key: BlockKey) -> bool:
        return False

    def on_turn(self, num_tokens: int) -> bool:
        return False


class WriteThrough:
    """Every committed block is queued for NVMe at once."""

    name = "write_through"
    watches_hits = False

    def on_commit(self, key: BlockKey) -> bool:
        return True

    def on_hit(self, key: BlockKey) -> bool:
        return False

    def on_turn(self, num_tokens: int) -> bool:
        return False


class WriteThroughSelective:
    """Write through what is likely to be used again: a block read from DRAM
    after its commit (seen twice; each key queued once per ``history_keys``
    hits), and every block of a turn of at least ``min_tokens`` tokens
    (a long session, whose prefill is the most expensive to lose)."""

    name = "write_through_selective"
    watches_hits = True

    def __init__(self, min_tokens: int = 8192, history_keys: int = 65536) -> None:
        self.min_tokens = min_tokens
        self._queued: OrderedDict[BlockKey, None] = OrderedDict()
        self._history_keys = history_keys

    def on_commit(self, key: BlockKey) -> bool:
        return False

    def on_hit(self, key: BlockKey) -> bool:
        if key in self._queued:
            return False
        self._queued[key] = None
        while len(self._queued) > self._history_keys:
            self._queued.popitem(last=False)
        return True

    def on_turn(self, num_tokens: int) -> bool:
        return num_tokens >= self.min_tokens


EVICTION_POLICIES: dict[str, Callable[[], EvictionPolicy]] = {
    "lru": LruPolicy,
    "s3fifo": S3FifoPolicy,
}
ADMISSION_POLICIES: dict[str, Callable[[], AdmissionPolicy]] = {
    "always": AlwaysAdmit,
    "seen_twice": SeenTwiceAdmit,
}


WRITE_POLICIES = ("write_back", "write_through", "write_through_selective")


def make_write_policy(name: str, min_tokens: int = 8192) -> WritePolicy:
    """The write policy named ``name``; ``min_tokens`` is the selective one's long turn."""
    if name == "write_back":
        return WriteBack()
    if name == "write_through":
        return WriteThrough()
    if name == "write_through_selective":
        return WriteThroughSelective(min_tokens)
    raise ConfigError(f"unknown write policy {name!r}; choose one of {list(WRITE_POLICIES)}")


def make_eviction_policy(name: str) -> EvictionPolicy:
    try:
        return EVICTION_POLICIES[name]()
    except KeyError:
        raise ConfigError(
            f"unknown eviction policy {name!r}; choose one of {sorted(EVICTION_POLICIES)}"
        ) from None


def make_admission_policy(name: str) -> AdmissionPolicy:
    try:
        return ADMISSION_POLICIES[name]()
    except KeyError:
        raise ConfigError(
            f"unknown admission policy {name!r}; choose one of {sorted(ADMISSION_POLICIES)}"
        ) from None


def rendezvous_weight(session: str, member: str) -> bytes:
    """The session's (highest-random-weight) rendezvous weight of a member:
    blake3 of the two names, compared as bytes; the same on every host."""
    return blake3.blake3(session.encode() + b"\0" + member.encode()).digest()


def rendezvous_target(session: str, members: Sequence[str], exclude: str) -> str | None:
    """The group member a session spills to next: highest-random-weight
    (rendezvous) hashing of the session id over the members, minus ``exclude``
    (this host). Deterministic on every host; adding or removing a member
    moves only the sessions that hashed to it."""
    candidates = [m for m in members if m != exclude]
    return max(candidates, key=lambda m: rendezvous_weight(session, m)) if candidates else None


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


@dataclass(frozen=True, slots=True)
class ReplicaRequest:
    """What a replication policy is shown about one push (all measured now
    by the sending host; nothing remembered beyond what is listed)."""

    num_tokens: int  # tokens of the session's context so far
    push_bytes: int  # bytes this push would send at most (its blocks)
    link_bytes_per_s: float  # measured rate of the link to the target (0: not measured)
    backlog_bytes: int  # replica bytes queued or in flight to any target now
    target_rejected: bool  # the target's last reply rejected blocks (its budget is full)


class ReplicationPolicy(Protocol):
    """Decides whether a session's blocks are replicated to its spill host."""

    def replicate(self, request: ReplicaRequest) -> bool: ...


@dataclass(frozen=True, slots=True)
class KvShareRule:
    """kv_share's rule: turns of at least ``min_tokens``, whatever the link."""

    min_tokens: int

    def replicate(self, request: ReplicaRequest) -> bool:
        return request.num_tokens >= self.min_tokens


@dataclass(frozen=True, slots=True)
class HeadroomRule:
    """Replicate what the link can carry: turns of at least ``min_tokens``
    always (the floor), shorter ones too while the push backlog including
    this push drains within ``headroom_s`` at the measured link rate (or
    ``default_link_bytes_per_s`` before a measurement) and the target's
    budget did not just reject blocks."""

    min_tokens: int
    headroom_s: float
    default_link_bytes_per_s: float

    def replicate(self, request: ReplicaRequest) -> bool:
        if request.num_tokens >= self.min_tokens:
            return True
        if request.target_rejected:
            return False
        rate = request.link_bytes_per_s or self.default_link_bytes_per_s
        if rate <= 0:
            return False
        return (request.backlog_bytes + request.push_bytes) / rate <= self.headroom_s


REPLICATION_POLICIES = ("headroom", "kv_share")


def make_replication_policy(
    name: str, min_tokens: int, headroom_s: float, default_link_bytes_per_s: float
) -> ReplicationPolicy:
    if name == "kv_share":
        return KvShareRule(min_tokens)
    if name == "headroom":
        return HeadroomRule(min_tokens, headroom_s, default_link_bytes_per_s)
    raise ConfigError(
        f"unknown replication policy {name!r}; choose one of {list(REPLICATION_POLICIES)}"
    )


@dataclass(frozen=True, slots=True)
class ReplicaRetention:
    """Recency with a bounded replica priority. A replica pushed within
    ``live_s`` belongs to a session that may switch to this host any
    moment: it stays in the eviction order by its recency, like the host's
    own blocks, so finished conversations (the least recently used) leave
    first. Older replicas leave before the host's own blocks. The priority
    is bounded twice: by ``live_s`` per block and by the replica budget."""

    live_s: float

    def evict_before_own(self, age_s: float) -> bool:
        """Whether a replica last pushed ``age_s`` ago leaves before own blocks."""
        return age_s >= self.live_s
