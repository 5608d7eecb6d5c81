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


@pytest.fixture(params=["pages512", "avx2", "pages"])
def loop(request):
    """Each C loop for large runs that this CPU runs, not only the one chosen
    for it (``RUNS_LOOP``), restored afterwards."""
    if memcopy._c_copy_runs is None:
        pytest.skip("the C extension was not built")
    try:
        before = memcopy.set_runs_loop(request.param)
    except ValueError:
        pytest.skip(f"this CPU cannot run the {request.param} loop")
    yield request.param
    memcopy.set_runs_loop(before)


# Long runs (5 MiB + 129: three pieces of 2 MiB a run, the last a short one;
# six runs, 31 MiB, give up to seven threads something to copy) and short
# ones (257 bytes, grouped 8160 to a piece; 50000 runs, 12 MiB, the last
# piece partial), at odd alignments.
@pytest.mark.parametrize("nbytes,runs", [((5 << 20) + 129, 6), (257, 50000)])
@pytest.mark.parametrize("threads", [1, 2, 3, 8])
def test_each_loop_on_threads_equals_one_copy_per_run(loop, threads, nbytes, runs):
    src, s_off, d_off = scattered(nbytes, runs, threads)
    got = np.full(len(src), 0xAB, np.uint8)
    want = got.copy()
    memcopy.copy_runs(got, src, d_off, s_off, nbytes, threads)
    one_copy_per_run(want, src, d_off, s_off, nbytes)
    assert np.array_equal(got, want)
    # Negative control: the oracle sees one piece (a run's second 2 MiB, or
    # the last short run) left out.
    wrong = want.copy()
    lost = d_off[0] + (2 << 20) if nbytes > (2 << 20) else d_off[-1]
    wrong[lost : lost + min(nbytes, 2 << 20)] = 0xAB
    assert not np.array_equal(got, wrong)


@pytest.mark.parametrize("nbytes", RUN_BYTES)
def test_each_loop_on_small_and_odd_runs(loop, nbytes):
    src, s_off, d_off = scattered(nbytes, 7, nbytes + 1)
    got = np.full(len(src), 0xAB, np.uint8)
    want = got.copy()
    memcopy.copy_runs(got, src, d_off, s_off, nbytes, 4)  # under 4 MiB a thread: one
    one_copy_per_run(want, src, d_off, s_off, nbytes)
    assert np.array_equal(got, want)


def test_each_loop_in_copy_into(loop):
    src = np.random.default_rng(5).integers(0, 256, (3 << 20) + 77, dtype=np.uint8)
    dst = np.zeros(len(src) + 16, np.uint8)
    memcopy.copy_into(dst[13 : 13 + len(src)], src)  # a destination off its lines
    assert np.array_equal(dst[13 : 13 + len(src)], src)
    assert not dst[:13].any() and not dst[13 + len(src) :].any()


def test_thread_counts_out_of_range_refused(copy_runs):
    dst = np.zeros(64, np.uint8)
    for threads in (0, -1, memcopy.MAX_COPY_THREADS + 1):
        with pytest.raises(ValueError, match="threads"):
            copy_runs(dst, np.ones(64, np.uint8), [0], [0], 8, threads)
    assert not dst.any()


def test_a_loop_the_cpu_cannot_run_is_refused():
    if memcopy._c_copy_runs is None:
        pytest.skip("the C extension was not built")
    with pytest.raises(ValueError, match="cannot run"):
        memcopy.set_runs_loop("sse9")
    assert memcopy.RUNS_LOOP in ("pages512", "avx2", "pages", "memcpy")
