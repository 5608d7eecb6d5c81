"""The gateway's HTTP front: the OpenAI API in front of the fleet's engines.

Provides ``Gateway`` (the request path: parse, tokenize, key, place,
pre-position, forward with failover; it is forwarding's ``Tracker``) and
``make_app`` (the aiohttp application): ``/v1/completions`` and
``/v1/chat/completions`` (streamed or not), ``/v1/models`` (the models the
up engines serve), ``/health`` (200 while an engine is up, with each
engine's state) and ``/metrics`` (Prometheus).

Every answer of the gateway's own is an OpenAI error object: malformed
JSON, a missing field, an unknown model (404), a prompt over the model's
context (400), a body over ``gateway_max_body_bytes`` (413), no engine left
(503). Answers say which engine served (``x-tierstore-host``) and why it
was chosen (``x-tierstore-placement``), and for the cost model's choice its
estimate (``x-tierstore-estimate``: TTFT, queue, load, prefill, the prefix
blocks expected from each tier).

Runs on one asyncio event loop; placement and the local tokenizer on
worker threads.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from tierstore.gateway.fleet import Engine, Fleet
from tierstore.gateway.forward import Attempt, Upstream, forward
from tierstore.gateway.keys import prompt_keys
from tierstore.gateway.metrics import GatewayMetrics
from tierstore.gateway.placement import Decision, Policy, Turn
from tierstore.gateway.requests import (
    ApiError,
    Request,
    RequestKind,
    parse_json,
    parse_request,
    with_transfer_params,
)
from tierstore.gateway.sessions import Sessions
from tierstore.gateway.tokens import HfTokenizer, prompt_tokens
from tierstore.keys import BlockKey, KVLayout
from tierstore.router.cost import HostCost

log = logging.getLogger(__name__)

SESSION_HEADER = "x-session-id"


@dataclass(frozen=True, slots=True)
class Prepared:
    request: Request
    engines: list[Engine]  # up, serving the model
    tokens: list[int] | None  # None: unknown (no tokenizer answered)
    layout: KVLayout | None
    keys: list[BlockKey]


class Gateway:
    def __init__(
        self,
        fleet: Fleet,
        policy: Policy,
        sessions: Sessions,
        upstream: Upstream,
        metrics: GatewayMetrics,
        tokenizer: HfTokenizer | None = None,
    ) -> None:
        self.fleet = fleet
        self.policy = policy
        self.sessions = sessions
        self.upstream = upstream
        self.metrics = metrics
        self.tokenizer = tokenizer
        self.uses_store = policy.name.startswith("tierstore")

    # -- the request path -----------------------------------------------------------------

    async def complete(self, request: web.Request, kind: RequestKind) -> web.StreamResponse:
        arrived = time.monotonic()
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge as e:
            raise ApiError(413, f"request body too large: {e.text}") from e
        p = await self.prepare(kind, parse_json(raw))
        header_id = request.headers.get(SESSION_HEADER, "")[:256]
        seen = self.sessions.find(p.keys, header_id)
        turn = Turn(
            layout=p.layout if p.keys else None,
            keys=p.keys,
            num_tokens=len(p.tokens) if p.tokens else 0,
            session=seen.session,
            last_host=seen.host,
            candidates=self.fleet.candidates(p.engines, p.keys),
        )
        if self.policy.may_wait(turn):
            decision = await asyncio.to_thread(self.policy.place, turn)
        else:
            decision = self.policy.place(turn)
        layout, keys, tokens, req = p.layout, p.keys, p.tokens, p.request
        if decision.preposition and layout is not None:
            self.fleet.preposition(decision.order[0], layout, keys)
        payload = raw
        if self.uses_store and keys:
            payload = with_transfer_params(raw, req.body, {"session": seen.session})
        attempts = self._attempts(decision, turn, tokens)
        tracker = _Tracker(self, arrived, decision, seen.session, header_id, keys, layout)
        path = "/v1/completions" if kind == "completions" else "/v1/chat/completions"
        response, out = await forward(
            request, path, payload, req.stream, attempts, self.upstream, tracker
        )
        reason = "failover" if out.retries else decision.reason
        self.metrics.requests.labels(out.host, reason).inc()
        return response

    async def prepare(self, kind: RequestKind, body: dict[str, Any]) -> Prepared:
        """What placement needs of a request body: it parsed, the engines
        serving its model, its token ids and block keys (empty when no
        tokenizer or layout can tell them, or the policy reads no keys: a
        text prompt is then tokenized by the engine alone). Raises ApiError
        for a request the engines would refuse."""
        req = parse_request(kind, body)
        engines = self.fleet.serving(req.model)
        if not engines:
            if not self.fleet.models():
                raise ApiError(
                    503, "no engine is up", type="server_error", code="no_backend_available"
                )
            raise ApiError(
                404,
                f"The model `{req.model}` does not exist.",
                param="model",
                code="model_not_found",
            )
        tokens = req.token_ids
        if self.policy.uses_keys:  # else the engine tokenizes (and checks the length) alone
            try:
                tokens = await prompt_tokens(req, self.tokenizer, self.fleet.tokenize)
            except ApiError as e:
                if e.status < 500:
                    raise
                tokens = None  # no engine tokenized it: placed by load alone
        self._check_length(req, tokens)
        layout = self.fleet.layout(engines)
        keys: list[BlockKey] = []
        if layout is not None and tokens:
            keys = prompt_keys(layout, tokens, req.cache_salt)
        return Prepared(req, engines, tokens, layout, keys)

    def _check_length(self, req: Request, tokens: list[int] | None) -> None:
        limit = self.fleet.max_model_len(req.model)
        if tokens is None or limit is None:
            return
        wanted = len(tokens) + (req.max_tokens or 1)
        if len(tokens) >= limit or wanted > limit:
            param = "messages" if req.messages is not None else "prompt"
            raise ApiError(
                400,
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {wanted} tokens ({len(tokens)} in the {param}, "
                f"{req.max_tokens or 1} in the completion).",
                param=param,
                code="context_length_exceeded",
            )

    def _attempts(self, d: Decision, turn: Turn, tokens: list[int] | None) -> list[Attempt]:
        rates = {c.name: c.prefill_tokens_per_s for c in turn.candidates}
        out: list[Attempt] = []
        for name in d.order:
            backend = self.fleet.backend(name)
            if backend is None:
                continue
            cost = d.costs.get(name)
            predicted_s = 0.0
            if cost is not None:
                prefill_s, prefill_tokens = cost.prefill_s + cost.load_s, cost.prefill_tokens
                predicted_s = cost.ttft_s
            else:
                prefill_tokens = len(tokens) if tokens else 0
                prefill_s = prefill_tokens / (rates.get(name) or self.fleet.prefill_tokens_per_s)
            reason = d.reason if not out else "failover"
            headers = [("x-tierstore-host", name), ("x-tierstore-placement", reason)]
            if cost is not None:
                headers.append(("x-tierstore-estimate", estimate_header(cost)))
            out.append(Attempt(name, backend.url, prefill_s, prefill_tokens, predicted_s,
                               tuple(headers)))  # fmt: skip
        return out

    # -- endpoints ------------------------------------------------------------------------

    async def models(self, request: web.Request) -> web.Response:
        data = list(self.fleet.models().values())
        return web.json_response({"object": "list", "data": data})

    async def health(self, request: web.Request) -> web.Response:
        status = self.fleet.status()
        up = any(s["up"] for s in status.values())
        body = {
            "status": "ok" if up else "no engine up",
            "engines": status,
            "poll_failures": self.fleet.poll_failures,
            "poll_error": self.fleet.poll_error,
        }
        return web.json_response(body, status=200 if up else 503)

    async def prometheus(self, request: web.Request) -> web.Response:
        return web.Response(
            body=self.metrics.text(),
            content_type="text/plain",
            headers={"X-Content-Type": "version=0.0.4"},
        )


def estimate_header(cost: HostCost) -> str:
    """The cost model's estimate for the host that answers, for the client and
    for whoever asks why a turn was slow: TTFT and its parts in seconds, and
    the prefix blocks it expected from each tier."""
    parts = [f"ttft={cost.ttft_s:.3f}", f"queue={cost.queue_s:.3f}", f"load={cost.load_s:.3f}",
             f"prefill={cost.prefill_s:.3f}", f"reused={cost.reused_tokens}"]  # fmt: skip
    parts += [f"{tier}={n}" for tier, n in sorted(cost.blocks.items())]
    return ";".join(parts)


class _Tracker:
    """One request's forwarding, told to the ledger, the fleet and the metrics."""

    def __init__(
        self,
        gw: Gateway,
        arrived: float,
        decision: Decision,
        session: str,
        header_id: str,
        keys: list[BlockKey],
        layout: KVLayout | None,
    ) -> None:
        self.gw, self.arrived, self.decision = gw, arrived, decision
        self.session, self.header_id, self.keys, self.layout = session, header_id, keys, layout
        self.first_sent = True

    def sent(self, attempt: Attempt, retry: bool) -> int:
        m = self.gw.metrics
        if self.first_sent:
            m.added_seconds.observe(time.monotonic() - self.arrived)
            self.first_sent = False
        if retry and self.gw.uses_store and self.layout is not None:
            self.gw.fleet.preposition(attempt.name, self.layout, self.keys)
        m.in_flight.labels(attempt.name).inc()
        return self.gw.fleet.ledger.sent(
            attempt.name, attempt.prefill_s, attempt.prefill_tokens, attempt.predicted_s
        )

    def first_byte(self, attempt: Attempt, ticket: int) -> None:
        self.gw.fleet.ledger.first_byte(ticket)
        self.gw.sessions.ran(self.session, attempt.name, self.keys, self.header_id)

    def chunk(self, attempt: Attempt, ticket: int) -> None:
        self.gw.fleet.ledger.chunk(ticket)

    def done(self, attempt: Attempt, ticket: int) -> None:
        self.gw.metrics.in_flight.labels(attempt.name).dec()
        self.gw.fleet.ledger.done(ticket)

    def failed(self, attempt: Attempt, why: str) -> None:
        log.warning("gateway: %s", why)
        self.gw.metrics.retries.labels(attempt.name).inc()
        self.gw.fleet.failed(attempt.name, why)

    def cut(self, attempt: Attempt, why: str) -> None:
        log.warning("gateway: the answer from %s broke after its first byte: %s", attempt.name, why)
        self.gw.metrics.streams_cut.labels(attempt.name).inc()


def _error_response(e: ApiError) -> web.Response:
    return web.json_response(e.body(), status=e.status)


def make_app(gw: Gateway, max_body_bytes: int) -> web.Application:
    """The aiohttp application serving ``gw``."""

    @web.middleware
    async def errors(request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            response: web.StreamResponse = await handler(request)
            return response
        except ApiError as e:
            gw.metrics.failed.labels(str(e.status)).inc()
            return _error_response(e)
        except web.HTTPException as e:  # aiohttp's own (404 route, 405 method): OpenAI's format
            if e.status < 400:
                raise
            gw.metrics.failed.labels(str(e.status)).inc()
            return _error_response(ApiError(e.status, e.reason))

    async def completions(request: web.Request) -> web.StreamResponse:
        return await gw.complete(request, "completions")

    async def chat(request: web.Request) -> web.StreamResponse:
        return await gw.complete(request, "chat")

    app = web.Application(middlewares=[errors], client_max_size=max_body_bytes)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/v1/models", gw.models)
    app.router.add_get("/health", gw.health)
    app.router.add_get("/metrics", gw.prometheus)
    return app
