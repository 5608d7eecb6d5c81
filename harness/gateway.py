"""A ``tierstore gateway`` inside the test's process, on an event loop of its own.

Provides ``LoopThread`` (an asyncio loop on a thread; ``run`` waits for a
coroutine with a deadline) and ``GatewayServer``: the gateway of a
``Config`` built, its fleet polled once, and its HTTP front served on a free
loopback port; ``post`` and ``get`` are a client's calls (status, headers,
body), ``stop`` ends it all. Tests reach its parts (``gw.fleet``,
``gw.prepare``) directly; benchmarks run the real ``tierstore gateway``
process instead.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Coroutine
from typing import Any

import aiohttp
from aiohttp import web

from tierstore.config import Config
from tierstore.gateway.app import Gateway, make_app
from tierstore.gateway.serve import build, http_session

WAIT_S = 60.0
REQUEST_TIMEOUT_S = 300.0
REQUEST_TIMEOUT = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)


class LoopThread:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, Any], timeout_s: float = WAIT_S) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(WAIT_S)


class GatewayServer:
    def __init__(self, lt: LoopThread, config: Config) -> None:
        self.lt = lt
        self.config = config
        self.gw: Gateway
        self.url = lt.run(self._start())

    async def _start(self) -> str:
        self.http = http_session()
        self.gw = build(self.config, self.http)
        self.poll = asyncio.create_task(self.gw.fleet.run())
        await asyncio.wait_for(self.gw.fleet.ready.wait(), WAIT_S)
        self.runner = web.AppRunner(make_app(self.gw, self.config.gateway.gateway_max_body_bytes))
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return f"http://127.0.0.1:{port}"

    async def _stop(self) -> None:
        self.poll.cancel()
        await self.runner.cleanup()
        await self.http.close()
        self.gw.fleet.close()

    def stop(self) -> None:
        self.lt.run(self._stop())

    def post(
        self, path: str, body: Any, raw: bytes | None = None, headers: dict[str, str] | None = None
    ) -> tuple[int, dict[str, str], bytes]:
        async def go() -> tuple[int, dict[str, str], bytes]:
            data = raw if raw is not None else json.dumps(body).encode()
            async with aiohttp.ClientSession(timeout=REQUEST_TIMEOUT) as s:
                async with s.post(self.url + path, data=data, headers=headers) as r:
                    return r.status, dict(r.headers), await r.read()

        result: tuple[int, dict[str, str], bytes] = self.lt.run(go(), REQUEST_TIMEOUT_S)
        return result

    def get(self, path: str) -> tuple[int, bytes]:
        async def go() -> tuple[int, bytes]:
            async with aiohttp.ClientSession(timeout=REQUEST_TIMEOUT) as s:
                async with s.get(self.url + path) as r:
                    return r.status, await r.read()

        result: tuple[int, bytes] = self.lt.run(go())
        return result
