"""What a sidecar's Stat answers: ``stat_reply``, the one place counters are
read into a StatReply, from which both ``tierstore stat`` and ``/metrics``
(``tierstore.sidecar.metrics``) are made.

Provides ``StatSource``, the parts of the local service a reply is read
from (the store, the service's, fast path's, peer tier's, membership's and
prefetcher's counters, the attached clients and their engines' tiers, the
engines' reported load, uptime and setup facts), and ``stat_reply``.
``LocalServicer`` (``tierstore.sidecar.service``) is one; this module
imports neither the service nor the process.

Runs in the sidecar, on the thread that asks: a gRPC handler (Stat) or a
metrics scrape. Reads only: snapshots of counters, no locks of its own.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Protocol

from tierstore import __version__
from tierstore.config import Config
from tierstore.config.server import ServerConfig
from tierstore.counters import Counters
from tierstore.sidecar.clients import TIER_STAT_FIELDS, ClientSession
from tierstore.sidecar.fastpath import FastLookupServer
from tierstore.sidecar.loadboard import LoadBoard
from tierstore.sidecar.prefetch import Prefetcher
from tierstore.store.tiered import TieredStore
from tierstore.v1 import common_pb2, local_pb2
from tierstore.wire import host_load_proto

if TYPE_CHECKING:
    from tierstore.peer.service import PeerServer


class StatSource(Protocol):
    """What a StatReply is read from (the local service)."""

    store: TieredStore
    counters: Counters  # the local service's own
    fast_lookup: FastLookupServer | None
    peer_server: PeerServer | None
    prefetcher: Prefetcher
    loads: LoadBoard  # the engines' reported load
    cfg: ServerConfig
    config: Config
    started_at: float  # time.time() at start

    def clients(self) -> list[ClientSession]: ...

    def engine_tiers(self) -> list[common_pb2.TierStat]: ...


def stat_reply(source: StatSource) -> local_pb2.StatReply:
    stat = source.store.stat()
    counters = dict(stat["store"])
    counters.update(source.counters.snapshot())
    if source.fast_lookup is not None:
        fast = source.fast_lookup.counters.snapshot()
        counters["fast_lookups"] = fast["lookups"]
        counters["fast_calls"] = fast["calls"]
        counters["bad_requests"] += fast["bad_requests"]
    if source.peer_server is not None:
        counters.update(
            {f"peer_{k}": v for k, v in source.peer_server.tier.counters.snapshot().items()}
        )
        counters.update(
            {f"peer_{k}": v for k, v in source.peer_server.data.counters.snapshot().items()}
        )
        counters["replica_bytes"] = source.store.replica_bytes()
        counters["peer_tls"] = int(source.peer_server.tls)
        if source.peer_server.members is not None:
            members = source.peer_server.members.counters.snapshot()
            counters.update({f"membership_{k}": v for k, v in members.items()})
    pf = source.prefetcher.counters.snapshot()
    counters.update({f"prefetch_{k}": v for k, v in pf.items()})
    failed = source.store.workers.failed()
    counters["worker_failures"] = len(failed)
    now = time.time()
    return local_pb2.StatReply(
        tiers=[
            *source.engine_tiers(),
            *(
                common_pb2.TierStat(
                    name=name, **{k: v for k, v in t.items() if k in TIER_STAT_FIELDS}
                )
                for name, t in stat["tiers"].items()
            ),
        ],
        counters={k: int(v) for k, v in counters.items()},
        clients=[
            local_pb2.ClientInfo(
                client_id=c.client_id,
                name=c.name,
                pid=c.pid,
                connected_s=now - c.connected_at,
                pins=source.store.pin_count(c.client_id),
            )
            for c in source.clients()
        ],
        version=__version__,
        uptime_s=now - source.started_at,
        socket_path=source.cfg.socket_path,
        nvme_dir=source.config.store.nvme_dir if source.store.has_nvme else "",
        load=host_load_proto(source.loads.host()),
        failed_workers=[f"{name}: {error}" for name, error in sorted(failed.items())],
        info=stat["info"],
    )
