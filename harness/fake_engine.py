"""A fake OpenAI-compatible engine: vLLM's routes (``/v1/completions``,
``/v1/chat/completions``, ``/v1/models``, ``/metrics``, ``/health``,
``/tokenize``) answered at once by rules the caller sets, so failures can be
made on purpose (a 503, a connection dropped before the first byte, a stream
cut after it, a stream held at its first chunk until released) and a
gateway's own cost measured with no engine time in the way.

Runs on the event loop of ``harness.gateway.LoopThread`` (the gateway's
tests), or as a process of its own: ``python -m harness.fake_engine --port N``
(the gateway's load bench).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

WAIT_S = 30.0


@dataclass
class FakeEngine:
    """``mode``: ok | refuse (503) | drop (connection closed before the first
    byte) | cut (first chunk, then the connection dropped) | hold (first
    chunk, then wait for ``release``)."""

    model: str = "m"
    max_model_len: int = 4096
    mode: str = "ok"
    chunks: int = 4
    waiting: int = 0  # what /metrics says
    running: int = 0
    seen: list[dict[str, Any]] = field(default_factory=list)
    tokenized: int = 0  # /tokenize calls
    url: str = ""
    runner: web.AppRunner | None = None
    release: asyncio.Event | None = None
    sent_first: asyncio.Event | None = None

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        self.release, self.sent_first = asyncio.Event(), asyncio.Event()
        app = web.Application()
        app.router.add_post("/v1/completions", self.complete)
        app.router.add_post("/v1/chat/completions", self.complete)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/health", self.health)
        app.router.add_post("/tokenize", self.tokenize)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, host, port)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://{host}:{port}"
        return self.url

    async def stop(self) -> None:
        if self.runner is not None:
            runner, self.runner = self.runner, None
            await runner.cleanup()

    async def models(self, request: web.Request) -> web.Response:
        card = {"id": self.model, "object": "model", "max_model_len": self.max_model_len}
        return web.json_response({"object": "list", "data": [card]})

    async def metrics(self, request: web.Request) -> web.Response:
        text = (
            f'vllm:num_requests_running{{model_name="{self.model}"}} {self.running}\n'
            f'vllm:num_requests_waiting{{model_name="{self.model}"}} {self.waiting}\n'
        )
        return web.Response(text=text)

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.tokenized += 1
        text = body.get("prompt") or " ".join(m["content"] for m in body["messages"])
        tokens = [len(w) for w in text.split()]
        return web.json_response({"tokens": tokens, "count": len(tokens)})

    async def complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seen.append(body)
        if self.mode == "refuse":
            return web.json_response({"error": "busy"}, status=503)
        if self.mode == "drop":
            assert request.transport is not None
            request.transport.close()
            return web.Response()  # never sent: the connection is gone
        if not body.get("stream"):
            return web.json_response({"choices": [{"text": "x" * self.chunks}], "engine": self.url})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(self.chunks):
            await resp.write(f"data: {json.dumps({'i': i, 'engine': self.url})}\n\n".encode())
            if i == 0:
                assert self.sent_first is not None and self.release is not None
                self.sent_first.set()
                if self.mode == "cut":
                    assert request.transport is not None
                    request.transport.close()
                    return resp
                if self.mode == "hold":
                    await asyncio.wait_for(self.release.wait(), WAIT_S)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


def main() -> None:
    import argparse

    p = argparse.ArgumentParser(description="a fake OpenAI engine that answers at once")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--chunks", type=int, default=4, help="streamed chunks per answer")
    args = p.parse_args()

    async def serve() -> None:
        engine = FakeEngine(chunks=args.chunks)
        await engine.start(args.host, args.port)
        await asyncio.Event().wait()  # until the process is stopped

    asyncio.run(serve())


if __name__ == "__main__":
    main()
