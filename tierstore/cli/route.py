"""``tierstore route`` (ask where a turn should run) and ``tierstore router``
(run the router service); their flags are in ``cli.main``, which imports
this module only when one of them runs.

``route`` asks the hosts itself (``--hosts``, router_hosts from the config,
or the group's live members in etcd with ``--membership``) or a running
router service (``--router``), and prints the ranking; with
``--explain`` the cost breakdown of every host as a table.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import grpc

from tierstore.cli.common import config_from_args
from tierstore.config import Config
from tierstore.errors import TierstoreError
from tierstore.keys import KVLayout
from tierstore.router.cost import Plan


def _config(args: argparse.Namespace) -> Config:
    """The config, with ``route``'s and ``router``'s own flags as settings."""
    if getattr(args, "hosts", None):
        args.set.append(f"router_hosts={args.hosts}")
    if getattr(args, "membership", None):
        args.set.append(f"membership={args.membership}")
    if getattr(args, "watch", False):
        args.set.append("router_watch=true")
    if getattr(args, "vllm_events", None):
        args.set.append(f"router_vllm_events={args.vllm_events}")
    if getattr(args, "vllm_layout", None):
        args.set.append(f"router_vllm_layout={args.vllm_layout}")
    return config_from_args(args)


def read_layout(text: str) -> KVLayout:
    source = text
    if not text.lstrip().startswith("{"):
        try:
            source = Path(text).read_text()
        except OSError as e:
            raise TierstoreError(
                f"--layout: {text!r} is neither JSON nor a readable file: {e}"
            ) from e
    try:
        return KVLayout.from_dict(json.loads(source))
    except (json.JSONDecodeError, TypeError, ValueError) as e:
        raise TierstoreError(f"--layout: not a KV layout: {e}") from e


def read_tokens(args: argparse.Namespace) -> list[int]:
    if args.random_tokens is not None:
        import numpy as np

        if args.random_tokens < 1:
            raise TierstoreError("--random-tokens must be >= 1")
        return np.random.default_rng(args.seed).integers(0, 32000, args.random_tokens).tolist()
    text = sys.stdin.read() if args.tokens == "-" else Path(args.tokens).read_text()
    try:
        data = json.loads(text) if text.lstrip().startswith("[") else text.split()
        tokens = [int(t) for t in data]
    except (json.JSONDecodeError, TypeError, ValueError) as e:
        raise TierstoreError(f"--tokens: expected a list of token ids: {e}") from e
    if not tokens:
        raise TierstoreError("--tokens: no token ids")
    return tokens


def parse_loads(items: list[str]) -> dict[str, Any]:
    from tierstore.load import HostLoadView

    loads = {}
    for item in items:
        host, sep, spec = item.rpartition("=")
        parts = spec.split("/")
        if not sep or not host or len(parts) not in (2, 3) or not all(p.isdigit() for p in parts):
            raise TierstoreError(f"--load: expected HOST=BUSY/SLOTS[/QUEUE], got {item!r}")
        busy, slots, queue = (int(p) for p in [*parts, "0"][:3])
        loads[host] = HostLoadView(True, busy, slots, queue)
    return loads


def cmd_route(args: argparse.Namespace) -> int:
    layout = read_layout(args.layout)
    tokens = read_tokens(args)
    loads = parse_loads(args.load)
    config = _config(args)
    if args.router:
        plan = _ask_router(args.router, config, layout, tokens, args.session, args.current, loads)
    else:
        import numpy as np

        from tierstore.keys import chain_keys
        from tierstore.router.router import Router

        router = Router(config.router, config.peer)
        try:
            keys = chain_keys(layout, np.asarray(tokens, dtype=np.int64))
            plan = router.route(
                layout, keys, len(tokens), session=args.session, current_host=args.current,
                loads=loads,
            )  # fmt: skip
        except ValueError as e:  # e.g. no live member (etcd unreachable, empty group)
            raise TierstoreError(str(e)) from None
        finally:
            router.close()
    if args.json:
        print(json.dumps(plan_to_dict(plan), indent=2))
    else:
        print(format_plan(plan, explain=args.explain))
    return 0 if plan.best is not None else 1


def _ask_router(
    address: str, config: Any, layout: KVLayout, tokens: list[int], session: str, current: str,
    loads: dict[str, Any],
) -> Plan:  # fmt: skip
    from tierstore.router.service import plan_from_proto
    from tierstore.v1 import router_pb2, router_pb2_grpc
    from tierstore.wire import host_load_proto, layout_to_proto

    req = router_pb2.RouteRequest(
        layout=layout_to_proto(layout), token_ids=tokens, session=session, current_host=current,
        hosts=list(config.router.router_hosts),
    )  # fmt: skip
    for host, view in loads.items():
        req.loads[host].CopyFrom(host_load_proto(view))
    metadata = (("authorization", f"Bearer {config.peer.token()}"),)
    peer = config.peer
    if peer.tls_ca_file:  # the router serves TLS like the peer port
        creds = grpc.ssl_channel_credentials(
            root_certificates=Path(peer.tls_ca_file).read_bytes(),
            private_key=Path(peer.tls_key_file).read_bytes() if peer.tls_key_file else None,
            certificate_chain=Path(peer.tls_cert_file).read_bytes() if peer.tls_cert_file else None,
        )
        channel = grpc.secure_channel(
            address, creds, options=[("grpc.ssl_target_name_override", "tierstore")]
        )
    else:
        channel = grpc.insecure_channel(address)
    with channel:
        try:
            reply = router_pb2_grpc.RouterServiceStub(channel).Route(
                req, timeout=10.0, metadata=metadata
            )
        except grpc.RpcError as e:
            raise TierstoreError(f"router {address}: {e.code().name}: {e.details()}") from e
    return plan_from_proto(reply)


def plan_to_dict(plan: Plan) -> dict[str, Any]:
    hosts = []
    for c in plan.ranked:
        d = {
            "host": c.host, "reachable": c.reachable, "ttft_s": c.ttft_s if c.reachable else None,
            "queue_s": c.queue_s, "load_s": c.load_s, "prefill_s": c.prefill_s,
            "blocks_by_tier": dict(c.blocks), "held_blocks": c.held_blocks,
            "reused_tokens": c.reused_tokens, "prefill_tokens": c.prefill_tokens,
            "source": c.source, "error": c.error,
        }  # fmt: skip
        if c.load is not None and c.load.reported:
            d["load"] = {"busy_slots": c.load.busy_slots, "slots": c.load.slots,
                         "queue_len": c.load.queue_len}  # fmt: skip
        hosts.append(d)
    return {
        "best": plan.best.host if plan.best is not None else None,
        "spill_host": plan.spill_host or None,
        "num_tokens": plan.num_tokens,
        "num_blocks": plan.num_blocks,
        "hosts": hosts,
    }


def format_plan(plan: Plan, explain: bool) -> str:
    best = plan.best
    lines = [
        f"{plan.num_tokens} tokens, {plan.num_blocks} full blocks: "
        + (f"best host {best.host} (TTFT {_s(best.ttft_s)})" if best else "no host answered"),
    ]
    if plan.spill_host:
        lines.append(f"spill host (replicas go here): {plan.spill_host}")
    if not explain:
        for i, c in enumerate(plan.ranked, 1):
            what = _s(c.ttft_s) if c.reachable else f"unreachable ({c.error})"
            lines.append(f"  {i}. {c.host:<24} {what}")
        return "\n".join(lines)
    head = ("#", "host", "TTFT", "queue", "load", "prefill", "reused", "hbm", "dram", "nvme",
            "peer", "slots", "via")  # fmt: skip
    rows: list[tuple[str, ...]] = [head]
    down = [c for c in plan.ranked if not c.reachable]
    for i, c in enumerate(plan.ranked, 1):
        if not c.reachable:
            continue
        slots = (
            f"{c.load.busy_slots}/{c.load.slots}+{c.load.queue_len}"
            if c.load is not None and c.load.reported else "?"
        )  # fmt: skip
        rows.append((
            str(i), c.host, _s(c.ttft_s), _s(c.queue_s), _s(c.load_s), _s(c.prefill_s),
            f"{c.reused_tokens}/{plan.num_tokens}",
            *(str(c.blocks.get(t, 0)) for t in ("hbm", "dram", "nvme", "peer")), slots, c.source,
        ))  # fmt: skip
    widths = [max(len(r[j]) for r in rows) for j in range(len(head))]
    for r in rows:
        cells = [r[j].ljust(widths[j]) if j == 1 else r[j].rjust(widths[j]) for j in range(len(r))]
        lines.append("  " + "  ".join(cells).rstrip())
    for c in down:
        lines.append(f"  unreachable: {c.host} ({c.error})")
    lines.append(
        "  TTFT = queue (wait for a slot) + load (prefix: HBM/DRAM/NVMe/peer) + prefill (the rest)"
    )
    return "\n".join(lines)


def _s(seconds: float) -> str:
    if seconds == float("inf"):
        return "-"
    return f"{seconds * 1000:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def cmd_router(args: argparse.Namespace) -> int:
    from tierstore.router.service import RouterServer

    config = _config(args)
    logging.basicConfig(
        level=config.server.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    server = RouterServer(config)
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    print(f"router listening on {config.router.router_host}:{server.port}", flush=True)
    done.wait()
    server.stop()
    return 0
