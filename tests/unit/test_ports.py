"""tierstore.cli.ports: ports the demo and the tests give their sidecars."""

from __future__ import annotations

import socket
from pathlib import Path

from tierstore.cli.ports import free_port


def test_ports_are_below_the_ephemeral_range_distinct_and_bindable() -> None:
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [free_port() for _ in range(64)]
    assert len(set(ports)) == len(ports)
    assert all(1024 <= p < low for p in ports), (min(ports), max(ports), low)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))  # free when handed out


def test_a_port_taken_is_never_handed_out() -> None:
    taken = []
    try:
        for _ in range(200):  # hold many, so that a free_port() draw must step around them
            s = socket.socket()
            s.bind(("127.0.0.1", free_port()))
            taken.append(s)
        held = {s.getsockname()[1] for s in taken}
        assert all(free_port() not in held for _ in range(50))
    finally:
        for s in taken:
            s.close()
