"""``tierstore demo``: two hosts, one conversation, a session switch.

Starts two sidecars on this machine ("host A" and "host B", each with its own
socket, arena, NVMe directory and peer port, joined as one group), builds a
small Llama-family model with random weights from a config (nothing is
downloaded), runs a multi-turn conversation on host A with the store, then
moves the session to host B as a busy host would and measures, side by side:

- the cold time to first token on B (a full prefill, no store), and
- the warm one (B resumes from the replica that kv_share pushed after A's
  last turn, or fetches from A on the spot),

checks that the warm logits equal the cold ones, and shows which tier every
reused block came from. Everything it started is stopped and removed at the
end, on error and on Ctrl-C too.

The progress bar (stderr; off with ``--json``) has one stretch per stage; a
stage that runs the model moves through its stretch one decoder layer at a
time, so the bar moves during a long prefill without splitting it (a prefill
in chunks would not give the cold prefill's exact logits).

Runs in the foreground, on one thread; the sidecars are child processes.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tierstore.cli.ports import free_port
from tierstore.errors import TierstoreError

READY_TIMEOUT_S = 60.0


@dataclass
class DemoHost:
    name: str
    root: Path
    peer_port: int
    proc: subprocess.Popen[bytes] | None = None

    @property
    def socket(self) -> Path:
        return self.root / "tierstore.sock"


def _start(host: DemoHost, other: DemoHost, token: str, min_tokens: int) -> None:
    host.root.mkdir(parents=True, exist_ok=True)
    args = [
        sys.executable, "-m", "tierstore.cli", "serve",
        "--socket", str(host.socket),
        "--nvme-dir", str(host.root / "nvme"),
        "--dram-bytes", "512MiB", "--nvme-bytes", "2GiB", "--metrics-port", "0",
        "--set", f"peer_port={host.peer_port}",
        "--set", f"peers=127.0.0.1:{other.peer_port}",
        "--set", f"peer_token={token}",
        "--set", f"min_tokens={min_tokens}",
        "--set", "log_level=warning",
    ]  # fmt: skip
    log = open(host.root / "sidecar.log", "wb")
    host.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    log.close()


def _wait_ready(host: DemoHost) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not host.socket.exists():
        assert host.proc is not None
        if host.proc.poll() is not None:
            log = (host.root / "sidecar.log").read_text(errors="replace")
            raise TierstoreError(f"{host.name}'s sidecar exited: {log[-2000:]}")
        if time.monotonic() > deadline:
            raise TierstoreError(f"{host.name}'s sidecar did not start in {READY_TIMEOUT_S}s")
        time.sleep(0.05)


def _stop(host: DemoHost) -> None:
    if host.proc is None or host.proc.poll() is not None:
        return
    host.proc.send_signal(signal.SIGTERM)
    try:
        host.proc.wait(30)
    except subprocess.TimeoutExpired:
        host.proc.kill()
        host.proc.wait(10)


@contextlib.contextmanager
def two_hosts(min_tokens: int, keep: bool = False) -> Iterator[tuple[DemoHost, DemoHost]]:
    """Two sidecars joined as a group, stopped and removed on exit."""
    root = Path(tempfile.mkdtemp(prefix="tierstore-demo-"))
    token = secrets.token_hex(16)
    a = DemoHost("host A", root / "a", free_port())
    b = DemoHost("host B", root / "b", free_port())
    try:
        _start(a, b, token, min_tokens)
        _start(b, a, token, min_tokens)
        _wait_ready(a)
        _wait_ready(b)
        yield a, b
    finally:
        _stop(a)
        _stop(b)
        if not keep:
            shutil.rmtree(root, ignore_errors=True)


class StageBar:
    """A tqdm bar of ``num_stages`` stages of ``ticks_per_stage`` ticks each.

    ``stage(what, model)`` wraps one stage; with ``model``, forward hooks on
    its decoder layers tick once per layer of the stage's first forward pass
    (its prefill: the long one; decode steps after it do not move the bar).
    The stage's stretch is filled when it ends. Used on the model's thread.
    """

    def __init__(
        self, num_stages: int, ticks_per_stage: int, enabled: bool, file: Any = None
    ) -> None:
        from tqdm import tqdm

        self.ticks_per_stage = ticks_per_stage
        self.ticks = 0  # ours: a disabled tqdm does not count
        self.bar = tqdm(
            total=num_stages * ticks_per_stage,
            desc="tierstore demo",
            disable=not enabled,
            file=file if file is not None else sys.stderr,
            bar_format="{desc}: {percentage:3.0f}% {bar} {elapsed}{postfix}",
            mininterval=0,  # a few dozen ticks in all: show each layer
            miniters=1,
        )

    def _advance(self, ticks: int) -> None:
        self.ticks += ticks
        self.bar.update(ticks)

    @contextlib.contextmanager
    def stage(self, what: str, model: Any = None) -> Iterator[None]:
        start = self.ticks
        self.bar.set_postfix_str(what)
        layers = list(model.model.layers) if model is not None else []

        def tick(*_: Any) -> None:
            done = self.ticks - start
            if done < len(layers) and done < self.ticks_per_stage:
                self.bar.set_postfix_str(f"{what}: layer {done + 1}/{len(layers)}", refresh=False)
                self._advance(1)

        hooks = [layer.register_forward_hook(tick) for layer in layers]
        try:
            yield
        finally:
            for hook in hooks:
                hook.remove()
        self.bar.set_postfix_str(what, refresh=False)
        self._advance(start + self.ticks_per_stage - self.ticks)

    def close(self) -> None:
        self.bar.close()


def build_model(hidden: int, layers: int, seed: int) -> Any:
    """A Llama-family model with random weights, float32, eager attention."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=8192,
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=max(hidden // 64, 1),
        num_key_value_heads=max(hidden // 128, 1),
        max_position_embeddings=65536,
    )
    config._attn_implementation = "eager"  # bitwise-equal logits for a split prefill
    config._name_or_path = f"tierstore-demo-llama-{hidden}x{layers}-seed{seed}"
    return LlamaForCausalLM(config).eval()


NUM_STAGES = 6  # sidecars and model, 2 turns on A, cold and warm on B, cleanup


def run(
    tokens: int = 3072,
    hidden: int = 256,
    layers: int = 4,
    keep: bool = False,
    show_progress: bool = True,
) -> dict[str, Any]:
    """The whole demo; returns the figures (see the module docstring)."""
    import torch

    from tierstore.client import StoreClient
    from tierstore.engines.hf import HFStoreAdapter

    gen = torch.Generator().manual_seed(7)
    # An agent-like conversation: a long first prompt (system, tools, files),
    # a follow-up, then a short new message when the session moves.
    turn_tokens = [tokens * 6 // 10, tokens * 3 // 10, tokens - tokens * 9 // 10]
    user_turns = [torch.randint(0, 8192, (n,), generator=gen) for n in turn_tokens]
    new_tokens = 8
    session = "demo-session-1"
    result: dict[str, Any] = {
        "prompt_tokens": tokens,
        "model": {"hidden": hidden, "layers": layers},
    }
    bar = StageBar(NUM_STAGES, layers, enabled=show_progress)
    try:
        with contextlib.ExitStack() as stack:
            with bar.stage("starting host A and host B"):
                hosts = two_hosts(min_tokens=min(turn_tokens[0], 8192), keep=keep)
                host_a, host_b = stack.enter_context(hosts)
                model = build_model(hidden, layers, seed=0)
            client_a = stack.enter_context(
                StoreClient(str(host_a.socket), name="engine-A", hbm_bytes=256 << 20)
            )
            client_b = stack.enter_context(
                StoreClient(str(host_b.socket), name="engine-B", hbm_bytes=256 << 20)
            )
            engine_a = HFStoreAdapter(model, client_a)
            engine_b = HFStoreAdapter(model, client_b)
            history = torch.empty(0, dtype=torch.long)
            turns = []
            for i, user in enumerate(user_turns[:2]):
                history = torch.cat([history, user])
                with bar.stage(f"turn {i + 1} on host A ({history.numel()} tokens)", model):
                    out = engine_a.generate(history, new_tokens)
                    engine_a.save(history, out.prompt.cache)
                    reply = engine_a.end_turn(session, history, wait=True)
                turns.append(
                    {
                        "turn": i + 1,
                        "host": "A",
                        "prompt_tokens": int(history.numel()),
                        "reused_tokens": out.prompt.num_reused_tokens,
                        "ttft_s": out.prompt.store_s + out.prompt.restore_s + out.prompt.model_s,
                        "replica_target": reply.replica_target,
                        "pushed_blocks": reply.pushed,
                        "push_s": reply.push_s,
                    }
                )
                history = torch.cat([history, torch.tensor(out.tokens)])
            # Host A is busy: the session's next turn lands on host B.
            history = torch.cat([history, user_turns[2]])
            with bar.stage(f"cold prefill on host B ({history.numel()} tokens)", model):
                cold = engine_b.prefill(history)
            with bar.stage("warm resume on host B", model):
                warm = engine_b.resume(history, include_peers=True)
            stat_b = client_b.stat()
            result.update(
                {
                    "turns": turns,
                    "switch_prompt_tokens": int(history.numel()),
                    "cold_ttft_s": cold.model_s,
                    "warm_ttft_s": warm.store_s + warm.restore_s + warm.model_s,
                    "warm_store_s": warm.store_s,
                    "warm_restore_s": warm.restore_s,
                    "warm_model_s": warm.model_s,
                    "reused_tokens": warm.num_reused_tokens,
                    "logits_equal": bool(torch.equal(cold.logits, warm.logits)),
                    "logits_max_abs_diff": float((cold.logits - warm.logits).abs().max()),
                    "same_next_token": int(torch.argmax(cold.logits))
                    == int(torch.argmax(warm.logits)),
                    "blocks_by_tier": dict(Counter(str(t) for t in warm.tiers)),
                    "replicas_imported_on_b": int(stat_b.counters.get("peer_replicas_imported", 0)),
                    "fetched_from_peer_on_b": int(stat_b.counters.get("peer_fetched_blocks", 0)),
                }
            )
            result["speedup"] = result["cold_ttft_s"] / max(result["warm_ttft_s"], 1e-9)
            with bar.stage("stopping host A and host B"):
                stack.close()
    finally:
        bar.close()
    return result


def format_result(r: dict[str, Any]) -> str:
    lines = [
        "",
        f"Model: random Llama, hidden {r['model']['hidden']}, {r['model']['layers']} layers "
        "(float32, built from a config; nothing downloaded)",
        "",
        "turn  host  prompt tokens  reused  TTFT      replica pushed to B",
    ]
    for t in r["turns"]:
        lines.append(
            f"{t['turn']:>4}  {t['host']:>4}  {t['prompt_tokens']:>13}  {t['reused_tokens']:>6}  "
            f"{t['ttft_s']:>6.2f} s  {t['pushed_blocks']} blocks in {t['push_s']:.3f} s"
        )
    lines += [
        "",
        f"Session moves to host B ({r['switch_prompt_tokens']} tokens):",
        "",
        "                      time to first token",
        f"  cold (full prefill)  {r['cold_ttft_s']:8.2f} s",
        f"  warm (tierstore)     {r['warm_ttft_s']:8.2f} s   "
        f"({r['warm_store_s']:.3f} s store, {r['warm_model_s']:.2f} s model on "
        f"{r['switch_prompt_tokens'] - r['reused_tokens']} new tokens)",
        f"  speedup              {r['speedup']:8.1f} x",
        "",
        "  blocks reused by tier: "
        + ", ".join(f"{n} from {tier}" for tier, n in sorted(r["blocks_by_tier"].items())),
        f"  logits equal to the cold prefill: {_logits_verdict(r)}",
    ]
    return "\n".join(lines)


# A prefill split at another token rounds differently in float32's last bit on
# some CPUs, with no store involved (measured here: layer 1's K/V and the
# logits 1.2e-7 off when 783 tokens are run as 400 + 383). The store returns
# the K/V it was given byte for byte; a warm resume whose prefix was computed in
# other chunks than the cold prefill can differ by that rounding, never more.
LOGITS_ROUNDING_ATOL = 1e-5


def logits_match(r: dict[str, Any]) -> bool:
    """Equal, or within float32 rounding with the same next token."""
    return bool(r["logits_equal"]) or (
        r["same_next_token"] and r["logits_max_abs_diff"] <= LOGITS_ROUNDING_ATOL
    )


def _logits_verdict(r: dict[str, Any]) -> str:
    if r["logits_equal"]:
        return "yes, bit for bit"
    if logits_match(r):
        return (
            f"yes, to float32 rounding (max |diff| {r['logits_max_abs_diff']:.1e}: "
            "the prefix was computed in other chunks; same next token)"
        )
    return f"NO (max |diff| {r['logits_max_abs_diff']:.1e})"


def main(args: Any) -> int:
    result = run(
        tokens=args.tokens,
        hidden=args.hidden,
        layers=args.layers,
        keep=args.keep,
        show_progress=not args.json,
    )
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(format_result(result))
    return 0 if logits_match(result) else 1
