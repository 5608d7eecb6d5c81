"""Authentication of the peer and router ports: the group token (checked
before any handler runs, in constant time) and the TLS contexts.

Shared by the peer service and the router service; imports no store.
"""

from __future__ import annotations

import hmac
import ipaddress
import socket
import ssl
from collections.abc import Callable
from typing import Any

import grpc

from tierstore.config.peer import PeerConfig


class TokenAuth(grpc.ServerInterceptor):
    """Refuses every call whose metadata lacks the group token."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

        def deny(request: Any, context: grpc.ServicerContext) -> Any:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong peer token")

        self._deny = grpc.unary_unary_rpc_method_handler(deny)

    def intercept_service(
        self, continuation: Callable[[Any], Any], handler_call_details: Any
    ) -> Any:
        for key, value in handler_call_details.invocation_metadata or ():
            if key == "authorization":
                given = value.encode() if isinstance(value, str) else value
                if hmac.compare_digest(given, self._expected):
                    return continuation(handler_call_details)
        return self._deny


def is_loopback(host: str) -> bool:
    """Whether every address ``host`` names is a loopback one (``0.0.0.0``,
    ``::`` and a name that does not resolve are not)."""
    try:
        infos = socket.getaddrinfo(host, None)
        return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)
    except (OSError, ValueError):
        return False


def server_ssl_context(cfg: PeerConfig) -> ssl.SSLContext | None:
    if not cfg.tls_cert_file:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cfg.tls_cert_file, cfg.tls_key_file)
    if cfg.tls_ca_file:
        ctx.load_verify_locations(cfg.tls_ca_file)
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx
