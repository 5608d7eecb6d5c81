"""What the tests and the benchmarks start and stop: real processes, namespaces
and loads, in one place (run from the repository root; not installed).

- ``harness.sidecar``: ``tierstore serve`` children (start, stop, SIGKILL,
  restart, Stat, memory, log), the benchmarks' sidecar, and helpers that act
  on a running sidecar's tiers from outside;
- ``harness.netns``: network namespaces joined by veth pairs, shaped with tc
  (tbf rate, netem delay and loss), a command or a thread run inside one,
  teardown that always runs;
- ``harness.relay``: packet loss (a BPF filter) and added delay (a TUN wire)
  where the kernel has no netem;
- ``harness.etcd``: a real single-node etcd (start, kill, restart, etcdctl);
- ``harness.seaweed``: a real SeaweedFS S3 store and a fault-injecting TCP
  proxy in front of it;
- ``harness.vllm_server``: vLLM's OpenAI api_server with the tests' tiny
  model, and its HTTP helpers (completions, metrics);
- ``harness.chat_load``: the serving benchmark's multi-turn chat workload, its
  streaming client and its statistics;
- ``harness.reliability``: deterministic blocks anyone can verify, memory
  bounds and samplers, and the client worker processes of the reliability
  tests and the soak;
- ``harness.fault_fleet``: the fault bench's two-host fleet and the faults it
  injects, each with its recovery probe;
- ``harness.fault_load``: the fault bench's engines and writers (multi-turn
  sessions that switch hosts, checking every block they get back).

``REPO`` is the checkout's root; ``child_env()`` the environment every child
runs in (this process's, with ``REPO`` first on PYTHONPATH).
"""

import contextlib
import os
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


class Started:
    """A ``with`` block over what ``_start`` puts on ``self.stack``: all of it
    is stopped on the way out, and if ``_start`` fails part-way, what it had
    started already."""

    stack: contextlib.ExitStack

    def _start(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Any:
        try:
            self._start()
        except BaseException:
            self.stack.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stack.close()


def child_env() -> dict[str, str]:
    """This process's environment with the checkout first on PYTHONPATH."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return env
