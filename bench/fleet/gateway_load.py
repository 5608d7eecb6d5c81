"""The gateway's own cost under load, with engines that cost nothing.

    python -m bench.fleet.gateway_load --json [--concurrency 1,8,32] [--seconds 10]

One ``tierstore gateway`` process in front of two fake engines
(``harness.fake_engine``: each answers at once with a few streamed chunks),
each with a real sidecar (peered; the engines' KV layout registered with them,
as a connector does), so every request takes the gateway's whole path:
parse, tokenize the chat with the model's tokenizer (its prefix cache hits as
in a real multi-turn chat: each client continues its own conversation),
derive the block keys, ask the cost model, forward, stream back.

For each concurrency C, C clients send streamed chat requests back to back
for ``--seconds``, first through the gateway, then straight to the fake
engines (the baseline: what the HTTP client and the fakes cost alone), with
the same prompts. Reported per C and path: requests/s, time to first chunk
p50/p99; for the gateway also its own histogram of the time from a request's
arrival to its forwarding (``tierstore_gateway_added_seconds``, p50/p99 by
bucket) and its CPU time per request; and the ratio of the gateway's
requests/s to the direct path's. ``least_loaded`` (no tokenization, no keys)
is measured beside ``tierstore``. Runs in about a minute per policy here.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from bench.fleet.run import model_dir
from bench.limits import emit
from harness import REPO, child_env
from harness.chat_load import parse_metrics, percentile
from harness.sidecar import SidecarProcess
from harness.vllm_server import http
from tierstore.cli.ports import free_port
from tierstore.client import StoreClient
from tierstore.engines.vllm.driver import WIDE_KV
from tierstore.keys import KVLayout

TOKEN = "bench-gateway"
PROMPT_WORDS = 2000
TURN_WORDS = 60
TURNS_PER_CHAT = 8


def layout() -> KVLayout:
    return KVLayout("vllm:bench-gateway-load", WIDE_KV["num_layers"], WIDE_KV["kv_heads"],
                    WIDE_KV["head_dim"], "bfloat16", 128)  # fmt: skip


def wait_http(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            http(url, timeout_s=2.0)
            return
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{url} did not answer") from None
            time.sleep(0.2)


def spawn(stack: ExitStack, args: list[str], log: Path) -> subprocess.Popen[bytes]:
    out = stack.enter_context(open(log, "ab"))
    proc = subprocess.Popen([sys.executable, *args], cwd=REPO, env=child_env(), stdout=out,
                            stderr=subprocess.STDOUT)  # fmt: skip

    def stop() -> None:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(20)

    stack.callback(stop)
    return proc


class Chat:
    """One client's conversation: each request adds a reply and a message."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.reset()

    def words(self, n: int) -> str:
        return " ".join(f"w{i}" for i in self.rng.integers(0, 1000, n))

    def reset(self) -> None:
        self.messages = [{"role": "user", "content": self.words(PROMPT_WORDS)}]

    def next_body(self) -> dict[str, Any]:
        if len(self.messages) > 2 * TURNS_PER_CHAT:
            self.reset()
        body = {"model": "m", "messages": list(self.messages), "max_tokens": 4, "stream": True}
        self.messages += [{"role": "assistant", "content": self.words(8)},
                          {"role": "user", "content": self.words(TURN_WORDS)}]  # fmt: skip
        return body


async def drive(urls: list[str], clients: int, seconds: float) -> dict[str, Any]:
    """``clients`` back-to-back streamed chats against ``urls`` (client i uses
    ``urls[i % len]``) for ``seconds``: requests/s and first-chunk times."""
    ttfts: list[float] = []
    errors = 0
    stop_at = time.perf_counter() + seconds

    async def client(i: int, http: aiohttp.ClientSession) -> None:
        nonlocal errors
        chat = Chat(seed=i)
        url = urls[i % len(urls)] + "/v1/chat/completions"
        while time.perf_counter() < stop_at:
            t = time.perf_counter()
            async with http.post(url, json=chat.next_body()) as r:
                if r.status != 200:
                    errors += 1
                    await r.read()
                    continue
                await r.content.readany()
                ttfts.append(time.perf_counter() - t)
                await r.read()

    start = time.perf_counter()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(*(client(i, session) for i in range(clients)))
    wall = time.perf_counter() - start
    return {
        "requests_per_s": round(len(ttfts) / wall, 1),
        "ttft_p50_ms": round((percentile(ttfts, 50) or 0) * 1000, 3),
        "ttft_p99_ms": round((percentile(ttfts, 99) or 0) * 1000, 3),
        "requests": len(ttfts),
        "errors": errors,
    }


def histogram_quantile(metrics: dict[str, float], name: str, q: float) -> float | None:
    """The bucket upper bound holding quantile ``q`` of a Prometheus histogram."""
    buckets = sorted(
        (float(k.split('le="', 1)[1].split('"', 1)[0]), v)
        for k, v in metrics.items()
        if k.startswith(f"{name}_bucket{{") and 'le="+Inf"' not in k
    )
    total = metrics.get(f"{name}_count", 0.0)
    for le, count in buckets:
        if total and count >= q * total:
            return le
    return None


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(policy: str, concurrency: list[int], seconds: float, root: Path) -> dict[str, Any]:
    root.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        engines = []
        for i in range(2):
            port = free_port()
            proc = spawn(stack, ["-m", "harness.fake_engine", "--port", str(port)],
                         root / f"engine{i}.log")  # fmt: skip
            engines.append(f"http://127.0.0.1:{port}")
            wait_http(engines[-1] + "/health", proc)
        backends = list(engines)
        if policy.startswith("tierstore"):
            ports = [free_port(), free_port()]
            for i, port in enumerate(ports):
                sc = SidecarProcess(
                    root / f"sidecar{i}", dram="256MiB", nvme="0", die_with_parent=True,
                    settings=("log_level=warning", f"peer_port={port}", f"peer_token={TOKEN}",
                              f"peers=127.0.0.1:{ports[1 - i]}"),
                )  # fmt: skip
                sc.start(timeout_s=60.0)
                stack.callback(sc.stop)
                with StoreClient(str(sc.socket)) as client:
                    client.register(layout())  # what an engine's connector does at start
                backends[i] = f"{engines[i]};peer=127.0.0.1:{port}"
        gw_port = free_port()
        args = ["-m", "tierstore.cli", "gateway", "--port", str(gw_port), "--policy", policy,
                "--tokenizer", str(model_dir()), "--set", f"peer_token={TOKEN}",
                "--set", "log_level=warning"]  # fmt: skip
        for b in backends:
            args += ["--backend", b]
        gw = spawn(stack, args, root / f"gateway-{policy}.log")
        gw_url = f"http://127.0.0.1:{gw_port}"
        wait_http(gw_url + "/health", gw)
        out: dict[str, Any] = {}
        for c in concurrency:
            asyncio.run(drive([gw_url], c, min(2.0, seconds)))  # warm: connections, caches
            before = parse_metrics(http(gw_url + "/metrics").decode())
            cpu0 = cpu_s(gw.pid)
            via = asyncio.run(drive([gw_url], c, seconds))
            cpu = cpu_s(gw.pid) - cpu0
            after = parse_metrics(http(gw_url + "/metrics").decode())
            direct = asyncio.run(drive(engines, c, seconds))
            added = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
            name = "tierstore_gateway_added_seconds"
            out[str(c)] = {
                "via_gateway": via,
                "direct": direct,
                "requests_per_s_vs_direct": round(via["requests_per_s"] / direct["requests_per_s"],
                                                  3) if direct["requests_per_s"] else None,
                "added_p50_ms_bucket": _ms(histogram_quantile(added, name, 0.5)),
                "added_p99_ms_bucket": _ms(histogram_quantile(added, name, 0.99)),
                "added_mean_ms": round(1000 * added.get(f"{name}_sum", 0.0)
                                       / max(added.get(f"{name}_count", 0.0), 1.0), 3),
                "gateway_cpu_ms_per_request": round(1000 * cpu / max(via["requests"], 1), 3),
            }  # fmt: skip
        return out


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1000, 3)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--json", action="store_true")
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--policies", default="least_loaded,tierstore")
    args = p.parse_args()
    concurrency = [int(c) for c in args.concurrency.split(",")]
    root = Path(tempfile.mkdtemp(prefix="bench-gateway-load-"))
    result: dict[str, Any] = {"prompt_words": PROMPT_WORDS, "turn_words": TURN_WORDS,
                              "seconds": args.seconds, "policies": {}}  # fmt: skip
    for policy in args.policies.split(","):
        result["policies"][policy] = measure(policy, concurrency, args.seconds, root / policy)
    emit(result, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
