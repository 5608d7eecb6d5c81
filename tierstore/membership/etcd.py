"""The group's live members from etcd: register under a lease, watch the group.

Provides ``EtcdMembers`` (a ``tierstore.membership.members.MemberSet``) and
``MEMBERSHIP_COUNTERS``. ``start`` (once the peer port serves) runs two
worker threads (``tierstore.workers.Workers``):

- ``tierstore-membership-lease`` (only for a sidecar that registers; a
  router only watches): grants a lease of ``membership_ttl_s``, puts this
  host's record (``Member``) under it, renews it every third of the TTL and
  rewrites the record when its load summary changed (at most every
  ``membership_refresh_s``). A lease found expired (etcd was unreachable
  longer than the TTL, or it was revoked) is replaced and the record put
  again: the host rejoins. ``close`` revokes the lease, so the others see
  this host leave at once rather than one TTL later.
- ``tierstore-membership-watch``: reads the group (one Range), then follows
  it with a Watch from the next revision; a compacted or cancelled watch,
  or an error, starts again from a fresh Range.

When etcd cannot be reached the last known set stays in force and serving
goes on: the outage is counted (``etcd_errors``, ``etcd_outages``), logged
once when it starts and once when it ends, and ``etcd_up`` reads 0 in
``tierstore stat``. Membership only decides where replica pushes go and
whom lookups ask; nothing stored depends on it, so a lease lost while
partitioned drops nothing.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable

import grpc

from tierstore.config.peer import MembershipURL, PeerConfig
from tierstore.counters import Counters
from tierstore.membership.etcd_client import EtcdAuth, EtcdClient, WatchStream
from tierstore.membership.members import Member, decode_member, diff
from tierstore.v1 import etcd_rpc_pb2 as pb
from tierstore.workers import Workers

log = logging.getLogger(__name__)

MEMBERSHIP_COUNTERS = (
    "members",  # live members known now (this host included once it registered)
    "joins",  # members that appeared
    "leaves",  # members that went (lease expired or revoked, record deleted)
    "etcd_up",  # 1 while etcd answers, 0 during an outage
    "etcd_errors",  # failed etcd calls and broken streams
    "etcd_outages",  # times etcd went from answering to not
    "registered",  # 1 while this host's record is in etcd under a live lease
    "registrations",  # records put under a new lease (first join and every rejoin)
    "leases_lost",  # leases found expired on renewal (partitioned longer than the TTL)
    "watch_resyncs",  # watches restarted from a fresh read of the group
    "bad_records",  # values under the group's prefix that are no member record
)
RETRY_MIN_S = 0.1  # first wait after a failed etcd call; doubles up to a third of the TTL


class EtcdRefused(Exception):
    """etcd answered but refused (a lease grant with an error): retried like an outage."""


def etcd_auth(url: MembershipURL, cfg: PeerConfig) -> EtcdAuth:
    return EtcdAuth(
        endpoints=url.endpoints,
        tls=url.scheme == "etcds" or bool(cfg.membership_tls_ca_file),
        ca_file=cfg.membership_tls_ca_file,
        cert_file=cfg.membership_tls_cert_file,
        key_file=cfg.membership_tls_key_file,
        credentials_file=cfg.membership_credentials_file,
    )


class EtcdMembers:
    """The live set of ``cfg.group`` in etcd. ``describe`` (a sidecar's own
    record) makes it register this host; None (the router) only watches."""

    def __init__(
        self,
        cfg: PeerConfig,
        *,
        describe: Callable[[], Member] | None = None,
        workers: Workers | None = None,
        on_change: Callable[[list[str]], None] | None = None,
    ) -> None:
        url = cfg.membership_url()
        if url is None:
            raise ValueError("EtcdMembers needs cfg.membership (etcd://...)")
        self.cfg = cfg
        self.url = url
        self.ttl_s = int(cfg.membership_ttl_s)
        self.prefix = url.group_prefix(cfg.group)
        self.counters = Counters(MEMBERSHIP_COUNTERS)
        self.etcd = EtcdClient(etcd_auth(url, cfg), cfg.membership_timeout_s)
        self._describe = describe
        self._on_change = on_change
        self._lock = threading.Lock()
        self._live: dict[str, Member] = {}
        self._version = 0
        self._reachable: bool | None = None  # None: not yet known
        self._watch: WatchStream | None = None
        self._synced = threading.Event()
        self._stop = threading.Event()
        self._wake = threading.Event()  # the lease thread's sleep; set to re-put at once
        self._reput = False
        self._lease = 0
        self._key = url.member_key(cfg.group, describe().address) if describe else b""
        self._workers = workers or Workers()
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        """Start watching (and registering): call once this host serves its peer port."""
        if self._threads or self._stop.is_set():
            raise RuntimeError("EtcdMembers.start: already started or closed")
        self._threads.append(self._workers.start("tierstore-membership-watch", self._watch_loop))
        if self._describe is not None:
            self._threads.append(
                self._workers.start("tierstore-membership-lease", self._lease_loop)
            )

    # -- MemberSet ------------------------------------------------------------------------

    @property
    def version(self) -> int:
        with self._lock:
            return self._version

    def addresses(self) -> list[str]:
        with self._lock:
            return sorted(self._live)

    def records(self) -> dict[str, Member]:
        with self._lock:
            return dict(self._live)

    def wait_synced(self, timeout_s: float) -> bool:
        """Whether the group was read from etcd at least once, waiting up to ``timeout_s``."""
        return self._synced.wait(timeout_s)

    # -- outages --------------------------------------------------------------------------

    def _up(self) -> None:
        with self._lock:
            was, self._reachable = self._reachable, True
        if was is False:
            log.info("etcd %s answers again: membership resumes", self.etcd.endpoint)
        self.counters.set("etcd_up", 1)

    def _down(self, e: BaseException) -> None:
        self.counters.add("etcd_errors")
        with self._lock:
            was, self._reachable = self._reachable, False
            watch = self._watch
            members = len(self._live)
        self.counters.set("etcd_up", 0)
        if was is not False:
            self.counters.add("etcd_outages")
            log.warning(
                "etcd %s unreachable (%s): keeping the last known group of %d members and "
                "serving on; will rejoin when it answers",
                ",".join(self.url.endpoints), _text(e), members,
            )  # fmt: skip
        if watch is not None:  # a watch on a dead connection may never notice by itself
            watch.cancel()

    def _backoff(self, wait_s: float) -> float:
        self._stop.wait(wait_s)
        return min(wait_s * 2, self.ttl_s / 3)

    # -- registration (tierstore-membership-lease) -------------------------------------------

    def _lease_loop(self) -> None:
        assert self._describe is not None
        wait_s = RETRY_MIN_S
        last_value, last_put = b"", 0.0
        while not self._stop.is_set():
            try:
                if self._lease:
                    if self.etcd.keepalive(self._lease) <= 0:
                        self.counters.add("leases_lost")
                        self.counters.set("registered", 0)
                        log.warning(
                            "membership lease of %s expired (etcd unreachable for longer than "
                            "%d s?): joining again", self._describe().address, self.ttl_s,
                        )  # fmt: skip
                        self._lease = 0
                        continue
                value = self._describe().encode()
                now = time.monotonic()
                if not self._lease:
                    grant = self.etcd.grant(self.ttl_s)
                    if grant.error or grant.ID == 0:
                        raise EtcdRefused(f"etcd refused a lease: {grant.error or 'no id'}")
                    self._put(value, grant.ID)
                    self._lease = grant.ID
                    self.counters.add("registrations")
                    self.counters.set("registered", 1)
                    last_value, last_put = value, now
                elif self._take_reput() or (
                    value != last_value and now - last_put >= self.cfg.membership_refresh_s
                ):
                    self._put(value, self._lease)
                    last_value, last_put = value, now
                self._up()
                wait_s = RETRY_MIN_S
                self._wake.wait(self.ttl_s / 3)
                self._wake.clear()
            except (grpc.RpcError, EtcdRefused) as e:
                if self._stop.is_set():
                    break
                self._down(e)
                wait_s = self._backoff(wait_s)
            except ValueError:  # the client was closed under a call: only while stopping
                if not self._stop.is_set():
                    raise
                break
        self._leave()

    def _put(self, value: bytes, lease: int) -> None:
        self.etcd.put(self._key, value, lease)

    def _take_reput(self) -> bool:
        with self._lock:
            reput, self._reput = self._reput, False
        return reput

    def _leave(self) -> None:
        """Revoke the lease (the record goes with it); best effort, bounded."""
        lease, self._lease = self._lease, 0
        if not lease:
            return
        try:
            self.etcd.revoke(lease)
        except (grpc.RpcError, ValueError) as e:  # ValueError: closed meanwhile
            log.info("could not revoke the membership lease (%s); it expires in %d s",
                     _text(e), self.ttl_s)  # fmt: skip
        self.counters.set("registered", 0)

    # -- the group (tierstore-membership-watch) ----------------------------------------------

    def _watch_loop(self) -> None:
        wait_s = RETRY_MIN_S
        while not self._stop.is_set():
            stream: WatchStream | None = None
            try:
                reply = self.etcd.range_prefix(self.prefix)
                self._replace(self._decode_all(reply.kvs))
                self._up()
                self._synced.set()
                stream = self.etcd.watch_prefix(self.prefix, reply.header.revision + 1)
                with self._lock:
                    self._watch = stream
                if self._stop.is_set():
                    stream.cancel()
                for resp in stream:
                    if resp.canceled or resp.compact_revision:
                        break  # compacted past our revision, or refused: read afresh
                    if resp.events:
                        self._apply(resp.events)
                    wait_s = RETRY_MIN_S
                if not self._stop.is_set():
                    self.counters.add("watch_resyncs")
            except grpc.RpcError as e:
                if self._stop.is_set():
                    break
                if e.code() != grpc.StatusCode.CANCELLED:  # CANCELLED: _down did it
                    self._down(e)
                    if stream is not None:
                        self.etcd.failed(stream.endpoint)
                self.counters.add("watch_resyncs")
                wait_s = self._backoff(wait_s)
            except ValueError:  # the client was closed under a call: only while stopping
                if not self._stop.is_set():
                    raise
                break
            finally:
                with self._lock:
                    self._watch = None

    def _decode_all(self, kvs: Iterable[pb.KeyValue]) -> dict[str, Member]:
        out: dict[str, Member] = {}
        for kv in kvs:
            m = decode_member(kv.key, kv.value, self.prefix)
            if m is None:
                self.counters.add("bad_records")
            else:
                out[m.address] = m
        return out

    def _apply(self, events: Iterable[pb.Event]) -> None:
        live = self.records()
        for ev in events:
            if ev.type == pb.Event.DELETE:
                address = ev.kv.key[len(self.prefix) :].decode(errors="replace")
                live.pop(address, None)
                if ev.kv.key == self._key and not self._stop.is_set():
                    self._request_reput()  # someone deleted our record under a live lease
            else:
                m = decode_member(ev.kv.key, ev.kv.value, self.prefix)
                if m is None:
                    self.counters.add("bad_records")
                else:
                    live[m.address] = m
        self._replace(live)

    def _request_reput(self) -> None:
        with self._lock:
            self._reput = True
        self._wake.set()

    def _replace(self, live: dict[str, Member]) -> None:
        with self._lock:
            before = sorted(self._live)
            self._live = live
            after = sorted(live)
            if before != after:
                self._version += 1
        joined, left = diff(before, after)
        if joined or left:
            self.counters.add_many({"joins": len(joined), "leaves": len(left)})
            self.counters.set("members", len(after))
            log.info("group %s: %d members%s%s", self.cfg.group, len(after),
                     f"; joined {', '.join(joined)}" if joined else "",
                     f"; left {', '.join(left)}" if left else "")  # fmt: skip
            if self._on_change is not None:
                self._on_change(after)

    # -- shutdown -------------------------------------------------------------------------

    def close(self) -> None:
        """Leave the group (lease revoked) and stop both threads. Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._wake.set()
        with self._lock:
            watch = self._watch
        if watch is not None:
            watch.cancel()
        deadline = time.monotonic() + 2 * self.cfg.membership_timeout_s + 1
        for t in self._threads:
            t.join(timeout=max(deadline - time.monotonic(), 0.01))
        self._leave()  # if the lease thread could not (it is stuck in a call)
        self.etcd.close()


def describe_host(
    address: str, group: str, tiers: tuple[str, ...], dram_bytes: int, nvme_bytes: int,
    replica_budget_bytes: int, load: Callable[[], dict[str, int]], version: str,
    engine_url: str = "", engine_events: str = "",
) -> Callable[[], Member]:  # fmt: skip
    """A sidecar's ``describe`` for ``EtcdMembers``: fixed facts (its engine's
    URL and event endpoint among them, for gateways) plus its load now."""
    pid = os.getpid()

    def describe() -> Member:
        return Member(address, group, tiers, dram_bytes, nvme_bytes, replica_budget_bytes,
                      load(), version, pid, engine_url, engine_events)  # fmt: skip

    return describe


def _text(e: BaseException) -> str:
    if isinstance(e, grpc.RpcError) and hasattr(e, "code"):
        return f"{e.code().name}: {e.details()}"
    return str(e)
