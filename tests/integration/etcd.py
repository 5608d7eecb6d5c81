"""Start, kill and restart a real single-node etcd for integration tests and
benchmarks: loopback ports, its own data directory, a bounded start-up wait.

``etcd_binary()`` is None when etcd is not installed (tests skip with that
reason; ``.ci/run`` installs the Debian package etcd-server).
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from pathlib import Path

import grpc

from tierstore.v1 import etcd_rpc_pb2 as pb
from tierstore.v1 import etcd_rpc_pb2_grpc as pb_grpc

from .sidecar import free_port

SKIP_REASON = "etcd is not installed (apt-get install etcd-server; .ci/run does)"


def etcd_binary() -> str | None:
    return shutil.which("etcd")


class EtcdProcess:
    """One etcd member on 127.0.0.1, data in ``root``; ``endpoint`` is host:port."""

    def __init__(self, root: Path) -> None:
        binary = etcd_binary()
        if binary is None:
            raise RuntimeError(SKIP_REASON)
        self.binary = binary
        self.root = root
        self.client_port, self.peer_port = free_port(), free_port()
        self.endpoint = f"127.0.0.1:{self.client_port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self, timeout_s: float = 30.0) -> None:
        """Start (or start again on the same data and ports) and wait until it answers."""
        client = f"http://{self.endpoint}"
        peer = f"http://127.0.0.1:{self.peer_port}"
        log = open(self.root / "etcd.log", "ab")
        self.proc = subprocess.Popen(
            [
                self.binary, "--name", "test", "--data-dir", str(self.root / "data"),
                "--listen-client-urls", client, "--advertise-client-urls", client,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", f"test={peer}", "--log-level", "error", "--logger", "zap",
            ],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        log.close()
        deadline = time.monotonic() + timeout_s
        with grpc.insecure_channel(self.endpoint) as ch:
            kv = pb_grpc.KVStub(ch)
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"etcd exited {self.proc.returncode}: {self.output()}")
                try:
                    kv.Range(pb.RangeRequest(key=b"ping"), timeout=1.0)
                    return
                except grpc.RpcError:
                    if time.monotonic() > deadline:
                        self.kill()
                        raise TimeoutError(
                            f"etcd not ready in {timeout_s} s: {self.output()}"
                        ) from None
                    time.sleep(0.1)

    def output(self) -> str:
        path = self.root / "etcd.log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""

    def kill(self) -> None:
        """SIGKILL: what a crashed or unreachable etcd looks like to its clients."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
