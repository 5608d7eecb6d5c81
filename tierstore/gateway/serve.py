"""Running the gateway: build its parts from the config, serve until a signal.

Provides ``build(config)`` (the ``Gateway`` and its ``Fleet``, with the
router when any engine has a sidecar: static ``gateway_backends``, or the
etcd group of ``membership``, whose members name their engines) and
``serve(config)``, the ``tierstore gateway`` process: the HTTP server on
``gateway_host:gateway_port``, the fleet's poll task, and a graceful stop
on SIGTERM or SIGINT (in-flight requests get ``shutdown_grace_s``); it
tells systemd when it serves (``Type=notify``).

Runs one asyncio event loop in the gateway's process.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import signal
from collections.abc import Callable

import aiohttp
from aiohttp import web

from tierstore.config import Config
from tierstore.errors import ConfigError
from tierstore.gateway.app import Gateway, make_app
from tierstore.gateway.backends import BackendSet, MemberBackends, StaticBackends, parse_backend
from tierstore.gateway.fleet import Fleet, cancel
from tierstore.gateway.forward import Upstream
from tierstore.gateway.metrics import GatewayMetrics
from tierstore.gateway.placement import make_policy
from tierstore.gateway.sessions import Sessions
from tierstore.gateway.tokens import HfTokenizer
from tierstore.notify import notify
from tierstore.router.engine_events import read_layout
from tierstore.router.router import Router

log = logging.getLogger(__name__)


def build(config: Config, http: aiohttp.ClientSession) -> Gateway:
    """The gateway of ``config`` (its fleet not yet polling)."""
    g = config.gateway
    metrics = GatewayMetrics()
    static = [parse_backend(b) for b in g.gateway_backends]
    if static and config.peer.membership:
        raise ConfigError("give gateway_backends or membership, not both")
    router: Router | None = None
    peers = tuple(b.peer for b in static if b.peer)
    if config.peer.membership or peers:
        if static and len(peers) != len(static):
            raise ConfigError("gateway_backends: give every engine its sidecar (peer=) or none")
        rcfg = dataclasses.replace(config.router, router_hosts=peers, router_watch=g.gateway_watch)
        router = Router(rcfg, config.peer)
    backends: BackendSet
    if config.peer.membership:
        assert router is not None
        backends = MemberBackends(router.members)  # type: ignore[arg-type]
    else:
        backends = StaticBackends(static)
    layout = read_layout(g.gateway_layout) if g.gateway_layout else None
    fleet = Fleet(g, config.peer, backends, http, metrics, router=router, layout=layout,
                  prefill_tokens_per_s=config.router.prefill_tokens_per_s)  # fmt: skip
    policy = make_policy(
        g.gateway_policy, router.route if router else None, g.gateway_prefix_max_waiting,
        g.gateway_move_margin_s, router.answers_from_index if router else None,
    )  # fmt: skip

    tokenizer = HfTokenizer(g.gateway_tokenizer) if g.gateway_tokenizer else None
    upstream = Upstream(http, g.gateway_connect_timeout_s, g.gateway_first_byte_timeout_s)
    return Gateway(fleet, policy, Sessions(g.gateway_sessions), upstream, metrics, tokenizer)


def http_session() -> aiohttp.ClientSession:
    """The gateway's one client session: pooled keep-alive connections to every engine."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=60.0),
        auto_decompress=False,
    )


async def run(config: Config, started: Callable[[str], None] | None = None) -> None:
    """Serve until SIGTERM or SIGINT; ``started`` gets the bound address."""
    g = config.gateway
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with http_session() as http:
        gw = build(config, http)
        poll = asyncio.create_task(gw.fleet.run(), name="gateway-fleet-poll")
        runner = web.AppRunner(
            make_app(gw, g.gateway_max_body_bytes),
            access_log=None,
            shutdown_timeout=config.server.shutdown_grace_s,
        )
        await runner.setup()
        site = web.TCPSite(runner, g.gateway_host, g.gateway_port)
        await site.start()
        address = f"{g.gateway_host}:{g.gateway_port}"
        log.info("tierstore gateway on http://%s, policy %s", address, gw.policy.name)
        notify("READY=1")
        if started is not None:
            started(address)
        try:
            await stop.wait()
        finally:
            notify("STOPPING=1")
            log.info("tierstore gateway stopping")
            await runner.cleanup()
            await cancel(poll)
            gw.fleet.close()


def serve(config: Config) -> int:
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run(config))
    return 0
