"""Charts of the switch benchmark (``bench/switch/run.py --charts DIR``):
host-switch warmth of the real runs next to the public write-up's, and the
simulated fleet's warmth and replica traffic by fleet size. Runs in the
benchmark's process (matplotlib, Agg).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.switch.real import PUBLIC


def chart_warmth(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = [
        (f"public\n{link}\n16 sess", PUBLIC[link]["warm"], PUBLIC[link]["partly_warm"], 0.01)
        for link in ("1gbit", "10gbit")
    ]
    for r in result["runs"]:
        if r["switches"]:
            label = f"{r['link']}\n{r['sessions']} sess" + (
                "" if r["replication"] else "\nrepl off"
            )
            bars.append((label, r["warm"], r["partly_warm"], r["cold"]))
    fig, ax = plt.subplots(figsize=(10, 4.5))
    xs = range(len(bars))
    warm = [b[1] for b in bars]
    partly = [b[2] for b in bars]
    cold = [b[3] for b in bars]
    ax.bar(xs, warm, color="#2a9d8f", label="warm (>= 90% reused)")
    ax.bar(xs, partly, bottom=warm, color="#e9c46a", label="partly warm (30-90%)")
    ax.bar(xs, cold, bottom=[w + p for w, p in zip(warm, partly)], color="#e76f51", label="cold")
    ax.set_xticks(list(xs), [b[0] for b in bars], fontsize=8)
    ax.set_ylabel("share of host switches")
    ax.set_ylim(0, 1.05)
    ax.set_title(f"Host switches, two namespaces, scale {result['scale']} (first two: public)")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def chart_fleet(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    series: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in rows:
        series.setdefault((r["sessions_per_host"], r["link_gbps"], r["replication"]), []).append(r)
    for (sph, gbps, repl), rs in sorted(series.items()):
        rs.sort(key=lambda r: r["hosts"])
        label = f"{sph} sess/host, " + (f"{gbps:g} Gbit/s" if repl else "replication off")
        style = "-" if repl else ":"
        hosts = [r["hosts"] for r in rs]
        ax1.plot(hosts, [r["warm"] for r in rs], style, marker="o", label=label)
        if repl:
            ax2.plot(
                hosts, [r["replica_mbps_per_host"] for r in rs], style, marker="o", label=label
            )
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("hosts (4 slots each)")
        ax.grid(alpha=0.3)
    ax1.set_ylabel("warm share of host switches")
    ax1.set_ylim(0, 1.02)
    ax2.set_ylabel("replica traffic per host (Mb/s)")
    ax1.legend(fontsize=7)
    ax2.legend(fontsize=7)
    fig.suptitle("Simulated fleet: affinity + spill, kv_share to the rendezvous spill host")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
