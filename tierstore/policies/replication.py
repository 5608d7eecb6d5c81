"""Replication policies: where a session's blocks are replicated, whether, and
how long the replicas keep their place in DRAM.

Provides:
- ``rendezvous_target`` (and ``rendezvous_weight``): the spill host of a
  session, kv_share's target: highest-random-weight hashing of the session
  id over the group, the same on every host;
- ``ReplicationPolicy`` protocol with ``KvShareRule`` (replicate turns of at
  least ``min_tokens``) and ``HeadroomRule`` (also shorter turns while the
  link and the target's replica budget have headroom; ``min_tokens`` stays
  the floor under pressure), shown a ``ReplicaRequest``;
  ``make_replication_policy`` by config name (``replicate_policy``);
- ``ReplicaRetention``: which replicas leave DRAM before the host's own
  blocks (those not pushed within ``live_s``: their session has likely
  ended) and which keep their recency place (live ones: the session may
  switch any moment).

Pure: no I/O, no locks, no torch. The sidecar's peer tier and demoter ask;
the router and the gateway use the rendezvous order too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import blake3

from tierstore.errors import ConfigError


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
