"""The sidecar process: ``tierstore serve``.

Provides ``Sidecar``, which owns one TieredStore and serves the local gRPC
service (``tierstore.sidecar.service.LocalServicer``, engine <-> sidecar) on a Unix
socket, with the standard gRPC health service, the fast path (lookups and the
hot calls, ``tierstore.sidecar.fastpath``), the
peer service when ``peer_port`` is set, and a Prometheus endpoint; and
``serve``, which runs one until SIGTERM or SIGINT.

``Sidecar.stop`` refuses new calls, lets in-flight calls finish for
``shutdown_grace_s``, drains DRAM-only blocks to NVMe for at most
``shutdown_drain_s`` (most recently used first; a restart on the same
directory serves them), then closes the store (NVMe index flushed). A second
sidecar on the same socket or NVMe directory fails at start with a message
naming the running one; nothing of the first is touched.
"""

from __future__ import annotations

import fcntl
import logging
import os
import signal
import threading
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tierstore import __version__
from tierstore.config import Config
from tierstore.errors import TierstoreError
from tierstore.fastwire import CALL_CONNECTIONS, fast_socket_path
from tierstore.notify import notify
from tierstore.peer.service import PeerServer
from tierstore.sidecar.fastpath import FastLookupServer
from tierstore.sidecar.loadboard import LoadBoard
from tierstore.sidecar.metrics import start_metrics_server
from tierstore.sidecar.service import MAX_MESSAGE_BYTES, SERVICE_NAME, LocalServicer
from tierstore.store.tiered import TieredStore
from tierstore.v1 import local_pb2_grpc
from tierstore.workers import Workers

log = logging.getLogger(__name__)


class SocketLock:
    """An flock next to the socket: one sidecar per socket path."""

    def __init__(self, socket_path: Path) -> None:
        self.path = socket_path.with_name(socket_path.name + ".lock")
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self._fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(self._fd)
            raise TierstoreError(
                f"socket {socket_path} is served by another tierstore process (pid {holder}); "
                "stop it first or choose another socket_path"
            ) from None
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, str(os.getpid()).encode(), 0)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class Sidecar:
    """One store, its gRPC services and its metrics endpoint."""

    def __init__(self, config: Config) -> None:
        self.config = config
        cfg = config.server
        self.socket_path = Path(cfg.socket_path)
        self.socket_path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._lock = SocketLock(self.socket_path)
        self.stopping = threading.Event()
        self._stopped = threading.Event()
        self.metrics_server: Any = None
        try:
            self.workers = Workers()
            self.store = TieredStore(config.store, workers=self.workers, remote=config.remote)
        except BaseException:
            self._lock.close()
            raise
        self.peer_server: PeerServer | None = None
        self.fast_lookup: FastLookupServer | None = None
        self.loads = LoadBoard(cfg.load_ttl_s)
        try:
            if config.peer.peer_port:
                self.peer_server = PeerServer(self.store, config.peer, self.loads)
            self.servicer = LocalServicer(
                self.store, config, self.stopping, self.peer_server, self.loads
            )
            self.health = health.HealthServicer()
            self.grpc_server = grpc.server(
                futures.ThreadPoolExecutor(
                    max_workers=cfg.max_clients + cfg.rpc_threads,
                    thread_name_prefix="tierstore-rpc",
                ),
                options=[
                    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ],
                maximum_concurrent_rpcs=cfg.max_clients + 4 * cfg.rpc_threads,
            )
            local_pb2_grpc.add_LocalServiceServicer_to_server(self.servicer, self.grpc_server)
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc_server)
            self.socket_path.unlink(missing_ok=True)  # stale: the lock says nobody serves it
            old_umask = os.umask(0o177)  # the socket is created owner-only
            try:
                self.grpc_server.add_insecure_port(f"unix:{self.socket_path}")
                self.grpc_server.start()
            finally:
                os.umask(old_umask)
            os.chmod(self.socket_path, 0o600)
            self.fast_lookup = FastLookupServer(
                fast_socket_path(self.socket_path), self.store, cfg.max_batch_keys,
                cfg.max_clients * (1 + CALL_CONNECTIONS), self.workers, self.servicer,
            )  # fmt: skip
            self.servicer.fast_lookup = self.fast_lookup
            if cfg.metrics_port:
                self.metrics_server = start_metrics_server(
                    self.servicer, cfg.metrics_host, cfg.metrics_port
                )
        except BaseException:
            self._close_store()
            raise
        for name in ("", SERVICE_NAME):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        # A worker that died of a bug (the demoter, a replicator, ...) leaves a
        # sidecar that answers but no longer does its job: say so to health checks.
        self.workers.on_failure(self._on_worker_failure)
        log.info(
            "tierstore %s serving on unix:%s (DRAM %s, NVMe %s)",
            __version__,
            self.socket_path,
            config.store.dram_bytes,
            config.store.nvme_dir if self.store.has_nvme else "off",
        )

    def _on_worker_failure(self, name: str, error: BaseException) -> None:
        if self.stopping.is_set():
            return
        for service in ("", SERVICE_NAME):
            self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)

    def stop(self) -> None:
        """Refuse new calls, finish in-flight ones, close the store. Idempotent."""
        if self.stopping.is_set():
            cfg = self.config.server
            self._stopped.wait(timeout=cfg.shutdown_grace_s + cfg.shutdown_drain_s + 30)
            return
        self.stopping.set()
        if self.peer_server is not None:
            self.peer_server.leave()  # out of the group before the grace period, not after
        self.health.enter_graceful_shutdown()
        stopped = self.grpc_server.stop(self.config.server.shutdown_grace_s)
        if self.fast_lookup is not None:  # its calls end with gRPC's, in the same grace
            self.fast_lookup.close(self.config.server.shutdown_grace_s)
        stopped.wait()
        if self.metrics_server is not None:
            self.metrics_server.shutdown()
        self._close_store(drain=True)
        self._stopped.set()
        log.info("tierstore stopped")

    def _close_store(self, drain: bool = False) -> None:
        if self.fast_lookup is not None:
            self.fast_lookup.close()
        if self.peer_server is not None:
            self.peer_server.stop(self.config.server.shutdown_grace_s)
        if hasattr(self, "servicer"):
            self.servicer.prefetcher.close()
        try:
            if drain:
                self.store.drain(self.config.server.shutdown_drain_s)
        finally:
            self.store.close()
        self.socket_path.unlink(missing_ok=True)
        self._lock.close()

    def wait(self) -> None:
        self._stopped.wait()


def serve(config: Config) -> int:
    """Run a sidecar until SIGTERM or SIGINT. Returns the exit status."""
    sidecar = Sidecar(config)
    stop_requested = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        log.info("signal %s: shutting down", signal.Signals(signum).name)
        stop_requested.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    print(f"tierstore serving on unix:{sidecar.socket_path}", flush=True)
    notify("READY=1")  # systemd's Type=notify: the socket and the peer port serve
    stop_requested.wait()
    notify("STOPPING=1")
    sidecar.stop()
    return 0
