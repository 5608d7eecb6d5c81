"""One real run of the switch benchmark (``bench/switch/run.py``): two hosts
in namespaces (``bench.switch.hosts``), the sessions (``bench.switch.driver``),
and the run's figures next to the public write-up's (``PUBLIC``,
``TARGETS``): switch warmth, send, receive and import times (each also at
its scale-1 equivalent), the import next to memcpy of the same bytes, link
bytes and utilisation, the sidecars' counters, CPU use, and the replay of
the run's turns with a perfect sender (``bench.switch.diag``): in hindsight
(what any order could hold), in the sidecars' own order (oldest first)
and in another a sender could run (shortest first), which tells a switch
lost to the order from one lost to the sending (``oracle.online_orders``).
Needs root; runs in the benchmark's process.
"""

from __future__ import annotations

import os
import resource
import shutil
import time
from collections import Counter
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

from bench.limits import memcpy_gbps
from bench.switch.diag import oracle_switches, peak_offered_load, replica_jobs
from bench.switch.driver import Driver, scaled_layout
from bench.switch.hosts import (
    CLEANUPS,
    DRAM_BYTES_SCALE1,
    LINK_BPS,
    LINKS,
    NVME_BYTES_SCALE1,
    PEER_PORT,
    REPLICA_BYTES_SCALE1,
    SUBNET,
    EngineImports,
    host_sidecar,
    scaled_bytes,
    stop_sidecar,
)
from bench.switch.workload import Workload, percentile, shares
from harness.netns import Network
from harness.sidecar import SidecarProcess
from tierstore.client import StoreClient

MIN_TOKENS = 8192
PUBLIC: dict[str, Any] = {  # the write-up's 16-session runs
    "1gbit": {"warm": 0.938, "partly_warm": 0.054, "cold": 0.01, "send_p50_s": 3.24},
    "10gbit": {"warm": 0.968, "partly_warm": 0.022, "cold": 0.01, "send_p50_s": 0.81},
    "unshaped": {"warm": 0.962, "send_p50_s": 0.55},
    "import_s": 2.8,
    "mbps_per_direction_1gbit": [320, 450],
}
TARGETS = {
    "warm_1gbit_16": 0.99,  # issue 6: every switch
    "cold_1gbit_16": 0.0,
    "import_p50_s_scale1": 0.28,
    "warm_of_cached_1gbit_16": 0.99,  # issue 39: affinity and router, each run
}


# -- one run ----------------------------------------------------------------------------------


def real_run(
    link: str,
    sessions: int,
    replication: bool,
    policy: str,
    scale: Fraction,
    duration_s: float,
    tmp: Path,
    nvme_bytes: int | None = None,
    settings: tuple[str, ...] = (),
) -> dict[str, Any]:
    wl = Workload()
    layout = scaled_layout(scale, wl)
    net = Network(2, LINKS[link], subnet=SUBNET, prefix="tsw")
    CLEANUPS.append(net)
    cars: list[SidecarProcess] = []
    min_tokens = MIN_TOKENS if replication else 1 << 40
    try:
        for i in range(2):
            car = host_sidecar(
                tmp / f"{link}-{sessions}-{int(replication)}-{i}",
                net.ns[i],
                net.addr[i],
                net.addr[1 - i],
                min_tokens,
                scaled_bytes(DRAM_BYTES_SCALE1, scale),
                scaled_bytes(NVME_BYTES_SCALE1, scale) if nvme_bytes is None else nvme_bytes,
                scaled_bytes(REPLICA_BYTES_SCALE1, scale),
                # Off: kv_share's rule with an unreachable min_tokens, nothing streamed.
                replicate_policy="headroom" if replication else "kv_share",
                stream=replication,
                settings=settings,
            )
            cars.append(car)
            CLEANUPS.append(car)
            car.start(wait=False)
        for car in cars:
            car.wait_serving(timeout_s=60.0)
        members = [f"{a}:{PEER_PORT}" for a in net.addr]
        clients = {m: StoreClient(str(c.socket), name=f"engine-{m}") for m, c in zip(members, cars)}
        engines: dict[str, EngineImports] = {}
        try:
            slot_blocks = (
                wl.max_context_tokens + wl.input_max_tokens + wl.output_tokens[1]
            ) // wl.block_tokens + 1
            for m, c in zip(members, cars):
                engines[m] = EngineImports(str(c.socket), layout, slot_blocks)
                CLEANUPS.append(engines[m])
            for e in engines.values():
                e.wait_ready()
            tx0 = [net.tx_bytes(i) for i in range(2)]
            driver = Driver(
                clients, layout, wl, float(scale), sessions, duration_s, MIN_TOKENS, engines,
                policy, stream=replication,
            )  # fmt: skip
            cpu0 = _cpu_now([c.proc.pid for c in cars])
            t0 = time.monotonic()
            st = driver.run()
            driver_busy = dict(driver.busy_s)
            wall = time.monotonic() - t0
            cpu = _cpu_used(cpu0, _cpu_now([c.proc.pid for c in cars]), wall)
            tx = [net.tx_bytes(i) - tx0[i] for i in range(2)]
            counters = [dict(c.stat().counters) for c in clients.values()]
            fetched = [c.get("peer_fetched_bytes", 0) for c in counters]
        finally:
            for e in engines.values():
                e.close()
                CLEANUPS.remove(e)
            for client in clients.values():
                client.close()
    finally:
        for car in cars:
            stop_sidecar(car)
            CLEANUPS.remove(car)
            shutil.rmtree(car.root, ignore_errors=True)  # its NVMe files: GBs per run
        net.close()
        CLEANUPS.remove(net)
    s = float(scale)
    bps = LINK_BPS[link]
    mbps = [b * 8 / wall / 1e6 for b in tx]
    delta = st.pushed_blocks * layout.block_bytes / st.pushes if st.pushes else 0

    def q(values: list[float], p: float, k: float = 1.0) -> float | None:
        v = percentile(values, p)
        return None if v is None else v / k

    # The receiver's time not covered by the wire: import_s minus the push's
    # bytes at the link rate (an upper bound: it also holds the link shared
    # with other pushes, and the Replicate and OpenFetch round trips).
    beyond_wire = [t - b * 8 / bps for t, b in zip(st.import_s, st.push_bytes)] if bps else []
    import_bytes_p50 = percentile(st.engine_import_bytes, 50)
    import_gbps = [b / t / 1e9 for b, t in zip(st.engine_import_bytes, st.engine_import_s) if t]
    memcpy = memcpy_gbps(int(import_bytes_p50)) if import_bytes_p50 else None
    # Each import next to the memcpy of the same bytes the engine ran right
    # after it (same process, same moment): DRAM-resident prefixes apart from
    # those read partly from NVMe.
    paired = list(zip(st.engine_import_s, st.engine_import_memcpy_s, st.engine_import_from_dram))
    vs_dram = [m / t for t, m, dram in paired if t > 0 and dram]
    vs_nvme = [m / t for t, m, dram in paired if t > 0 and not dram]
    # How much of a DRAM-resident import's wall time its thread was on a CPU
    # (the rest: control-call replies, and other processes on the cores).
    timed = zip(st.engine_import_s, st.engine_import_cpu_s, st.engine_import_from_dram)
    on_cpu = [c / t for t, c, dram in timed if t > 0 and dram]

    busy = list(driver_busy.values())
    return {
        "link": link,
        "sessions": sessions,
        "replication": replication,
        "policy": policy,
        "turns": st.turns,
        # Time to first token of every turn: wait for a slot + the import at
        # a switch + the simulated prefill of what was not reused.
        "ttft_mean_s_scale1_equiv": float(np.mean(st.ttft_s)) / s if st.ttft_s else None,
        "ttft_p90_s_scale1_equiv": q(st.ttft_s, 90, s),
        "wait_mean_s_scale1_equiv": float(np.mean(st.wait_s)) / s if st.wait_s else None,
        # The router's lookups of the prompt on both hosts, included in the
        # wait: a per-call cost, so its scale-1 equivalent is inflated by 1/s.
        "router_lookup_p50_s": q(st.lookup_s, 50),
        "router_lookup_mean_s_scale1_equiv": float(np.mean(st.lookup_s)) / s
        if st.lookup_s
        else None,
        # Load balance: the busier host's slot-seconds over the mean host's.
        "busy_max_over_mean": max(busy) / float(np.mean(busy)) if any(busy) else None,
        **shares(st.outcomes),
        "reuse_mean": float(np.mean(st.reuse)) if st.reuse else None,
        "pushes": st.pushes,
        "delta_bytes_mean": delta,
        "delta_bytes_scale1_equiv": delta / s,
        "send_p50_s": q(st.send_s, 50),
        "send_p90_s": q(st.send_s, 90),
        # The receiver's Replicate: from the call until the delta is resident
        # (the wire included: part of the send), and what the wire leaves.
        "receive_p50_s": q(st.import_s, 50),
        "receive_p90_s": q(st.import_s, 90),
        "receive_p50_s_scale1_equiv": q(st.import_s, 50, s),
        "receive_p90_s_scale1_equiv": q(st.import_s, 90, s),
        "receive_beyond_wire_p50_s": q(beyond_wire, 50),
        "receive_beyond_wire_p90_s": q(beyond_wire, 90),
        "receive_beyond_wire_p50_s_scale1_equiv": q(beyond_wire, 50, s),
        "receive_beyond_wire_p90_s_scale1_equiv": q(beyond_wire, 90, s),
        # Measured by the receiver: from the last byte until the delta was
        # resident (what beyond_wire bounds from above).
        "receive_tail_p50_s": q(st.tail_s, 50),
        "receive_tail_p90_s": q(st.tail_s, 90),
        "receive_tail_p50_s_scale1_equiv": q(st.tail_s, 50, s),
        "receive_tail_p90_s_scale1_equiv": q(st.tail_s, 90, s),
        "send_p50_s_scale1_equiv": q(st.send_s, 50, s),
        "send_p90_s_scale1_equiv": q(st.send_s, 90, s),
        # The import as in the public write-up: the serving engine's ingest
        # after the replica arrived, here its load of the reused prefix at a
        # switch, next to memcpy of the same bytes measured in this run.
        "import_p50_s": q(st.engine_import_s, 50),
        "import_p90_s": q(st.engine_import_s, 90),
        "import_p50_s_scale1_equiv": q(st.engine_import_s, 50, s),
        "import_p90_s_scale1_equiv": q(st.engine_import_s, 90, s),
        "import_bytes_p50": import_bytes_p50,
        "import_gbps_p50": q(import_gbps, 50),
        "memcpy_gbps": memcpy,
        "import_p50_s_at_memcpy_scale1_equiv": (
            import_bytes_p50 / (memcpy * 1e9) / s if memcpy and import_bytes_p50 else None
        ),
        "imports_from_dram": len(vs_dram),
        "imports_partly_nvme": len(vs_nvme),
        "import_vs_memcpy_dram_p50": q(vs_dram, 50),
        "import_vs_memcpy_dram_p10": q(vs_dram, 10),
        "import_vs_memcpy_nvme_p50": q(vs_nvme, 50),
        "import_on_cpu_share_dram_p50": q(on_cpu, 50),
        "bytes_a_to_b": fetched[1],
        "bytes_b_to_a": fetched[0],
        "wire_bytes_a_to_b": tx[0],
        "wire_bytes_b_to_a": tx[1],
        "mbps_a_to_b": mbps[0],
        "mbps_b_to_a": mbps[1],
        "link_util_mean": (sum(mbps) / 2 * 1e6 / bps) if bps else None,
        "same_host_misses": st.same_host_misses,
        **{
            f"{k}_of_cached": v
            for k, v in shares([e["class_of_cached"] for e in st.switch_log]).items()
            if k != "switches"
        },
        "switch_causes": dict(Counter(e["cause"] for e in st.switch_log)),
        "switch_causes_not_warm": dict(
            Counter(e["cause"] for e in st.switch_log if e["class"] != "warm")
        ),
        "pushes_unfinished_at_next_turn": st.pushes_unfinished_at_next_turn,
        "push_slack_p10_s_scale1_equiv": q(st.push_slack_s, 10, s),
        "slot_excess_p50_s_scale1_equiv": q(st.slot_excess_s, 50, s),
        "slot_excess_p90_s_scale1_equiv": q(st.slot_excess_s, 90, s),
        "sidecar_counters": [{k: c.get(k, 0) for k in SIDECAR_COUNTERS} for c in counters],
        "cpu": cpu,
        "switch_log": st.switch_log,
        "turn_log": st.turn_log,
        "oracle": _oracle(st, bps / 8 if bps else None, layout.block_bytes),
        "wall_s": wall,
        "errors": st.errors[:10],
        "error_count": len(st.errors),
    }


ORACLE_WINDOWS_S = (0.25, 1.0, 4.0)  # at the run's scale: 8, 32 and 128 s at 1/32


def _oracle(st: Any, link_bytes_per_s: float | None, block_bytes: int) -> dict[str, Any] | None:
    """The run's turns replayed with a perfect sender (``bench.switch.diag``):
    what any order of the link could have held at each switch, next to what
    the sidecars held; and each uplink's peak offered load."""
    if not link_bytes_per_s or not st.turn_log:
        return None
    real = {(e["session"], e["t_s"]): e for e in st.switch_log}

    def replay(order: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """The switches replayed with a perfect sender in ``order``, and the
        real switches it kept warm that the sidecars did not."""
        switches = oracle_switches(st.turn_log, link_bytes_per_s, block_bytes, order)
        pairs = [(o, real.get((o["session"], round(o["t_s"], 3)))) for o in switches]
        lost = [
            {**r, "oracle_held": o["oracle_held"]}
            for o, r in pairs
            if r is not None
            and o["oracle_class_of_cached"] == "warm"
            and r["class_of_cached"] != "warm"
        ]
        return switches, lost

    oracle, lost_by_sender = replay("deadline")
    jobs = replica_jobs(st.turn_log, block_bytes)
    online = {}
    for order in ("oldest", "shortest"):
        switches, lost = replay(order)
        allowed = sum(o["oracle_class_of_cached"] == "warm" for o in switches)
        online[order] = {
            "warm_of_cached": shares([o["oracle_class_of_cached"] for o in switches])["warm"],
            # Of the switches this order keeps warm, the share the sidecars kept.
            "sidecars_kept_of_allowed": (allowed - len(lost)) / allowed if allowed else None,
            "not_warm_t_s": [
                round(o["t_s"], 3) for o in switches if o["oracle_class_of_cached"] != "warm"
            ],
            "lost_by_sender": lost,
        }
    return {
        "switches": len(oracle),
        **{
            f"{k}_of_cached": v
            for k, v in shares([o["oracle_class_of_cached"] for o in oracle]).items()
            if k != "switches"
        },
        # Switches a perfect sender keeps warm that the sidecars did not, and the reverse.
        "lost_by_sender": lost_by_sender,
        "not_warm_for_any_sender": [o for o in oracle if o["oracle_class_of_cached"] != "warm"],
        # The same perfect sender (no per-push cost, the link whole) in an
        # order that needs no hindsight: ``oldest`` is the sidecars' own. A
        # switch it loses is lost to the order; one it keeps that the
        # sidecars lost (its ``lost_by_sender``) is lost to the sending.
        "online_orders": online,
        "offered_bytes": {h: sum(j.nbytes for j in js) for h, js in jobs.items()},
        "peak_offered_load": {
            str(w): {h: peak_offered_load(js, w, link_bytes_per_s) for h, js in jobs.items()}
            for w in ORACLE_WINDOWS_S
        },
    }


SIDECAR_COUNTERS = (  # reported per sidecar: where blocks went
    "dropped_blocks",  # evicted from DRAM without an NVMe copy
    "spilled_blocks",  # evicted from DRAM to NVMe
    "replica_bytes",
    "peer_pushes",
    "peer_pushes_dropped",
    "peer_push_errors",
    "peer_replicas_imported",
    "peer_replicas_rejected",
    "peer_fetch_errors",
)


def _cpu_now(pids: list[int]) -> dict[str, float]:
    """CPU seconds of each sidecar and this process, and the machine's busy
    and total jiffies (/proc): is the run CPU-bound?"""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for name, pid in zip("ab", pids):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            out[f"sidecar_{name}"] = (int(fields[11]) + int(fields[12])) / tick
        except (OSError, IndexError, ValueError):
            out[f"sidecar_{name}"] = 0.0
    ru = resource.getrusage(resource.RUSAGE_SELF)
    out["driver"] = ru.ru_utime + ru.ru_stime
    cpu = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    out["machine_total"] = sum(cpu) / tick
    out["machine_idle"] = (cpu[3] + cpu[4]) / tick
    return out


def _cpu_used(before: dict[str, float], after: dict[str, float], wall: float) -> dict[str, Any]:
    d = {k: after[k] - before[k] for k in before}
    total = d.pop("machine_total")
    idle = d.pop("machine_idle")
    return {
        **{f"{k}_cpu_s": round(v, 2) for k, v in d.items()},
        "cores": os.cpu_count(),
        "machine_busy_share": round(1 - idle / total, 3) if total > 0 else None,
        "wall_s": round(wall, 2),
    }
