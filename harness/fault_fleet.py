"""The fault bench's two-host fleet (bench/reliability/faults.py) and the faults
it injects, each with the probe that says when the fleet has recovered.

``FaultFleet`` is a context manager that starts, and on every exit path
stops: two network namespaces on a bridge (``harness.netns``; the root
namespace has ``ROOT_ADDR`` on it, where etcd and the bucket's proxy
listen), a real etcd (the sidecars' membership), a real SeaweedFS behind a
``FaultProxy`` (the remote tier), and one sidecar per host, peered through
etcd, with replicas streamed to the other host during each turn. Host 1's
NVMe tier lives on a tmpfs of ``DISK_BYTES`` where its sparse file has room
to grow, until the full-disk fault's ballast takes the room away.

Faults (``apply``/``clear`` by kind, see ``KINDS``): SIGKILL of a sidecar
and its restart on the same files (``kill_sidecar``); packet loss on both
hosts' links (a BPF filter, ``harness.relay.drop_random``: the kernel here
has no netem); added delay (the hosts' traffic to each other routed over a
``harness.relay.DelayLine``); a partition (host 1's link down); a full disk
(a ballast file fills the tmpfs); the bucket unreachable (the proxy refuses,
then swallows, connections); etcd SIGKILLed. ``recover`` waits, within a
deadline, for the probe of the kind's path: a pull across the link of a
chain only the other host holds, a spill after the full disk's cap lifted,
a durable EndTurn, both members seen in etcd again.
"""

from __future__ import annotations

import contextlib
import errno
import secrets
import subprocess
import time
from contextlib import ExitStack
from pathlib import Path

from tierstore.client import StoreClient
from tierstore.errors import TierstoreError
from tierstore.keys import BlockKey

from . import Started
from .etcd import EtcdProcess
from .netns import Network, ip
from .reaper import forget_mount, watch_mount
from .relay import DelayLine, drop_random, stop_dropping, tcp_retransmits
from .reliability import LAYOUT, SETTINGS, blocks_of, chain, count_wrong
from .seaweed import ACCESS_KEY, SECRET_KEY, FaultProxy, SeaweedFS
from .sidecar import SidecarProcess, remove_arenas

SUBNET, ROOT_ADDR = "10.203.0", "10.203.0.254"
PEER_PORT = 7710
TOKEN = "faults-token"
BUCKET = "tierstore-faults"
DRAM, NVME = "4MiB", "768MiB"
# Host 1's NVMe filesystem: room for its tier's sparse file to grow in, which
# the ballast of the full-disk fault takes away (the file is not at its
# budget by then: a slot the tier reuses needs no new room on the disk).
DISK_BYTES = 1 << 30
DELAY_S = 0.05  # added one-way delay (100 ms more round trip)
PARTITION_HOST = 1
RECOVER_TIMEOUT_S = 60.0
PROBE_BLOCKS = 64
KINDS = ("kills", "disk_full", "bucket_down", "etcd_down", "loss_1pct", "loss_5pct", "delay",
         "partition")  # fmt: skip
TUNS = ("tsfltd0", "tsfltd1")


class FaultFleet(Started):
    """See the module docstring. ``sidecars[i]`` is host i's; ``sockets`` their paths."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.stack = ExitStack()
        self.sidecars: list[SidecarProcess] = []
        self.restart_s: list[float] = []  # a killed sidecar's spawn to serving
        self._line: DelayLine | None = None
        self.delayed_packets = 0  # carried by the delay lines closed so far
        self._probe_seq = 0
        self.last_probe = ""  # what the last recovery probe saw

    @property
    def sockets(self) -> list[str]:
        return [str(sc.socket) for sc in self.sidecars]

    def _start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.credentials = self.root / "s3-credentials"  # not this process's environment
        self.credentials.write_text(
            f"[default]\naws_access_key_id = {ACCESS_KEY}\naws_secret_access_key = {SECRET_KEY}\n"
        )
        held = ip("-o", "addr", "show", "to", ROOT_ADDR).stdout.split()
        if held:  # two fleets on one subnet would route each other's traffic
            raise RuntimeError(f"{ROOT_ADDR} is taken ({held[1]}): another fault fleet runs here")
        self.net = self.stack.enter_context(
            Network(2, subnet=SUBNET, root_addr=ROOT_ADDR, prefix="tsflt")
        )
        (self.root / "etcd").mkdir(exist_ok=True)
        self.etcd = EtcdProcess(self.root / "etcd", host=ROOT_ADDR)
        self.stack.callback(self.etcd.stop)
        self.seaweed = SeaweedFS(self.root / "s3")
        self.stack.callback(self.seaweed.stop)
        self.seaweed.start()
        self.seaweed.create_bucket(BUCKET)
        self.proxy = FaultProxy(self.seaweed.s3_port, host=ROOT_ADDR)
        self.stack.callback(self.proxy.close)
        self.disk = self.root / "disk1"
        self.disk.mkdir(parents=True, exist_ok=True)
        watch_mount(str(self.disk))  # unmounted even if the bench is SIGKILLed
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK_BYTES},mode=0700", "tmpfs",
                        str(self.disk)], check=True, timeout=30)  # fmt: skip
        self.stack.callback(self._unmount)
        self.url = f"s3://{BUCKET}/run-{secrets.token_hex(6)}"
        membership = f"etcd://{self.etcd.endpoint}/faults"
        for i in range(2):
            self.sidecars.append(self._sidecar(i, membership))
        self.stack.callback(self._teardown_faults)

    def _unmount(self) -> None:
        subprocess.run(["umount", "-l", str(self.disk)], check=False, timeout=30)
        forget_mount(str(self.disk))

    def _sidecar(self, i: int, membership: str) -> SidecarProcess:
        addr = self.net.addr[i]
        sc = SidecarProcess(
            self.root / f"host{i}", dram=DRAM, nvme=NVME, netns=self.net.ns[i],
            nvme_dir=self.disk / "nvme" if i == PARTITION_HOST else None, die_with_parent=True,
            settings=(
                *SETTINGS, "log_level=warning", f"peer_host={addr}", f"peer_port={PEER_PORT}",
                f"peer_token={TOKEN}", f"membership={membership}", "membership_ttl_s=3",
                "membership_timeout_s=1", "peer_lookup_timeout_s=1", "fetch_timeout_s=3",
                "min_tokens=256", "stream_replicas=true", "compression=none",
                *self.remote_settings(), "remote_request_timeout_s=2", "remote_connect_timeout_s=1",
                "remote_max_retries=1", "remote_min_tokens=512", "remote_lookup_timeout_s=1",
                "remote_upload_backoff_max_s=1", "nvme_full_backoff_s=0.2",
            ),
        )  # fmt: skip
        sc.start(timeout_s=60.0)
        self.stack.callback(sc.stop, timeout_s=20.0)
        return sc

    def remote_settings(self) -> tuple[str, ...]:
        return (
            f"remote_url={self.url}", f"remote_endpoint={self.proxy.endpoint}",
            "remote_region=us-east-1", f"remote_credentials_file={self.credentials}",
        )  # fmt: skip

    def client(self, i: int) -> StoreClient:
        """A probe's client of host i (bounded connect and calls)."""
        return StoreClient(self.sockets[i], connect_timeout_s=2.0, call_timeout_s=10.0)

    def counters(self, i: int) -> dict[str, int]:
        """Host i's sidecar counters, and the TCP segments its namespace
        retransmitted (``tcp_retransmits``); {} while it does not answer."""
        with contextlib.suppress(Exception):
            c = self.sidecars[i].counters()
            c["tcp_retransmits"] = tcp_retransmits(self.sidecars[i].pid)
            c["delay_line_packets"] = self.delayed_packets
            return c
        return {}

    # -- kills ---------------------------------------------------------------------------

    def kill_sidecar(self, i: int) -> float:
        """SIGKILL host i's sidecar, start it again on its files: seconds to serving."""
        sc = self.sidecars[i]
        remove_arenas(sc.kill())
        took = sc.start(timeout_s=60.0)
        self.restart_s.append(took)
        return took

    # -- faults ---------------------------------------------------------------------------

    def apply(self, kind: str) -> None:
        ns, dev = self.net.ns, self.net.dev
        if kind in ("loss_1pct", "loss_5pct"):
            pct = 1.0 if kind == "loss_1pct" else 5.0
            for i in range(2):
                done = drop_random(ns[i], dev[i], pct)
                if done.returncode != 0:
                    raise RuntimeError(f"tc refused the loss filter on {dev[i]}: {done.stderr}")
        elif kind == "delay":
            for i, tun in enumerate(TUNS):
                ip("-n", ns[i], "tuntap", "add", "dev", tun, "mode", "tun")
                ip("-n", ns[i], "link", "set", tun, "up")
            self._line = DelayLine([(ns[0], TUNS[0]), (ns[1], TUNS[1])], DELAY_S)
            for i, tun in enumerate(TUNS):  # a host route beats the subnet's
                other = self.net.addr[1 - i]
                ip("-n", ns[i], "route", "add", f"{other}/32", "dev", tun, "src", self.net.addr[i])
        elif kind == "partition":
            self.net.set_up(PARTITION_HOST, False)
        elif kind == "disk_full":
            fill(self.disk / "ballast")
        elif kind == "bucket_down":
            self.proxy.set_mode("refuse")
        elif kind == "etcd_down":
            self.etcd.kill()
        else:
            raise ValueError(f"unknown fault kind {kind!r}")

    def worsen(self, kind: str) -> None:
        """Half-way through the hold: the bucket stops answering at all."""
        if kind == "bucket_down":
            self.proxy.set_mode("blackhole")

    def clear(self, kind: str) -> None:
        ns, dev = self.net.ns, self.net.dev
        if kind in ("loss_1pct", "loss_5pct"):
            for i in range(2):
                stop_dropping(ns[i], dev[i])
        elif kind == "delay":
            for i, tun in enumerate(TUNS):
                ip("-n", ns[i], "link", "del", tun, check=False)  # takes its route with it
            if self._line is not None:
                self._line.close()
                self.delayed_packets += self._line.packets
                self._line = None
        elif kind == "partition":
            self.net.set_up(PARTITION_HOST, True)
        elif kind == "disk_full":
            (self.disk / "ballast").unlink(missing_ok=True)
        elif kind == "bucket_down":
            self.proxy.set_mode("pass")
        elif kind == "etcd_down":
            self.etcd.start()

    def _teardown_faults(self) -> None:
        for kind in KINDS[1:]:
            with contextlib.suppress(Exception):
                self.clear(kind)

    # -- recovery -------------------------------------------------------------------------

    def recover(self, kind: str, before: dict[str, int]) -> tuple[float, dict[str, int]]:
        """Seconds until the probe of ``kind``'s path succeeds (raises past the
        deadline), and the blocks the probes checked and found wrong."""
        t0 = time.monotonic()
        checked = {"checked": 0, "wrong": 0}
        probe = {
            "disk_full": lambda: self._spilled_again(before),
            "bucket_down": self._durable_turn,
            "etcd_down": self._members_back,
        }.get(kind, lambda: self._pull_across(checked))
        while not probe():
            if time.monotonic() - t0 > RECOVER_TIMEOUT_S:
                raise TimeoutError(
                    f"{kind}: not recovered in {RECOVER_TIMEOUT_S} s; last probe: {self.last_probe}"
                )
            time.sleep(0.1)
        return time.monotonic() - t0, checked

    def _next_chain(self, n: int = PROBE_BLOCKS) -> list[BlockKey]:
        self._probe_seq += 1
        return chain(900_000_000 + self._probe_seq, n)

    def _pull_across(self, checked: dict[str, int]) -> bool:
        """A chain stored on host 1 loads whole on host 0, pulled over the link."""
        keys = self._next_chain()
        try:
            with self.client(1) as b:
                if not all(b.store(LAYOUT, keys, blocks_of(keys))):
                    self.last_probe = "host 1 refused the probe's store"
                    return False
            with self.client(0) as a:
                res = a.load(LAYOUT, keys, include_peers=True, deadline_s=3.0)
        except TierstoreError as e:
            self.last_probe = str(e)
            return False
        checked["checked"] += res.num_blocks
        checked["wrong"] += count_wrong(keys, res.blocks, res.num_blocks)
        self.last_probe = f"pulled {res.num_blocks} of {len(keys)} blocks"
        return res.num_blocks == len(keys)

    def _spilled_again(self, before: dict[str, int]) -> bool:
        """The full tier looked again and lifted its cap (or was never capped)."""
        c = self.counters(PARTITION_HOST)
        capped = c.get("nvme_full_events", 0) > before.get("nvme_full_events", 0)
        self.last_probe = f"capped {capped}, resumed {c.get('nvme_full_resumed')}"
        return bool(c) and (not capped or c.get("nvme_full_resumed", 0) > before.get(
            "nvme_full_resumed", 0))  # fmt: skip

    def _durable_turn(self) -> bool:
        keys = self._next_chain(8)
        try:
            with self.client(0) as a:
                a.store(LAYOUT, keys, blocks_of(keys))
                reply = a.end_turn("probe", LAYOUT, keys, len(keys) * LAYOUT.block_tokens,
                                   durable=True, durable_timeout_s=2.0)  # fmt: skip
        except TierstoreError as e:
            self.last_probe = str(e)
            return False
        self.last_probe = f"durable EndTurn: {reply.durable} ({reply.not_durable_reason})"
        return bool(reply.durable)

    def _members_back(self) -> bool:
        seen = [self.counters(i) for i in range(2)]
        up = [c.get("membership_etcd_up", 0) for c in seen]
        members = [c.get("membership_members", 0) for c in seen]
        self.last_probe = f"etcd up per host {up}, members seen {members}"
        return all(up) and min(members) >= 2

    def fresh_host(self) -> SidecarProcess:
        """A new host on empty disks, the same bucket, no peers (the durable audit)."""
        sc = SidecarProcess(
            self.root / "fresh", dram="64MiB", nvme="256MiB", die_with_parent=True,
            settings=(*SETTINGS, "log_level=warning", *self.remote_settings(),
                      "remote_fetch_timeout_s=30"),
        )  # fmt: skip
        sc.start(timeout_s=60.0)
        self.stack.callback(sc.stop, timeout_s=20.0)
        return sc


def fill(path: Path) -> int:
    """Write zeros to ``path`` until its filesystem is full; the bytes written."""
    chunk = bytes(1 << 20)
    written = 0
    with open(path, "wb", buffering=0) as f:
        while True:
            try:
                written += f.write(chunk)
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
                break
            if written > 1 << 34:  # a bound: no tmpfs here is this large
                break
    return written
