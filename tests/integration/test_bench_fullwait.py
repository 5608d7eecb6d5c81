"""bench/tiers/fullwait.py against a real sidecar: a short run that fills a
small DRAM reports the saves that found it full, their wait and the spills,
from the sidecar's own counters; a run too short to fill a large DRAM (the
control) reports none of them."""

from __future__ import annotations

from bench.tiers.fullwait import LAYOUT, run


def test_a_run_that_fills_dram_reports_the_waits_of_the_saves_that_found_it_full() -> None:
    got = run(3.0, 128 << 20, 4, [], raw_bytes=64 << 20)
    assert got["store_calls"] * 4 * LAYOUT.block_bytes > 128 << 20  # DRAM filled
    assert len(got["store_ms"]) == 4 and got["store_ms"][0] > 0  # p50 p90 p99 max
    assert got["full_waits"] > 0 and got["full_wait_s"] > 0
    assert got["spilled_blocks"] > 0
    assert got["offered_gbps"] > 0 and got["nvme_write_gbps"] > 0


def test_control_a_run_that_never_fills_dram_reports_no_full_waits() -> None:
    got = run(0.05, 1 << 30, 1, [], raw_bytes=8 << 20)
    assert 0 < got["store_calls"] * LAYOUT.block_bytes < 1 << 30
    assert got["store_ms"] == [] and len(got["store_ms_filling"]) == 4
    assert got["full_waits"] == 0 and got["full_wait_s"] == 0 and got["spilled_blocks"] == 0
