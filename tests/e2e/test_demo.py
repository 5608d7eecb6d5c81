"""`tierstore demo` end to end: two sidecars, a session switch, cleanup."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_demo_json_is_warm_exact_and_cleans_up() -> None:
    tmp_before = {p.name for p in Path(tempfile.gettempdir()).glob("tierstore-demo-*")}
    shm_before = set(os.listdir("/dev/shm"))
    out = subprocess.run(
        [sys.executable, "-m", "tierstore.cli", "demo", "--json",
         "--tokens", "768", "--hidden", "64", "--layers", "2"],
        capture_output=True, text=True, timeout=300, cwd=REPO, check=True,
    )  # fmt: skip
    result = json.loads(out.stdout)
    assert result["logits_equal"] is True and result["same_next_token"] is True
    assert result["reused_tokens"] > 0
    assert sum(result["blocks_by_tier"].values()) * 16 == result["reused_tokens"]
    assert result["replicas_imported_on_b"] > 0  # kv_share pushed the session to B
    assert result["turns"][1]["reused_tokens"] > 0  # turn 2 on A resumed warm
    assert result["cold_ttft_s"] > 0 and result["warm_ttft_s"] > 0
    tmp_after = {p.name for p in Path(tempfile.gettempdir()).glob("tierstore-demo-*")}
    assert tmp_after <= tmp_before  # its files are removed
    leftover = {n for n in set(os.listdir("/dev/shm")) - shm_before if n.startswith("tierstore-")}
    assert not leftover  # its sidecars stopped and unlinked their arenas
