"""Soak for growth: does a sidecar's memory, open files or thread count creep
under a long mixed load?

The fleet and the load are the fault bench's (bench/reliability/faults.py:
two sidecars in namespaces, peered through etcd, the remote tier on
SeaweedFS; engines moving sessions between the hosts, every block they get
back checked, every third turn durable; a two-phase writer), with no fault.
Every ``--sample-s`` seconds each sidecar's RSS (VmRSS, and RssAnon: the
heap, what a leak grows), open file descriptors and threads are read from
/proc. After ``--warmup-min`` (queues and caches filling to their bounds),
growth is the mean of the last minute against the mean of the first minute
after warm-up: ``(last - first) / first``. Target: <= 5% for each figure.

    python -m bench.reliability.flat --minutes 20 --json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from tqdm import tqdm

from bench.reliability.faults import Load
from harness.fault_fleet import FaultFleet
from harness.reliability import stop_forkserver
from harness.sidecar import SidecarProcess

FIGURES = ("rss_kib", "anon_kib", "fds", "threads")


def sample(sidecar: SidecarProcess) -> dict[str, int]:
    """The sidecar's RSS and anonymous RSS (KiB), open fds and threads."""
    mem, pid = sidecar.memory_kib(), sidecar.pid
    return {"rss_kib": mem["VmRSS"], "anon_kib": mem["RssAnon"],
            "fds": len(os.listdir(f"/proc/{pid}/fd")),
            "threads": len(os.listdir(f"/proc/{pid}/task"))}  # fmt: skip


def thread_names(pid: int) -> dict[str, int]:
    """How many of ``pid``'s threads carry each name (what a growing count is made of)."""
    names: Counter[str] = Counter()
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/comm") as f:
            names[re.sub(r"[_-]?\d+$", "", f.read().strip())] += 1
    return dict(sorted(names.items()))


def growth(series: list[dict[str, Any]], warmup_s: float) -> dict[str, Any]:
    """Per figure: the first and last minute's means after warm-up, and the growth."""
    after = [s for s in series if s["t"] >= warmup_s]
    if not after or after[-1]["t"] - after[0]["t"] < 120:
        raise ValueError("too short: growth needs at least 2 minutes after warm-up")
    first = [s for s in after if s["t"] < after[0]["t"] + 60]
    last = [s for s in after if s["t"] > after[-1]["t"] - 60]
    out: dict[str, Any] = {}
    for fig in FIGURES:
        a = statistics.fmean(s[fig] for s in first)
        b = statistics.fmean(s[fig] for s in last)
        out[fig] = {"first": round(a, 1), "last": round(b, 1), "max": max(s[fig] for s in after),
                    "growth": round((b - a) / a, 4)}  # fmt: skip
    return out


def run(minutes: float, warmup_min: float, sample_s: float, workdir: Path) -> dict[str, Any]:
    series: list[list[dict[str, Any]]] = [[], []]
    with FaultFleet(workdir / "fleet") as fleet:
        (workdir / "logs").mkdir(parents=True, exist_ok=True)
        load = Load(fleet, 2, workdir / "logs")
        start = time.monotonic()
        pids = [sc.pid for sc in fleet.sidecars]
        named: dict[str, list[dict[str, int]]] = {"after_warmup": [], "end": []}
        try:
            steps = int(minutes * 60 / sample_s)
            for _ in tqdm(range(steps), desc="soak", unit="sample", file=sys.stderr):
                time.sleep(sample_s)
                for i, pid in enumerate(pids):
                    if not fleet.sidecars[i].alive() or fleet.sidecars[i].pid != pid:
                        raise RuntimeError(f"sidecar {i} died during the soak")
                    t = round(time.monotonic() - start, 1)
                    series[i].append({"t": t, **sample(fleet.sidecars[i])})
                if not named["after_warmup"] and time.monotonic() - start >= warmup_min * 60:
                    named["after_warmup"] = [thread_names(pid) for pid in pids]
            named["end"] = [thread_names(pid) for pid in pids]
        finally:
            load.stop()
            stop_forkserver()
        events = load.events("engine")
        counters = [fleet.counters(i) for i in range(2)]
    turns = [e for e in events if e["op"] == "turn"]
    hosts = [growth(s, warmup_min * 60) for s in series]
    worst = {fig: max(h[fig]["growth"] for h in hosts) for fig in FIGURES}
    return {
        "minutes": minutes,
        "warmup_min": warmup_min,
        "rss_growth": worst["rss_kib"],
        "anon_growth": worst["anon_kib"],
        "fds_growth": worst["fds"],
        "threads_growth": worst["threads"],
        "hosts": hosts,
        "turns": len(turns),
        "blocks_checked": sum(e["served"] for e in turns),
        "wrong_blocks": sum(e["wrong"] for e in turns),
        "failed": sum(e["op"] == "error" for e in events),
        "worker_failures": [c.get("worker_failures") for c in counters],
        "threads_by_name": named,
        "series": series,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=20.0)
    ap.add_argument("--warmup-min", type=float, default=3.0)
    ap.add_argument("--sample-s", type=float, default=5.0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="tierstore-flat-") as tmp:
        out = run(args.minutes, args.warmup_min, args.sample_s, Path(tmp))
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        for i, h in enumerate(out["hosts"]):
            figs = [f"{k} {v['first']:.0f} -> {v['last']:.0f} ({v['growth']:+.1%})"
                    for k, v in h.items()]  # fmt: skip
            print(f"host {i}: " + ", ".join(figs))
        print(f"{out['turns']} turns, {out['blocks_checked']} blocks checked, "
              f"{out['wrong_blocks']} wrong, {out['failed']} failed calls")  # fmt: skip


if __name__ == "__main__":
    main()
