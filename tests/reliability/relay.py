"""Network faults this kernel has no qdisc for, for tests/reliability/test_network.py.

- ``drop_random``: real packet loss on a veth inside a test's namespace. netem
  is not built and neither nft nor iptables is installed, so a classic BPF
  program on the device's clsact *ingress* hook (cls_bpf in direct-action
  mode) drops each arriving packet with the given probability (``ld rand``).
  Ingress, not egress: a packet dropped on the sender's own egress is
  reported to its TCP stack, which just sends it again (no loss seen).
- ``DelayRelay``: added latency. A TCP relay, run in the test process but
  inside a namespace, that forwards every byte of each connection after
  ``delay_s`` in both directions, in order; it listens on one address for
  each forwarded port and connects to the same port on the target.
- ``listening_ports``: the TCP ports a process listens on at one address (to
  relay a sidecar's ephemeral data port too).

Threads: ``DelayRelay`` runs one setup thread that enters the namespace
(``setns`` applies per thread; threads it starts inherit it), one accept thread
per port and, per relayed connection, a reader and a writer per direction.
``close`` ends them all; every wait has a deadline.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import queue
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Sequence

CLONE_NEWNET = 0x40000000
SKF_AD_RANDOM = (-0x1000 + 56) & 0xFFFFFFFF  # classic BPF ancillary load: a random u32
TC_ACT_OK, TC_ACT_SHOT = 0, 2
POLL_S = 0.1  # how often relay threads look at the stop flag
CHUNK_BYTES = 64 << 10


def drop_random(ns: str, dev: str, percent: float) -> subprocess.CompletedProcess[str]:
    """Drop ``percent`` % of the packets arriving on ``dev`` (clsact + classic BPF).
    Returns tc's result; the caller decides whether a failure skips its test."""
    threshold = int((1 << 32) * percent / 100)
    # ld rand; jgt #threshold -> pass; ret SHOT; pass: ret OK
    code = f"4,32 0 0 {SKF_AD_RANDOM},37 1 0 {threshold},6 0 0 {TC_ACT_SHOT},6 0 0 {TC_ACT_OK}"
    tc = ["ip", "netns", "exec", ns, "tc"]
    added = subprocess.run(
        [*tc, "qdisc", "add", "dev", dev, "clsact"], capture_output=True, text=True, timeout=20
    )
    if added.returncode != 0:
        return added
    return subprocess.run(
        [*tc, "filter", "add", "dev", dev, "ingress", "bpf", "da", "bytecode", code],
        capture_output=True,
        text=True,
        timeout=20,
    )


def stop_dropping(ns: str, dev: str) -> None:
    subprocess.run(
        ["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "clsact"],
        capture_output=True,
        timeout=20,
    )


def tcp_retransmits(pid: int) -> int:
    """RetransSegs of the network namespace ``pid`` runs in."""
    with open(f"/proc/{pid}/net/snmp") as f:
        rows = [line.split() for line in f if line.startswith("Tcp:")]
    return int(rows[1][rows[0].index("RetransSegs")])


def listening_ports(pid: int, host: str) -> set[int]:
    """TCP ports listening on IPv4 ``host`` in the network namespace of ``pid``
    (gRPC listens on an IPv6 socket, as ``::ffff:host``)."""
    want = socket.inet_aton(host)[::-1].hex().upper()  # /proc prints each word host-order
    ports = set()
    for table, addr_hex in (("tcp", want), ("tcp6", "0000000000000000FFFF0000" + want)):
        with open(f"/proc/{pid}/net/{table}") as f:
            next(f)
            for line in f:
                fields = line.split()
                addr, _, port = fields[1].partition(":")
                if addr == addr_hex and fields[3] == "0A":  # TCP_LISTEN
                    ports.add(int(port, 16))
    return ports


def enter_netns(ns: str) -> None:
    """Move the calling thread (only) into network namespace ``ns``."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{ns}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({ns}): {os.strerror(err)}")
    finally:
        os.close(fd)


class DelayRelay:
    """Relays ``listen_host:port`` -> ``target_host:port`` for each port, inside
    ``ns``, delaying every byte by ``delay_s`` (settable while it runs)."""

    def __init__(
        self, ns: str, listen_host: str, target_host: str, ports: Sequence[int], delay_s: float
    ) -> None:
        self.delay_s = delay_s
        self.target_host = target_host
        self.connections = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        failed: list[BaseException] = []
        setup = threading.Thread(
            target=self._setup, args=(ns, listen_host, ports, failed), name="relay-setup"
        )
        setup.start()
        setup.join(10)
        if setup.is_alive() or failed:
            self.close()
            raise RuntimeError(f"relay in {ns} did not start: {failed or 'timed out'}")

    def _setup(self, ns: str, host: str, ports: Sequence[int], failed: list[BaseException]) -> None:
        try:
            enter_netns(ns)
            for port in ports:
                listener = socket.create_server((host, port))
                listener.settimeout(POLL_S)
                self._track(listener)
                self._spawn(self._accept, listener, port)
        except OSError as e:
            failed.append(e)

    def _track(self, *socks: socket.socket) -> None:
        with self._lock:
            self._sockets.extend(socks)

    def _spawn(self, target: Callable[..., None], *args: object) -> None:
        t = threading.Thread(target=target, args=args, daemon=True, name="relay")
        with self._lock:
            self._threads.append(t)
        t.start()

    def _accept(self, listener: socket.socket, port: int) -> None:
        while not self._stop.is_set():
            try:
                down, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed
            try:
                up = socket.create_connection((self.target_host, port), timeout=5)
            except OSError:
                down.close()
                continue
            self.connections += 1
            self._track(down, up)
            for src, dst in ((down, up), (up, down)):
                line: queue.Queue[tuple[float, bytes]] = queue.Queue()
                self._spawn(self._read, src, line)
                self._spawn(self._write, dst, line)

    def _read(self, src: socket.socket, line: queue.Queue[tuple[float, bytes]]) -> None:
        src.settimeout(POLL_S)
        while not self._stop.is_set():
            try:
                data = src.recv(CHUNK_BYTES)
            except TimeoutError:
                continue
            except OSError:
                data = b""
            line.put((time.monotonic() + self.delay_s, data))
            if not data:
                return

    def _write(self, dst: socket.socket, line: queue.Queue[tuple[float, bytes]]) -> None:
        while not self._stop.is_set():
            try:
                due, data = line.get(timeout=POLL_S)
            except queue.Empty:
                continue
            while (wait := due - time.monotonic()) > 0 and not self._stop.is_set():
                time.sleep(min(wait, POLL_S))
            if not data:  # the other side closed: pass it on, late like the bytes
                with contextlib.suppress(OSError):
                    dst.shutdown(socket.SHUT_WR)
                return
            view = memoryview(data)
            while view and not self._stop.is_set():
                try:  # send, not sendall: a timed-out sendall loses track of what went
                    view = view[dst.send(view) :]
                except TimeoutError:
                    continue  # a slow reader: flow control, not a fault
                except OSError:
                    return

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            socks, threads = list(self._sockets), list(self._threads)
        for s in socks:
            with contextlib.suppress(OSError):
                s.close()
        deadline = time.monotonic() + 10
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
