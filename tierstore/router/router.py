"""The router: asks the hosts (or its index) and ranks them with the cost model.

Provides ``Router``. The candidates are ``router_hosts``, or with
``membership`` the group's live members in etcd (watched, never joined;
the index follows hosts as they come and go). For a request's block keys
it gets, for every candidate host, the prefix that host holds by tier and
its load: from the ``FleetIndex`` when the host's event stream is synced
and fresh (``watch=True``), else from one batched peer ``Lookup`` per host,
all sent at once under one deadline (a host that does not answer in time
is listed as unreachable, never waited for). Measured speeds a host
reports (prefill, NVMe read, peer fetch) replace the configured ones for
that host. ``tierstore.router.cost.plan`` does the rest.
With ``router_vllm_events`` it also subscribes to each host's vLLM engine's
KV events (``tierstore.router.engine_events``) and ranks every reachable
host on the better, block by block, of its sidecar's view and its engine's
(a prefix vLLM still holds on the GPU, or one only vLLM's events announced).
``preposition`` tells the chosen host to bring the prefix into DRAM (from its
NVMe, the peers, the remote tier) before the request reaches it; it does not
wait for the answer.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import grpc

from tierstore.config.peer import PeerConfig
from tierstore.config.router import RouterConfig
from tierstore.errors import ConfigError
from tierstore.keys import BlockKey, KVLayout
from tierstore.load import HostLoadView
from tierstore.membership.etcd import EtcdMembers
from tierstore.membership.members import MemberSet, StaticMembers
from tierstore.peer.client import PeerClient
from tierstore.peer.clients import PeerClients
from tierstore.router.cost import HostView, Plan, Rates, plan
from tierstore.router.engine_events import (
    EngineIndex,
    EngineSubscriber,
    merge_tiers,
    parse_endpoints,
    read_layout,
    start_subscribers,
)
from tierstore.router.feeder import IndexFeeder
from tierstore.router.index import FleetIndex
from tierstore.wire import load_from_proto

log = logging.getLogger(__name__)


def rates_from_config(cfg: RouterConfig) -> Rates:
    return Rates(
        prefill_tokens_per_s=cfg.prefill_tokens_per_s,
        dram_bytes_per_s=cfg.dram_load_bytes_per_s,
        nvme_bytes_per_s=cfg.nvme_load_bytes_per_s,
        peer_bytes_per_s=cfg.peer_load_bytes_per_s,
        turn_s=cfg.turn_s,
    )


class Router:
    def __init__(self, cfg: RouterConfig, peer: PeerConfig) -> None:
        if not cfg.router_hosts and not peer.membership:
            raise ConfigError(
                "router_hosts is empty: name the peer address of every host, or give the "
                "group's membership (etcd://...)"
            )
        if cfg.router_hosts and peer.membership:
            raise ConfigError("give router_hosts or membership, not both")
        token = peer.token()
        if not token:
            raise ConfigError("the router needs the group's peer_token (or peer_token_file)")
        self.cfg = cfg
        self.rates = rates_from_config(cfg)
        self.index: FleetIndex | None = None
        self.feeder: IndexFeeder | None = None
        self._fleet_lock = threading.Lock()
        self.members: MemberSet
        if peer.membership:
            # The router only watches the group: it is not a member of it.
            self.members = EtcdMembers(peer, on_change=self._fleet_changed)
            self.members.start()
            self.members.wait_synced(peer.membership_timeout_s)
        else:
            self.members = StaticMembers(cfg.router_hosts)
        self._clients = PeerClients(self.members, lambda h: PeerClient(h, peer, token))
        self.engines: EngineIndex | None = None
        self._subscribers: list[EngineSubscriber] = []
        if cfg.router_vllm_events:
            self.engines = EngineIndex(read_layout(cfg.router_vllm_layout))
            endpoints = parse_endpoints(cfg.router_vllm_events)
            self._subscribers = start_subscribers(self.engines, endpoints)
        if cfg.router_watch:
            self.index = FleetIndex(stale_s=cfg.router_stale_s)
            self.feeder = IndexFeeder(self.index, (), self._open_watch)
            self._fleet_changed()

    @property
    def clients(self) -> dict[str, PeerClient]:
        """host -> client of every candidate host now (the live group with membership)."""
        return self._clients.clients()

    def _open_watch(self, host: str, epoch: int, seq: int) -> Any:
        client = self.clients.get(host)
        if client is None:
            raise ValueError(f"{host} left the group")
        return client.watch_blocks(epoch, seq)

    def _fleet_changed(self, hosts: Sequence[str] = ()) -> None:
        # The set is read under the lock, so whichever call runs last (the
        # first one here, or a change arriving meanwhile) leaves it current.
        with self._fleet_lock:
            if self.feeder is not None:
                self.feeder.set_hosts(self.members.addresses())

    def route(
        self,
        layout: KVLayout,
        keys: Sequence[BlockKey],
        num_tokens: int,
        *,
        hosts: Sequence[str] = (),
        session: str = "",
        current_host: str = "",
        loads: Mapping[str, HostLoadView] | None = None,
        held: Mapping[str, bytes] | None = None,
        prefill_tokens_per_s: Mapping[str, float] | None = None,
    ) -> Plan:
        """Rank ``hosts`` (default: all configured) for a prompt of
        ``num_tokens`` tokens whose full blocks have ``keys``. ``loads``
        replace the hosts' own load reports; ``held`` adds, per host, tier
        codes of a prefix its engine holds (a gateway's view of vLLM's KV
        events), merged block by block with the sidecar's answer;
        ``prefill_tokens_per_s`` replaces a host's prefill speed (measured
        by the caller)."""
        clients = self.clients  # one view of the fleet for the whole request
        candidates = list(dict.fromkeys(hosts or clients))
        unknown = [h for h in candidates if h not in clients]
        if unknown:
            raise ValueError(f"not configured hosts: {unknown}; known: {sorted(clients)}")
        if not candidates:
            raise ValueError(
                "no candidate hosts: the group has no live member (is etcd reachable, and do "
                "the sidecars use the same membership prefix and group?)"
            )
        if len(keys) * layout.block_tokens > num_tokens:
            raise ValueError(
                f"{len(keys)} blocks of {layout.block_tokens} tokens exceed num_tokens {num_tokens}"
            )
        views = self._views(layout, keys, candidates, clients)
        if loads:
            views = [replace(v, load=loads[v.host]) if v.host in loads else v for v in views]
        if held:
            views = [_with_held(v, held.get(v.host, b"")) for v in views]
        if prefill_tokens_per_s:
            views = [
                replace(v, rates=(v.rates or self.rates).for_host(prefill_tokens_per_s[v.host]))
                if v.host in prefill_tokens_per_s and v.reachable
                else v
                for v in views
            ]
        return plan(
            views, len(keys), num_tokens, layout.block_tokens, layout.block_bytes, self.rates,
            session=session, current_host=current_host, spill_tie_s=self.cfg.spill_tie_s,
        )  # fmt: skip

    def _views(
        self, layout: KVLayout, keys: Sequence[BlockKey], hosts: list[str],
        clients: Mapping[str, PeerClient],
    ) -> list[HostView]:  # fmt: skip
        now = time.monotonic()
        views: dict[str, HostView] = {}
        if self.index is not None:
            for h in hosts:
                if self.index.fresh(h, now):
                    tiers, load = self.index.prefix(h, keys)
                    speed = load.prefill_tokens_per_s if load is not None else 0.0
                    views[h] = HostView(
                        h,
                        tiers,
                        load,
                        self.rates.for_host(prefill_tokens_per_s=speed),
                        source="index",
                    )
        asked = {
            h: clients[h].lookup_future(layout, keys, self.cfg.router_lookup_timeout_s)
            for h in hosts
            if h not in views
        }
        for h, fut in asked.items():
            try:
                reply = fut.result()
            except grpc.RpcError as e:
                views[h] = HostView(h, reachable=False, error=f"{e.code().name}: {e.details()}")
                continue
            load = load_from_proto(reply.load)
            rates = self.rates.for_host(
                load.prefill_tokens_per_s, reply.nvme_read_bytes_per_s, reply.peer_fetch_bytes_per_s
            )
            views[h] = HostView(h, reply.tiers[: reply.num_hits], load, rates)
        if self.engines is not None:
            for h in hosts:
                views[h] = _with_held(views[h], self.engines.prefix(h, keys))
        return [views[h] for h in hosts]

    def answers_from_index(self, hosts: Sequence[str]) -> bool:
        """Whether ``route`` for these hosts reads only the index (every host
        synced and fresh): no call to a host, so no wait on one."""
        if self.index is None:
            return False
        now = time.monotonic()
        return all(self.index.fresh(h, now) for h in hosts)

    def preposition(self, host: str, layout: KVLayout, keys: Sequence[BlockKey]) -> None:
        """Ask ``host`` to prefetch ``keys`` into DRAM; returns at once (a
        failure is logged, and the request simply finds less in DRAM)."""
        client = self.clients.get(host)
        if client is None:  # left the group meanwhile
            return
        fut = client.preposition_future(layout, keys, self.cfg.router_lookup_timeout_s)

        def done(f: grpc.Future) -> None:
            if f.exception() is not None:
                log.debug("preposition on %s failed: %s", host, f.exception())

        fut.add_done_callback(done)

    def close(self) -> None:
        self.members.close()  # no more fleet changes from here on
        if self.feeder is not None:
            self.feeder.close()
        for sub in self._subscribers:
            sub.close()
        self._clients.close()


def _with_held(view: HostView, held: bytes) -> HostView:
    """``view`` with the prefix its engine's events say it holds merged in."""
    if not held or not view.reachable:
        return view
    return replace(view, tiers=merge_tiers(view.tiers, held), source=f"{view.source}+vllm")
