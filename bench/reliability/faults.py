"""Faults at fleet scale: a two-host fleet under load while it is killed,
its link made sick, its disk filled, its bucket and its etcd taken away.

The fleet (``harness.fault_fleet.FaultFleet``): two sidecars in network
namespaces on a bridge, peered through a real etcd, with the remote tier on
a real SeaweedFS behind a fault proxy; host 1's NVMe on a small tmpfs. The
load (``harness.fault_load``): ``--engines`` engine processes running
multi-turn sessions that move between the hosts (every block a load returns
is compared with its true bytes; every third turn ends durable) and a
writer doing two-phase writes that a kill may cut between its halves.

The run: a quiet baseline (``none``), then ``--kills`` SIGKILLs at random
moments spread over the sidecars (each restarted on its files), the engines
and the writer (each started again: engines resume their sessions), then
each fault kind in turn, held ``--hold-s`` seconds and cleared, followed by
its recovery probe (``harness.fault_fleet``: what "recovered" means for each
kind, and the time it took). Afterwards: every chain the writer reserved
whose write a kill may have cut, and a sample of the rest, is loaded on both
hosts and checked; then every turn an engine was told was durable is loaded
on a fresh host with empty disks and the same bucket: a turn that does not
load whole is a durable turn lost.

Per fault kind (its window: from the fault to the end of its recovery), from
the engines' logs: blocks served and checked, wrong blocks and bytes, the
share of the asked prefix that fell back to recompute, the calls that failed
and the host's sidecar being unreachable (what an engine meets while its
sidecar restarts), turns that moved host and where their blocks came from,
durable EndTurns asked and granted; and the sidecars' counters over the
window. Prints one JSON object (``--json``) or a table.

    python -m bench.reliability.faults --json            # about 12 minutes here
    python -m bench.reliability.faults --kills 24 --hold-s 4   # the test's short form
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from tqdm import tqdm

from harness import fault_load
from harness.fault_fleet import KINDS, FaultFleet
from harness.reaper import forget_process, watch_process
from harness.reliability import BLOCK, LAYOUT, chain, count_wrong, read_events, stop_forkserver
from harness.reliability import workers as worker_context
from tierstore.client import StoreClient
from tierstore.tiers import TierName

WATCHED = ("verify_failures", "remote_verify_failures", "peer_fetch_verify_failures",
           "peer_pulls", "peer_pushes", "peer_pushed_blocks", "peer_push_errors",
           "peer_replicas_imported", "peer_fetch_errors", "peer_fetch_timeouts",
           "remote_pulled_blocks", "spill_failures", "nvme_full_events", "nvme_full_resumed",
           "remote_uploads_failed", "remote_request_errors", "remote_durable_end_turns_failed",
           "membership_etcd_outages", "tcp_retransmits", "delay_line_packets")  # fmt: skip
KILL_TARGETS = {"sidecar0": 0.25, "sidecar1": 0.25, "engine": 0.3, "writer": 0.2}
WRITER_SAMPLE = 300  # committed chains checked besides every one a kill may have cut
RUN_S = 3600.0  # workers run until the bench kills them
OUTAGE_GRACE_S = 2.0  # a call's deadline past a sidecar's restart (CONNECT_TIMEOUT_S)


class Load:
    """The engine and writer processes: started, SIGKILLed, started again."""

    def __init__(self, fleet: FaultFleet, engines: int, logs: Path) -> None:
        self.ctx = worker_context()
        self.fleet = fleet
        self.logs = logs
        self.procs: dict[str, Any] = {}
        for e in range(engines):
            self.start(f"engine{e}")
        self.start("writer")

    def log(self, name: str) -> Path:
        return self.logs / f"{name}.jsonl"

    def start(self, name: str) -> None:
        fn: Any = fault_load.writer if name == "writer" else fault_load.engine
        n = 0 if name == "writer" else int(name.removeprefix("engine"))
        args = (self.fleet.sockets, str(self.log(name)), n, RUN_S)
        p = self.ctx.Process(target=fn, args=args, name=name, daemon=True)
        p.start()
        watch_process(p.pid)  # a forkserver child: not this process's, so not ended with it
        self.procs[name] = p

    def kill(self, name: str) -> None:
        p = self.procs[name]
        p.kill()
        p.join(10)
        forget_process(p.pid)
        self.start(name)

    def stop(self) -> None:
        for p in self.procs.values():
            p.kill()
        for p in self.procs.values():
            p.join(10)
            forget_process(p.pid)

    def events(self, prefix: str) -> list[dict[str, Any]]:
        return [e for name in self.procs if name.startswith(prefix)
                for e in read_events(self.log(name))]  # fmt: skip


def kill_phase(
    fleet: FaultFleet, load: Load, kills: int, rng: random.Random
) -> tuple[Counter[str], list[tuple[int, float, float]]]:
    """``kills`` SIGKILLs at random moments; sidecars come back on their files.
    Returns the kills by target, and each sidecar's outage: (host, from, to)."""
    done: Counter[str] = Counter()
    outages = []
    engines = [n for n in load.procs if n.startswith("engine")]
    for _ in tqdm(range(kills), desc="kills", unit="kill", file=sys.stderr, leave=False):
        time.sleep(rng.uniform(0.2, 1.0))
        target = rng.choices(list(KILL_TARGETS), weights=list(KILL_TARGETS.values()))[0]
        if target.startswith("sidecar"):
            t0 = time.time()
            fleet.kill_sidecar(int(target[-1]))
            outages.append((int(target[-1]), t0, time.time()))
        elif target == "engine":
            target = rng.choice(engines)
            load.kill(target)
        else:
            load.kill("writer")
        done[target.rstrip("0123456789")] += 1
    return done, outages


def during_outage(e: dict[str, Any], outages: list[tuple[int, float, float]]) -> bool:
    """Whether an engine's failed call went to a sidecar that was down then: a
    call in flight at the kill, or made before the engine saw the new one."""
    return any(
        e["host"] == host and t0 <= e["t"] <= t1 + OUTAGE_GRACE_S for host, t0, t1 in outages
    )


def deltas(before: list[dict[str, int]], after: list[dict[str, int]]) -> dict[str, int]:
    """Counter growth over a window, both hosts summed (no window with a restart
    has these: a restarted sidecar counts from 0)."""
    out = {}
    for name in WATCHED:
        out[name] = sum(a.get(name, 0) - b.get(name, 0) for b, a in zip(before, after))
    return out


def window_figures(events: list[dict[str, Any]], t0: float, t1: float) -> dict[str, Any]:
    """What the engines met between wall times ``t0`` and ``t1``."""
    inside = [e for e in events if t0 <= e["t"] < t1]
    turns = [e for e in inside if e["op"] == "turn"]
    asked = sum(e["asked"] for e in turns)
    served = sum(e["served"] for e in turns)
    tiers: Counter[str] = Counter()
    for e in turns:
        tiers.update(e["tiers"])
    moved = [e for e in turns if e["moved"]]
    return {
        "turns": len(turns),
        "served": served,
        "checked": served,
        "wrong": sum(e["wrong"] for e in turns),
        "wrong_bytes": sum(e.get("wrong_bytes", 0) for e in turns),
        "recomputed": round((asked - served) / asked, 4) if asked else None,
        "failed": sum(e["op"] == "error" for e in inside),
        "failed_unexpected": sum(e["op"] == "error" and not e.get("expected") for e in inside),
        "failed_by_stage": dict(Counter(e["stage"] for e in inside if e["op"] == "error")),
        "unavailable": sum(e["op"] == "unavailable" for e in inside),
        "moved_turns": len(moved),
        "moved_recomputed": round(1 - sum(e["served"] for e in moved) /
                                  max(1, sum(e["asked"] for e in moved)), 4) if moved else None,
        "served_by_tier": dict(tiers),
        "durable_asked": sum(e["asked_durable"] for e in turns),
        "durable_granted": sum(e["durable"] for e in turns),
    }  # fmt: skip


def writer_audit(fleet: FaultFleet, events: list[dict[str, Any]], rng: random.Random) -> dict:
    """Load, on both hosts, every chain a kill may have cut mid-write and a sample of the rest."""
    ended = {e["chain"] for e in events if e["op"] in ("committed", "aborted")}
    reserved = [e for e in events if e["op"] == "reserved"]
    cut = [e for e in reserved if e["chain"] not in ended]
    rest = [e for e in reserved if e["chain"] in ended]
    picked = cut + rng.sample(rest, min(WRITER_SAMPLE, len(rest)))
    out = {"chains_cut": len(cut), "chains": len(picked), "checked": 0, "wrong": 0}
    for sock in fleet.sockets:
        with StoreClient(sock, connect_timeout_s=5.0, call_timeout_s=30.0) as c:
            for e in picked:
                keys = chain(e["chain"], e["n"])
                res = c.load(LAYOUT, keys)
                out["checked"] += res.num_blocks
                out["wrong"] += count_wrong(keys, res.blocks, res.num_blocks)
    return out


def durable_audit(socket: str, turns: list[dict[str, Any]]) -> dict[str, int]:
    """Each durable turn must load whole, byte-exact, from ``socket``'s host."""
    longest: dict[int, int] = {}
    for e in turns:
        longest[e["seed"]] = max(longest.get(e["seed"], 0), e["blocks"])
    got: dict[int, int] = {}
    out = {"durable_turns": len(turns), "sessions": len(longest), "checked": 0, "wrong": 0,
           "from_bucket": 0}  # fmt: skip
    with StoreClient(socket, connect_timeout_s=5.0, call_timeout_s=60.0) as c:
        for seed, n in longest.items():
            keys = chain(seed, n)
            res = c.load(LAYOUT, keys, include_peers=True, deadline_s=30.0)  # from the bucket
            got[seed] = res.num_blocks
            out["from_bucket"] += sum(t == TierName.REMOTE for t in res.tiers[: res.num_blocks])
            out["checked"] += res.num_blocks
            out["wrong"] += count_wrong(keys, res.blocks, res.num_blocks)
    out["durable_turns_lost"] = sum(got[e["seed"]] < e["blocks"] for e in turns)
    return out


def run(kills: int, hold_s: float, engines: int, seed: int, workdir: Path) -> dict[str, Any]:
    rng = random.Random(seed)
    logs = workdir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    windows: list[dict[str, Any]] = []
    with FaultFleet(workdir / "fleet") as fleet:

        def counters() -> list[dict[str, int]]:
            return [fleet.counters(0), fleet.counters(1)]

        load = Load(fleet, engines, logs)
        try:
            before, t0 = counters(), time.time()
            time.sleep(hold_s)
            windows.append(window("none", t0, 0.0, counters=deltas(before, counters())))
            t0 = time.time()
            killed, outages = kill_phase(fleet, load, kills, rng)
            restarts = sorted(fleet.restart_s) or [0.0]
            p50 = round(restarts[len(restarts) // 2], 3)
            windows.append(window("kills", t0, restarts[-1], restart_p50_s=p50))
            for kind in tqdm(KINDS[1:], desc="faults", file=sys.stderr, leave=False):
                before, t0 = counters(), time.time()
                fleet.apply(kind)
                time.sleep(hold_s / 2)
                fleet.worsen(kind)
                time.sleep(hold_s / 2)
                fleet.clear(kind)
                recover_s, probed = fleet.recover(kind, before[1])
                windows.append(window(kind, t0, recover_s, probe=probed,
                                      counters=deltas(before, counters())))  # fmt: skip
            time.sleep(1.0)
        finally:
            load.stop()
            stop_forkserver()
        engine_events = load.events("engine")
        writer = writer_audit(fleet, load.events("writer"), rng)
        durable_turns = [e for e in engine_events if e["op"] == "turn" and e["durable"]]
        fresh = fleet.fresh_host()
        durable = durable_audit(str(fresh.socket), durable_turns)
    for e in engine_events:
        if e["op"] == "error":
            e["expected"] = during_outage(e, outages)
    return report(windows, engine_events, killed, writer, durable, time.monotonic() - started)


def window(kind: str, t0: float, recover_s: float, **extra: Any) -> dict[str, Any]:
    """A fault's window: from ``t0`` to now (the end of its recovery)."""
    return {"kind": kind, "t0": t0, "t1": time.time(), "recover_s": round(recover_s, 3), **extra}


def report(windows: list[dict[str, Any]], events: list[dict[str, Any]], killed: Counter[str],
           writer: dict, durable: dict, took_s: float) -> dict[str, Any]:  # fmt: skip
    faults = {}
    for w in windows:
        fig = window_figures(events, w["t0"], w["t1"])
        probe = w.get("probe", {"checked": 0, "wrong": 0})
        fig["checked"] += probe["checked"]
        fig["wrong"] += probe["wrong"]
        fig["seconds"] = round(w["t1"] - w["t0"], 1)
        fig["recover_s"] = w["recover_s"]
        fig.update({k: w[k] for k in ("restart_p50_s", "counters") if k in w})
        faults[w["kind"]] = fig
    wrong = sum(f["wrong"] for f in faults.values()) + writer["wrong"] + durable["wrong"]
    checked = sum(f["checked"] for f in faults.values()) + writer["checked"] + durable["checked"]
    wrong_bytes = sum(f["wrong_bytes"] for f in faults.values())
    return {
        "kills": sum(killed.values()),
        "failed_unexpected": sum(f["failed_unexpected"] for f in faults.values()),
        "kills_by_target": dict(killed),
        "wrong_blocks": wrong,
        "wrong_bytes": wrong_bytes if not (writer["wrong"] or durable["wrong"]) else None,
        "checked_blocks": checked,
        "durable_turns_lost": durable["durable_turns_lost"],
        "durable": durable,
        "writer": writer,
        "faults": faults,
        "turns": sum(e["op"] == "turn" for e in events),
        "block_bytes": BLOCK,
        "took_s": round(took_s, 1),
    }


def table(out: dict[str, Any]) -> str:
    rows = [f"{'fault':12} {'served':>7} {'wrong':>5} {'recomp':>7} {'failed':>6} "
            f"{'unavail':>7} {'moved':>5} {'recover_s':>9}"]  # fmt: skip
    for kind, f in out["faults"].items():
        rec = f["recomputed"]
        share = "-" if rec is None else f"{rec:.3f}"
        rows.append(
            f"{kind:12} {f['served']:7d} {f['wrong']:5d} {share:>7} {f['failed']:6d} "
            f"{f['unavailable']:7d} {f['moved_turns']:5d} {f['recover_s']:9.2f}"
        )
    rows.append(f"kills {out['kills']} {out['kills_by_target']}; wrong blocks "
                f"{out['wrong_blocks']} of {out['checked_blocks']} checked; durable turns lost "
                f"{out['durable_turns_lost']} of {out['durable']['durable_turns']}")  # fmt: skip
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=100)
    ap.add_argument("--hold-s", type=float, default=15.0, help="how long each fault is held")
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--seed", type=int, default=40)
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="tierstore-faults-") as tmp:
        out = run(args.kills, args.hold_s, args.engines, args.seed, args.workdir or Path(tmp))
    print(json.dumps(out, indent=1) if args.json else table(out))


if __name__ == "__main__":
    main()
