"""NvmeTier survives SIGKILL at any moment: every block it indexes afterwards
reads back verified and byte-exact.

A child process writes batches of deterministic blocks (the block's number is
in its key, its bytes come from a PRNG seeded with that number) into a small
tier, so eviction runs all the time. The parent kills it at random moments,
reopens the tier and checks every indexed block.
"""

from __future__ import annotations

import logging
import os
import queue
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from tierstore.errors import StorageError
from tierstore.store.nvme.tier import NvmeTier

REPO = Path(__file__).resolve().parents[2]
CAPACITY = 2 << 20
SEGMENT = 64 << 10
FP = b"L" * 32
BATCH = 8
WAIT_S = 20.0

WRITER = textwrap.dedent(
    """
    import sys
    import numpy as np
    from tierstore.store.nvme.tier import NvmeTier

    root, first = sys.argv[1], int(sys.argv[2])
    tier = NvmeTier(root, {capacity}, segment_bytes={segment})
    print("open", flush=True)
    number = first
    while True:
        batch = []
        for _ in range({batch}):
            rng = np.random.default_rng(number)
            size = int(rng.integers(1, 100_000))
            data = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
            key = number.to_bytes(8, "little") + bytes(24)
            batch.append((key, b"L" * 32, data))
            number += 1
        assert all(tier.write_many(batch)), "write failed"
        print(number, flush=True)
    """
).format(capacity=CAPACITY, segment=SEGMENT, batch=BATCH)


def expected_block(key: bytes) -> bytes:
    number = int.from_bytes(key[:8], "little")
    rng = np.random.default_rng(number)
    size = int(rng.integers(1, 100_000))
    return rng.integers(0, 256, size, dtype=np.uint8).tobytes()


class Writer:
    """The writer child and a thread that forwards its progress lines."""

    def __init__(self, root: Path, first: int) -> None:
        env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(root), str(first)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._forward, daemon=True).start()

    def _forward(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put("")  # end of output

    def wait_for_lines(self, count: int) -> None:
        """Wait for ``count`` progress lines; fail after WAIT_S in all."""
        deadline = time.monotonic() + WAIT_S
        for _ in range(count):
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"writer printed fewer than {count} lines in {WAIT_S} s")
            if not line:
                self.proc.kill()
                _, err = self.proc.communicate(timeout=WAIT_S)
                pytest.fail(f"writer exited with {self.proc.returncode}: {err}")

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.communicate(timeout=WAIT_S)


def check_every_block(root: Path) -> int:
    tier = NvmeTier(root, CAPACITY, segment_bytes=SEGMENT)
    try:
        keys = list(tier._entries)
        out = bytearray(100_000)
        for key in keys:
            expected = expected_block(key)
            assert tier.read_into(key, out) == len(expected), f"block {key[:8].hex()}"
            assert bytes(out[: len(expected)]) == expected
        stats = tier.stats()
        assert stats.verify_failures == 0 and stats.read_failures == 0
        assert stats.hits == len(keys) > 0
        # The tier keeps working after the crash: slots do not overlap.
        number = 10**9 + len(keys)
        key = number.to_bytes(8, "little") + bytes(24)
        assert tier.write_many([(key, FP, expected_block(key))]) == [True]
        assert tier.read_into(key, out) == len(expected_block(key))
        return len(keys)
    finally:
        tier.close()


@pytest.mark.slow
def test_sigkill_never_leaves_a_bad_block(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    rng = random.Random(1234)
    root = tmp_path / "nvme"
    for run in range(5):
        writer = Writer(root, first=run * 10**6)
        try:
            writer.wait_for_lines(1)  # opened
            if run == 0:
                pid = writer.proc.pid
                with pytest.raises(StorageError, match=rf"in use by .*\(pid {pid}\)"):
                    NvmeTier(root, CAPACITY, segment_bytes=SEGMENT)
            # Enough batches that the tier is full and evicting, then a random moment.
            writer.wait_for_lines(rng.randint(6, 30))
            time.sleep(rng.uniform(0, 0.05))
        finally:
            writer.kill()
        assert writer.proc.returncode == -signal.SIGKILL
        with caplog.at_level(logging.WARNING, logger="tierstore.store.nvme.tier"):
            assert check_every_block(root) > 0
        assert "dropped" not in caplog.text  # no row pointed outside its data file
