"""``tierstore serve`` under systemd's Type=notify: READY=1 once its socket
answers, STOPPING=1 at SIGTERM (deploy/systemd/tierstore.service relies on it)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from harness.sidecar import SidecarProcess


def test_the_sidecar_says_ready_then_stopping(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "notify"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as rx:
        rx.bind(str(path))
        rx.settimeout(30)
        monkeypatch.setenv("NOTIFY_SOCKET", str(path))
        sc = SidecarProcess(tmp_path / "sc", dram="4MiB", nvme="8MiB")
        sc.start()
        try:
            assert rx.recv(64) == b"READY=1"
            assert sc.stat().tiers  # it serves by then
        finally:
            sc.stop()
        assert rx.recv(64) == b"STOPPING=1"
