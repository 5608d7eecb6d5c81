"""Benchmark of the router's decisions over real sidecars on loopback.

    python -m bench.router.decisions --json [--quick] [--hosts 4]

Starts ``--hosts`` sidecars (peers of one group on 127.0.0.1), stores on host
``i`` the first ``(i + 1) / hosts`` of each of ``PROMPTS`` prompts of
``TOKENS`` tokens (so every host holds a different prefix), and measures:

- ``lookup_rtt_p50_s``: the limit: one peer ``Lookup`` of one key on one host
  (a gRPC round trip on loopback, nothing to compute);
- ``route_lookup_p50_s`` / ``_p99_s``: ``Router.route`` asking every host
  (one batched Lookup of the prompt's blocks per host, all in flight at once),
  and the same as a multiple of the round trip (``route_lookup_vs_rtt``);
- ``route_index_p50_s`` / ``_p99_s``: the same decisions from the index fed
  by the hosts' ``WatchBlocks`` streams (no call to any host);
- ``index_lag_p50_s`` / ``_max_s``: from ``store`` returning on a host until
  the router's index shows the new blocks;
- ``same_choice``: share of requests where both ways chose the same host.

Keys are computed before timing (``chain_keys`` is measured in bench/tiers/local.py).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.limits import emit
from harness.sidecar import bench_sidecar
from tierstore.cli.ports import free_port
from tierstore.client import StoreClient
from tierstore.config.peer import PeerConfig
from tierstore.config.router import RouterConfig
from tierstore.keys import KVLayout, chain_keys
from tierstore.peer.tier import PeerClient
from tierstore.router.router import Router

LAYOUT = KVLayout("bench-router", 4, 2, 64, "bfloat16", 16)  # 32 KiB blocks
TOKENS = 8192  # per prompt: 512 blocks
PROMPTS = 16
TOKEN = "bench-router-token"


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def run(num_hosts: int, requests: int, lag_samples: int) -> dict[str, Any]:
    ports = [free_port() for _ in range(num_hosts)]
    hosts = [f"127.0.0.1:{p}" for p in ports]
    peer_cfg = PeerConfig(peer_token=TOKEN)
    cfg = RouterConfig(router_hosts=tuple(hosts), router_lookup_timeout_s=2.0)
    prompts = [np.arange(TOKENS, dtype=np.int64) + i * 10_000_000 for i in range(PROMPTS)]
    keys = [chain_keys(LAYOUT, p) for p in prompts]
    with tempfile.TemporaryDirectory(prefix="tierstore-bench-router-") as tmp, ExitStack() as stack:
        socks = []
        for i, port in enumerate(ports):
            root = Path(tmp) / f"h{i}"
            root.mkdir()
            others = ",".join(h for h in hosts if not h.endswith(f":{port}"))
            socks.append(stack.enter_context(bench_sidecar(
                root, 256 << 20, f"peer_port={port}", f"peers={others}", f"peer_token={TOKEN}",
                "watch_heartbeat_s=0.5", "max_watchers=4",
            )))  # fmt: skip
        clients = [stack.enter_context(StoreClient(str(s))) for s in socks]
        data = torch.zeros((TOKENS // LAYOUT.block_tokens, LAYOUT.block_bytes), dtype=torch.uint8)
        for i, client in enumerate(clients):
            for k in keys:
                n = len(k) * (i + 1) // num_hosts
                client.store(LAYOUT, k[:n], data[:n])

        probe = PeerClient(hosts[0], peer_cfg, TOKEN)
        stack.callback(probe.close)
        rtt = []
        for _ in range(requests):
            t0 = time.perf_counter()
            probe.lookup_future(LAYOUT, keys[0][:1], 5.0).result()
            rtt.append(time.perf_counter() - t0)

        asking = Router(cfg, peer_cfg)
        stack.callback(asking.close)
        indexed = Router(RouterConfig(**{**cfg.__dict__, "router_watch": True}), peer_cfg)
        stack.callback(indexed.close)
        deadline = time.monotonic() + 60
        assert indexed.feeder is not None and indexed.index is not None
        while not all(indexed.feeder.synced().values()):
            if time.monotonic() > deadline:
                raise RuntimeError("the router's index did not sync within 60 s")
            time.sleep(0.05)

        by_lookup, by_index, same = [], [], 0
        for r in range(requests):
            k = keys[r % PROMPTS]
            t0 = time.perf_counter()
            a = asking.route(LAYOUT, k, TOKENS, session=f"s{r}")
            t1 = time.perf_counter()
            b = indexed.route(LAYOUT, k, TOKENS, session=f"s{r}")
            t2 = time.perf_counter()
            by_lookup.append(t1 - t0)
            by_index.append(t2 - t1)
            same += a.best is not None and b.best is not None and a.best.host == b.best.host
            assert all(c.source == "index" for c in b.ranked), "a host fell back to lookups"

        lags = []
        fresh = np.arange(TOKENS, dtype=np.int64) + 99 * 10_000_000
        for s in range(lag_samples):
            k = chain_keys(LAYOUT, fresh + s * 100_000)[:8]
            clients[-1].store(LAYOUT, k, data[:8])
            t0 = time.perf_counter()
            while len(indexed.index.prefix(hosts[-1], k)[0]) < len(k):
                if time.perf_counter() - t0 > 10:
                    raise RuntimeError("the index did not follow a store within 10 s")
                time.sleep(0.0005)
            lags.append(time.perf_counter() - t0)
    rtt50 = statistics.median(rtt)
    return {
        "hosts": num_hosts,
        "requests": requests,
        "prompt_tokens": TOKENS,
        "prompt_blocks": TOKENS // LAYOUT.block_tokens,
        "lookup_rtt_p50_s": rtt50,
        "route_lookup_p50_s": statistics.median(by_lookup),
        "route_lookup_p99_s": _pct(by_lookup, 99),
        "route_lookup_vs_rtt": statistics.median(by_lookup) / rtt50,
        "route_index_p50_s": statistics.median(by_index),
        "route_index_p99_s": _pct(by_index, 99),
        "route_index_vs_rtt": statistics.median(by_index) / rtt50,
        "index_lag_p50_s": statistics.median(lags),
        "index_lag_max_s": max(lags),
        "same_choice": same / requests,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--quick", action="store_true", help="fewer requests")
    parser.add_argument("--hosts", type=int, default=4)
    args = parser.parse_args(argv)
    requests, lags = (50, 10) if args.quick else (300, 40)
    emit(run(args.hosts, requests, lags), args.json)


if __name__ == "__main__":
    main()
