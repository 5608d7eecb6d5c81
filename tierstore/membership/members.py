"""Group membership: which sidecars make up the group right now.

Provides:
- ``MemberSet``: the protocol the peer tier and the router ask for the live
  peer addresses (``addresses``) and a number that changes whenever the set
  does (``version``); ``StaticMembers`` is the configured ``peers`` list
  (the default, no etcd), ``tierstore.membership.etcd.EtcdMembers`` the
  live set from etcd leases;
- ``Member``: the record a sidecar publishes in etcd (group, peer address,
  tiers, capacity, load summary, its engine's URL and KV-event endpoint for
  gateways; never a secret), its JSON encoding and
  strict decoding (a malformed record is None: ignored and counted).

Pure: no I/O, no gRPC. Thread-safe.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

RECORD_VERSION = 1
MAX_RECORD_BYTES = 4096  # a member record is small; a larger value is not ours


class MemberSet(Protocol):
    """The peer addresses (host:port) of the group's live members."""

    @property
    def version(self) -> int:
        """Changes whenever ``addresses`` does (callers cache on it)."""
        ...

    def addresses(self) -> list[str]: ...

    def close(self) -> None: ...


class StaticMembers:
    """The configured list: never changes."""

    version = 0

    def __init__(self, addresses: Sequence[str]) -> None:
        self._addresses = list(dict.fromkeys(addresses))

    def addresses(self) -> list[str]:
        return list(self._addresses)

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class Member:
    """What a sidecar says about itself in etcd. Informational beyond
    ``address``: peers and routers use the address; people and tools read
    the rest (``etcdctl get --prefix <prefix>/groups/<group>/``)."""

    address: str
    group: str
    tiers: tuple[str, ...] = ()
    dram_bytes: int = 0
    nvme_bytes: int = 0
    replica_budget_bytes: int = 0
    load: dict[str, int] = field(default_factory=dict)  # busy_slots, slots, queue_len
    version: str = ""  # tierstore version
    pid: int = 0
    engine_url: str = ""  # the engine's OpenAI server next to this sidecar (for gateways)
    engine_events: str = ""  # its engine's KV-event publisher, tcp://host:port

    def encode(self) -> bytes:
        d = asdict(self)
        d["tiers"] = list(self.tiers)
        d["v"] = RECORD_VERSION
        return json.dumps(d, sort_keys=True, separators=(",", ":")).encode()


def decode_member(key: bytes, value: bytes, key_prefix: bytes) -> Member | None:
    """The record stored under ``key``, or None when it is not a well-formed
    member record of this group (its address must match its key)."""
    if not key.startswith(key_prefix) or len(value) > MAX_RECORD_BYTES:
        return None
    try:
        d: Any = json.loads(value)
        address = key[len(key_prefix) :].decode()
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(d, dict) or d.get("v") != RECORD_VERSION or d.get("address") != address:
        return None
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    try:
        load = d.get("load", {})
        return Member(
            address=address,
            group=str(d["group"]),
            tiers=tuple(str(t) for t in d.get("tiers", ())),
            dram_bytes=int(d.get("dram_bytes", 0)),
            nvme_bytes=int(d.get("nvme_bytes", 0)),
            replica_budget_bytes=int(d.get("replica_budget_bytes", 0)),
            load={str(k): int(v) for k, v in load.items()} if isinstance(load, dict) else {},
            version=str(d.get("version", "")),
            pid=int(d.get("pid", 0)),
            engine_url=str(d.get("engine_url", "")),
            engine_events=str(d.get("engine_events", "")),
        )
    except (KeyError, TypeError, ValueError, AttributeError):
        return None


def diff(before: Sequence[str], after: Sequence[str]) -> tuple[list[str], list[str]]:
    """(joined, left) between two address lists, each in the order given."""
    b, a = set(before), set(after)
    return [x for x in after if x not in b], [x for x in before if x not in a]
