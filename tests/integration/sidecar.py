"""Start and stop real `tierstore serve` processes for integration tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tierstore.cli import ports
from tierstore.client import StoreClient
from tierstore.keys import KVLayout, chain_keys

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (see tierstore.cli.ports)."""
    return ports.free_port()


def serve_args(socket: Path, nvme_dir: Path, dram: str, nvme: str, *extra: str) -> list[str]:
    """The command line of a small test sidecar: tiny tiers, 64 KiB segments,
    no metrics port; ``extra`` flags go last (later flags win)."""
    return [
        sys.executable, "-m", "tierstore.cli", "serve",
        "--socket", str(socket), "--nvme-dir", str(nvme_dir),
        "--dram-bytes", dram, "--nvme-bytes", nvme, "--metrics-port", "0",
        "--set", "dram_segment_bytes=64KiB", "--set", "nvme_segment_bytes=64KiB",
        *extra,
    ]  # fmt: skip


class SidecarProcess:
    """A `tierstore serve` child with small tiers in ``root``."""

    def __init__(self, root: Path, *extra: str, dram: str = "1MiB", nvme: str = "8MiB") -> None:
        self.root = root
        self.socket = root / "s.sock"
        self.nvme_dir = root / "nvme"
        self.args = serve_args(self.socket, self.nvme_dir, dram, nvme, *extra)
        self.log = open(root / "sidecar.log", "ab")
        env = dict(os.environ, PYTHONPATH=str(REPO))
        self.proc = subprocess.Popen(self.args, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.wait_ready()

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.socket.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"sidecar exited {self.proc.returncode}: {self.output()}")
            if time.monotonic() > deadline:
                self.proc.kill()
                raise TimeoutError(f"sidecar not ready in {timeout_s}s: {self.output()}")
            time.sleep(0.05)

    def output(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return (self.root / "sidecar.log").read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()
        return self.proc.returncode


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
