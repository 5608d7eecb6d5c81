"""Start, stop, kill and restart real ``tierstore serve`` children, for the
tests and the benchmarks alike.

Provides ``serve_args`` (the command line of a sidecar), ``SidecarProcess``
(one child with its files under a directory: start, wait until it answers
Stat, stop, SIGKILL, freeze and thaw, restart on the same files, its
counters, memory and log; optionally inside a network namespace),
``threads_not_stopped`` (what ``freeze`` waits on), ``start_sidecar``
(build and start one: the tests' one-liner), ``bench_sidecar`` (the single-host
benchmarks' sidecar for the length of a ``with`` block), and the helpers that
act on a running sidecar's tiers from outside (``push_out_of_dram``,
``overwrite_nvme_blocks``) or on the arenas a killed one leaves in /dev/shm.

Runs in the caller's process and thread; every wait is bounded and every
process started is stopped by its owner (``stop``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from tierstore.keys import KVLayout, chain_keys
from tierstore.v1 import local_pb2, local_pb2_grpc

from . import REPO, child_env
from .reaper import forget_process, watch_process

if TYPE_CHECKING:
    from tierstore.client import StoreClient

START_TIMEOUT_S = 30.0  # spawn to the first answered Stat
STOP_TIMEOUT_S = 30.0  # SIGTERM to exit, then SIGKILL
# The tests' sidecars: 64 KiB segments, so that tiers of a few MiB hold many.
SMALL_SEGMENTS = ("dram_segment_bytes=64KiB", "nvme_segment_bytes=64KiB")
# The benchmarks' sidecars: DRAM never spilled by the watermarks, quiet logs.
BENCH_SETTINGS = ("dram_segment_bytes=64MiB", "dram_high_watermark=1.0",
                  "dram_low_watermark=0.95", "log_level=warning")  # fmt: skip
# util-linux's setpriv sets the death signal and execs the sidecar in place. Not a
# preexec_fn: that makes subprocess fork() rather than vfork(), fork() runs gRPC's
# pthread_atfork handlers, and in a process whose gRPC channels are busy those can block
# forever (seen once: a fleet bench stuck 18 min in fork(), its next sidecar never started).
_DIE_WITH_PARENT = ("setpriv", "--pdeathsig", "TERM", "--")


def serve_args(
    socket: Path,
    nvme_dir: Path,
    dram: str,
    nvme: str,
    *extra: str,
    settings: tuple[str, ...] = SMALL_SEGMENTS,
) -> list[str]:
    """The command line of a sidecar with no metrics port: ``settings``
    (``name=value``) as ``--set`` flags, then ``extra`` flags (later flags win)."""
    args = [
        sys.executable, "-m", "tierstore.cli", "serve",
        "--socket", str(socket), "--nvme-dir", str(nvme_dir),
        "--dram-bytes", dram, "--nvme-bytes", nvme, "--metrics-port", "0",
    ]  # fmt: skip
    for setting in settings:
        args += ["--set", setting]
    return [*args, *extra]


def die_with_parent_prefix() -> tuple[str, ...]:
    """The command prefix that has the kernel SIGTERM a child when its parent
    dies, even by SIGKILL, so that no sidecar outlives a benchmark."""
    if sys.platform != "linux" or shutil.which(_DIE_WITH_PARENT[0]) is None:
        raise RuntimeError("die_with_parent needs Linux and util-linux's setpriv")
    return _DIE_WITH_PARENT


def arenas_of(pid: int) -> list[str]:
    """The /dev/shm arena files of the sidecar with ``pid``."""
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"tierstore-{pid}-")]


def remove_arenas(pid: int) -> list[str]:
    """Remove what ``arenas_of(pid)`` lists (a SIGKILLed sidecar cannot); returns the names."""
    removed = []
    for name in arenas_of(pid):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join("/dev/shm", name))
        removed.append(name)
    return removed


class SidecarProcess:
    """A ``tierstore serve`` child with its files under ``root``: the socket
    ``s.sock``, the NVMe tier in ``nvme/`` (or ``nvme_dir``), its output
    appended to ``sidecar.log``. ``start`` runs it (again, after ``kill`` or
    ``stop``, on the same files); ``netns`` runs it inside that network
    namespace (``ip netns exec``: the child is the sidecar itself);
    ``die_with_parent`` SIGTERMs it when the process that started it dies.
    Not thread-safe: one owner starts and stops it."""

    def __init__(
        self,
        root: Path,
        *extra: str,
        dram: str = "1MiB",
        nvme: str = "8MiB",
        nvme_dir: Path | None = None,
        settings: tuple[str, ...] = SMALL_SEGMENTS,
        netns: str | None = None,
        die_with_parent: bool = False,
    ) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.root = root
        self.socket = root / "s.sock"
        self.nvme_dir = nvme_dir or root / "nvme"
        self.log_path = root / "sidecar.log"
        self.netns = netns
        self.die_with_parent = die_with_parent
        self.args = serve_args(self.socket, self.nvme_dir, dram, nvme, *extra, settings=settings)
        self.procs: list[subprocess.Popen[bytes]] = []  # every child started, the last one live
        self.started_at = 0.0

    @property
    def proc(self) -> subprocess.Popen[bytes]:
        assert self.procs, "never started"
        return self.procs[-1]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def start(self, wait: bool = True, timeout_s: float = START_TIMEOUT_S) -> float:
        """Start; with ``wait``, return the seconds from spawn to the first answered Stat."""
        self.socket.unlink(missing_ok=True)  # a killed sidecar's socket must not look ready
        prefix = [*die_with_parent_prefix()] if self.die_with_parent else []
        if self.netns:
            prefix += ["ip", "netns", "exec", self.netns]
        with open(self.log_path, "ab") as log:
            self.started_at = time.monotonic()
            proc = subprocess.Popen(
                [*prefix, *self.args], cwd=REPO, env=child_env(), stdout=log,
                stderr=subprocess.STDOUT,
            )  # fmt: skip
        self.procs.append(proc)
        watch_process(proc.pid)
        return self.wait_serving(timeout_s) if wait else 0.0

    def alive(self) -> bool:
        return bool(self.procs) and self.proc.poll() is None

    def wait_serving(self, timeout_s: float = START_TIMEOUT_S) -> float:
        """Wait until the socket answers Stat: the seconds since ``start``.
        Raises RuntimeError if the child exits first, TimeoutError (the child
        killed) if ``timeout_s`` passes."""
        deadline = self.started_at + timeout_s
        while True:
            if not self.alive():
                raise RuntimeError(
                    f"sidecar exited {self.proc.returncode}: {self.output()[-3000:]}"
                )
            if self.socket.exists():
                with contextlib.suppress(grpc.RpcError):
                    self.stat(timeout_s=1.0)
                    return time.monotonic() - self.started_at
            if time.monotonic() > deadline:
                self.proc.kill()
                self.proc.wait(STOP_TIMEOUT_S)
                raise TimeoutError(f"sidecar not serving in {timeout_s} s: {self.output()[-3000:]}")
            time.sleep(0.02)

    def stat(self, timeout_s: float = 10.0) -> local_pb2.StatReply:
        with grpc.insecure_channel(f"unix:{self.socket}") as channel:
            stub = local_pb2_grpc.LocalServiceStub(channel)
            return stub.Stat(local_pb2.StatRequest(), timeout=timeout_s)

    def counters(self) -> dict[str, int]:
        return dict(self.stat().counters)

    def tier(self, name: str) -> Any:
        return next(t for t in self.stat().tiers if t.name == name)

    def pins(self) -> int:
        return sum(c.pins for c in self.stat().clients)

    def memory_kib(self) -> dict[str, int]:
        """VmRSS, VmHWM, RssAnon, RssFile, RssShmem of the sidecar (KiB)."""
        out: dict[str, int] = {}
        with contextlib.suppress(OSError), open(f"/proc/{self.pid}/status") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                    out[name] = int(value.split()[0])
        return out

    def output(self) -> str:
        """Everything the sidecar (each start of it) wrote to its log."""
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def freeze(self, timeout_s: float = 10.0) -> None:
        """SIGSTOP, and wait until every thread of it is stopped: the signal
        stops a process only as each thread takes it, and until the last one
        does, a thread already running can still answer a call (a test's
        "stalled peer" once answered a lookup, then hung the fetch after it).
        ``thaw`` (SIGCONT) lets it go on."""
        self.proc.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + timeout_s
        while (running := threads_not_stopped(self.pid)) and time.monotonic() < deadline:
            time.sleep(0.001)
        if running:
            raise RuntimeError(
                f"sidecar {self.pid}: threads {running} not stopped {timeout_s} s after SIGSTOP"
            )

    def thaw(self) -> None:
        """SIGCONT (after ``freeze``)."""
        self.proc.send_signal(signal.SIGCONT)

    def kill(self) -> int:
        """SIGKILL and reap; leaves the arena behind, as a real crash does. Returns the pid."""
        self.proc.kill()
        self.proc.wait(STOP_TIMEOUT_S)
        forget_process(self.proc.pid)
        return self.proc.pid

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = STOP_TIMEOUT_S) -> int:
        """Send ``sig`` (SIGKILL after ``timeout_s``) and reap; returns the exit
        status. The arenas of every child that died by a signal (which cannot
        remove its own) are removed; a clean exit's leftovers are not, so that
        a test can see them."""
        if self.procs and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(STOP_TIMEOUT_S)
        if self.procs:
            forget_process(self.proc.pid)
        for proc in self.procs:
            if proc.returncode is not None and proc.returncode < 0:
                remove_arenas(proc.pid)
        return self.proc.returncode if self.procs else 0


def threads_not_stopped(pid: int) -> list[int]:
    """The threads of ``pid`` not in the stopped state ("T"), by /proc."""
    running = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                state = f.read().rpartition(")")[2].split()[0]  # after "tid (comm)"
        except FileNotFoundError:  # the thread ended
            continue
        if state not in ("T", "t"):
            running.append(int(tid))
    return running


def start_sidecar(root: Path, *extra: str, **options: Any) -> SidecarProcess:
    """A started ``SidecarProcess(root, *extra, **options)``."""
    sidecar = SidecarProcess(root, *extra, **options)
    sidecar.start()
    return sidecar


@contextlib.contextmanager
def bench_sidecar(
    root: Path, dram_bytes: int, *settings: str, netns: str | None = None
) -> Iterator[Path]:
    """A benchmark's sidecar in ``root`` (1 GiB of NVMe, no metrics, DRAM never
    spilled by the watermarks) for the duration of the block; its socket is
    yielded. ``settings``: more ``name=value`` pairs; ``netns``: run inside
    that network namespace. Stopped (and its arena removed) even on error,
    and SIGTERMed if the benchmark dies."""
    sidecar = SidecarProcess(
        root, dram=str(dram_bytes), nvme="1GiB", settings=(*BENCH_SETTINGS, *settings),
        die_with_parent=True, netns=netns,
    )  # fmt: skip
    try:
        sidecar.start(timeout_s=60.0)
        yield sidecar.socket
    finally:
        if sidecar.procs:
            sidecar.stop(timeout_s=20.0)
            remove_arenas(sidecar.pid)


def push_out_of_dram(
    client: StoreClient, dram_bytes: int, block_tokens: int, batch: int = 16
) -> None:
    """Store zero blocks of a layout no engine uses, 1.5x a DRAM tier of
    ``dram_bytes``, so that every block stored before is pushed to NVMe."""
    filler = KVLayout("filler", 4, 2, 64, "bfloat16", block_tokens)
    n = dram_bytes * 3 // 2 // filler.block_bytes
    keys = chain_keys(filler, list(range(n * block_tokens)))
    for lo in range(0, n, batch):
        some = keys[lo : lo + batch]
        stored = client.store(filler, some, bytearray(len(some) * filler.block_bytes))
        assert all(stored), f"filler batch at block {lo} not stored: {stored}"


def overwrite_nvme_blocks(nvme_dir: Path) -> None:
    """Replace every byte of a sidecar's NVMe block file with random bytes,
    its index untouched (a corrupted disk: reads must fail verification)."""
    with open(Path(nvme_dir) / "blocks.dat", "r+b") as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(0)
        for _ in range(0, size, 1 << 20):
            f.write(os.urandom(1 << 20))
        f.flush()
        os.fsync(f.fileno())
