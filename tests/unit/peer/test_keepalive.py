"""Peer channels ping their server so that a connection that stopped
answering (a partition) is closed and replaced, and the peer server accepts
those pings: a server that allowed fewer would answer GOAWAY
(too_many_pings) and gRPC would back the pings off, which is the stall the
pings are there to end."""

from __future__ import annotations

from tierstore.peer.client import KEEPALIVE_OPTIONS, KEEPALIVE_SERVER_OPTIONS


def test_the_server_accepts_the_clients_pings() -> None:
    client, server = dict(KEEPALIVE_OPTIONS), dict(KEEPALIVE_SERVER_OPTIONS)
    assert client["grpc.keepalive_permit_without_calls"] == 1  # idle channels are watched too
    assert server["grpc.keepalive_permit_without_calls"] == 1
    ping_ms = int(client["grpc.keepalive_time_ms"])
    assert int(server["grpc.http2.min_recv_ping_interval_without_data_ms"]) <= ping_ms
    # A dead connection is given up within a few seconds, not TCP's minutes.
    assert ping_ms + int(client["grpc.keepalive_timeout_ms"]) <= 5000
