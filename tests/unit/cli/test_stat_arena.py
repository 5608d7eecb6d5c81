"""``tierstore stat``'s arena line: the page size, the populated share, the
huge-page share of what is populated, and the lock."""

from __future__ import annotations

from tierstore.cli.stat import _restart_lines

MIB = 1 << 20
INFO = {"arena_page": "2048 KiB, thp (tmpfs huge=always)", "arena_lock": "NOT locked"}


def arena_line(**figures: int) -> str:
    c = {"arena_bytes": 64 * MIB, "arena_populated_bytes": 32 * MIB, **figures}
    (line,) = _restart_lines(INFO, c)
    return line


def test_the_huge_page_share_is_of_the_populated_memory() -> None:
    line = arena_line(arena_huge_bytes=27 * MIB)
    assert line == (
        "arena     pages 2048 KiB, thp (tmpfs huge=always)  populated 50%  huge pages 84%  "
        "NOT locked"
    )


def test_no_huge_pages_is_said_in_words() -> None:
    assert "populated 50%  no huge pages  NOT locked" in arena_line(arena_huge_bytes=0)


def test_nothing_populated_yet_divides_by_nothing() -> None:
    assert "populated 0%  no huge pages" in arena_line(arena_populated_bytes=0, arena_huge_bytes=0)
    # Counted a moment apart: huge pages seen before the populated count caught up.
    assert "huge pages 100%" in arena_line(arena_populated_bytes=0, arena_huge_bytes=2 * MIB)


def test_a_sidecar_that_does_not_report_huge_pages_shows_the_line_as_before() -> None:
    line = arena_line()
    assert line == "arena     pages 2048 KiB, thp (tmpfs huge=always)  populated 50%  NOT locked"
