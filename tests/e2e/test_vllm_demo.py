"""`tierstore demo --engine vllm`: the session switch with real vLLM engines."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="needs vllm (pip install 'tierstore[vllm]', see README)")

REPO = Path(__file__).resolve().parents[2]
BLOCK_TOKENS = 128  # vLLM's CPU block size: the connector's block


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_vllm_demo_resumes_warm_on_host_b_with_equal_outputs() -> None:
    tmp_before = {p.name for p in Path(tempfile.gettempdir()).glob("tierstore-demo-*")}
    out = subprocess.run(
        [sys.executable, "-m", "tierstore.cli", "demo", "--engine", "vllm", "--json",
         "--tokens", "1536"],
        capture_output=True, text=True, timeout=840, cwd=REPO,
    )  # fmt: skip
    # The demo prints its result before it exits 1 on unequal outputs; an
    # error (no like-for-like reference, an engine failure) prints none.
    assert out.stdout, out.stderr[-4000:]
    result = json.loads(out.stdout)
    # Warm equals a no-store engine that computed the prefix in A's two chunks
    # and reused from its own cache what the warm engine reused from B's store
    # (the demo fails when it did not), over at least 32 greedy tokens.
    assert result["outputs_equal"] is True, result
    assert result["warm_first_difference"] is None
    assert result["compared_tokens"] >= 32
    assert result["reference_cached_tokens"] == result["reused_tokens"]
    assert result["reference_turn_reused_tokens"] == [t["reused_tokens"] for t in result["turns"]]
    # The cold full prefill is information: its verdict and first differing
    # token are reported and consistent.
    assert result["cold_equal"] is (result["cold_first_difference"] is None)
    cold_diff = result["cold_first_difference"]
    assert cold_diff is None or 0 <= cold_diff < result["compared_tokens"]
    assert out.returncode == 0, out.stderr[-4000:]
    assert result["replica_bytes_on_b"] > 0  # A pushed the session to B after its turns
    # B reused at least turn 2's prompt (its full blocks), all from A's replica:
    # the switch prompt is that prompt, its 16 output tokens and at most 64 new
    # ones (1 at --tokens 1536).
    bt = BLOCK_TOKENS
    assert result["reused_tokens"] >= (result["switch_prompt_tokens"] - 80) // bt * bt
    # B's store served every reused block and fetched none of them from A at
    # load time (the warm engine has include_peers, so it could have); A's
    # push had brought at least as many blocks.
    warm = result["warm_blocks_on_b"]
    assert warm["fetched_from_peer"] == 0, warm
    assert warm["pinned"] * bt == result["reused_tokens"], warm
    assert result["replicas_imported_on_b"] >= warm["pinned"], result["replicas_imported_on_b"]
    tmp_after = {p.name for p in Path(tempfile.gettempdir()).glob("tierstore-demo-*")}
    assert tmp_after <= tmp_before
