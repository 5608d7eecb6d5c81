"""A small synchronous client of etcd's v3 gRPC API, for group membership.

Provides ``EtcdClient``: ``range_prefix``, ``put``, ``delete``,
``grant``/``keepalive``/``revoke`` of leases and ``watch_prefix`` (a stream
of events, cancellable), over several endpoints (the next one is tried when
one is unreachable), with TLS and etcd's user/password authentication (the
credentials come from a file; the token etcd hands out is renewed when it
expires). Every unary call has a deadline (``membership_timeout_s``).

Why our own stubs (``tierstore/v1/etcd_rpc_pb2*``, from
``proto/tierstore/v1/etcd_rpc.proto``) rather than a PyPI client
(``bench/membership/etcd_clients.py`` measures them on one real etcd; docs/benchmarks.md):
python-etcd3 fails to import under protobuf >= 4; etcd-sdk-python is as fast
but refuses every call for 300 s after one failed call and never logs in
again after an etcd restart; etcd-client-py drops the lease id, so a member
cannot register under a lease; etcd3gw (JSON over etcd's HTTP gateway) is 3x
slower a put and 9x a 300-key range and adds ten packages. These stubs need
nothing beyond the grpcio and protobuf we already pin.

Used by ``tierstore.membership.etcd`` in the sidecar and the router; no
store import. Thread-safe: gRPC stubs are, and the endpoint and token state
is under a lock.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc

from tierstore.errors import ConfigError
from tierstore.v1 import etcd_rpc_pb2 as pb
from tierstore.v1 import etcd_rpc_pb2_grpc as pb_grpc

T = TypeVar("T")

# etcd refuses client pings more often than its --grpc-keepalive-min-time
# (5 s by default) with GOAWAY; 10 s stays clear of it and still notices a
# dead connection under a watch stream within about 10 s + timeout.
KEEPALIVE_TIME_MS = 10_000
FAILOVER_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def prefix_end(prefix: bytes) -> bytes:
    """The range_end that makes [prefix, end) every key starting with ``prefix``."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"  # all keys


@dataclass(frozen=True)
class EtcdAuth:
    """Where etcd is and how to speak to it (nothing secret is kept here
    beyond what the credentials file holds)."""

    endpoints: tuple[str, ...]
    tls: bool = False
    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""
    credentials_file: str = ""  # "user:password" on its first line

    def credentials(self) -> tuple[str, str] | None:
        if not self.credentials_file:
            return None
        try:
            line = Path(self.credentials_file).read_text().splitlines()[0].strip()
        except (OSError, IndexError) as e:
            raise ConfigError(
                f"cannot read membership_credentials_file {self.credentials_file}: {e}"
            ) from e
        user, sep, password = line.partition(":")
        if not sep or not user:
            raise ConfigError(
                f"membership_credentials_file {self.credentials_file}: expected user:password"
            )
        return user, password


class WatchStream:
    """One open Watch call: iterate for ``WatchResponse``s; ``cancel`` ends
    it from any thread (the iteration then raises grpc.RpcError CANCELLED)."""

    def __init__(self, open_call: Callable[[Iterator[pb.WatchRequest]], Any],
                 create: pb.WatchCreateRequest, endpoint: str) -> None:  # fmt: skip
        self.endpoint = endpoint
        self._done = threading.Event()

        def requests() -> Iterator[pb.WatchRequest]:
            yield pb.WatchRequest(create_request=create)
            # Keep the request side open until the call ends, without a
            # thread spinning: grpc consumes this iterator on its own thread.
            self._done.wait()

        self._call = open_call(requests())

    def __iter__(self) -> Iterator[pb.WatchResponse]:
        try:
            yield from self._call
        finally:
            self._done.set()

    def cancel(self) -> None:
        self._done.set()
        self._call.cancel()


class EtcdClient:
    """etcd's KV, Lease, Watch and Auth services over one of ``endpoints``."""

    def __init__(self, auth: EtcdAuth, timeout_s: float) -> None:
        if not auth.endpoints:
            raise ConfigError("membership: no etcd endpoints")
        self.auth = auth
        self.timeout_s = timeout_s
        self._credentials = auth.credentials()  # read once: a bad file fails at start
        self._lock = threading.Lock()
        self._index = 0
        self._channels: dict[str, grpc.Channel] = {}
        self._token = ""
        self._closed = False

    # -- endpoints, channels and the auth token -----------------------------------------

    @property
    def endpoint(self) -> str:
        with self._lock:
            return self.auth.endpoints[self._index]

    def _channel(self) -> grpc.Channel:
        with self._lock:
            if self._closed:
                raise ValueError("EtcdClient is closed")
            endpoint = self.auth.endpoints[self._index]
            ch = self._channels.get(endpoint)
            if ch is None:
                ch = self._open(endpoint)
                self._channels[endpoint] = ch
            return ch

    def _open(self, endpoint: str) -> grpc.Channel:
        options: list[tuple[str, Any]] = [
            ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
            ("grpc.keepalive_timeout_ms", max(int(self.timeout_s * 1000), 1000)),
            ("grpc.http2.max_pings_without_data", 0),
            ("grpc.initial_reconnect_backoff_ms", 200),
            ("grpc.max_reconnect_backoff_ms", 2000),
        ]
        if not self.auth.tls:
            return grpc.insecure_channel(endpoint, options=options)
        a = self.auth
        creds = grpc.ssl_channel_credentials(
            root_certificates=Path(a.ca_file).read_bytes() if a.ca_file else None,
            private_key=Path(a.key_file).read_bytes() if a.key_file else None,
            certificate_chain=Path(a.cert_file).read_bytes() if a.cert_file else None,
        )
        return grpc.secure_channel(endpoint, creds, options=options)

    def _failover(self, endpoint: str) -> None:
        """The endpoint that just failed: move on to the next (once per failure)."""
        with self._lock:
            if self.auth.endpoints[self._index] == endpoint:
                self._index = (self._index + 1) % len(self.auth.endpoints)

    def _metadata(self, channel: grpc.Channel) -> tuple[tuple[str, str], ...]:
        if self._credentials is None:
            return ()
        with self._lock:
            token = self._token
        if not token:
            user, password = self._credentials
            reply = pb_grpc.AuthStub(channel).Authenticate(
                pb.AuthenticateRequest(name=user, password=password), timeout=self.timeout_s
            )
            token = reply.token
            with self._lock:
                self._token = token
        return (("token", token),)

    def _call(self, fn: Callable[[grpc.Channel, tuple[tuple[str, str], ...]], T]) -> T:
        """Run ``fn(channel, metadata)``; an unreachable endpoint moves to the
        next one for the following call; an expired token is renewed once."""
        endpoint = self.endpoint
        channel = self._channel()
        try:
            try:
                return fn(channel, self._metadata(channel))
            except grpc.RpcError as e:
                if self._credentials is None or e.code() != grpc.StatusCode.UNAUTHENTICATED:
                    raise
                with self._lock:
                    self._token = ""
                return fn(channel, self._metadata(channel))
        except grpc.RpcError as e:
            if e.code() in FAILOVER_CODES:
                self._failover(endpoint)
            raise

    # -- KV -----------------------------------------------------------------------------

    def range_prefix(self, prefix: bytes) -> pb.RangeResponse:
        req = pb.RangeRequest(key=prefix, range_end=prefix_end(prefix))
        return self._call(
            lambda ch, md: pb_grpc.KVStub(ch).Range(req, timeout=self.timeout_s, metadata=md)
        )

    def put(self, key: bytes, value: bytes, lease: int = 0) -> pb.PutResponse:
        req = pb.PutRequest(key=key, value=value, lease=lease)
        return self._call(
            lambda ch, md: pb_grpc.KVStub(ch).Put(req, timeout=self.timeout_s, metadata=md)
        )

    def delete(self, key: bytes) -> pb.DeleteRangeResponse:
        req = pb.DeleteRangeRequest(key=key)
        return self._call(
            lambda ch, md: pb_grpc.KVStub(ch).DeleteRange(req, timeout=self.timeout_s, metadata=md)
        )

    # -- leases ---------------------------------------------------------------------------

    def grant(self, ttl_s: int) -> pb.LeaseGrantResponse:
        req = pb.LeaseGrantRequest(TTL=ttl_s)
        return self._call(
            lambda ch, md: pb_grpc.LeaseStub(ch).LeaseGrant(
                req, timeout=self.timeout_s, metadata=md
            )
        )

    def keepalive(self, lease: int) -> int:
        """Renew ``lease`` once: its new TTL in seconds (<= 0: it expired).
        One short stream per renewal, so every renewal has a deadline (a
        long-lived stream's reads have none in synchronous gRPC)."""
        req = pb.LeaseKeepAliveRequest(ID=lease)

        def once(ch: grpc.Channel, md: tuple[tuple[str, str], ...]) -> int:
            call = pb_grpc.LeaseStub(ch).LeaseKeepAlive(
                iter([req]), timeout=self.timeout_s, metadata=md
            )
            try:
                for reply in call:
                    return int(reply.TTL)
            finally:
                call.cancel()
            return 0  # the stream ended without an answer: treat the lease as gone

        return self._call(once)

    def revoke(self, lease: int) -> None:
        req = pb.LeaseRevokeRequest(ID=lease)
        self._call(
            lambda ch, md: pb_grpc.LeaseStub(ch).LeaseRevoke(
                req, timeout=self.timeout_s, metadata=md
            )
        )

    # -- watch ----------------------------------------------------------------------------

    def watch_prefix(self, prefix: bytes, start_revision: int) -> WatchStream:
        """Events on keys under ``prefix`` from ``start_revision`` on."""
        create = pb.WatchCreateRequest(
            key=prefix, range_end=prefix_end(prefix), start_revision=start_revision
        )
        endpoint = self.endpoint
        channel = self._channel()
        try:
            md = self._metadata(channel)
        except grpc.RpcError as e:
            if e.code() in FAILOVER_CODES:
                self._failover(endpoint)
            raise
        stub = pb_grpc.WatchStub(channel)
        return WatchStream(lambda reqs: stub.Watch(reqs, metadata=md), create, endpoint)

    def failed(self, endpoint: str) -> None:
        """A stream on ``endpoint`` broke: the next call tries another one."""
        self._failover(endpoint)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            channels = list(self._channels.values())
            self._channels.clear()
        for ch in channels:
            ch.close()
