"""The two-engine modes of ``bench/serving/vllm_serve.py`` (``--two-engines``).

Two api_servers on one machine; sessions move between them:

- ``two_none``: no connector; every returning turn goes to the other server
  than its last turn (``(user + turn) % 2``), which computes it whole;
- ``two_tierstore``: each server with TierstoreConnector on its own sidecar,
  the two sidecars in one peer group (``include_peers``: a moved turn pulls
  its prefix from the other host; no proactive replica pushes,
  ``min_tokens`` out of reach); the same moves as ``two_none``, made by the
  bench: every returning turn is a peer pull, the worst case for a store;
- ``two_router``: the same stores, and tierstore's router places each turn:
  ``tierstore.router.router.Router``, in the bench's process (the cost
  model ``tierstore router`` serves, without its gRPC hop), from the prefix
  each host holds (its batched peer lookups) and the gateway's view of each
  host's load (the bench's requests in flight; one slot a host: each
  engine's worker runs on one core). A session moves when the other host's
  estimated TTFT (queue + load + prefill) is lower.

The router needs the connector's ``KVLayout``, whose model string hashes
vLLM's view of the model config; rather than trusting a copy of that
derivation, ``probe_layout`` stores a probe prompt through the first server
and keeps the candidate layout under which its sidecar finds the probe's
blocks (an error names the candidates when none matches).

Runs in the benchmark's process; ``Place`` callables run on worker threads
(``harness.chat_load``), one at a time per user, so the placement's state is locked.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.serving.engine import BLOCK_BYTES, BLOCK_TOKENS, Mode, ModeSetup, Sizing, tier_hits
from harness.sidecar import bench_sidecar
from tierstore.cli.ports import free_port
from tierstore.engines.vllm.driver import kv_transfer_config
from tierstore.keys import KVLayout, chain_keys

PEER_TOKEN = "bench-serve"
PROBE_BLOCKS = 2
PROBE_TIMEOUT_S = 120.0


def alternate(user: int, turn: int, context: list[int], inflight: list[int]) -> int:
    """Every turn on the other host than the user's last one."""
    return (user + turn) % 2


# vLLM's KVCacheLayout member names (vllm/v1/kv_cache_layout.py) and the older
# attention-backend names: the candidates for the connector's page string, named here
# rather than read from vllm (the bench's process needs no vLLM: a mode's servers may run
# from another environment); probe_layout checks which one the connector really used.
PAGE_LAYOUTS = (None, "LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "NHD", "HND")


def candidate_layouts(model: Path) -> list[KVLayout]:
    """The layouts the connector may use for ``model`` (see the docstring)."""
    from transformers import AutoConfig

    from tierstore.engines.vllm.driver import WIDE_KV
    from tierstore.engines.vllm.layout import _config_hash

    cfg = _config_hash(AutoConfig.from_pretrained(model), "bfloat16")
    return [
        KVLayout(
            model=f"vllm:{model}@#{cfg}/cpu-{name}",
            num_layers=WIDE_KV["num_layers"],
            num_kv_heads=WIDE_KV["kv_heads"],
            head_dim=WIDE_KV["head_dim"],
            dtype="bfloat16",
            block_tokens=BLOCK_TOKENS,
        )
        for name in PAGE_LAYOUTS
    ]


def probe_layout(model: Path, url: str, sock: Path) -> KVLayout:
    """The connector's layout: the candidate under which ``sock`` holds a probe
    prompt just sent through ``url`` (its tokens are none of the workload's:
    ids 1 and 2 never occur there)."""
    from tierstore.client import StoreClient

    probe = [1, 2] * (PROBE_BLOCKS * BLOCK_TOKENS // 2) + [1]
    body = {"model": "m", "prompt": probe, "max_tokens": 1, "temperature": 0.0}
    req = urllib.request.Request(
        f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=PROBE_TIMEOUT_S) as r:
        r.read()
    candidates = candidate_layouts(model)
    deadline = time.monotonic() + 10.0  # the connector commits its saves after the step
    with StoreClient(str(sock)) as client:
        while time.monotonic() < deadline:
            for layout in candidates:
                keys = chain_keys(layout, probe)
                if keys and client.lookup(layout, keys).num_hits == len(keys):
                    return layout
            time.sleep(0.5)
    names = ", ".join(c.model for c in candidates)
    raise RuntimeError(f"two_router: the probe's blocks are under none of the layouts {names}")


class RouterPlace:
    """Each turn's host from tierstore's Router (see the module docstring)."""

    def __init__(self, hosts: list[str], args: argparse.Namespace) -> None:
        from tierstore.config.peer import PeerConfig
        from tierstore.config.router import RouterConfig
        from tierstore.router.router import Router

        cfg = RouterConfig(
            router_hosts=tuple(hosts),
            router_lookup_timeout_s=2.0,  # loopback, but two busy cores
            prefill_tokens_per_s=args.router_prefill_tokens_per_s,
            turn_s=args.router_turn_s,
        )
        self.router = Router(cfg, PeerConfig(peer_token=PEER_TOKEN))
        self.hosts = hosts
        self.layout: KVLayout | None = None  # set by probe_layout before the load
        self.last: dict[int, int] = {}  # user -> host of its last turn
        self.decisions: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def __call__(self, user: int, turn: int, context: list[int], inflight: list[int]) -> int:
        from tierstore.load import HostLoadView

        assert self.layout is not None, "probe_layout first"
        keys = chain_keys(self.layout, context)
        loads = {
            h: HostLoadView(True, min(n, 1), 1, max(n - 1, 0))
            for h, n in zip(self.hosts, inflight, strict=True)
        }
        with self._lock:
            current = self.hosts[self.last[user]] if user in self.last else ""
        plan = self.router.route(self.layout, keys, len(context), session=f"u{user}",
                                 current_host=current, loads=loads)  # fmt: skip
        best = plan.best
        if best is None:
            raise RuntimeError(f"router: no reachable host ({[c.error for c in plan.ranked]})")
        host = self.hosts.index(best.host)
        with self._lock:
            moved = user in self.last and self.last[user] != host
            self.last[user] = host
            self.decisions.append({
                "user": user, "turn": turn, "host": host, "moved": moved,
                "inflight": list(inflight),
                "held_blocks": {self.hosts.index(c.host): c.held_blocks for c in plan.ranked},
                "ttft_est_s": {self.hosts.index(c.host): round(c.ttft_s, 3) for c in plan.ranked},
            })  # fmt: skip
        return host

    def describe(self) -> dict[str, Any]:
        with self._lock:
            moves = sum(d["moved"] for d in self.decisions)
            return {"policy": "router", "layout_model": self.layout.model if self.layout else None,
                    "moves": moves, "decisions": list(self.decisions)}  # fmt: skip

    def close(self) -> None:
        self.router.close()


@contextlib.contextmanager
def two_engines(mode: str, tmp: Path, size: Sizing, args: argparse.Namespace) -> Iterator[Mode]:
    """A two-engine mode's servers' setups and placement, its stores running."""
    if mode == "two_none":
        moves = {"policy": "alternate (the bench moves every returning turn)"}
        yield Mode([ModeSetup(), ModeSetup()], alternate, lambda: moves)
        return
    if mode not in ("two_tierstore", "two_router"):
        raise ValueError(f"unknown two-engine mode {mode!r}")
    unit = BLOCK_BYTES * max(1, (16 << 20) // BLOCK_BYTES)
    ports = [free_port(), free_port()]
    hosts = [f"127.0.0.1:{p}" for p in ports]
    common = (
        f"peer_token={PEER_TOKEN}",
        "min_tokens=1000000000",
        "replicate_policy=kv_share",
        f"dram_segment_bytes={unit}",
        f"nvme_bytes={max(1 << 30, size.store_bytes)}",
    )
    with contextlib.ExitStack() as stack:
        socks = []
        for i in range(2):
            (tmp / f"h{i}").mkdir(parents=True, exist_ok=True)
            settings = (*common, f"peer_port={ports[i]}", f"peers={hosts[1 - i]}")
            socks.append(
                stack.enter_context(bench_sidecar(tmp / f"h{i}", size.store_bytes, *settings))
            )
        # a 12 MiB-a-block pull can outlast the default 5 s deadline on two busy cores
        setups = [
            ModeSetup(kv_transfer=kv_transfer_config(s, include_peers=True, load_deadline_s=30.0),
                      stat=tier_hits(s), extra_body={"kv_transfer_params": {}})
            for s in socks
        ]  # fmt: skip
        if mode == "two_tierstore":
            moves = {"policy": "alternate (the bench moves every returning turn)"}
            yield Mode(setups, alternate, lambda: moves)
            return
        place = RouterPlace(hosts, args)
        stack.callback(place.close)

        def learn_layout(urls: list[str], model: Path) -> None:
            place.layout = probe_layout(model, urls[0], socks[0])

        yield Mode(setups, place, place.describe, learn_layout)
