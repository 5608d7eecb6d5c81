"""Start, kill and restart a real single-node etcd for the tests and the
benchmarks: loopback ports, its own data directory, a bounded start-up wait.

Provides ``EtcdProcess`` (start, SIGKILL, start again on the same data and
ports, stop, a gRPC channel to it, etcdctl against it) and ``etcd_binary()``,
None when etcd is not installed (``MISSING`` says so: the tests skip with it;
``.ci/run`` installs the Debian package etcd-server). Runs in the caller's
process and thread.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import grpc

from tierstore.cli.ports import free_port
from tierstore.v1 import etcd_rpc_pb2 as pb
from tierstore.v1 import etcd_rpc_pb2_grpc as pb_grpc

from .reaper import forget_process, watch_process

MISSING = "etcd is not installed (apt-get install etcd-server; .ci/run does)"


def etcd_binary() -> str | None:
    return shutil.which("etcd")


class EtcdProcess:
    """One etcd member on ``host`` (default 127.0.0.1), data in ``root``;
    ``endpoint`` is host:port."""

    def __init__(
        self, root: Path, tls: dict[str, Path] | None = None, host: str = "127.0.0.1"
    ) -> None:
        """``tls``: {"cert", "key", "ca"} PEM files: the client port speaks TLS
        and requires client certificates signed by "ca". ``host``: the client
        port's address (a bridge's, for hosts in network namespaces)."""
        binary = etcd_binary()
        if binary is None:
            raise RuntimeError(MISSING)
        self.binary = binary
        self.root = root
        self.tls = tls
        self.client_port, self.peer_port = free_port(), free_port()
        self.endpoint = f"{host}:{self.client_port}"
        self.proc: subprocess.Popen[bytes] | None = None
        # Raft's fsyncs on a tmpfs: on a busy 2-core machine a disk fsync can
        # take longer than etcd's request timeout ("etcdserver: request timed
        # out"), a fault of the test machine, not of what is tested. The data
        # survives kill() and start(); stop() removes it.
        shm = Path("/dev/shm")
        self.data_dir = Path(
            tempfile.mkdtemp(prefix="etcd-test-", dir=shm if shm.is_dir() else root)
        )
        try:
            self.start()
        except BaseException:
            shutil.rmtree(self.data_dir, ignore_errors=True)
            raise

    def channel(self) -> grpc.Channel:
        if self.tls is None:
            return grpc.insecure_channel(self.endpoint)
        creds = grpc.ssl_channel_credentials(
            self.tls["ca"].read_bytes(), self.tls["key"].read_bytes(),
            self.tls["cert"].read_bytes(),
        )  # fmt: skip
        return grpc.secure_channel(self.endpoint, creds)

    def start(self, timeout_s: float = 30.0) -> None:
        """Start (or start again on the same data and ports) and wait until it answers."""
        client = f"{'https' if self.tls else 'http'}://{self.endpoint}"
        peer = f"http://127.0.0.1:{self.peer_port}"
        tls_args: list[str] = []
        if self.tls is not None:
            tls_args = ["--cert-file", str(self.tls["cert"]), "--key-file", str(self.tls["key"]),
                        "--trusted-ca-file", str(self.tls["ca"]), "--client-cert-auth"]  # fmt: skip
        log = open(self.root / "etcd.log", "ab")
        self.proc = subprocess.Popen(
            [
                self.binary, "--name", "test", "--data-dir", str(self.data_dir),
                "--listen-client-urls", client, "--advertise-client-urls", client,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", f"test={peer}", "--log-level", "error", "--logger", "zap",
                *tls_args,
            ],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        watch_process(self.proc.pid)
        log.close()
        deadline = time.monotonic() + timeout_s
        with self.channel() as ch:
            kv = pb_grpc.KVStub(ch)
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"etcd exited {self.proc.returncode}: {self.output()}")
                try:
                    kv.Range(pb.RangeRequest(key=b"ping"), timeout=1.0)
                    return
                except grpc.RpcError as e:
                    if e.code() == grpc.StatusCode.INVALID_ARGUMENT:  # auth on: it answers
                        return
                    if time.monotonic() > deadline:
                        self.kill()
                        raise TimeoutError(
                            f"etcd not ready in {timeout_s} s: {self.output()}"
                        ) from None
                    time.sleep(0.1)

    def etcdctl(self, *args: str) -> str:
        """Run etcdctl against this etcd (users, roles, auth); needs etcd-client."""
        ctl = shutil.which("etcdctl")
        if ctl is None:
            raise RuntimeError("etcdctl is not installed (apt-get install etcd-client)")
        out = subprocess.run(
            [ctl, "--endpoints", self.endpoint, *args], capture_output=True, text=True,
            timeout=30, env={"ETCDCTL_API": "3", "PATH": "/usr/bin:/bin"},
        )  # fmt: skip
        if out.returncode != 0:
            raise RuntimeError(f"etcdctl {' '.join(args)}: {out.stderr}")
        return out.stdout

    def output(self) -> str:
        path = self.root / "etcd.log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""

    def kill(self) -> None:
        """SIGKILL: what a crashed or unreachable etcd looks like to its clients."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
            forget_process(self.proc.pid)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
            forget_process(self.proc.pid)
        shutil.rmtree(self.data_dir, ignore_errors=True)
