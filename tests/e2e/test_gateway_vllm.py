"""The gateway in front of two real vLLM servers, each with TierstoreConnector on
its own sidecar (peered), with the model's tokenizer and chat template:

- the gateway's keys are the connector's keys: for a token-id, a text and a
  chat prompt, every block key the gateway derives (its own tokenizer, and
  the engine's /tokenize) is held by the sidecar of the engine that served
  the prompt, and the tokens are the engine's own; one changed token finds
  none (the negative control);
- an engine that dies: the session's next turn, sent to it first, is
  retried on the other host, which is told to pull the prefix (pre-position)
  and resumes warm from the dead engine's sidecar;
- a streamed chat passes through with its usage.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from harness.gateway import GatewayServer, LoopThread
from harness.sidecar import SidecarProcess
from harness.vllm_server import Server, http, openai_server
from tierstore.cli.ports import free_port
from tierstore.client import StoreClient
from tierstore.config import Config
from tierstore.config.gateway import GatewayConfig
from tierstore.config.peer import PeerConfig
from tierstore.engines.vllm.driver import chat_tokenizer, kv_transfer_config, tiny_llama
from tierstore.gateway.keys import prompt_keys
from tierstore.gateway.placement import Turn

from ..conftest import SidecarFactory

pytestmark = pytest.mark.vllm

TOKEN = "gateway-e2e"
BLOCK = 32  # vLLM-CPU's smallest block: many blocks in a short prompt
WORDS = 600  # a prompt of about 600 tokens: 18 blocks


@dataclass
class Host:
    sidecar: SidecarProcess
    peer: str
    engine: Server
    events_port: int

    def backend(self) -> str:
        return f"{self.engine.url};peer={self.peer};events=tcp://127.0.0.1:{self.events_port}"


@dataclass
class Setup:
    hosts: list[Host]
    model: Path
    lt: LoopThread

    def gateway(self, **settings: Any) -> GatewayServer:
        cfg = GatewayConfig(gateway_backends=tuple(h.backend() for h in self.hosts),
                            gateway_port=1, **settings)  # fmt: skip
        return GatewayServer(self.lt, Config(gateway=cfg, peer=PeerConfig(peer_token=TOKEN)))

    def host(self, name: str) -> Host:
        (h,) = [h for h in self.hosts if h.peer == name]
        return h


@pytest.fixture(scope="module")
def setup(
    tmp_path_factory: pytest.TempPathFactory, module_sidecar_factory: SidecarFactory
) -> Iterator[Setup]:
    root = tmp_path_factory.mktemp("gateway-vllm")
    model = chat_tokenizer(tiny_llama(root / "model"))
    ports = [free_port(), free_port()]
    with ExitStack() as stack:
        hosts = []
        for i, port in enumerate(ports):
            sc = module_sidecar_factory(
                "--set", f"peer_port={port}", "--set", f"peers=127.0.0.1:{ports[1 - i]}",
                "--set", f"peer_token={TOKEN}", name=f"host{i}", dram="128MiB",
                nvme="128MiB", settings=(),
            )  # fmt: skip
            events = free_port()
            engine = stack.enter_context(openai_server(
                model, root / f"engine{i}.log", block=BLOCK, max_model_len=4096,
                transfer=kv_transfer_config(sc.socket, include_peers=True), events_port=events,
            ))  # fmt: skip
            hosts.append(Host(sc, f"127.0.0.1:{port}", engine, events))
        lt = LoopThread()
        try:
            yield Setup(hosts, model, lt)
        finally:
            lt.close()


def words(seed: int, n: int = WORDS) -> str:
    rng = np.random.default_rng(seed)
    return " ".join(f"w{i}" for i in rng.integers(0, 1000, n))


def held(host: Host, layout: Any, keys: list[Any]) -> int:
    with StoreClient(str(host.sidecar.socket)) as client:
        return client.lookup(layout, keys).num_hits


def tokenize(host: Host, body: dict[str, Any]) -> list[int]:
    out: list[int] = json.loads(http(f"{host.engine.url}/tokenize", body))["tokens"]
    return out


def test_the_gateways_keys_are_the_connectors_for_token_text_and_chat_prompts(
    setup: Setup,
) -> None:
    local = setup.gateway(gateway_tokenizer=str(setup.model), gateway_load_poll_s=0.2)
    remote = setup.gateway(gateway_load_poll_s=0.2)  # tokenizes through the engines
    try:
        rng = np.random.default_rng(1)
        cases = [
            ("completions", {"prompt": rng.integers(7, 1000, WORDS).tolist()}),
            ("completions", {"prompt": words(2)}),
            ("chat", {"messages": [{"role": "system", "content": words(3, 200)},
                                   {"role": "user", "content": words(4, 400)}]}),
        ]  # fmt: skip
        compared = 0
        for kind, fields in cases:
            body = {"model": "m", "max_tokens": 2, "temperature": 0.0, **fields}
            path = "/v1/completions" if kind == "completions" else "/v1/chat/completions"
            status, headers, reply = local.post(path, body)
            assert status == 200, reply
            served = setup.host(headers["x-tierstore-host"])
            ours = local.lt.run(local.gw.prepare(kind, dict(body)))
            theirs = remote.lt.run(remote.gw.prepare(kind, dict(body)))
            assert ours.tokens == theirs.tokens  # local tokenizer == the engine's /tokenize
            if kind == "chat":
                assert ours.tokens == tokenize(served, {"model": "m", **fields})
            assert ours.layout is not None and ours.layout.model.startswith("vllm:")
            assert len(ours.keys) == len(ours.tokens) // BLOCK >= 10
            # Every block the connector stored is under the gateway's key.
            assert held(served, ours.layout, ours.keys) == len(ours.keys)
            compared += len(ours.keys)
            wrong = list(ours.tokens)
            wrong[0] = (wrong[0] + 1) % 1000
            assert held(served, ours.layout, prompt_keys(ours.layout, wrong)) == 0
        assert compared >= 50
    finally:
        local.stop()
        remote.stop()


def test_a_dead_engines_session_resumes_warm_on_the_other_host(setup: Setup) -> None:
    # Slow polls: the gateway still believes in the engine when it dies, so the
    # turn goes to it first and is retried on the other host.
    gw = setup.gateway(gateway_tokenizer=str(setup.model), gateway_load_poll_s=60.0)
    try:
        messages = [{"role": "user", "content": words(10, 800)}]
        body = {"model": "m", "max_tokens": 4, "temperature": 0.0, "messages": messages,
                "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
        status, headers, first = gw.post("/v1/chat/completions", body)
        assert status == 200 and b"data: [DONE]" in first
        messages += [{"role": "assistant", "content": words(11, 4)},
                     {"role": "user", "content": words(12, 40)}]  # fmt: skip
        # Where the gateway will send the next turn: that engine dies now.
        p = gw.lt.run(gw.gw.prepare("chat", dict(body)))
        seen = gw.gw.sessions.find(p.keys)
        assert seen.host  # the first turn's session, found by its prefix
        turn = Turn(p.layout, p.keys, len(p.tokens or ()), seen.session, seen.host,
                    gw.gw.fleet.candidates(p.engines, p.keys))  # fmt: skip
        dead = setup.host(gw.gw.policy.place(turn).order[0])
        other = next(h for h in setup.hosts if h is not dead)
        prepositioned = other.sidecar.counters()["peer_prepositions"]
        dead.engine.kill()  # its sidecar lives on
        status, headers, answer = gw.post("/v1/chat/completions", body)
        assert status == 200 and b"data: [DONE]" in answer, answer[-500:]
        assert headers["x-tierstore-host"] == other.peer
        assert headers["x-tierstore-placement"] == "failover"
        assert headers["x-tierstore-estimate"].startswith("ttft=")  # the cost model's view
        events = [json.loads(line[6:]) for line in answer.decode().splitlines()
                  if line.startswith("data: {")]  # fmt: skip
        usage = [e["usage"] for e in events if e.get("usage")][-1]
        prompt, cached = usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]
        assert cached >= 0.9 * 800 and prompt > cached  # warm: the first turn's prefix
        assert other.sidecar.counters()["peer_prepositions"] > prepositioned
        _, metrics = gw.get("/metrics")
        assert f'tierstore_gateway_retries_total{{host="{dead.peer}"}} 1.0'.encode() in metrics
    finally:
        gw.stop()
