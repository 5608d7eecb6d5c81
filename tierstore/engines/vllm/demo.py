"""``tierstore demo --engine vllm``: the session switch with real vLLM engines.

The same story as the HF demo (``tierstore.cli.demo``), with vLLM's CPU
build serving a random-weight Llama (built from a config, nothing
downloaded) through ``TierstoreConnector``: two sidecars in a group ("host
A", "host B"), two turns of a conversation on an engine on host A (each turn
ends with a replica push to B), then the session moves to host B, where a
fresh engine without the connector gives the cold time to first token and a
fresh engine with it the warm one. It prints both, the tokens reused,
the blocks B's store served the warm engine (and how many of them it
fetched from A at load time), and whether the greedy outputs are equal.

The oracle (``compare_outputs``): the warm engine's prefix was computed on
A in two prefill chunks (turn 1, then turn 2 on top of A's own cache); a
cold full prefill of the same prompt rounds bf16 differently, store or no
store. So the reference is the cold engine again, its prefix cache reset,
running turn 1, turn 2 and the switch prompt: the same chunks, without any
store. The warm output must equal it over ``SWITCH_TOKENS`` greedy tokens,
and the reference must have reused as many tokens from its own cache as
the warm engine did from the store (else the demo fails: no like-for-like
reference). The cold full prefill's agreement with the reference is
reported, not required.
Three engine starts dominate its run time; each engine runs vLLM's worker
inside the engine's process (``in_process``, as a one-GPU engine can),
which starts in about 10 s here instead of 20-40 s. The HF demo stays the
default.

Runs in the foreground; the sidecars and engines are child processes,
stopped (and their files removed) at the end, on error and on Ctrl-C.
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path
from typing import Any

from tierstore.cli.demo import two_hosts
from tierstore.client import StoreClient
from tierstore.engines.vllm.driver import Output, VllmEngine, kv_transfer_config, tiny_llama
from tierstore.errors import TierstoreError

REPLICA_WAIT_S = 60.0
NEW_TOKENS = 16  # generated per turn on host A
SWITCH_TOKENS = 32  # generated on host B (cold, reference, warm) and compared
ROUNDING_NOTE = (
    "a full prefill rounds bf16 differently from a prefill in two chunks; "
    "the same happens without any store"
)


class DemoError(TierstoreError):
    """The demo could not build a like-for-like reference."""


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where ``a`` and ``b`` differ (a length
    difference counts), or None when they are equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare_outputs(
    warm: Output, reference: Output, cold: Output, reference_turn_reused: list[int],
    turn_reused: list[int],
) -> dict[str, Any]:  # fmt: skip
    """The demo's verdict. ``reference`` is a no-store engine that computed
    the prefix in the same chunks as host A (``reference_turn_reused``: the
    tokens it reused on each turn, which must be A's ``turn_reused``) and
    reused from its own cache what the warm engine reused from the store;
    raises DemoError when it did not, since the comparison would not be
    like for like. ``cold`` (one full prefill) is compared with the
    reference, as information only."""
    if (
        reference_turn_reused != turn_reused
        or reference.num_cached_tokens != warm.num_cached_tokens
    ):
        raise DemoError(
            f"the reference engine reused {reference_turn_reused} tokens on its turns and "
            f"{reference.num_cached_tokens} on the switch prompt; host A reused {turn_reused} "
            f"and the warm engine {warm.num_cached_tokens}: not a like-for-like reference"
        )
    warm_diff = first_difference(warm.token_ids, reference.token_ids)
    # Both without a store: only how the prefix was chunked differs.
    cold_diff = first_difference(cold.token_ids, reference.token_ids)
    return {
        "compared_tokens": len(warm.token_ids),
        "outputs_equal": warm_diff is None,
        "warm_first_difference": warm_diff,
        "reference_cached_tokens": reference.num_cached_tokens,
        "reference_turn_reused_tokens": reference_turn_reused,
        "cold_equal": cold_diff is None,
        "cold_first_difference": cold_diff,
    }


def _say(quiet: bool, what: str) -> None:
    if not quiet:
        print(f"  {what} ...", file=sys.stderr, flush=True)


def _wait_for_replica(socket: Path, deadline_s: float) -> int:
    """Bytes of replicas host B holds, once A's push has landed (or at the deadline)."""
    deadline = time.monotonic() + deadline_s
    with StoreClient(str(socket)) as c:
        while True:
            held = int(c.stat().counters["replica_bytes"])
            if held or time.monotonic() > deadline:
                return held
            time.sleep(0.2)


def _served_on(socket: Path) -> dict[str, int]:
    """What a sidecar has served so far: blocks pinned for engines (DRAM
    hits: every block a load gets passes through a pin, wherever it was
    found), blocks fetched from a peer, and replica blocks imported."""
    with StoreClient(str(socket)) as c:
        stat = c.stat()
    dram = next(t for t in stat.tiers if t.name == "dram")
    return {
        "pinned": int(dram.hits),
        "fetched_from_peer": int(stat.counters.get("peer_fetched_blocks", 0)),
        "replicas_imported": int(stat.counters.get("peer_replicas_imported", 0)),
    }


def _reference(
    engine: VllmEngine, turn_prompts: list[list[int]], switch_prompt: list[int]
) -> tuple[Output, list[int]]:
    """The switch prompt's output on a no-store engine whose KV was computed
    in host A's chunks: its prefix cache emptied, it runs A's turns first.
    Returns that output and the tokens each turn reused from its own cache."""
    if not engine.reset_prefix_cache():
        raise DemoError("vLLM refused to reset the cold engine's prefix cache: no reference")
    reused: list[int] = []
    for prompt in turn_prompts:
        (out,), _ = engine.generate([prompt], NEW_TOKENS)
        reused.append(out.num_cached_tokens)
    (reference,), _ = engine.generate([switch_prompt], SWITCH_TOKENS, ignore_eos=True)
    return reference, reused


def run(tokens: int, keep: bool = False, quiet: bool = False) -> dict[str, Any]:
    rng = random.Random(7)
    first = [rng.randrange(1, 1000) for _ in range(tokens // 2)]
    result: dict[str, Any] = {"engine": "vllm", "turns": []}
    with two_hosts(min_tokens=min(1024, tokens // 4), keep=keep) as (host_a, host_b):
        root = host_a.root.parent
        _say(quiet, "building a random Llama (4 layers, hidden 256, bf16)")
        model = tiny_llama(root / "model")
        session = "demo-session"
        _say(quiet, "starting a vLLM engine on host A")
        turn_prompts: list[list[int]] = []
        with VllmEngine(
            model, kv_transfer_config(host_a.socket), log_path=root / "a.log", in_process=True
        ) as a:
            history = first
            for turn in (1, 2):
                turn_prompts.append(history)
                (out,), ttft = a.generate([history], NEW_TOKENS, session=session)
                result["turns"].append(
                    {"turn": turn, "host": "A", "prompt_tokens": len(history),
                     "reused_tokens": out.num_cached_tokens, "seconds": ttft}
                )  # fmt: skip
                more = [rng.randrange(1, 1000) for _ in range(max(1, tokens - len(history)))]
                history = history + out.token_ids + (more if turn == 1 else more[:64])
        result["replica_bytes_on_b"] = _wait_for_replica(host_b.socket, REPLICA_WAIT_S)
        result["switch_prompt_tokens"] = len(history)
        _say(quiet, "host B, cold: a vLLM engine without the store")
        with VllmEngine(model, None, log_path=root / "b-cold.log", in_process=True) as cold_engine:
            (cold,), result["cold_ttft_s"] = cold_engine.generate(
                [history], SWITCH_TOKENS, ignore_eos=True
            )
            _say(quiet, "host B, reference: the same engine, A's two turns, then the switch")
            reference, reference_turn_reused = _reference(cold_engine, turn_prompts, history)
        _say(quiet, "host B, warm: a vLLM engine with TierstoreConnector")
        warm_cfg = kv_transfer_config(host_b.socket, include_peers=True)
        before = _served_on(host_b.socket)
        with VllmEngine(
            model, warm_cfg, log_path=root / "b-warm.log", in_process=True
        ) as warm_engine:
            (warm,), result["warm_ttft_s"] = warm_engine.generate(
                [history], SWITCH_TOKENS, ignore_eos=True
            )
        after = _served_on(host_b.socket)
        # The warm engine's load, by where B found it (include_peers lets B
        # fetch what it lacks from A on the spot; the rest was already on B).
        result["warm_blocks_on_b"] = {
            k: after[k] - before[k] for k in ("pinned", "fetched_from_peer")
        }
        result["replicas_imported_on_b"] = after["replicas_imported"]
        result["reused_tokens"] = warm.num_cached_tokens
        turn_reused = [t["reused_tokens"] for t in result["turns"]]
        result.update(compare_outputs(warm, reference, cold, reference_turn_reused, turn_reused))
        result["speedup"] = result["cold_ttft_s"] / max(result["warm_ttft_s"], 1e-9)
    return result


def format_result(r: dict[str, Any]) -> str:
    lines = [
        "",
        "Model: random Llama, 4 layers, hidden 256 (bf16, built from a config), "
        "served by vLLM (CPU build) with TierstoreConnector",
        "",
        f"turn  host  prompt tokens  reused  time (prefill + {NEW_TOKENS} tokens)",
    ]
    for t in r["turns"]:
        lines.append(
            f"{t['turn']:>4}  {t['host']:>4}  {t['prompt_tokens']:>13}  "
            f"{t['reused_tokens']:>6}  {t['seconds']:6.2f} s"
        )
    n = r["compared_tokens"]
    if r["cold_equal"]:
        cold_line = "yes"
    else:
        cold_line = f"no, from token {r['cold_first_difference']} on ({ROUNDING_NOTE})"
    warm_line = "yes" if r["outputs_equal"] else f"NO, from token {r['warm_first_difference']} on"
    lines += [
        "",
        f"Session moves to host B ({r['switch_prompt_tokens']} tokens; "
        f"{r['replica_bytes_on_b'] / 2**20:.1f} MiB of replica there):",
        "",
        f"                      prefill + {n} tokens",
        f"  cold (no store)      {r['cold_ttft_s']:8.2f} s",
        f"  warm (tierstore)     {r['warm_ttft_s']:8.2f} s   ({r['reused_tokens']} tokens reused)",
        f"  blocks B served it   {r['warm_blocks_on_b']['pinned']}, of which "
        f"{r['warm_blocks_on_b']['fetched_from_peer']} fetched from A at load time",
        f"  speedup              {r['speedup']:8.1f} x",
        "",
        f"  {n} greedy tokens, warm equal to a no-store engine that computed the prefix in",
        f"  A's two chunks ({r['reference_cached_tokens']} tokens from its own cache): {warm_line}",
        f"  cold full prefill equal to that reference: {cold_line}",
    ]
    return "\n".join(lines)


def main(args: Any) -> int:
    try:
        result = run(tokens=args.tokens, keep=args.keep, quiet=args.json)
    except TierstoreError as e:
        print(f"tierstore demo --engine vllm: {e}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=2) if args.json else format_result(result))
    return 0 if result["outputs_equal"] else 1
