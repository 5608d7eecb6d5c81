"""systemd's readiness datagrams (tierstore.notify): sent to a path or an
abstract socket, nothing without NOTIFY_SOCKET, a dead socket never raises."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tierstore.notify import notify


def test_ready_reaches_a_path_socket(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "notify"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as rx:
        rx.bind(str(path))
        rx.settimeout(5)
        monkeypatch.setenv("NOTIFY_SOCKET", str(path))
        assert notify("READY=1")
        assert rx.recv(64) == b"READY=1"


def test_an_abstract_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    name = f"tierstore-test-{id(monkeypatch)}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as rx:
        rx.bind("\0" + name)
        rx.settimeout(5)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert notify("STOPPING=1")
        assert rx.recv(64) == b"STOPPING=1"


def test_without_systemd_nothing_is_sent_and_a_dead_socket_does_not_raise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert not notify("READY=1")
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "nobody"))
    assert not notify("READY=1")
