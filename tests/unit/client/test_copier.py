"""ArenaCopier: runs of adjacent slots are one copy, in both directions, and
every byte lands where it belongs."""

from __future__ import annotations

import pytest
import torch

from tierstore.client.copier import ArenaCopier

B = 4096


@pytest.fixture
def copier(monkeypatch: pytest.MonkeyPatch) -> tuple[ArenaCopier, list[int]]:
    c = ArenaCopier(torch.zeros(64 * B, dtype=torch.uint8), torch.device("cpu"))
    sizes: list[int] = []
    real = c._copy_one

    def counting(dst: torch.Tensor, src: torch.Tensor) -> None:
        sizes.append(dst.numel())
        real(dst, src)

    monkeypatch.setattr(c, "_copy_one", counting)
    return c, sizes


def blocks(n: int) -> torch.Tensor:
    return torch.arange(n * B, dtype=torch.int64).remainder(251).to(torch.uint8).view(n, B)


@pytest.mark.parametrize(
    ("slots", "want_copies"),
    [([0, 1, 2, 3], 1), ([0, 1, 5, 6], 2), ([7, 3, 4, 9], 3), ([2], 1)],
)
def test_rows_to_arena_one_copy_per_run(
    copier: tuple[ArenaCopier, list[int]], slots: list[int], want_copies: int
) -> None:
    c, sizes = copier
    data = blocks(len(slots))
    c.copy_rows_to_arena(list(data), [s * B for s in slots], B)
    assert len(sizes) == want_copies and sum(sizes) == len(slots) * B
    for row, slot in zip(data, slots):
        assert torch.equal(c.arena_tensor[slot * B : (slot + 1) * B], row)


def test_rows_from_separate_tensors_are_not_merged(copier: tuple[ArenaCopier, list[int]]) -> None:
    c, sizes = copier
    rows = [blocks(1)[0], blocks(1)[0].clone()]
    c.copy_rows_to_arena(rows, [0, B], B)
    assert len(sizes) == 2
    assert torch.equal(c.arena_tensor[B : 2 * B], rows[1])


def test_runs_out_of_the_arena_round_trip(copier: tuple[ArenaCopier, list[int]]) -> None:
    c, sizes = copier
    slots = [10, 11, 12, 20, 21]
    data = blocks(len(slots))
    c.copy_rows_to_arena(list(data), [s * B for s in slots], B)
    out = torch.empty_like(data)
    sizes.clear()
    c.copy_runs(out, [s * B for s in slots], B)
    assert len(sizes) == 2 and torch.equal(out, data)
