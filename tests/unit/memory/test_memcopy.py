"""tierstore.memory.memcopy: the C streaming copy and its numpy fallback copy
exactly, at every size and alignment the hot paths use, and refuse bad
arguments with a message that names the problem."""

from __future__ import annotations

import mmap

import numpy as np
import pytest

from tierstore.memory import memcopy

# Around the C loop's edges: the 256 KiB streaming floor, its four-page
# (16 KiB) groups and the tail after the last whole group.
SIZES = [
    0,
    1,
    15,
    63,
    64,
    65,
    4095,
    64 << 10,
    (256 << 10) - 1,
    256 << 10,
    (2 << 20) + 7,
    (256 << 10) + 3 * 16384 + 4095,
]


@pytest.fixture(params=["c", "numpy"])
def copy(request, monkeypatch):
    if request.param == "c":
        if memcopy._c_copy is None:
            pytest.skip("the C extension was not built")
        return memcopy.copy_into
    monkeypatch.setattr(memcopy, "_c_copy", None)
    return memcopy.copy_into


@pytest.mark.parametrize("nbytes", SIZES)
@pytest.mark.parametrize(
    "dst_shift,src_shift", [(0, 0), (1, 0), (0, 3), (7, 13), (48, 5), (63, 0), (16, 40)]
)
def test_copies_every_byte_at_any_alignment(copy, nbytes, dst_shift, src_shift):
    rng = np.random.default_rng(nbytes + dst_shift)
    src_buf = rng.integers(0, 256, nbytes + 64, dtype=np.uint8)
    dst_buf = np.full(nbytes + 64, 0xAB, dtype=np.uint8)
    dst = dst_buf[dst_shift : dst_shift + nbytes]
    src = src_buf[src_shift : src_shift + nbytes]
    copy(dst, src)
    assert np.array_equal(dst, src)
    # Nothing written outside the destination range.
    assert (dst_buf[:dst_shift] == 0xAB).all()
    assert (dst_buf[dst_shift + nbytes :] == 0xAB).all()


def test_into_shared_mapping_and_from_memoryview(copy):
    nbytes = 3 << 20
    shared = mmap.mmap(-1, nbytes)
    src = np.random.default_rng(1).integers(0, 256, nbytes, dtype=np.uint8)
    copy(memoryview(shared), memoryview(src.tobytes()))
    assert bytes(shared) == src.tobytes()


def test_size_mismatch_names_both_sizes(copy):
    with pytest.raises(ValueError, match="destination has 10 bytes, source 12"):
        copy(np.zeros(10, np.uint8), np.zeros(12, np.uint8))


def test_read_only_destination_refused(copy):
    with pytest.raises((TypeError, ValueError, BufferError)):
        copy(bytes(16), np.zeros(16, np.uint8))


def test_overlap_refused_by_c_copy():
    if memcopy._c_copy is None:
        pytest.skip("the C extension was not built")
    buf = np.zeros(1 << 20, np.uint8)
    with pytest.raises(ValueError, match="overlap"):
        memcopy.copy_into(buf[: 512 << 10], buf[256 << 10 : 768 << 10])
