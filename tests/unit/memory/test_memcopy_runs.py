"""tierstore.memory.memcopy.copy_runs: many runs in one call copy exactly
what one copy per run (plain slicing) copies, in the C loop and the numpy
fallback, and refuse bad runs before copying anything."""

from __future__ import annotations

import numpy as np
import pytest

from tierstore.memory import memcopy

# Below and above the 256 KiB streaming floor, the 128-byte steps of the
# AVX2 loop and its tail, the wide model's 512 KiB page.
RUN_BYTES = [0, 1, 100, 64 << 10, (256 << 10) + 129, 512 << 10]


@pytest.fixture(params=["c", "numpy"])
def copy_runs(request, monkeypatch):
    if request.param == "c" and memcopy._c_copy_runs is None:
        pytest.skip("the C extension was not built")
    if request.param == "numpy":
        monkeypatch.setattr(memcopy, "_c_copy_runs", None)
    return memcopy.copy_runs


def one_copy_per_run(dst, src, dst_offsets, src_offsets, nbytes):
    """The straightforward reference: one slice assignment per run."""
    for d, s in zip(dst_offsets, src_offsets):
        dst[d : d + nbytes] = src[s : s + nbytes]


def scattered(nbytes: int, runs: int, seed: int):
    """Random source bytes and distinct, unaligned, non-overlapping run slots."""
    rng = np.random.default_rng(seed)
    slot = nbytes + 67  # every run starts at another alignment
    src = rng.integers(0, 256, runs * slot + 64, dtype=np.uint8)
    src_offsets = rng.permutation(runs) * slot + rng.integers(0, 64, runs)
    dst_offsets = rng.permutation(runs) * slot + rng.integers(0, 64, runs)
    return src, src_offsets.astype(np.int64), dst_offsets.astype(np.int64)


@pytest.mark.parametrize("nbytes", RUN_BYTES)
def test_runs_equal_one_copy_per_run(copy_runs, nbytes):
    src, s_off, d_off = scattered(nbytes, 7, nbytes)
    got = np.full(len(src), 0xAB, np.uint8)
    want = got.copy()
    copy_runs(got, src, d_off, s_off, nbytes)
    one_copy_per_run(want, src, d_off, s_off, nbytes)
    assert np.array_equal(got, want)  # the runs, and nothing written between them
    if nbytes:
        # Negative control: the same oracle sees two runs' sources swapped.
        wrong = np.full(len(src), 0xAB, np.uint8)
        one_copy_per_run(wrong, src, d_off, s_off[[1, 0, *range(2, 7)]], nbytes)
        assert not np.array_equal(got, wrong)


def test_between_two_shaped_buffers(copy_runs):
    # The mover's case: a [planes, blocks, inner] page and a flat arena.
    page = np.zeros((2, 5, 4096), np.uint8)
    arena = np.random.default_rng(3).integers(0, 256, 6 * 8192, dtype=np.uint8)
    copy_runs(page, arena, [3 * 4096, 5 * 4096 + 3 * 4096], [8192, 8192 + 4096], 4096)
    assert np.array_equal(page[0, 3], arena[8192 : 8192 + 4096])
    assert np.array_equal(page[1, 3], arena[8192 + 4096 : 8192 + 8192])
    assert page[:, [0, 1, 2, 4]].sum() == 0


def test_bad_runs_refused_before_any_copy(copy_runs):
    src = np.arange(256, dtype=np.uint8)
    dst = np.zeros(256, np.uint8)
    with pytest.raises(ValueError, match="outside"):
        copy_runs(dst, src, [0, 250], [0, 0], 16)  # the second run ends past dst
    with pytest.raises(ValueError, match="outside"):
        copy_runs(dst, src, [0], [-1], 16)
    with pytest.raises(ValueError, match="offsets"):
        copy_runs(dst, src, [0, 16], [0], 16)
    assert not dst.any()  # the first, valid run was not copied either
    with pytest.raises(ValueError, match="overlaps"):
        copy_runs(src, src, [0], [8], 16)


def test_no_runs_copy_nothing(copy_runs):
    dst = np.zeros(16, np.uint8)
    copy_runs(dst, np.ones(16, np.uint8), [], [], 8)
    assert not dst.any()


def test_c_refuses_offsets_that_are_not_int64():
    if memcopy._c_copy_runs is None:
        pytest.skip("the C extension was not built")
    dst = np.zeros(64, np.uint8)
    with pytest.raises(TypeError, match="int64"):
        memcopy._c_copy_runs(dst, dst.copy(), np.zeros(1, np.int32), np.zeros(1, np.int64), 8)
