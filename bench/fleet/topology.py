"""The fleet bench's hosts: what deploy/kubernetes/tierstore.yaml runs, on one machine.

Provides ``Mode`` (what a mode runs: a connector and sidecars or not, KV
events or not, the gateway's policy), ``MODES``, ``Sizing`` and ``Fleet``:

- each pod is a network namespace (``harness.netns``) on a bridge whose
  egress is shaped (tc tbf at the link's rate): its vLLM OpenAI server
  (the model's tokenizer and chat template, one core of its own), and in the
  store modes its sidecar beside it (the socket and /dev/shm shared, as the
  pod's memory-backed emptyDirs are), registered in etcd with its engine's
  URL and KV-event endpoint;
- etcd and the gateway (``tierstore gateway``, a process of its own, as its
  Deployment runs) sit in the root namespace on the bridge, where a
  cluster's Services would be. In the store modes the gateway finds the
  engines through etcd; without a store, from its backend list.

``Fleet`` is a context manager: everything it starts is stopped on the way
out, on every path, and every process it starts dies with the bench.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.fleet.workload import REFERENCE_PREFILL_TOKENS_PER_S
from harness import REPO, Started, child_env
from harness.etcd import EtcdProcess
from harness.netns import Network, Shape
from harness.reaper import forget_process, watch_process
from harness.sidecar import SidecarProcess, remove_arenas
from harness.vllm_server import Server, http, openai_server
from tierstore.cli.ports import free_port
from tierstore.engines.vllm.driver import kv_transfer_config

TOKEN = "bench-fleet"
ENGINE_PORT = 8000
EVENTS_PORT = 5557
PEER_PORT = 7700
ROOT_ADDR = "10.200.0.254"
BLOCK_TOKENS = 128
# The engines' forward passes run on the CPU here, on the cores the sidecars
# and the gateway use; on a GPU host they run on the GPU. The engines run at
# a lower priority (every mode alike), so the I/O of the store and the gateway
# is not queued behind a CPU prefill's matmuls, as it would not be behind a
# GPU's: at equal priority a sidecar's send to a moved turn ran at 60-200 MB/s
# on a 10 Gbit/s link while its host prefilled.
ENGINE_NICE = 10
GATEWAY_START_S = 120.0
LINK_RATES = {"10g": ("10gbit", 10e9 / 8), "1g": ("1gbit", 1e9 / 8)}


@dataclass(frozen=True)
class Mode:
    name: str
    store: bool  # engines with TierstoreConnector, sidecars peered through etcd
    events: bool  # engines publish their KV events to the gateway
    policy: str  # the gateway's gateway_policy


MODES = {
    m.name: m
    for m in (
        Mode("round_robin", store=False, events=False, policy="round_robin"),
        Mode("least_loaded", store=False, events=False, policy="least_loaded"),
        Mode("prefix_aware", store=False, events=True, policy="prefix_aware"),
        Mode("tierstore", store=True, events=True, policy="tierstore"),
        Mode("tierstore_no_preposition", store=True, events=True,
             policy="tierstore_no_preposition"),
    )
}  # fmt: skip


@dataclass(frozen=True)
class Sizing:
    kv_cache_bytes: int  # each engine's own KV cache: less than the users' contexts
    dram_bytes: int  # each sidecar's arena
    nvme_bytes: int
    max_model_len: int
    prefix_max_waiting: float = 2.0  # prefix_aware: a host with more waiting is full
    # The cost model's starting speed (the bench measures it before the modes run).
    prefill_tokens_per_s: float = REFERENCE_PREFILL_TOKENS_PER_S


class Fleet(Started):
    def __init__(
        self, root: Path, mode: Mode, link: str, sizing: Sizing, model: Path, hosts: int = 2,
        replicas: bool = True,
    ) -> None:  # fmt: skip
        self.root, self.mode, self.link, self.sizing, self.model = root, mode, link, sizing, model
        self.hosts = hosts
        self.replicas = replicas
        self.stack = ExitStack()
        self.net: Network
        self.sidecars: list[SidecarProcess] = []
        self.engines: list[Server] = []
        self.gateway_url = ""
        self._gateway: subprocess.Popen[bytes] | None = None

    # -- bring-up --------------------------------------------------------------------------

    def _start(self) -> None:
        rate, _ = LINK_RATES[self.link]
        self.root.mkdir(parents=True, exist_ok=True)
        self.net = self.stack.enter_context(
            Network(self.hosts, Shape(rate=rate), root_addr=ROOT_ADDR, prefix="tsf")
        )
        membership = ""
        if self.mode.store:
            etcd = EtcdProcess(self.root, host=ROOT_ADDR)
            self.stack.callback(etcd.stop)
            membership = f"etcd://{etcd.endpoint}/bench"
            for i in range(self.hosts):
                self.sidecars.append(self._sidecar(i, membership))
        with ThreadPoolExecutor(self.hosts) as pool:
            started = list(pool.map(self._engine, range(self.hosts)))
        for cm, server in started:  # stopped in reverse order of this
            self.stack.push(cm.__exit__)
            self.engines.append(server)
        self._start_gateway(membership)

    def _sidecar(self, i: int, membership: str) -> SidecarProcess:
        addr = self.net.addr[i]
        sc = SidecarProcess(
            self.root / f"host{i}", dram=str(self.sizing.dram_bytes),
            nvme=str(self.sizing.nvme_bytes), netns=self.net.ns[i], die_with_parent=True,
            settings=(
                "dram_segment_bytes=64MiB", "log_level=warning", f"peer_host={addr}",
                f"peer_port={PEER_PORT}", f"peer_token={TOKEN}", f"membership={membership}",
                "membership_ttl_s=5", f"engine_url=http://{addr}:{ENGINE_PORT}",
                f"engine_events=tcp://{addr}:{EVENTS_PORT}",
                f"link_bytes_per_s={LINK_RATES[self.link][1]:g}", *self.replica_settings(),
            ),
        )  # fmt: skip
        sc.start(timeout_s=60.0)

        def stop() -> None:
            sc.stop(timeout_s=30.0)
            remove_arenas(sc.pid)
            # The NVMe tier's file is allocated whole (twice the DRAM arena): a
            # bench of 15 store runs left 48 GiB and filled the disk.
            shutil.rmtree(self.root / f"host{i}" / "nvme", ignore_errors=True)

        self.stack.callback(stop)
        return sc

    def replica_settings(self) -> tuple[str, ...]:
        """Replicas pushed to the other host during and after each turn
        (``replicas``), or none: moved turns then pull at the switch."""
        if self.replicas:
            return ("min_tokens=1024", "replicate_policy=headroom", "stream_replicas=true")
        return ("min_tokens=1000000", "replicate_policy=kv_share", "stream_replicas=false")

    def _engine(self, i: int) -> tuple[Any, Server]:
        """Start host ``i``'s engine (on a thread: both start at once)."""
        transfer = None
        if self.mode.store:
            transfer = kv_transfer_config(self.sidecars[i].socket, include_peers=True)
        prefix = [*self.net.prefix(i), "nice", "-n", str(ENGINE_NICE)]
        cm = openai_server(
            self.model, self.root / f"engine{i}.log", host=self.net.addr[i], port=ENGINE_PORT,
            prefix=prefix, block=BLOCK_TOKENS, max_model_len=self.sizing.max_model_len,
            transfer=transfer, events_port=EVENTS_PORT if self.mode.events else 0,
            env={"VLLM_CPU_OMP_THREADS_BIND": str(i % (os.cpu_count() or 1))},
            extra=("--kv-cache-memory-bytes", str(self.sizing.kv_cache_bytes)),
        )  # fmt: skip
        return cm, cm.__enter__()

    def _start_gateway(self, membership: str) -> None:
        port = free_port()
        _, link_bytes_per_s = LINK_RATES[self.link]
        gateway: dict[str, Any] = {
            "gateway_host": "127.0.0.1", "gateway_port": port,
            "gateway_policy": self.mode.policy, "gateway_tokenizer": str(self.model),
            "gateway_prefix_max_waiting": self.sizing.prefix_max_waiting,
        }  # fmt: skip
        peer: dict[str, Any] = {"peer_token": TOKEN}
        if membership:
            peer["membership"] = membership
        else:
            events = [f";events=tcp://{a}:{EVENTS_PORT}" if self.mode.events else ""
                      for a in self.net.addr]  # fmt: skip
            gateway["gateway_backends"] = [f"{e.url}{ev}" for e, ev in zip(self.engines, events)]
            gateway["gateway_layout"] = json.dumps(self.key_layout())
        # The cost model's starting speeds: this model's cold prefill on one
        # core of this machine (measured before the modes run), the link, a
        # CPU host's memory copy; the gateway calibrates each engine from its
        # answers.
        router = {"prefill_tokens_per_s": self.sizing.prefill_tokens_per_s,
                  "peer_load_bytes_per_s": link_bytes_per_s,
                  "dram_load_bytes_per_s": 5e9}  # fmt: skip
        config = self.root / "gateway.toml"
        config.write_text(_toml({"gateway": gateway, "peer": peer, "router": router}))
        log = open(self.root / "gateway.log", "ab")  # closed by the stack
        self.stack.callback(log.close)
        self._gateway = subprocess.Popen(
            [sys.executable, "-m", "tierstore.cli", "gateway", "--config", str(config)],
            cwd=REPO, env=child_env(), stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        watch_process(self._gateway.pid, group=True)
        self.stack.callback(self._stop_gateway)
        self.gateway_url = f"http://127.0.0.1:{port}"
        self._wait_gateway()

    def key_layout(self) -> dict[str, Any]:
        """The layout the no-store gateway keys prompts under (prefix_aware):
        only its block size must be the engines'."""
        return {"model": "bench-fleet", "num_layers": 1, "num_kv_heads": 1, "head_dim": 1,
                "dtype": "uint8", "block_tokens": BLOCK_TOKENS}  # fmt: skip

    def _wait_gateway(self) -> None:
        """Until the gateway sees every engine up (and, with a store, the
        layout each engine's connector registered)."""
        deadline = time.monotonic() + GATEWAY_START_S
        status: Any = None
        while time.monotonic() < deadline:
            assert self._gateway is not None
            if self._gateway.poll() is not None:
                raise RuntimeError(f"the gateway exited: {self.log_tail('gateway.log')}")
            with contextlib.suppress(OSError, urllib.error.HTTPError, ValueError):
                status = json.loads(http(f"{self.gateway_url}/health", timeout_s=2.0))
                engines = list(status["engines"].values())
                if (
                    len(engines) == self.hosts
                    and all(e["up"] for e in engines)
                    and (not self.mode.store or all(e["layout"] for e in engines))
                ):
                    return
            time.sleep(0.5)
        raise RuntimeError(f"the gateway did not see every engine: {status}")

    def _stop_gateway(self) -> None:
        if self._gateway is None or self._gateway.poll() is not None:
            return
        self._gateway.terminate()
        try:
            self._gateway.wait(30)
        except subprocess.TimeoutExpired:
            self._gateway.kill()
            self._gateway.wait(30)
        forget_process(self._gateway.pid)

    # -- during a run ----------------------------------------------------------------------

    def host_of(self, served_by: str) -> int:
        """Host index of a gateway's ``x-tierstore-host`` (a peer address or an engine URL)."""
        for i, (addr, e) in enumerate(zip(self.net.addr, self.engines)):
            if served_by in (f"{addr}:{PEER_PORT}", e.url):
                return i
        return -1

    def engine_metrics(self, i: int) -> str:
        return http(f"{self.engines[i].url}/metrics", timeout_s=10.0).decode()

    def gateway_metrics(self) -> str:
        return http(f"{self.gateway_url}/metrics", timeout_s=10.0).decode()

    def sidecar_counters(self, i: int) -> dict[str, int]:
        return self.sidecars[i].counters() if self.sidecars else {}

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds used so far by each part: every engine's process group
        (API server, engine core, workers), every sidecar, the gateway."""
        groups = {f"engine{i}": e.proc.pid for i, e in enumerate(self.engines)}
        pids = {f"sidecar{i}": sc.pid for i, sc in enumerate(self.sidecars)}
        if self._gateway is not None:
            pids["gateway"] = self._gateway.pid
        out = dict.fromkeys([*groups, *pids], 0.0)
        tick = os.sysconf("SC_CLK_TCK")
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue  # exited meanwhile
            pid, pgrp, cpu = int(entry), int(fields[2]), (int(fields[11]) + int(fields[12])) / tick
            for name, group in groups.items():
                if pgrp == group:
                    out[name] += cpu
            for name, own in pids.items():
                if pid == own:
                    out[name] += cpu
        return {k: round(v, 2) for k, v in out.items()}

    def log_tail(self, name: str, chars: int = 3000) -> str:
        path = self.root / name
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""


def _toml(tables: dict[str, dict[str, Any]]) -> str:
    """A TOML file of ``[table]`` sections with scalar and list values."""
    lines = []
    for table, values in tables.items():
        lines.append(f"[{table}]")
        for name, value in values.items():
            lines.append(f"{name} = {json.dumps(value)}")  # JSON scalars and lists are TOML
    return "\n".join(lines) + "\n"
