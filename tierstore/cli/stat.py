"""``tierstore stat``: a running sidecar's tiers and counters, as a table or JSON.

Provides ``cmd_stat`` (ask the sidecar's Stat over its Unix socket, once or
every ``--watch`` seconds), ``format_stat`` (the table) and ``_stat_dict``
(a StatReply as plain JSON types: the output of ``--json``, and what
``format_stat`` reads). Imports neither torch nor the store: ``cli.main``
imports this module only when ``stat`` runs.

Runs in the foreground of the shell that calls it.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from typing import Any

from tierstore.config import load_config


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _stat_dict(reply: Any) -> dict[str, Any]:
    """A StatReply as plain JSON types: 64-bit integers as numbers (protobuf's
    JSON mapping writes them as strings), every field present."""
    from google.protobuf.json_format import MessageToDict

    d = MessageToDict(
        reply, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    return _json_numbers(reply.DESCRIPTOR, d)


_INT64_TYPES = {3, 4, 6, 16, 18}  # FieldDescriptor.TYPE_INT64, UINT64, FIXED64, SFIXED64, SINT64


def _json_numbers(descriptor: Any, d: dict[str, Any]) -> dict[str, Any]:
    for field in descriptor.fields:
        if field.name not in d:
            continue
        value = d[field.name]
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            value_field = field.message_type.fields_by_name["value"]
            if value_field.type in _INT64_TYPES:
                d[field.name] = {k: int(v) for k, v in value.items()}
        elif field.message_type is not None:
            items = value if isinstance(value, list) else [value]
            for item in items:
                _json_numbers(field.message_type, item)
        elif field.type in _INT64_TYPES:
            d[field.name] = [int(v) for v in value] if isinstance(value, list) else int(value)
    return d


def format_stat(stat: dict[str, Any]) -> str:
    """A readable table of a StatReply (as a dict)."""
    lines = [
        f"tierstore {stat.get('version', '?')}  up {float(stat.get('uptime_s', 0)):.0f}s  "
        f"socket {stat.get('socket_path', '?')}",
        "",
    ]
    failed = stat.get("failed_workers", [])
    if failed:
        lines += [
            f"NOT SERVING: {len(failed)} worker thread(s) died (see the sidecar's log):",
            *(f"  {w}" for w in failed),
            "",
        ]
    header = (
        "tier",
        "used",
        "capacity",
        "use%",
        "blocks",
        "hit rate",
        "in",
        "out",
        "evicted",
        "bad reads",
    )
    rows = [header]
    for t in stat.get("tiers", []):
        cap, used = int(t["capacity_bytes"]), int(t["used_bytes"])
        hits, misses = int(t["hits"]), int(t["misses"])
        lookups = hits + misses
        rows.append(
            (
                t["name"],
                _human_bytes(used),
                _human_bytes(cap),
                f"{100 * used / cap:.0f}%" if cap else "-",
                str(t["num_blocks"]),
                f"{100 * hits / lookups:.1f}%" if lookups else "-",
                _human_bytes(int(t["bytes_in"])),
                _human_bytes(int(t["bytes_out"])),
                str(t["evictions"]),
                str(int(t["verify_failures"]) + int(t["read_failures"])),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    for r, row in enumerate(rows):
        lines.append(
            "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
        )
        if r == 0:
            lines.append("  ".join("-" * w for w in widths))
    c = {k: int(v) for k, v in stat.get("counters", {}).items()}
    lines += [
        "",
        "prefetch  done {}  late {}  cancelled {}  started {}  blocks {}".format(
            c.get("prefetch_done", 0),
            c.get("prefetch_late", 0),
            c.get("prefetch_cancelled", 0),
            c.get("prefetch_started", 0),
            c.get("prefetch_blocks_promoted", 0),
        ),
        "store     lookups {}  promotions {}  spilled {}  spill failures {}  "
        "bad requests {}".format(
            c.get("lookups", 0),
            c.get("promotions", 0),
            c.get("spilled_blocks", 0),
            c.get("spill_failures", 0),
            c.get("bad_requests", 0),
        ),
        "          writes and promotions that found DRAM full {} (waited {:.2f} s, "
        "evicting {} blocks)".format(
            c.get("full_waits", 0),
            c.get("full_wait_us", 0) / 1e6,
            c.get("full_wait_evicted_blocks", 0),
        ),
    ]
    lines += _restart_lines(stat.get("info", {}), c)
    if "remote_turns_not_durable" in c:
        lines.append(_remote_line(c))
    if "peer_lookups" in c:
        lines.append(
            "peers     lookups {} (errors {}, timeouts {})  fetched {} blocks, {} "
            "(errors {}, timeouts {}, stalls {}, bad blocks {})".format(
                c.get("peer_lookups", 0),
                c.get("peer_lookup_errors", 0),
                c.get("peer_lookup_timeouts", 0),
                c.get("peer_fetched_blocks", 0),
                _human_bytes(c.get("peer_fetched_bytes", 0)),
                c.get("peer_fetch_errors", 0),
                c.get("peer_fetch_timeouts", 0),
                c.get("peer_fetch_stalls", 0),
                c.get("peer_fetch_verify_failures", 0),
            )
        )
        pulls = c.get("peer_pulls", 0)
        lines.append(
            "pulls     {} (mean {:.0f} ms, {:.0f} ms of it waiting on transfers here)  joined {}  "
            "slow {}".format(
                pulls,
                c.get("peer_pull_ms", 0) / max(pulls, 1),
                c.get("peer_pull_join_ms", 0) / max(pulls, 1),
                c.get("peer_pulls_joined", 0),
                c.get("peer_slow_pulls", 0),
            )
        )
        lines.append(
            "replicas  pushed {} blocks in {} pushes (errors {}, dropped {})  imported {}  "
            "rejected {}  held {}".format(
                c.get("peer_pushed_blocks", 0),
                c.get("peer_pushes", 0),
                c.get("peer_push_errors", 0),
                c.get("peer_pushes_dropped", 0),
                c.get("peer_replicas_imported", 0),
                c.get("peer_replicas_rejected", 0),
                _human_bytes(c.get("replica_bytes", 0)),
            )
        )
    if "membership_members" in c:
        lines.append(
            "group     {} members (etcd: {})  joins {}  leaves {}  registered {}  "
            "rejoins {}  leases lost {}  etcd errors {} in {} outages".format(
                c.get("membership_members", 0),
                "up" if c.get("membership_etcd_up") else "UNREACHABLE: last known group kept",
                c.get("membership_joins", 0),
                c.get("membership_leaves", 0),
                "yes" if c.get("membership_registered") else "no",
                max(c.get("membership_registrations", 0) - 1, 0),
                c.get("membership_leases_lost", 0),
                c.get("membership_etcd_errors", 0),
                c.get("membership_etcd_outages", 0),
            )
        )
    if "peer_watchers" in c:
        lines.append(
            "routers   {} watching  snapshots sent {}  refused {}".format(
                c.get("peer_watchers", 0),
                c.get("peer_watch_snapshots", 0),
                c.get("peer_watch_refused", 0),
            )
        )
    load = stat.get("load") or {}
    if load.get("reported"):
        lines.append(
            "load      {}/{} slots busy, {} queued (reported by the engines)".format(
                load.get("busy_slots", 0), load.get("slots", 0), load.get("queue_len", 0)
            )
        )
    clients = stat.get("clients", [])
    lines.append(f"clients   {len(clients)} attached")
    for cl in clients:
        lines.append(
            f"          #{cl['client_id']} {cl['name']} (pid {cl['pid']}) "
            f"{float(cl['connected_s']):.0f}s, {cl['pins']} pins"
        )
    return "\n".join(lines)


def _remote_line(c: dict[str, int]) -> str:
    """What a crash would lose now, and how long turns take to be durable."""
    return (
        "remote    not yet in the bucket: {} turns ({} blocks), {} uploads ({})  "
        "turns durable {} (end_turn to durable p50 {:.3f}s p99 {:.3f}s max {:.3f}s)  "
        "not written {}".format(
            c.get("remote_turns_not_durable", 0),
            c.get("remote_turn_blocks_not_durable", 0),
            c.get("remote_uploads_queued", 0),
            _human_bytes(c.get("remote_upload_bytes_queued", 0)),
            c.get("remote_turns_durable", 0),
            c.get("remote_turn_durable_p50_us", 0) / 1e6,
            c.get("remote_turn_durable_p99_us", 0) / 1e6,
            c.get("remote_turn_durable_us_max", 0) / 1e6,
            c.get("remote_turns_not_written", 0),
        )
    )


def _huge_share(c: dict[str, int]) -> str:
    """How much of the arena's populated memory the sidecar maps with huge
    pages; "" from a sidecar that does not say."""
    if "arena_huge_bytes" not in c:
        return ""
    huge = c["arena_huge_bytes"]
    if not huge:
        return "no huge pages"
    # Populated is counted a moment apart from huge (a populator may be running).
    populated = max(c.get("arena_populated_bytes", 0), huge)
    return f"huge pages {100 * huge / populated:.0f}%"


def _restart_lines(info: dict[str, str], c: dict[str, int]) -> list[str]:
    """The write policy and its queue, the last drain, the arena's pages."""
    lines = []
    if "write_policy" in info:
        line = f"writes    policy {info['write_policy']}"
        if "write_queued" in c:
            line += (
                "  queued {}  written {}  dropped {}  failed {}  queue {} blocks, {} of {}".format(
                    c.get("write_queued", 0),
                    c.get("write_written", 0),
                    c.get("write_dropped", 0),
                    c.get("write_failed", 0),
                    c.get("write_queue_blocks", 0),
                    _human_bytes(c.get("write_queue_bytes", 0)),
                    _human_bytes(c.get("write_queue_bound_bytes", 0)),
                )
            )
        lines.append(line)
    if "last_drain_blocks" in c:
        lines.append(
            "drain     last stop wrote {} blocks ({}) in {:.2f}s of {:.2f}s, "
            "dropped {} ({})".format(
                c["last_drain_blocks"],
                _human_bytes(c.get("last_drain_bytes", 0)),
                c.get("last_drain_ms", 0) / 1000,
                c.get("last_drain_budget_ms", 0) / 1000,
                c.get("last_drain_dropped_blocks", 0),
                _human_bytes(c.get("last_drain_dropped_bytes", 0)),
            )
        )
    if "arena_page" in info:
        total = c.get("arena_bytes", 0)
        share = 100 * c.get("arena_populated_bytes", 0) / total if total else 0.0
        lock = info.get("arena_lock", "")
        if lock.startswith("locked"):
            lock = f"locked {c.get('arena_locked_bytes', 0) / 2**20:.0f} MiB"
        parts = [f"pages {info['arena_page']}", f"populated {share:.0f}%", _huge_share(c), lock]
        lines.append("arena     " + "  ".join(p for p in parts if p))
    if c.get("nvme_disk_full", 0) or c.get("nvme_full_rechecks", 0):
        lines.append(
            "disk      full now {}  full events {}  re-checks {}  resumed {}  "
            "index reserve used {}".format(
                c.get("nvme_disk_full", 0),
                c.get("nvme_full_events", 0),
                c.get("nvme_full_rechecks", 0),
                c.get("nvme_full_resumed", 0),
                c.get("nvme_index_reserve_used", 0),
            )
        )
    return lines


def cmd_stat(args: argparse.Namespace) -> int:
    import grpc

    from tierstore.v1 import local_pb2, local_pb2_grpc

    socket_path = args.socket or load_config(args.config).server.socket_path
    # --watch ends at Ctrl-C (SIGINT) between two refreshes: a KeyboardInterrupt
    # raised inside a gRPC call can leave the channel's threads hanging at exit.
    stop = threading.Event()
    if args.watch:
        signal.signal(signal.SIGINT, lambda signum, frame: stop.set())
    with grpc.insecure_channel(f"unix:{socket_path}") as channel:
        stub = local_pb2_grpc.LocalServiceStub(channel)
        while not stop.is_set():
            try:
                reply = stub.Stat(local_pb2.StatRequest(), timeout=args.timeout)
            except grpc.RpcError as e:
                print(
                    f"tierstore stat: no sidecar answers on unix:{socket_path} "
                    f"({e.code().name}); start one with `tierstore serve`",
                    file=sys.stderr,
                )
                return 1
            stat = _stat_dict(reply)
            if args.json:
                print(json.dumps(stat, indent=2), flush=True)
            else:
                if args.watch:
                    print("\x1b[2J\x1b[H", end="")
                print(format_stat(stat), flush=True)
            if not args.watch:
                return 0
            stop.wait(args.watch)
    return 0
