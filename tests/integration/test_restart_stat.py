"""What an operator sees of writes, drains and the arena: ``tierstore stat``
(table and JSON) and ``/metrics`` show the write policy and its queue, the
arena's page size, populated and huge-page shares and lock, and after a
graceful restart the last drain's figures."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import numpy as np

from harness import REPO
from harness.sidecar import start_sidecar
from tierstore.cli.ports import free_port
from tierstore.client import StoreClient
from tierstore.keys import chain_keys

from ..conftest import SMALL_LAYOUT


def stat_cli(socket: Path, *flags: str) -> str:
    cli = [sys.executable, "-m", "tierstore.cli", "stat", "--socket", str(socket), *flags]
    done = subprocess.run(cli, capture_output=True, text=True, timeout=60, cwd=REPO, check=True)
    return done.stdout


def test_stat_and_metrics_show_writes_drain_and_arena(tmp_path: Path) -> None:
    keys = chain_keys(SMALL_LAYOUT, np.arange(8 * 20))
    data = np.random.default_rng(0).integers(0, 255, (20, SMALL_LAYOUT.block_bytes), np.uint8)
    port = free_port()
    proc = start_sidecar(
        tmp_path, "--metrics-port", str(port), "--set", "write_policy=write_through",
        dram="4MiB",
    )  # fmt: skip
    try:
        with StoreClient(str(proc.socket)) as client:
            assert all(client.store(SMALL_LAYOUT, keys, data))
            table = stat_cli(proc.socket)
            assert "writes    policy write_through  queued 20" in table, table
            assert "arena     pages 4 KiB" in table or "arena     pages 2048 KiB" in table, table
            stat = json.loads(stat_cli(proc.socket, "--json"))
            assert stat["info"]["write_policy"] == "write_through"
            c = stat["counters"]
            assert c["write_queued"] == 20 and c["arena_bytes"] == 4 << 20
            assert 0 < c["arena_populated_bytes"] <= c["arena_bytes"]
            # Root here: the arena is locked (dram_lock = "auto"), and stat says how much.
            assert c["arena_locked_bytes"] >= c["arena_bytes"]
            assert f"locked {c['arena_locked_bytes'] / 2**20:.0f} MiB" in table, table
            # The sidecar's own mapping; on a /dev/shm without huge= (here): no huge pages.
            assert "arena_huge_bytes" in c
            if c["arena_page_bytes"] == 4096:
                assert c["arena_huge_bytes"] == 0 and "  no huge pages  " in table, table
            assert c["write_queue_bound_bytes"] == 256 << 20
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
                text = r.read().decode()
            assert 'tierstore_settings_info{arena_lock="locked as faulted in",arena_page="' in text
            assert 'write_policy="write_through"' in text
            assert "# TYPE tierstore_write_queue_bytes gauge" in text
            assert "# TYPE tierstore_arena_populated_bytes gauge" in text
            assert "# TYPE tierstore_arena_locked_bytes gauge" in text
            assert "# TYPE tierstore_arena_huge_bytes gauge" in text
            assert "tierstore_write_queued_total 20.0" in text
    finally:
        assert proc.stop() == 0
    again = start_sidecar(tmp_path, "--set", "write_policy=write_back", dram="4MiB")
    try:
        with StoreClient(str(again.socket)) as client:
            assert client.lookup(SMALL_LAYOUT, keys).num_hits == 20
            table = stat_cli(again.socket)
            # What write-through had not written yet, the stop's drain did.
            assert re.search(r"drain     last stop wrote \d+ blocks .* dropped 0 ", table), table
            assert "writes    policy write_back" in table
            assert "last_drain_blocks" in json.loads(stat_cli(again.socket, "--json"))["counters"]
    finally:
        again.stop()
