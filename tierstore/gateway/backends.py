"""The engines behind the gateway, and how the gateway learns of them.

Provides:
- ``Backend``: one engine's OpenAI URL, its sidecar's peer address (empty:
  an engine without tierstore) and its engine's KV-event publisher (vLLM's
  ZMQ endpoint; empty: none). Its ``name`` is the peer address when it has
  one (the router's and the sidecars' name for the host), else the URL.
- ``parse_backend(item)``: ``URL[;peer=HOST:PORT][;events=tcp://HOST:PORT]``
  (``gateway_backends``; a list in the config splits on commas);
- ``StaticBackends`` (the configured list) and ``MemberBackends`` (the
  live members of the etcd group: each sidecar publishes its engine's URL
  and event endpoint in its member record, ``engine_url`` and
  ``engine_events``); both answer ``backends()`` and a ``version`` that
  changes whenever the set does.

Pure but for ``MemberBackends``, which reads a ``MemberSet``'s records.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import urlsplit

from tierstore.errors import ConfigError
from tierstore.membership.members import Member


@dataclass(frozen=True, slots=True)
class Backend:
    url: str  # the engine's OpenAI server, e.g. http://10.0.0.1:8000
    peer: str = ""  # its sidecar's peer service, host:port
    events: str = ""  # its engine's KV-event publisher, tcp://host:port

    @property
    def name(self) -> str:
        return self.peer or self.url


def _check_url(url: str, what: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{what}: expected an http(s)://host:port URL, got {url!r}")
    try:
        parts.port  # noqa: B018  # raises on a malformed port
    except ValueError as e:
        raise ConfigError(f"{what}: bad port in {url!r}") from e
    return url.rstrip("/")


def _check_peer(addr: str, what: str) -> str:
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{what}: peer must be host:port, got {addr!r}")
    return addr


def parse_backend(item: str) -> Backend:
    """One ``gateway_backends`` item; raises ConfigError naming what is wrong."""
    url, *opts = [p.strip() for p in item.split(";")]
    fields: dict[str, str] = {}
    for opt in opts:
        name, sep, value = opt.partition("=")
        if not sep or name not in ("peer", "events") or not value:
            raise ConfigError(
                f"gateway_backends: expected URL[;peer=HOST:PORT][;events=tcp://HOST:PORT], "
                f"got {item!r}"
            )
        fields[name] = value
    peer = _check_peer(fields["peer"], "gateway_backends") if "peer" in fields else ""
    events = fields.get("events", "")
    if events and "://" not in events:
        raise ConfigError(f"gateway_backends: events must be a ZMQ endpoint, got {events!r}")
    return Backend(_check_url(url, "gateway_backends"), peer, events)


def backend_of(member: Member) -> Backend | None:
    """The backend a member record describes (None: its sidecar names no engine)."""
    if not member.engine_url:
        return None
    try:
        url = _check_url(member.engine_url, f"member {member.address}")
    except ConfigError:
        return None
    return Backend(url, member.address, member.engine_events)


class BackendSet(Protocol):
    @property
    def version(self) -> int: ...

    def backends(self) -> list[Backend]: ...


class StaticBackends:
    """The configured list: never changes."""

    version = 0

    def __init__(self, backends: Sequence[Backend]) -> None:
        names = [b.name for b in backends]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ConfigError(f"gateway_backends: the same engine or sidecar twice: {dup}")
        if not backends:
            raise ConfigError("gateway_backends is empty and no membership is given")
        self._backends = list(backends)

    def backends(self) -> list[Backend]:
        return list(self._backends)


class MemberRecords(Protocol):
    @property
    def version(self) -> int: ...

    def records(self) -> dict[str, Member]: ...


class MemberBackends:
    """The engines of the group's live members (``EtcdMembers``)."""

    def __init__(self, members: MemberRecords) -> None:
        self.members = members

    @property
    def version(self) -> int:
        return self.members.version

    def backends(self) -> list[Backend]:
        out = [backend_of(m) for _, m in sorted(self.members.records().items())]
        return [b for b in out if b is not None]
