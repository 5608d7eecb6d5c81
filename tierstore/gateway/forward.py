"""Sending a placed request to its engine, and on to the next one if it fails.

Provides ``forward(...)``: tries the decision's hosts in order. A host that
refuses (a 5xx or 429 answer, a refused or reset connection, a timeout) or
dies before the first byte of its answer is marked down for
``gateway_down_s`` and the request goes to the next host, whose sidecar is
first told to pull the prefix (the turn moved). Once the first byte has
reached the client, the answer is the client's: a stream cut later is
counted and ends the client's stream, never retried (as vLLM
production-stack's and SGLang's routers do). A 4xx answer is the request's
own fault and goes back as it is.

A streamed answer (server-sent events) is written to the client chunk by
chunk as it arrives, never buffered; a non-streamed one is read whole
first, so it can still be retried until then.

Runs on the gateway's event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import aiohttp
from aiohttp import web

from tierstore.gateway.requests import ApiError

HOP_HEADERS = frozenset(
    h.lower()
    for h in (
        "Connection",
        "Keep-Alive",
        "Transfer-Encoding",
        "Content-Length",
        "Host",
        "Content-Encoding",
        "Upgrade",
        "TE",
        "Trailer",
        "Proxy-Authorization",
    )
)
RETRY_STATUS = frozenset((429, 500, 502, 503, 504))


@dataclass(frozen=True, slots=True)
class Attempt:
    """One host to try: where, and what the ledger and pre-positioning need."""

    name: str
    url: str
    prefill_s: float  # the placement's estimate (the ledger's queue)
    prefill_tokens: int
    predicted_s: float  # the placement's whole TTFT estimate (0: none)
    reply_headers: tuple[tuple[str, str], ...] = ()  # added to the client's answer


@dataclass(slots=True)
class Outcome:
    host: str = ""  # the host that answered ("" none)
    status: int = 0
    retries: int = 0
    cut: bool = False  # the stream broke after its first byte


class Tracker(Protocol):
    """What forwarding tells the rest of the gateway (ledger, fleet, metrics)."""

    def sent(self, attempt: Attempt, retry: bool) -> int:
        """The request leaves for ``attempt``'s host; returns a ticket."""
        ...

    def first_byte(self, attempt: Attempt, ticket: int) -> None: ...

    def chunk(self, attempt: Attempt, ticket: int) -> None:
        """A later chunk of a streamed answer went to the client."""
        ...

    def done(self, attempt: Attempt, ticket: int) -> None: ...

    def failed(self, attempt: Attempt, why: str) -> None:
        """``attempt``'s host refused or failed before its first byte."""
        ...

    def cut(self, attempt: Attempt, why: str) -> None:
        """The answer from ``attempt``'s host broke after its first byte."""
        ...


class Upstream:
    """The engines' side of forwarding: the HTTP session and its timeouts."""

    def __init__(self, http: aiohttp.ClientSession, connect_s: float, first_byte_s: float):
        self.http = http
        self.timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=connect_s, sock_read=first_byte_s
        )


async def forward(
    request: web.Request,
    path: str,
    payload: bytes,
    stream: bool,
    attempts: Sequence[Attempt],
    upstream: Upstream,
    tracker: Tracker,
) -> tuple[web.StreamResponse, Outcome]:
    """Send ``payload`` to ``path`` on each attempt's host in turn; the
    response written to the client and what happened."""
    out = Outcome()
    headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
    headers["Content-Type"] = "application/json"
    last_error = "no engine serves this model"
    for i, att in enumerate(attempts):
        out.retries = i
        ticket = tracker.sent(att, retry=i > 0)
        try:
            try:
                resp = await upstream.http.post(
                    att.url + path, data=payload, headers=headers, timeout=upstream.timeout
                )
            except (aiohttp.ClientError, TimeoutError) as e:
                last_error = f"{att.name}: {type(e).__name__}: {e}"
                tracker.failed(att, last_error)
                continue
            async with resp:
                if resp.status in RETRY_STATUS:
                    last_error = f"{att.name} answered {resp.status}: {(await _text(resp))[:200]}"
                    tracker.failed(att, last_error)
                    continue
                try:
                    if stream and resp.status == 200:
                        first = await resp.content.readany()
                        if not first:
                            raise aiohttp.ClientPayloadError("the stream ended before a byte")
                    else:
                        first = await resp.read()
                except (aiohttp.ClientError, TimeoutError) as e:
                    last_error = f"{att.name} failed before its first byte: {e}"
                    tracker.failed(att, last_error)
                    continue
                tracker.first_byte(att, ticket)
                out.host, out.status = att.name, resp.status
                if not (stream and resp.status == 200):
                    return _whole(resp, first, att), out
                client = web.StreamResponse(status=resp.status, headers=_passed(resp.headers, att))
                await client.prepare(request)
                await client.write(first)
                try:
                    async for chunk in resp.content.iter_any():
                        await client.write(chunk)
                        tracker.chunk(att, ticket)
                except (aiohttp.ClientError, TimeoutError) as e:
                    out.cut = True
                    tracker.cut(att, f"{type(e).__name__}: {e}")
                except (ConnectionResetError, asyncio.CancelledError):
                    raise  # the client went away: aiohttp closes the upstream with the block
                await client.write_eof()
                return client, out
        finally:
            tracker.done(att, ticket)
    raise ApiError(
        503,
        f"no engine could serve the request ({len(attempts)} tried): {last_error}",
        type="server_error",
        code="no_backend_available",
    )


async def _text(resp: aiohttp.ClientResponse) -> str:
    try:
        return await resp.text()
    except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError):
        return ""


def _passed(headers: Mapping[str, str], att: Attempt) -> dict[str, str]:
    out = {k: v for k, v in headers.items() if k.lower() not in HOP_HEADERS}
    out.update(att.reply_headers)
    return out


def _whole(resp: aiohttp.ClientResponse, body: bytes, att: Attempt) -> web.Response:
    return web.Response(status=resp.status, body=body, headers=_passed(resp.headers, att))
