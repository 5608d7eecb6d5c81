"""The C chained-blake3 loop (tierstore._chainhash) against the blake3 package."""

from __future__ import annotations

import blake3
import numpy as np
import pytest

_chainhash = pytest.importorskip("tierstore._chainhash")
chain = _chainhash.chain

from tierstore.keys import KVLayout, chain_keys, root_key  # noqa: E402

# Message length is 32 + stride: covers one block, one full chunk (992), one
# byte past a chunk (993), the chunk and block edges of the data alone, and
# 2-, 3-, 5- and 69-chunk trees (odd counts leave parents on the stack).
STRIDES = [1, 4, 31, 32, 63, 64, 65, 96 - 32, 991, 992, 993, 1023, 1024, 1025]
STRIDES += [2016, 2048, 3000, 4096 + 7, 70000]
COUNTS = [0, 1, 2, 5]


def reference(prev: bytes, data: bytes, stride: int) -> bytes:
    out = []
    for i in range(len(data) // stride):
        prev = blake3.blake3(prev + data[i * stride : (i + 1) * stride]).digest()
        out.append(prev)
    return b"".join(out)


@pytest.mark.parametrize("stride", STRIDES)
@pytest.mark.parametrize("count", COUNTS)
def test_matches_blake3_package(stride: int, count: int) -> None:
    rng = np.random.default_rng(stride * 31 + count)
    prev = rng.bytes(32)
    data = rng.bytes(stride * count)
    got = chain(prev, data, stride)
    assert len(got) == 32 * count
    assert got == reference(prev, data, stride)


@pytest.mark.parametrize("stride", [1, 64, 1000, 1025])
def test_trailing_partial_block_is_ignored(stride: int) -> None:
    rng = np.random.default_rng(stride)
    prev, data = rng.bytes(32), rng.bytes(3 * stride + stride // 2)
    assert chain(prev, data, stride) == reference(prev, data[: 3 * stride], stride)
    assert chain(prev, data[: stride - 1], stride) == b""


def test_one_mib_stride() -> None:
    rng = np.random.default_rng(1)
    prev, data = rng.bytes(32), rng.bytes(2 << 20)
    assert chain(prev, data, 1 << 20) == reference(prev, data, 1 << 20)


def test_many_small_blocks() -> None:
    rng = np.random.default_rng(2)
    prev, data = rng.bytes(32), rng.bytes(64 * 1000)
    assert chain(prev, data, 64) == reference(prev, data, 64)


def test_agrees_with_chain_keys() -> None:
    layout = KVLayout("m", 2, 2, 8, "float16", 16)
    tokens = np.random.default_rng(3).integers(0, 2**32, size=16 * 40 + 5, dtype=np.uint64)
    packed = tokens.astype("<u4")[: 16 * 40]
    expected = b"".join(chain_keys(layout, tokens))
    assert chain(root_key(layout), packed, 64) == expected


def test_buffer_kinds_agree() -> None:
    tokens = np.random.default_rng(4).integers(0, 2**32, size=1000, dtype=np.uint64).astype("<u4")
    prev = bytes(range(32))
    raw = tokens.tobytes()
    expected = reference(prev, raw, 64)
    assert chain(prev, tokens, 64) == expected
    assert chain(prev, raw, 64) == expected
    assert chain(prev, memoryview(raw), 64) == expected
    assert chain(prev, bytearray(raw), 64) == expected
    assert chain(bytearray(prev), tokens.data, 64) == expected
    assert chain(memoryview(prev), tokens.reshape(10, 100), 64) == expected
    assert chain(prev=prev, data=raw, stride=64) == expected


def test_bad_prev() -> None:
    for bad in (b"", b"\0" * 31, b"\0" * 33):
        with pytest.raises(ValueError, match="prev must be 32"):
            chain(bad, b"\0" * 64, 64)
    with pytest.raises(TypeError, match="prev must be a bytes-like"):
        chain("x" * 32, b"\0" * 64, 64)
    with pytest.raises(TypeError, match="prev must be a bytes-like"):
        chain(None, b"\0" * 64, 64)


def test_bad_data() -> None:
    with pytest.raises(TypeError, match="data must be a bytes-like"):
        chain(b"\0" * 32, [1, 2, 3, 4], 4)
    with pytest.raises(TypeError, match="data must be a bytes-like"):
        chain(b"\0" * 32, "abcd", 4)
    strided = np.arange(64, dtype="<u4")[::2]
    with pytest.raises(ValueError, match="C-contiguous"):
        chain(b"\0" * 32, strided, 4)
    with pytest.raises(ValueError, match="C-contiguous"):
        chain(b"\0" * 32, memoryview(bytes(64))[::2], 4)


def test_bad_stride() -> None:
    for bad in (0, -1, -64):
        with pytest.raises(ValueError, match="stride must be >= 1"):
            chain(b"\0" * 32, b"\0" * 64, bad)
    with pytest.raises(TypeError):
        chain(b"\0" * 32, b"\0" * 64, 1.5)
    with pytest.raises(TypeError):
        chain(b"\0" * 32, b"\0" * 64)
