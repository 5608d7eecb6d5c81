"""The ``tierstore`` command: ``serve``, ``stat``, ``demo``, ``config``, ``route``,
``router``, ``gateway``.

Provides ``build_parser`` (every command's flags) and ``main`` (run one).
Each command's module is imported only when that command runs (``serve``:
the sidecar; ``stat``: ``cli.stat``; ``demo``: ``cli.demo`` or the vLLM
demo; ``route`` and ``router``: ``cli.route``; ``gateway``:
``gateway.serve``), so that ``tierstore stat`` starts without torch. The
flags that make a ``Config`` are ``cli.common``'s.

Runs in the foreground of the shell that calls it.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from typing import Any

from tierstore import __version__
from tierstore.cli.common import add_config_flags, config_from_args
from tierstore.config import config_to_dict
from tierstore.errors import TierstoreError


def cmd_serve(args: argparse.Namespace) -> int:
    from tierstore.sidecar.process import serve

    config = config_from_args(args)
    logging.basicConfig(
        level=config.server.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    return serve(config)


def cmd_demo(args: argparse.Namespace) -> int:
    if args.engine == "vllm":
        from tierstore.engines.vllm.demo import main as vllm_demo_main

        return vllm_demo_main(args)
    from tierstore.cli.demo import main as demo_main

    return demo_main(args)


def cmd_config(args: argparse.Namespace) -> int:
    print(json.dumps(config_to_dict(config_from_args(args)), indent=2))
    return 0


def cmd_stat(args: argparse.Namespace) -> int:
    from tierstore.cli.stat import cmd_stat as stat_main

    return stat_main(args)


def cmd_route(args: argparse.Namespace) -> int:
    from tierstore.cli.route import cmd_route as route_main

    return route_main(args)


def cmd_router(args: argparse.Namespace) -> int:
    from tierstore.cli.route import cmd_router as router_main

    return router_main(args)


def cmd_gateway(args: argparse.Namespace) -> int:
    try:
        from tierstore.gateway.serve import serve as gateway_serve
    except ImportError as e:  # the gateway extra is not installed
        raise TierstoreError(
            f"{e}: install the gateway's packages: pip install 'tierstore[gateway]'"
        ) from e
    config = config_from_args(args)
    logging.basicConfig(
        level=config.server.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    return gateway_serve(config)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tierstore", description="Tiered KV-cache store for LLM inference."
    )
    parser.add_argument("--version", action="version", version=f"tierstore {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="run the sidecar (no config needed)")
    add_config_flags(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("stat", help="show a running sidecar's tiers and counters")
    p.add_argument("--socket", default=None, help="Unix socket of the sidecar")
    p.add_argument("--config", metavar="FILE", help="read socket_path from this config")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument(
        "--watch",
        type=float,
        nargs="?",
        const=2.0,
        default=0.0,
        metavar="SECONDS",
        help="refresh every SECONDS (default 2) until interrupted",
    )
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the sidecar")
    p.set_defaults(func=cmd_stat)

    p = sub.add_parser("demo", help="two hosts, one conversation, a warm session switch")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.add_argument("--tokens", type=int, default=4096, help="prompt tokens at the switch")
    p.add_argument("--hidden", type=int, default=256, help="hidden size of the random model")
    p.add_argument("--layers", type=int, default=4, help="layers of the random model")
    p.add_argument("--keep", action="store_true", help="keep the sidecars' files (logs)")
    p.add_argument(
        "--engine", choices=("hf", "vllm"), default="hf",
        help="hf: transformers (starts in seconds); vllm: real vLLM engines (needs vllm)",
    )  # fmt: skip
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("config", help="print the effective configuration")
    add_config_flags(p)
    p.set_defaults(func=cmd_config)

    _add_router_parsers(sub)
    _add_gateway_parser(sub)
    return parser


def _add_gateway_parser(sub: Any) -> None:
    """``gateway``: the OpenAI-compatible front of the fleet (``tierstore.gateway``)."""
    p = sub.add_parser("gateway", help="serve the OpenAI API in front of the engines")
    p.add_argument(
        "--backend",
        action="append",
        dest="gateway_backends",
        metavar="URL[;peer=HOST:PORT][;events=tcp://HOST:PORT]",
        help="an engine, its sidecar's peer address, its vLLM KV events (repeatable)",
    )
    p.add_argument(
        "--membership",
        metavar="URL",
        help="the engines of the etcd group (etcd://host:port/prefix)",
    )
    p.add_argument("--policy", dest="gateway_policy", help="tierstore | tierstore_no_preposition "
                   "| prefix_aware | least_loaded | round_robin")  # fmt: skip
    p.add_argument("--host", dest="gateway_host", help="address to listen on")
    p.add_argument("--port", dest="gateway_port", type=int, help="port to listen on")
    p.add_argument(
        "--tokenizer",
        dest="gateway_tokenizer",
        metavar="DIR",
        help="the model's tokenizer directory (default: the engines' /tokenize)",
    )
    add_config_flags(p)
    p.set_defaults(func=cmd_gateway)


def _add_router_parsers(sub: Any) -> None:
    """``route`` and ``router``: their flags; their code is ``cli.route``."""
    p = sub.add_parser("route", help="rank hosts for a turn by estimated time to first token")
    p.add_argument(
        "--layout", required=True, help="KV layout: a JSON object, or a file holding one"
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--tokens",
        metavar="FILE",
        help="token ids: a JSON list or whitespace-separated ints ('-': stdin)",
    )
    src.add_argument(
        "--random-tokens",
        type=int,
        metavar="N",
        help="N random token ids (--seed), for trying it out",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of --random-tokens")
    hosts = p.add_mutually_exclusive_group()
    hosts.add_argument("--hosts", help="candidates: peer host:port list, comma-separated")
    hosts.add_argument(
        "--membership", metavar="URL", help="candidates: the group's live members in etcd"
    )
    p.add_argument(
        "--router", metavar="HOST:PORT", help="ask this router service instead of the hosts"
    )
    p.add_argument("--session", default="", help="session id (spill choice, stable ties)")
    p.add_argument("--current", default="", help="host of the session's last turn")
    p.add_argument(
        "--load",
        action="append",
        default=[],
        metavar="HOST=BUSY/SLOTS[/QUEUE]",
        help="the gateway's view of a host's load (repeatable)",
    )
    p.add_argument("--explain", action="store_true", help="print the cost breakdown per host")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    add_config_flags(p)
    p.set_defaults(func=cmd_route)

    p = sub.add_parser("router", help="run the router service (gRPC) for a gateway")
    hosts = p.add_mutually_exclusive_group()
    hosts.add_argument("--hosts", help="candidates: peer host:port list, comma-separated")
    hosts.add_argument(
        "--membership",
        metavar="URL",
        help="candidates: the group's live members in etcd (etcd://host:port[,...]/prefix)",
    )
    p.add_argument("--port", type=int, default=None, dest="router_port", help="port to listen on")
    p.add_argument("--watch", action="store_true", help="index the hosts' event streams")
    p.add_argument(
        "--vllm-events",
        metavar="HOST=tcp://ENGINE:PORT[,...]",
        help="also index vLLM's KV events of the engine behind each host (HOST: its "
        "sidecar's peer address; ENGINE:PORT: vllm's --kv-events-config endpoint)",
    )
    p.add_argument(
        "--vllm-layout", metavar="JSON|FILE", help="the engines' KV layout (with --vllm-events)"
    )
    add_config_flags(p)
    p.set_defaults(func=cmd_router)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except TierstoreError as e:
        print(f"tierstore {args.command}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return _closed_pipe()


def _closed_pipe() -> int:
    """The reader went away (``tierstore stat --json | head``): end quietly with
    the shell's status for SIGPIPE. stdout is pointed at /dev/null first, so
    the interpreter's final flush does not raise again."""
    import os

    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 128 + 13  # 128 + SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
