"""The growth figure of the soak (bench/reliability/flat.py): the first and the
last minute after warm-up, compared; a leak shows, a flat line does not, and
the warm-up (queues filling to their bounds) is left out."""

from __future__ import annotations

import pytest

from bench.reliability.flat import FIGURES, growth


def series(rss_at: object, minutes: float = 10, every_s: float = 5) -> list[dict[str, float]]:
    out = []
    for i in range(int(minutes * 60 / every_s)):
        t = i * every_s
        rss = rss_at(t)  # type: ignore[operator]
        out.append({"t": t, "rss_kib": rss, "anon_kib": rss / 2, "fds": 100, "threads": 40})
    return out


def test_a_flat_line_after_the_warmup_does_not_grow() -> None:
    # Filling for 3 minutes (1.5x), then flat with a little noise.
    got = growth(series(lambda t: 1000 * min(1.5, 1 + t / 360) + (t % 10)), warmup_s=180)
    assert all(abs(got[f]["growth"]) < 0.01 for f in FIGURES), got


def test_control_a_steady_leak_shows() -> None:
    # +20 KiB a minute: the first minute after warm-up averages 1070, the last 1190.
    got = growth(series(lambda t: 1000 + t / 3), warmup_s=180)
    assert got["rss_kib"]["growth"] == pytest.approx(120 / 1070, abs=0.005)
    assert got["anon_kib"]["growth"] == pytest.approx(got["rss_kib"]["growth"])
    assert got["fds"]["growth"] == 0


def test_too_short_a_run_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 2 minutes after warm-up"):
        growth(series(lambda t: 1000, minutes=4), warmup_s=180)
