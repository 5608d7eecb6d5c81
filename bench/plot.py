"""Charts for docs/benchmarks.md from the benchmarks' JSON output.

    python -m bench.engines.hf_ttft --json > ttft.json
    python -m bench.peer.tier --json > peer.json
    python -m bench.switch.run --simulate --json > sim.json
    python -m bench.engines.vllm_kv --json > vllm.json
    python -m bench.tiers.scale --json > scale.json
    python -m bench.engines.sglang_hicache --json > sglang.json
        (--copy-threads 1, --keep-warm-s 5 for the others)
    python -m bench.plot --sglang sglang*.json ...
    python -m bench.plot --ttft ttft.json --peer peer.json --routing sim.json \
        --vllm vllm.json --scale scale.json --out docs/img
    python -m bench.plot --fleet fleet.json

Needs matplotlib (not a tierstore dependency: `pip install matplotlib`).
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from bench.fleet.figures import conversations
from harness.chat_load import Sample


def plot_ttft(data: dict, out: Path) -> None:
    runs = data["runs"]
    labels = [f"{r['tokens'] // 1024}k" for r in runs]
    x = range(len(runs))
    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=120)
    ax.bar([i - 0.2 for i in x], [r["cold_ttft_s"] for r in runs], 0.4, label="cold (prefill)")
    ax.bar([i + 0.2 for i in x], [r["warm_ttft_s"] for r in runs], 0.4, label="warm (tierstore)")
    for i, r in enumerate(runs):
        ax.annotate(
            f"{r['speedup']:.0f}x",
            (i + 0.2, r["warm_ttft_s"]),
            ha="center",
            va="bottom",
            fontsize=9,
        )
    ax.set_yscale("log")
    ax.set_xticks(list(x), labels)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("time to first token (s, log)")
    m = data["model"]
    ax.set_title(f"TTFT, random Llama {m['num_hidden_layers']}x{m['hidden_size']}, 2 CPU cores")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "ttft.png")


def plot_peer(data: dict, out: Path) -> None:
    rows = [
        ("raw TCP", data["raw_tcp_gbps"], "#999"),
        ("ceiling, 1 hash (computed)", data.get("cpu_ceiling_one_hash_gbps"), "#bbb"),
        ("raw TCP + verify (measured)", data.get("raw_tcp_verified_gbps"), "#bbb"),
        ("peer fetch", data["peer_fetch_gbps"], "#4c72b0"),
        ("peer load", data["peer_load_gbps"], "#4c72b0"),
        ("import (push)", data["import_gbps"], "#55a868"),
        ("fetch, zstd", data["zstd_peer_fetch_gbps"], "#c44e52"),
    ]
    rows = [r for r in rows if r[1] is not None]  # runs before the ceiling was reported
    names, vals, colors = (list(c) for c in zip(*rows))
    fig, ax = plt.subplots(figsize=(6.4, 3.4), dpi=120)
    bars = ax.barh(names[::-1], vals[::-1], color=colors[::-1])
    for bar, v in zip(bars, vals[::-1]):
        ax.text(v, bar.get_y() + bar.get_height() / 2, f" {v:.2f}", va="center", fontsize=9)
    ax.set_xlim(0, max(vals) * 1.12)  # room for the labels
    ax.set_xlabel("GB/s, loopback, same run")
    ax.set_title(f"Peer transfer of a {data['delta_bytes'] / 2**20:.0f} MiB delta")
    fig.tight_layout()
    fig.savefig(out / "peer.png")


def plot_routing(data: dict, out: Path) -> None:
    """Affinity-with-spill vs the router in the simulated fleet (replication
    on, first link speed): warm share, TTFT p90 and replica traffic by hosts."""
    rows = [r for r in data.get("routing_rows", data["rows"]) if r["replication"]]
    routed = {r["hosts"] for r in rows if r.get("policy") == "router"}
    gbps = min(r["link_gbps"] for r in rows)
    rows = [r for r in rows if r["hosts"] in routed and r["link_gbps"] == gbps]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6), dpi=120)
    metrics = [
        ("warm", "warm share of host switches", (0, 1.02)),
        ("ttft_p90_s", "TTFT p90 (s)", None),
        ("replica_mbps_per_host", "replica traffic per host (Mb/s)", None),
    ]
    for ax, (key, label, ylim) in zip(axes, metrics):
        for color, sph in enumerate(sorted({r["sessions_per_host"] for r in rows})):
            for policy, style in (("affinity", ":"), ("router", "-")):
                rs = sorted(
                    (r for r in rows
                     if r["sessions_per_host"] == sph and r.get("policy", "affinity") == policy),
                    key=lambda r: r["hosts"],
                )  # fmt: skip
                ax.plot([r["hosts"] for r in rs], [r[key] for r in rs], style, marker="o",
                        color=f"C{color}", label=f"{policy}, {sph} sessions/host")  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_xlabel("hosts (4 slots each)")
        ax.set_ylabel(label)
        if ylim:
            ax.set_ylim(*ylim)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"Simulated fleet at {gbps:g} Gbit/s: affinity + spill (dotted) vs router (solid)")
    fig.tight_layout()
    fig.savefig(out / "routing.png")


VLLM_MODES = [
    ("cold_ttft_s", "cold (no connector)", "#999"),
    ("cold_with_store_ttft_s", "cold, saving to tierstore", "#bbb"),
    ("warm_ttft_s", "warm: tierstore DRAM", "#4c72b0"),
    ("warm_nvme_ttft_s", "warm: tierstore NVMe", "#55a868"),
    ("warm_peer_ttft_s", "warm: peer sidecar", "#8172b2"),
    ("example_warm_ttft_s", "warm: vLLM ExampleConnector", "#c44e52"),
    ("lmcache_warm_ttft_s", "warm: LMCache (MP server)", "#dd8452"),
]


def plot_vllm(datas: list[dict], out: Path, name: str = "vllm_ttft.png") -> None:
    """One group of bars per prompt length; with several runs of the bench,
    per run and length."""
    runs = [
        dict(
            r,
            label=f"run {k + 1}, {r['tokens']} tokens"
            if len(datas) > 1
            else f"{r['tokens']} tokens",
        )
        for k, data in enumerate(datas)
        for r in data["runs"]
    ]
    modes = [m for m in VLLM_MODES if m[0] in runs[0]]
    width = 0.8 / len(modes)
    fig, ax = plt.subplots(figsize=(7.2, 4.4), dpi=120)
    for j, (key, label, color) in enumerate(modes):
        xs = [i - 0.4 + width * (j + 0.5) for i in range(len(runs))]
        ax.bar(xs, [r[key] for r in runs], width, label=label, color=color)
    ax.set_yscale("log")
    ax.set_xticks(range(len(runs)), [r["label"] for r in runs])
    ax.set_ylabel("time to first token (s, log)")
    ax.set_title("vLLM (CPU build) TTFT, fresh engine processes, 2 CPU cores")
    ax.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.1))
    fig.tight_layout()
    fig.savefig(out / name)


SCALE_OPS = {
    "put_evict_us": "put with eviction",
    "lookup_us": "lookup",
    "acquire_us": "acquire (pin)",
    "release_us": "release a transfer's pins",
    "promote_us": "promotion from NVMe",
    "index_probe_us": "floor: one probe of a plain dict of n keys",
    "cold_lookup_us": "lookup, old prefix (caches flushed)",
    "cold_acquire_us": "acquire, old prefix",
    "cold_release_us": "release, old prefix",
    "cold_index_probe_us": "floor, old prefix",
}


def plot_scale(data: dict, out: Path) -> None:
    sizes = sorted(data["sizes"], key=int)
    held = [int(n) for n in sizes]
    fig, ax = plt.subplots(figsize=(8.4, 3.8), dpi=120)
    for op, label in SCALE_OPS.items():
        if op in data["sizes"][sizes[0]]:
            floor, cold = op.endswith("index_probe_us"), op.startswith("cold_")
            style = (":" if floor else "-.") if cold else ("--" if floor else "-")
            base = list(SCALE_OPS).index(op.removeprefix("cold_"))  # one color per operation
            ys = [data["sizes"][n][op] for n in sizes]
            ax.plot(held, ys, style, marker="o", color=f"C{base}", label=label)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("blocks held")
    ax.set_ylabel("us per block")
    ax.set_title(f"Cost per block vs blocks held ({data['block_bytes'] // 1024} KiB blocks)")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "scale.png")


RULE_LABELS = {
    "kv_share": "kv_share (min_tokens, after the turn)",
    "headroom": "headroom rule",
    "stream": "headroom + streamed during the turn",
}


def plot_rules(data: dict, out: Path) -> None:
    """Warm switches of cached context, and cold ones, per replication rule."""
    rows = [r for r in data["rows"] if r["replication"] and r["policy"] == "affinity"]
    gbps = min(r["link_gbps"] for r in rows)
    sph = max(r["sessions_per_host"] for r in rows)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9.6, 3.6), dpi=120)
    for rule, label in RULE_LABELS.items():
        pick = sorted(
            (r for r in rows if r["replicate"] == rule and r["link_gbps"] == gbps
             and r["sessions_per_host"] == sph),
            key=lambda r: r["hosts"],
        )  # fmt: skip
        if not pick:
            continue
        hosts = [r["hosts"] for r in pick]
        ax1.plot(hosts, [r["warm_of_cached"] for r in pick], marker="o", label=label)
        ax2.plot(hosts, [r["cold_of_cached"] for r in pick], marker="o", label=label)
    for ax, title in ((ax1, "warm share of switches (of cached)"), (ax2, "cold share")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("hosts")
        ax.set_title(title, fontsize=10)
        ax.grid(True, alpha=0.3)
    ax1.legend(fontsize=7)
    fig.suptitle(f"Simulated fleet, {gbps:g} Gbit/s, {sph} sessions per host: replication rules")
    fig.tight_layout()
    fig.savefig(out / "replication_rules.png")


def plot_sglang(datas: list[dict], out: Path) -> None:
    """Each bench/engines/sglang_hicache.py run's tierstore v1 rounds, backup and prefetch,
    coloured by mode (copy threads, memory kept warm), with half of memcpy."""
    fig, axes = plt.subplots(1, 2, figsize=(9.6, 3.8), dpi=120, sharey=True)
    styles = {"warm": ("#55a868", "2 threads, memory kept warm"),
              "two": ("#4c72b0", "2 threads"), "one": ("#dd8452", "1 thread")}  # fmt: skip
    shown: set[str] = set()
    for d in datas:
        mode = "warm" if d.get("keep_warm_s") else "one" if d["copy_threads"] == 1 else "two"
        color, label = styles[mode]
        for ax, step in zip(axes, ("backup", "prefetch")):
            runs = d["runs"]["tierstore"][step]
            ax.plot(range(1, len(runs) + 1), runs, "o-", color=color, alpha=0.8, ms=3,
                    label=None if mode in shown else label)  # fmt: skip
        shown.add(mode)
    limits = [d["memcpy_gbps"] for d in datas if d["copy_threads"] > 1]
    for ax, step in zip(axes, ("backup", "prefetch")):
        if limits:
            half = 0.5 * sorted(limits)[len(limits) // 2]
            ax.axhline(half, color="#999", ls="--", lw=1, label="0.5 of memcpy (2 threads)")
        ax.set_title(f"{step} through SGLang's controller")
        ax.set_xlabel("round (one 256 MiB conversation each)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("GB/s")
    axes[1].legend(fontsize=8)
    fig.suptitle("SGLang HiCache L3, tierstore v1 path, 8B KV shape, 2-core VM")
    fig.tight_layout()
    fig.savefig(out / "sglang_rounds.png")


FLEET_COLORS = {
    "tierstore": "#55a868",
    "tierstore_no_preposition": "#8172b3",
    "prefix_aware": "#4c72b0",
    "least_loaded": "#dd8452",
    "round_robin": "#c44e52",
}


def plot_fleet(data: dict, out: Path, name: str = "fleet_ttft.png") -> None:
    """The returning turns' TTFT distribution of each mode of a bench.fleet.run
    (every repeat's turns together), and its switched turns beside."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.9), dpi=120)
    for mode, figures in data["modes"].items():
        back, switched = [], []
        for run in figures["runs"]:
            for turns in conversations([Sample(**row) for row in run["samples"]]):
                for prev, cur in itertools.pairwise(turns):
                    if cur.error or prev.error or cur.ttft_s is None:
                        continue
                    back.append(cur.ttft_s)
                    if cur.served_by != prev.served_by:
                        switched.append(cur.ttft_s)
        color = FLEET_COLORS.get(mode)
        for ax, values in zip(axes, (back, switched)):
            if values:
                xs = sorted(values)
                ys = [(i + 1) / len(xs) for i in range(len(xs))]
                ax.step(xs, ys, where="post", color=color, label=f"{mode} ({len(xs)})")
    ticks = [0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50]
    for ax, title in zip(axes, ("returning turns", "turns that moved to another host")):
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(matplotlib.ticker.FixedLocator(ticks))
        ax.xaxis.set_major_formatter(matplotlib.ticker.FixedFormatter([f"{t:g}" for t in ticks]))
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlabel("time to first token (s, log scale)")
        ax.set_title(title)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7, loc="lower right")
    axes[0].set_ylabel("share of turns")
    link = data.get("link", "")
    fig.suptitle(f"Two vLLM engines behind the gateway, {link} link, "
                 f"{data.get('repeats', 1)} repeat(s) a mode")  # fmt: skip
    fig.tight_layout()
    fig.savefig(out / name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ttft", type=Path)
    parser.add_argument("--peer", type=Path)
    parser.add_argument("--routing", type=Path, help="bench.switch.run --simulate --json output")
    parser.add_argument(
        "--vllm", type=Path, nargs="+", help="bench.engines.vllm_kv --json output(s)"
    )
    parser.add_argument("--vllm-name", default="vllm_ttft.png", help="the vLLM chart's file")
    parser.add_argument("--scale", type=Path, help="bench.tiers.scale --json output")
    parser.add_argument("--rules", type=Path, help="bench.switch.run --simulate --json output")
    parser.add_argument(
        "--sglang", type=Path, nargs="+", help="bench.engines.sglang_hicache --json output(s)"
    )
    parser.add_argument("--fleet", type=Path, help="bench.fleet.run --json output")
    parser.add_argument("--fleet-name", default="fleet_ttft.png", help="the fleet chart's file")
    parser.add_argument("--out", type=Path, default=Path("docs/img"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.ttft:
        plot_ttft(json.loads(args.ttft.read_text()), args.out)
    if args.peer:
        plot_peer(json.loads(args.peer.read_text()), args.out)
    if args.routing:
        plot_routing(json.loads(args.routing.read_text()), args.out)
    if args.vllm:
        plot_vllm([json.loads(f.read_text()) for f in args.vllm], args.out, args.vllm_name)
    if args.scale:
        plot_scale(json.loads(args.scale.read_text()), args.out)
    if args.rules:
        plot_rules(json.loads(args.rules.read_text()), args.out)
    if args.sglang:
        plot_sglang([json.loads(f.read_text()) for f in args.sglang], args.out)
    if args.fleet:
        plot_fleet(json.loads(args.fleet.read_text()), args.out, args.fleet_name)


if __name__ == "__main__":
    main()
