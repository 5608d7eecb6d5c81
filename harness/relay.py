"""Network faults this kernel has no qdisc for (tests/reliability/test_network.py,
bench/reliability/faults.py).

- ``drop_random``: real packet loss on a veth inside a test's namespace. netem
  is not built and neither nft nor iptables is installed, so a classic BPF
  program on the device's clsact *ingress* hook (cls_bpf in direct-action
  mode) drops each arriving packet with the given probability (``ld rand``).
  Ingress, not egress: a packet dropped on the sender's own egress is
  reported to its TCP stack, which just sends it again (no loss seen).
- ``DelayLine``: added latency the end hosts' TCP stacks see. This kernel
  has no netem, fq or etf (no qdisc that holds a packet until a time), and a
  classic BPF filter can only pass or drop. So the delay is a wire made of
  two TUN devices, one in each namespace, joined by this process: every IP
  packet that leaves one end is written into the other ``delay_s`` later, in
  order, in both directions. Packets, not bytes of a terminated connection:
  SYN, data and ACK each pay the delay, so a round trip costs ``2 * delay_s``
  and TCP's own RTT estimate, ACK clock and window growth see it (``ss -ti``
  shows the RTT). It models a long, fast, lossless path: no bandwidth limit
  beyond this process's forwarding (98 MB/s measured here, one connection
  without delay), no jitter, no reordering, no loss (unless its TUN queue
  overflows). It counts the TCP connections opened across it, per
  destination port (``connections``).
- ``listening_ports``: the TCP ports a process listens on at one address (to
  find a sidecar's ephemeral data port).

Threads: ``DelayLine`` opens each TUN device from a short setup thread that
enters its namespace (``setns`` applies per thread), then runs one forwarding
thread per direction. ``close`` ends them; every wait has a deadline.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import os
import select
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Sequence

from harness.netns import enter_netns

SKF_AD_RANDOM = (-0x1000 + 56) & 0xFFFFFFFF  # classic BPF ancillary load: a random u32
TC_ACT_OK, TC_ACT_SHOT = 0, 2
POLL_S = 0.1  # how often the delay line's threads look at the stop flag
TUNSETIFF, IFF_TUN_NO_PI = 0x400454CA, 0x0001 | 0x1000  # linux/if_tun.h
IPPROTO_TCP, TCP_SYN, TCP_ACK = 6, 0x02, 0x10
READ_BURST = 256  # packets read per wake-up before the due ones are written


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


class DelayLine:
    """A point-to-point IP link with ``delay_s`` (settable while it runs) added
    in each direction: see the module docstring. ``ends`` names the two TUN
    devices as (namespace, device); each must exist (``ip tuntap add``) and
    belongs to the caller, who also routes over it."""

    def __init__(self, ends: Sequence[tuple[str, str]], delay_s: float) -> None:
        assert len(ends) == 2
        self.delay_s = delay_s
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._syns: dict[int, set[tuple[bytes, int]]] = {}  # dst port -> (src addr, src port)
        self._fds: list[int] = []
        self._threads: list[threading.Thread] = []
        self._forwarded = [0, 0]  # packets carried, per direction (each thread its own)
        for ns, dev in ends:
            opened: list[int | BaseException] = []
            t = threading.Thread(target=self._open, args=(ns, dev, opened), name="delay-setup")
            t.start()
            t.join(10)
            if t.is_alive() or not opened or isinstance(opened[0], BaseException):
                self.close()
                raise RuntimeError(f"delay line cannot open {dev} in {ns}: {opened or 'timed out'}")
            assert isinstance(opened[0], int)
            self._fds.append(opened[0])
        for src, dst in ((0, 1), (1, 0)):
            t = threading.Thread(
                target=self._forward, args=(src, self._fds[src], self._fds[dst]), name="delay-line"
            )
            self._threads.append(t)
            t.start()

    @staticmethod
    def _open(ns: str, dev: str, opened: list[int | BaseException]) -> None:
        try:
            enter_netns(ns)  # TUNSETIFF finds ``dev`` in the calling thread's namespace
            fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
            try:
                fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH22x", dev.encode(), IFF_TUN_NO_PI))
            except OSError:
                os.close(fd)
                raise
            opened.append(fd)
        except OSError as e:
            opened.append(e)

    @property
    def packets(self) -> int:
        """IP packets carried across the line so far, both directions."""
        return sum(self._forwarded)

    def connections(self, port: int) -> int:
        """TCP connections opened across the line to ``port`` (distinct SYNs)."""
        with self._lock:
            return len(self._syns.get(port, ()))

    def _note(self, packet: bytes) -> None:
        """Count a TCP SYN (without ACK): a connection being opened."""
        if len(packet) < 20 or packet[0] >> 4 != 4 or packet[9] != IPPROTO_TCP:
            return
        tcp = packet[(packet[0] & 0xF) * 4 :]
        if len(tcp) >= 14 and tcp[13] & (TCP_SYN | TCP_ACK) == TCP_SYN:
            src_port, dst_port = struct.unpack_from("!HH", tcp)
            with self._lock:
                self._syns.setdefault(dst_port, set()).add((packet[12:16], src_port))

    def _forward(self, direction: int, src: int, dst: int) -> None:
        """Packets read from ``src`` are written to ``dst`` ``delay_s`` later, in order."""
        line: collections.deque[tuple[float, bytes]] = collections.deque()
        while not self._stop.is_set():
            wait = POLL_S if not line else min(POLL_S, max(0.0, line[0][0] - time.monotonic()))
            try:
                ready, _, _ = select.select([src], [], [], wait)
            except (OSError, ValueError):
                return  # closed
            for _ in range(READ_BURST if ready else 0):
                try:
                    packet = os.read(src, 1 << 16)
                except BlockingIOError:
                    break
                except OSError:
                    return
                self._note(packet)
                line.append((time.monotonic() + self.delay_s, packet))
            now = time.monotonic()
            while line and line[0][0] <= now:
                with contextlib.suppress(OSError):  # the far end is down: lost, as on a wire
                    os.write(dst, line.popleft()[1])
                    self._forwarded[direction] += 1

    def close(self) -> None:
        self._stop.set()
        deadline = time.monotonic() + 10
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        for fd in self._fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds = []
