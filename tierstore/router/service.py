"""The router's gRPC service (``router.proto``) and its conversions.

Provides ``RouterServicer`` (Route: a request's layout and token ids or block
keys in, the candidate hosts ranked with their cost breakdown out),
``RouterServer`` (the servicer on a TCP port, behind the group token and the
same TLS settings as the peer port), and ``plan_to_proto``/``plan_from_proto``
shared with the CLI.
"""

from __future__ import annotations

import logging
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from tierstore.config import Config
from tierstore.errors import TierstoreError
from tierstore.keys import KEY_BYTES, BlockKey, KVLayout, chain_keys, unpack_keys
from tierstore.peer.auth import TokenAuth
from tierstore.router.cost import HostCost, Plan
from tierstore.router.router import Router
from tierstore.v1 import router_pb2, router_pb2_grpc
from tierstore.wire import host_load_proto, layout_from_proto, load_from_proto

log = logging.getLogger(__name__)

MAX_ROUTE_TOKENS = 4 << 20  # tokens in one request
MAX_ROUTE_KEYS = 65536  # block keys in one request (the peer Lookup's bound)
MAX_MESSAGE_BYTES = 36 << 20  # 4 Mi token ids as int64, with room


class RouterServicer(router_pb2_grpc.RouterServiceServicer):
    def __init__(self, router: Router) -> None:
        self.router = router

    def Route(self, request: router_pb2.RouteRequest, context: Any) -> router_pb2.RouteReply:
        try:
            layout, keys, num_tokens = parse_request(request)
            plan = self.router.route(
                layout,
                keys,
                num_tokens,
                hosts=list(request.hosts),
                session=request.session[:256],
                current_host=request.current_host,
                loads={h: load_from_proto(m) for h, m in request.loads.items()},
            )
        except (TierstoreError, ValueError) as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        reply = plan_to_proto(plan)
        best = plan.ranked[0] if plan.ranked else None
        if request.preposition and best is not None and best.reachable and keys:
            self.router.preposition(best.host, layout, keys)
            reply.prepositioned_host = best.host
        return reply


def parse_request(request: router_pb2.RouteRequest) -> tuple[KVLayout, list[BlockKey], int]:
    """Layout, block keys and prompt length of a request; ValueError or
    TierstoreError naming what is wrong."""
    if not request.HasField("layout"):
        raise ValueError("layout is required")
    layout = layout_from_proto(request.layout)
    if request.token_ids and request.keys:
        raise ValueError("give token_ids or keys, not both")
    if request.token_ids:
        if len(request.token_ids) > MAX_ROUTE_TOKENS:
            raise ValueError(f"{len(request.token_ids)} token ids; at most {MAX_ROUTE_TOKENS}")
        if request.num_tokens and request.num_tokens != len(request.token_ids):
            raise ValueError(
                f"num_tokens {request.num_tokens} differs from {len(request.token_ids)} token ids"
            )
        tokens = np.asarray(request.token_ids, dtype=np.int64)
        keys = chain_keys(layout, tokens)
        if len(keys) > MAX_ROUTE_KEYS:
            raise ValueError(f"{len(keys)} blocks; at most {MAX_ROUTE_KEYS} per request")
        return layout, keys, len(tokens)
    raw = request.keys
    if len(raw) % KEY_BYTES or len(raw) // KEY_BYTES > MAX_ROUTE_KEYS:
        raise ValueError(f"keys must be a multiple of {KEY_BYTES} bytes, at most {MAX_ROUTE_KEYS}")
    keys = unpack_keys(raw)
    num_tokens = request.num_tokens or len(keys) * layout.block_tokens
    return layout, keys, num_tokens


def plan_to_proto(plan: Plan) -> router_pb2.RouteReply:
    reply = router_pb2.RouteReply(
        spill_host=plan.spill_host, num_blocks=plan.num_blocks, num_tokens=plan.num_tokens
    )
    for c in plan.ranked:
        m = reply.hosts.add(
            host=c.host, reachable=c.reachable, error=c.error, source=c.source,
            ttft_s=c.ttft_s if c.reachable else 0.0, queue_s=c.queue_s, load_s=c.load_s,
            prefill_s=c.prefill_s, held_blocks=c.held_blocks, reused_tokens=c.reused_tokens,
            prefill_tokens=c.prefill_tokens,
        )  # fmt: skip
        for tier, n in c.blocks.items():
            setattr(m, f"{tier}_blocks", n)
        if c.load is not None:
            m.load.CopyFrom(host_load_proto(c.load))
    return reply


def plan_from_proto(reply: router_pb2.RouteReply) -> Plan:
    ranked = []
    for m in reply.hosts:
        blocks = {t: getattr(m, f"{t}_blocks") for t in ("hbm", "dram", "nvme", "peer")}
        ranked.append(
            HostCost(
                host=m.host,
                ttft_s=m.ttft_s if m.reachable else float("inf"),
                queue_s=m.queue_s,
                load_s=m.load_s,
                prefill_s=m.prefill_s,
                blocks={k: v for k, v in blocks.items() if v},
                held_blocks=m.held_blocks,
                reused_tokens=m.reused_tokens,
                prefill_tokens=m.prefill_tokens,
                reachable=m.reachable,
                error=m.error,
                source=m.source,
                load=load_from_proto(m.load) if m.HasField("load") else None,
            )
        )
    return Plan(ranked, reply.spill_host, reply.num_blocks, reply.num_tokens)


class RouterServer:
    """The router service on ``router_host:router_port``."""

    def __init__(self, config: Config) -> None:
        token = config.peer.token()
        self.router = Router(config.router, config.peer)
        self.servicer = RouterServicer(self.router)
        self.server = grpc.server(
            futures.ThreadPoolExecutor(
                config.router.router_rpc_threads, thread_name_prefix="tierstore-router"
            ),
            interceptors=[TokenAuth(token)],
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", 4 << 20),
            ],
            maximum_concurrent_rpcs=64,
        )
        router_pb2_grpc.add_RouterServiceServicer_to_server(self.servicer, self.server)
        cfg, peer = config.router, config.peer
        bind = f"{cfg.router_host}:{cfg.router_port}"
        if peer.tls_cert_file:
            pair = [(Path(peer.tls_key_file).read_bytes(), Path(peer.tls_cert_file).read_bytes())]
            root = Path(peer.tls_ca_file).read_bytes() if peer.tls_ca_file else None
            creds = grpc.ssl_server_credentials(
                pair, root_certificates=root, require_client_auth=root is not None
            )
            self.port = self.server.add_secure_port(bind, creds)
        else:
            self.port = self.server.add_insecure_port(bind)
        if self.port == 0:
            self.router.close()
            raise TierstoreError(f"cannot listen for route requests on {bind} (in use?)")
        self.server.start()
        log.info(
            "router on %s: %d hosts, %s", bind, len(self.router.clients),
            "index from event streams" if cfg.router_watch else "lookups per request",
        )  # fmt: skip

    def stop(self, grace_s: float = 2.0) -> None:
        self.server.stop(grace_s).wait()
        self.router.close()
