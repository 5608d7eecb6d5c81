"""The gateway's live picture of its engines.

Provides ``Fleet``. Its ``run`` task follows the backend set (the static
list, or the etcd group's members) and, every ``gateway_load_poll_s``,
scrapes each engine's ``/metrics`` (running and waiting requests; a failed
scrape marks the engine down), and every ``gateway_models_poll_s`` reads its
``/v1/models`` (which models it serves, their ``max_model_len``) and the KV
layouts its sidecar's engines registered (the peer service's ``PeerStat``:
the connector's own layout, so the gateway's keys are the engine's). With
KV events (``events=`` of a backend), one subscriber thread per engine
feeds an ``EngineIndex`` of what each engine holds in HBM.

Then, per request: ``candidates`` (engines up, serving the model, not in
their ``gateway_down_s`` after a failure, with their load), ``layout``,
``hbm`` (the prefix an engine's events show), ``preposition`` (a sidecar is
told to pull a prefix; not waited for) and ``tokenize`` (an engine's
``/tokenize``).

Runs on the gateway's event loop; sidecar calls and the router run on
worker threads (``asyncio.to_thread``); subscribers on their own threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import grpc

from tierstore.config.gateway import GatewayConfig
from tierstore.config.peer import PeerConfig
from tierstore.gateway.backends import Backend, BackendSet
from tierstore.gateway.load import EngineCounts, Ledger, host_load, scrape_counts
from tierstore.gateway.metrics import GatewayMetrics
from tierstore.gateway.placement import Candidate
from tierstore.gateway.requests import ApiError
from tierstore.keys import BlockKey, KVLayout
from tierstore.peer.client import PeerClient
from tierstore.router.engine_events import EngineIndex, EngineSubscriber
from tierstore.router.router import Router

log = logging.getLogger(__name__)

CACHE_SALT_MARK = "\x00cache_salt="  # a layout registered for a salted request (not the base)


@dataclass(slots=True)
class Engine:
    backend: Backend
    up: bool = False
    down_until: float = 0.0  # after a failed request: skipped until then
    models: dict[str, dict[str, Any]] = field(default_factory=dict)  # id -> model card
    counts: EngineCounts | None = None
    layout: KVLayout | None = None  # the base layout its sidecar's engine registered
    subscriber: EngineSubscriber | None = None
    models_at: float = 0.0
    error: str = ""


def base_layout(layouts: Sequence[KVLayout]) -> KVLayout | None:
    """The layout requests are keyed under: rank 0's, not a salted variant."""
    base = [lo for lo in layouts if lo.tp_rank == 0 and CACHE_SALT_MARK not in lo.tenant_salt]
    return base[0] if len(base) == 1 else None


class Fleet:
    def __init__(
        self,
        cfg: GatewayConfig,
        peer: PeerConfig,
        backends: BackendSet,
        http: aiohttp.ClientSession,
        metrics: GatewayMetrics,
        *,
        router: Router | None = None,
        layout: KVLayout | None = None,
        prefill_tokens_per_s: float = 8000.0,
    ) -> None:
        self.cfg = cfg
        self.peer = peer
        self.backends = backends
        self.http = http
        self.metrics = metrics
        self.router = router
        self.ledger = Ledger()
        self.prefill_tokens_per_s = prefill_tokens_per_s  # configured; calibrated per engine
        self._configured_layout = layout
        self._engines: dict[str, Engine] = {}
        self._version: int | None = None
        self._peer_clients: dict[str, PeerClient] = {}
        self.index: EngineIndex | None = EngineIndex(layout) if layout else None
        self.ready = asyncio.Event()  # the first poll of every engine is done
        self.poll_failures = 0
        self.poll_error = ""

    # -- the picture ----------------------------------------------------------------------

    def engines(self) -> list[Engine]:
        return list(self._engines.values())

    def backend(self, name: str) -> Backend | None:
        e = self._engines.get(name)
        return e.backend if e else None

    def models(self) -> dict[str, dict[str, Any]]:
        """Every model an up engine serves: id -> its model card (the first seen)."""
        out: dict[str, dict[str, Any]] = {}
        for e in self._engines.values():
            if e.up:
                for mid, card in e.models.items():
                    out.setdefault(mid, card)
        return out

    def max_model_len(self, model: str) -> int | None:
        """The smallest context of the up engines serving ``model`` (None: unknown)."""
        lens = [
            n
            for e in self._engines.values()
            if e.up and model in e.models
            for n in [e.models[model].get("max_model_len")]
            if isinstance(n, int) and n > 0
        ]
        return min(lens) if lens else None

    def serving(self, model: str) -> list[Engine]:
        """Up engines serving ``model``; those in their down time after a failure last."""
        now = time.monotonic()
        live = [e for e in self._engines.values() if e.up and model in e.models]
        return sorted(live, key=lambda e: e.down_until > now)

    def layout(self, engines: Sequence[Engine]) -> KVLayout | None:
        """The layout to key a request for these engines: the one most of them
        registered (engines of one model share it), else the configured one."""
        seen = Counter(e.layout for e in engines if e.layout is not None)
        if seen:
            return seen.most_common(1)[0][0]
        return self._configured_layout

    def candidates(self, engines: Sequence[Engine], keys: Sequence[BlockKey]) -> list[Candidate]:
        now = time.monotonic()
        out = []
        for e in engines:
            name = e.backend.name
            waiting, streaming = self.ledger.in_flight(name)
            engine_waiting = e.counts.waiting if e.counts else 0.0
            engine_running = e.counts.running if e.counts else 0.0
            load = host_load(
                self.ledger.pending_prefill_s(name, now),
                waiting,
                e.counts,
                self.cfg.gateway_foreign_request_s,
                self.ledger.step_s(name),
            )
            out.append(
                Candidate(
                    name=name,
                    load=load,
                    waiting=max(float(waiting), engine_waiting),
                    in_flight=max(float(waiting + streaming), engine_waiting + engine_running),
                    hbm=self.index.prefix(name, keys) if self.index is not None and keys else b"",
                    prefill_tokens_per_s=self.effective_prefill(e),
                )
            )
        return out

    def effective_prefill(self, e: Engine) -> float:
        """The prefill speed the cost model uses for ``e``: the configured one
        (``prefill_tokens_per_s``), slowed or sped by how much later (or
        sooner) its first tokens came than estimated (the ledger's factor)."""
        return self.prefill_tokens_per_s / self.ledger.ttft_factor(e.backend.name)

    def failed(self, name: str, why: str) -> None:
        """A request to ``name`` failed before its first byte: skip it for a while."""
        e = self._engines.get(name)
        if e is not None:
            e.down_until = time.monotonic() + self.cfg.gateway_down_s
            e.error = why

    def preposition(self, name: str, layout: KVLayout, keys: Sequence[BlockKey]) -> None:
        """Tell ``name``'s sidecar to pull the prefix now (returns at once)."""
        if self.router is None or not keys:
            return
        self.router.preposition(name, layout, keys)
        self.metrics.prepositions.labels(name).inc()

    async def tokenize(self, body: dict[str, Any]) -> list[int]:
        """``body`` through an up engine's ``/tokenize`` (vLLM's)."""
        for e in self.serving(str(body.get("model", ""))):
            try:
                async with self.http.post(
                    f"{e.backend.url}/tokenize",
                    json=body,
                    timeout=self._timeout(self.cfg.gateway_connect_timeout_s),
                ) as r:
                    if r.status == 400:
                        raise ApiError(400, f"the engine refused the prompt: {await r.text()}")
                    if r.status == 200:
                        tokens = (await r.json()).get("tokens")
                        if isinstance(tokens, list):
                            return tokens
            except (aiohttp.ClientError, TimeoutError):
                continue
        raise ApiError(
            503,
            "no engine could tokenize the prompt",
            type="server_error",
            code="no_backend_available",
        )

    def _timeout(self, total_s: float) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=total_s)

    # -- following the engines ------------------------------------------------------------

    async def run(self) -> None:
        """Poll until cancelled. A round that fails unexpectedly (a bug: the
        expected failures of an engine or a sidecar are its state) is logged
        with its traceback, counted in ``/health``, and the next round runs."""
        while True:
            try:
                self._follow_backends()
                await asyncio.gather(*(self._poll(e) for e in list(self._engines.values())))
            except Exception as e:
                self.poll_failures += 1
                self.poll_error = f"{type(e).__name__}: {e}"
                log.exception("gateway: polling the engines failed")
            self.ready.set()
            await asyncio.sleep(self.cfg.gateway_load_poll_s)

    def _follow_backends(self) -> None:
        version = self.backends.version
        if version == self._version:
            return
        self._version = version
        current = {b.name: b for b in self.backends.backends()}
        for name in [n for n in self._engines if n not in current]:
            self._drop(name)
        for name, b in current.items():
            old = self._engines.get(name)
            if old is not None and old.backend != b:
                self._drop(name)
            if name not in self._engines:
                self._engines[name] = Engine(b)
                log.info("gateway: engine %s (%s) joined", name, b.url)

    def _drop(self, name: str) -> None:
        e = self._engines.pop(name)
        if e.subscriber is not None:
            e.subscriber.close()
        if self.index is not None:
            self.index.forget(name)
        client = self._peer_clients.pop(name, None)
        if client is not None:
            client.close()
        with contextlib.suppress(KeyError):  # never polled: no sample yet
            self.metrics.backend_up.remove(name)
        log.info("gateway: engine %s (%s) left", name, e.backend.url)

    async def _poll(self, e: Engine) -> None:
        name = e.backend.name
        try:
            async with self.http.get(
                f"{e.backend.url}/metrics",
                timeout=self._timeout(self.cfg.gateway_connect_timeout_s),
            ) as r:
                r.raise_for_status()
                e.counts = scrape_counts(await r.text())
            now = time.monotonic()
            if not e.up or now - e.models_at >= self.cfg.gateway_models_poll_s:
                await self._read_models(e)
                e.models_at = now
            if not e.up:
                log.info("gateway: engine %s answers (%d models)", name, len(e.models))
            e.up, e.error = True, ""
        except (aiohttp.ClientError, TimeoutError, ValueError) as ex:
            if e.up:
                log.warning("gateway: engine %s does not answer: %s", name, ex)
            e.up, e.error = False, f"{type(ex).__name__}: {ex}"
        self.metrics.backend_up.labels(name).set(1 if e.up else 0)
        if e.up and e.backend.peer and e.layout is None:
            await self._read_layout(e)
        self._subscribe(e)

    async def _read_models(self, e: Engine) -> None:
        async with self.http.get(
            f"{e.backend.url}/v1/models", timeout=self._timeout(self.cfg.gateway_connect_timeout_s)
        ) as r:
            r.raise_for_status()
            data = (await r.json()).get("data") or []
        e.models = {str(m["id"]): m for m in data if isinstance(m, dict) and "id" in m}

    async def _read_layout(self, e: Engine) -> None:
        client = self._peer_clients.get(e.backend.name)
        if client is None:
            token = self.peer.token()
            client = self._peer_clients[e.backend.name] = PeerClient(
                e.backend.peer, self.peer, token
            )
        try:
            layouts = await asyncio.to_thread(client.layouts, self.cfg.gateway_connect_timeout_s)
        except grpc.RpcError as ex:
            e.error = f"sidecar {e.backend.peer}: {ex.code().name}"
            return
        e.layout = base_layout(layouts)
        if e.layout is not None and self.index is None:
            self.index = EngineIndex(e.layout)

    def _subscribe(self, e: Engine) -> None:
        if not e.backend.events or self.index is None:
            return
        if e.subscriber is not None and e.subscriber.alive():
            return
        if e.subscriber is not None:
            log.warning(
                "gateway: KV events of %s stopped (%s): subscribing again",
                e.backend.name,
                e.subscriber.error,
            )
        e.subscriber = EngineSubscriber(self.index, e.backend.name, e.backend.events)

    def close(self) -> None:
        for name in list(self._engines):
            self._drop(name)
        if self.router is not None:
            self.router.close()

    def status(self) -> dict[str, Any]:
        """For ``/health``: each engine's state."""
        now = time.monotonic()
        return {
            e.backend.name: {
                "url": e.backend.url,
                "up": e.up,
                "resting_s": round(max(e.down_until - now, 0.0), 3),
                "models": sorted(e.models),
                "layout": e.layout.model if e.layout else "",
                "events": bool(e.subscriber and e.subscriber.alive()),
                "error": e.error,
            }
            for e in self._engines.values()
        }


async def cancel(task: asyncio.Task[Any] | None) -> None:
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
