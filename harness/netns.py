"""Hosts as Linux network namespaces, joined by shaped links (needs root and
iproute2), for the tests and benchmarks that put sidecars, engines, etcd and
gateways on separate "machines" of one box.

Provides ``Shape`` (a link's egress: ``tc tbf`` rate, netem delay and loss),
``Network`` (N namespaces with an address each: two hosts joined by one veth
pair, or any number on a bridge in the root namespace, which then reaches
them all; shape, reshape, take links down, count bytes, run a command inside
a host; ``close`` removes everything and runs on every exit path), the
building blocks it uses (``ip``, ``tc``, ``add_namespace``,
``delete_namespace``), ``enter_netns`` (move the calling thread into a
namespace), ``run_in_netns`` (a function on a thread of its own moved
into one) and ``exit_on_signals`` (SIGTERM and SIGINT unwind ``with`` and
``finally`` blocks, so an interrupted benchmark still tears its namespaces
down).

netem is a kernel module some kernels lack (this project's CI kernel among
them): a delay or loss then raises ``ShapingUnsupported`` with tc's message;
harness/relay.py has loss (a BPF filter) and delay (a TUN wire)
that need no netem. Runs in the caller's thread; every command is bounded.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import signal
import subprocess
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any, TypeVar

from .reaper import forget_link, forget_netns, watch_link, watch_netns

CLONE_NEWNET = 0x40000000
_networks = itertools.count()  # networks made by this process
COMMAND_TIMEOUT_S = 20.0
T = TypeVar("T")


class ShapingUnsupported(RuntimeError):
    """The kernel refused a qdisc (netem missing, say): tc's message says why."""


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """``ip ARGS``; raises RuntimeError with its message when it fails and ``check``."""
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    if check and done.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


def tc(ns: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """``tc ARGS`` inside namespace ``ns``; raises as ``ip`` does."""
    done = subprocess.run(
        ["ip", "netns", "exec", ns, "tc", *args],
        capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S,
    )  # fmt: skip
    if check and done.returncode:
        raise RuntimeError(f"tc {' '.join(args)} (in {ns}): {done.stderr.strip()}")
    return done


def add_namespace(name: str) -> None:
    """A new network namespace with its loopback up."""
    ip("netns", "add", name)
    watch_netns(name)
    try:
        ip("-n", name, "link", "set", "lo", "up")
    except RuntimeError:
        delete_namespace(name)
        raise


def delete_namespace(name: str) -> None:
    """Remove ``name`` (and the devices in it, each veth's peer with it); no error if gone."""
    ip("netns", "del", name, check=False)
    forget_netns(name)


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


def run_in_netns(ns: str, fn: Callable[[], T]) -> T:
    """``fn()`` on a thread moved into network namespace ``ns`` (this
    process's other threads stay where they are); its result, or its error
    raised here."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            enter_netns(ns)
            out["result"] = fn()
        except BaseException as e:  # raised again on the caller's thread
            out["error"] = e

    thread = threading.Thread(target=run, name=f"in-{ns}")
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["result"]


def _raise_exit(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def exit_on_signals() -> None:
    """SIGTERM and SIGINT raise SystemExit in the main thread, so the
    ``finally`` blocks and ``with`` exits that remove namespaces still run."""
    signal.signal(signal.SIGTERM, _raise_exit)
    signal.signal(signal.SIGINT, _raise_exit)


@dataclass(frozen=True)
class Shape:
    """A link's egress shaping. ``rate`` in tc's units ("1gbit", "10gbit";
    None: unlimited) with a ``burst`` bucket and the ``latency`` a packet may
    queue; ``delay_s`` added one way and ``loss_percent`` of packets dropped
    (netem), both on egress: two hosts each shaped so see twice the delay as
    round-trip time."""

    rate: str | None = None
    burst: str = "256kb"
    latency: str = "50ms"
    delay_s: float = 0.0
    loss_percent: float = 0.0

    def apply(self, ns: str, dev: str) -> None:
        """Shape ``dev`` in ``ns`` (its root qdisc, which must be the default)."""
        if self.delay_s or self.loss_percent:
            netem = ["netem"]
            if self.delay_s:
                netem += ["delay", f"{self.delay_s * 1000:g}ms"]
            if self.loss_percent:
                netem += ["loss", f"{self.loss_percent:g}%"]
            done = tc(ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", *netem, check=False)
            if done.returncode:
                raise ShapingUnsupported(f"netem on {dev} in {ns}: {done.stderr.strip()}")
            parent = ["parent", "1:1", "handle", "10:"]
        else:
            parent = ["root"]
        if self.rate is not None:
            tc(ns, "qdisc", "add", "dev", dev, *parent, "tbf", "rate", self.rate,
               "burst", self.burst, "latency", self.latency)  # fmt: skip

    @staticmethod
    def clear(ns: str, dev: str) -> None:
        """Back to the default qdisc (no error if none was added)."""
        tc(ns, "qdisc", "del", "dev", dev, "root", check=False)


class Network:
    """``hosts`` namespaces, host i at ``addr[i]`` on ``dev[i]`` in ``ns[i]``.

    Two hosts are joined by one veth pair; more (or ``root_addr`` set) hang
    on a bridge in the root namespace, which then has ``root_addr`` on the
    hosts' subnet and reaches them all (a client, etcd or a gateway run
    there). ``shape`` applies to every host's egress. Names carry this
    process's pid, so that concurrent runs do not collide. ``close`` removes
    it all (idempotent); so does leaving its ``with`` block, and a failure
    part-way through the constructor."""

    def __init__(
        self,
        hosts: int = 2,
        shape: Shape | None = None,
        subnet: str = "10.200.0",
        prefix: str = "tsn",
        root_addr: str | None = None,
    ) -> None:
        assert 2 <= hosts <= 250
        # The pid and a count of this process's networks: the kernel removes a
        # deleted namespace's devices in the background, so a name used a
        # moment ago by the previous network may still exist.
        tag = f"{os.getpid() % 100000}n{next(_networks) % 100}"
        self.ns = [f"{prefix}{tag}h{i}" for i in range(hosts)]
        self.dev = [f"{prefix}{tag}v{i}" for i in range(hosts)]
        self.addr = [f"{subnet}.{i + 1}" for i in range(hosts)]
        self.bridge = f"{prefix}{tag}br" if hosts > 2 or root_addr else None
        self.root_addr = root_addr
        self._created: list[str] = []
        try:
            for ns in self.ns:
                add_namespace(ns)
                self._created.append(ns)
            if self.bridge is None:
                ip("link", "add", self.dev[0], "netns", self.ns[0], "type", "veth",
                   "peer", "name", self.dev[1], "netns", self.ns[1])  # fmt: skip
            else:
                self._add_bridge(subnet)
            for ns, dev, addr in zip(self.ns, self.dev, self.addr):
                ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
                ip("-n", ns, "link", "set", dev, "up")
                if shape is not None:
                    shape.apply(ns, dev)
        except BaseException:
            self.close()
            raise

    def _add_bridge(self, subnet: str) -> None:
        assert self.bridge is not None
        ip("link", "add", self.bridge, "type", "bridge")
        watch_link(self.bridge)  # the namespaces take the veths with them, not the bridge
        self._created.append(self.bridge)
        for i, (ns, dev) in enumerate(zip(self.ns, self.dev)):
            port = f"{self.bridge}{i}"
            ip("link", "add", dev, "netns", ns, "type", "veth", "peer", "name", port)
            self._created.append(port)
            ip("link", "set", port, "master", self.bridge)
            ip("link", "set", port, "up")
        if self.root_addr is not None:
            routed = ip("-o", "route", "show", f"{subnet}.0/24").stdout.strip()
            if routed:  # a second route to the subnet would take the hosts' packets
                raise RuntimeError(
                    f"{subnet}.0/24 is already routed in the root namespace ({routed}): "
                    "a network another run left? `ip link del` its device"
                )
            ip("addr", "add", f"{self.root_addr}/24", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def prefix(self, i: int) -> list[str]:
        """The command prefix that runs a program inside host ``i`` (it execs the program)."""
        return ["ip", "netns", "exec", self.ns[i]]

    def run(self, i: int, *cmd: str, **kwargs: Any) -> subprocess.CompletedProcess[Any]:
        """``subprocess.run`` of ``cmd`` inside host ``i``."""
        kwargs.setdefault("timeout", COMMAND_TIMEOUT_S)
        return subprocess.run([*self.prefix(i), *cmd], **kwargs)

    def popen(self, i: int, cmd: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """``subprocess.Popen`` of ``cmd`` inside host ``i``: its pid is the program's."""
        return subprocess.Popen([*self.prefix(i), *cmd], **kwargs)

    def shape(self, i: int, shape: Shape | None) -> None:
        """Reshape host ``i``'s egress (None: unshaped)."""
        Shape.clear(self.ns[i], self.dev[i])
        if shape is not None:
            shape.apply(self.ns[i], self.dev[i])

    def set_up(self, i: int, up: bool) -> None:
        """Take host ``i``'s link down (a cable pulled) or bring it back."""
        ip("-n", self.ns[i], "link", "set", self.dev[i], "up" if up else "down")

    def tx_bytes(self, i: int) -> int:
        """Bytes host ``i`` has sent on its link."""
        out = self.run(i, "cat", f"/sys/class/net/{self.dev[i]}/statistics/tx_bytes",
                       capture_output=True, text=True, check=True)  # fmt: skip
        return int(out.stdout)

    def close(self) -> None:
        """Remove the namespaces (their veth ends take the peers with them) and the bridge."""
        while self._created:
            name = self._created.pop()
            if name in self.ns:
                delete_namespace(name)
            else:  # the bridge and its ports, at once (not when the kernel gets to them)
                with contextlib.suppress(RuntimeError):
                    ip("link", "del", name, check=False)
                if name == self.bridge:
                    forget_link(name)
