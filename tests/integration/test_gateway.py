"""The gateway's HTTP front against fake engines (``fake_engine.py``): streams
passed through as each event arrives, failover before the first byte and
never after it, OpenAI-format errors that leave the gateway up, and the
/v1/models, /health and /metrics endpoints. Placement by load only (no
sidecars here: the cost model's path is in test_gateway_fleet.py)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from harness.fake_engine import FakeEngine
from harness.gateway import GatewayServer, LoopThread
from tierstore.config import Config
from tierstore.config.gateway import GatewayConfig

TIMEOUT = aiohttp.ClientTimeout(total=30)


class Fleet(GatewayServer):
    """Fake engines and a gateway in front of them, on one background loop."""

    def __init__(self, lt: LoopThread, engines: list[FakeEngine], **gateway: Any) -> None:
        self.engines = engines
        self.urls = [lt.run(e.start()) for e in engines]
        cfg = GatewayConfig(gateway_backends=tuple(self.urls), gateway_port=1,
                            gateway_load_poll_s=0.05, **gateway)  # fmt: skip
        super().__init__(lt, Config(gateway=cfg))

    def close(self) -> None:
        self.stop()
        for e in self.engines:
            self.lt.run(e.stop())


@pytest.fixture
def lt() -> Iterator[LoopThread]:
    loop = LoopThread()
    yield loop
    loop.close()


@pytest.fixture
def two(lt: LoopThread, request: pytest.FixtureRequest) -> Iterator[Fleet]:
    fleet = Fleet(lt, [FakeEngine(), FakeEngine()], gateway_policy="round_robin")
    yield fleet
    fleet.close()


def completion(stream: bool = False, **kw: Any) -> dict[str, Any]:
    return {"model": "m", "prompt": [1, 2, 3], "max_tokens": 4, "stream": stream, **kw}


def test_a_stream_passes_through_as_each_event_arrives(two: Fleet) -> None:
    a, b = two.engines
    a.mode = b.mode = "hold"

    async def go() -> tuple[bytes, bool, bytes]:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
            async with s.post(two.url + "/v1/completions", json=completion(True)) as r:
                first = await asyncio.wait_for(r.content.readuntil(b"\n\n"), 10)
                # The engine still holds the rest: the event came through unbuffered.
                held = not (a.release.is_set() or b.release.is_set())  # type: ignore[union-attr]
                a.release.set()  # type: ignore[union-attr]
                b.release.set()  # type: ignore[union-attr]
                return first, held, await r.read()

    first, held, rest = two.lt.run(go())
    assert held and first.startswith(b"data: {") and b'"i": 0' in first
    assert rest.count(b"data: ") == 4 and rest.endswith(b"data: [DONE]\n\n")


@pytest.mark.parametrize("failure", ["refuse", "drop"])
def test_an_engine_failing_before_the_first_byte_is_skipped_and_the_request_retried(
    two: Fleet, failure: str
) -> None:
    bad, good = two.engines
    bad.mode = failure
    answers = [two.post("/v1/completions", completion(stream=i % 2 == 0)) for i in range(6)]
    assert all(status == 200 for status, _, _ in answers), answers
    assert {h["x-tierstore-host"] for _, h, _ in answers} == {two.urls[1]}
    assert len(good.seen) == 6 and len(bad.seen) >= 1  # tried, failed, then rested
    retried = [h for _, h, _ in answers if h["x-tierstore-placement"] == "failover"]
    assert len(retried) == len(bad.seen)
    _, text = two.get("/metrics")
    assert b"tierstore_gateway_retries_total{host=" in text


def test_a_stream_cut_after_its_first_byte_is_not_retried(two: Fleet) -> None:
    a, b = two.engines
    a.mode = b.mode = "cut"
    status, _, body = two.post("/v1/completions", completion(True))
    assert status == 200 and body.count(b"data: ") == 1 and b"[DONE]" not in body
    assert len(a.seen) + len(b.seen) == 1  # the client's error: never sent elsewhere
    _, text = two.get("/metrics")
    assert b"tierstore_gateway_streams_cut_total" in text


def test_no_engine_left_is_a_503_in_openai_format(two: Fleet) -> None:
    for e in two.engines:
        e.mode = "refuse"
    status, _, body = two.post("/v1/completions", completion())
    err = json.loads(body)["error"]
    assert status == 503 and err["code"] == "no_backend_available"
    assert len(two.engines[0].seen) + len(two.engines[1].seen) == 2


def test_bad_requests_get_openai_errors_and_the_gateway_stays_up(lt: LoopThread) -> None:
    fleet = Fleet(lt, [FakeEngine(max_model_len=64)], gateway_policy="least_loaded",
                  gateway_max_body_bytes=4096)  # fmt: skip
    try:
        cases = [
            (b"{not json", 400, None),
            (json.dumps(completion(model="other")).encode(), 404, "model_not_found"),
            (json.dumps(completion(prompt=list(range(80)))).encode(), 400,
             "context_length_exceeded"),
            (json.dumps(completion(prompt=[1] * 60, max_tokens=10)).encode(), 400,
             "context_length_exceeded"),
            (json.dumps(completion(prompt=[1] * 3000)).encode(), 413, None),
            (json.dumps({"prompt": [1]}).encode(), 400, None),
        ]  # fmt: skip
        for raw, want, code in cases:
            status, _, body = fleet.post("/v1/completions", None, raw=raw)
            err = json.loads(body)["error"]
            assert status == want, (raw[:40], body)
            assert set(err) == {"message", "type", "param", "code"} and err["code"] == code
        status, _, body = fleet.post("/v1/nothing", {})
        assert status == 404 and "error" in json.loads(body)
        assert fleet.engines[0].seen == []  # none of it reached the engine
        assert fleet.post("/v1/completions", completion())[0] == 200  # still serving
        status, text = fleet.get("/metrics")
        assert b'tierstore_gateway_failed_total{code="400"} 4.0' in text
    finally:
        fleet.close()


def test_least_loaded_reads_the_engines_own_queues(lt: LoopThread) -> None:
    busy, idle = FakeEngine(waiting=5, running=2), FakeEngine()
    fleet = Fleet(lt, [busy, idle], gateway_policy="least_loaded")
    try:
        for _ in range(4):
            _, headers, _ = fleet.post("/v1/completions", completion())
            assert headers["x-tierstore-host"] == fleet.urls[1]
            assert headers["x-tierstore-placement"] == "least_loaded"
    finally:
        fleet.close()


def test_models_health_and_metrics(two: Fleet) -> None:
    status, body = two.get("/v1/models")
    assert status == 200 and [m["id"] for m in json.loads(body)["data"]] == ["m"]
    two.post(
        "/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "a b"}]}
    )
    status, body = two.get("/health")
    health = json.loads(body)
    assert status == 200 and all(e["up"] for e in health["engines"].values())
    assert len(health["engines"]) == 2 and health["poll_failures"] == 0
    _, text = two.get("/metrics")
    assert b"tierstore_gateway_requests_total{host=" in text and b'reason="round_robin"' in text
    assert b"tierstore_gateway_added_seconds_count 1.0" in text
    # round_robin reads no keys: the chat's text was tokenized by its engine alone.
    assert len(two.engines[0].seen) + len(two.engines[1].seen) == 1
    assert two.engines[0].tokenized + two.engines[1].tokenized == 0
    for e in two.engines:
        two.lt.run(e.stop())
    two.lt.run(asyncio.sleep(0.3))  # a poll or two
    status, body = two.get("/health")
    assert status == 503 and not any(e["up"] for e in json.loads(body)["engines"].values())


def test_prefix_aware_tokenizes_text_through_an_engine_without_a_local_tokenizer(
    lt: LoopThread,
) -> None:
    layout = {"model": "x", "num_layers": 1, "num_kv_heads": 1, "head_dim": 1,
              "dtype": "uint8", "block_tokens": 2}  # fmt: skip
    fleet = Fleet(lt, [FakeEngine(), FakeEngine()], gateway_policy="prefix_aware",
                  gateway_layout=json.dumps(layout))  # fmt: skip
    try:
        chat = {"model": "m", "messages": [{"role": "user", "content": "aa bbb c dddd e"}]}
        status, _, _ = fleet.post("/v1/chat/completions", chat)
        assert status == 200
        assert sum(e.tokenized for e in fleet.engines) == 1
        p = fleet.lt.run(fleet.gw.prepare("chat", dict(chat)))
        assert p.tokens == [2, 3, 1, 4, 1] and len(p.keys) == 2  # the fake's ids: word lengths
    finally:
        fleet.close()
