"""The peer wire codec (tierstore/peer/codec.py): byte-plane zstd round trips
byte-exact for fp16 and bf16 blocks, incompressible blocks go raw (None),
other dtypes are never byte-split, and a payload that is not the block's
frame (garbage, truncated, another size, a decompression bomb) is refused
with ValueError before it costs more memory than the block."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
import torch
import zstandard

from tierstore.keys import KVLayout
from tierstore.peer import codec

FP16 = KVLayout("codec-test", 2, 2, 64, "float16", 8)  # 8 KiB blocks
BF16 = KVLayout("codec-test", 2, 2, 64, "bfloat16", 8)
FP32 = KVLayout("codec-test", 2, 2, 64, "float32", 8)


def kv_like(layout: KVLayout, seed: int) -> bytes:
    """Normal values in the layout's dtype: what attention K/V look like."""
    values = torch.from_numpy(np.random.default_rng(seed).standard_normal(layout.block_bytes // 2))
    return values.to(getattr(torch, layout.dtype)).view(torch.uint8).numpy().tobytes()


def roundtrip(payload: bytes, nbytes: int) -> bytes:
    out = bytearray(nbytes)
    codec.decompress_into(memoryview(payload), memoryview(out))
    return bytes(out)


@pytest.mark.parametrize("layout", [FP16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kv_blocks_round_trip_byte_exact_and_shrink(layout: KVLayout, seed: int) -> None:
    block = kv_like(layout, seed)
    payload = codec.compress(memoryview(block), layout)
    assert payload is not None
    assert len(payload) < len(block)
    assert roundtrip(payload, len(block)) == block


@pytest.mark.parametrize("layout", [FP16, BF16], ids=["fp16", "bf16"])
def test_special_values_round_trip(layout: KVLayout) -> None:
    """Every 16-bit pattern (NaNs, infinities, subnormals, -0) comes back as sent."""
    patterns = np.arange(1 << 16, dtype="<u2").tobytes()
    block = (patterns * (layout.block_bytes // len(patterns) + 1))[: layout.block_bytes]
    payload = codec.compress(memoryview(block), layout)
    assert payload is not None  # each pattern repeats: it shrinks
    assert roundtrip(payload, len(block)) == block


def test_planes_are_split_low_bytes_first() -> None:
    """The wire format: all low bytes, then all high bytes (a peer of another
    version must read the same planes)."""
    block = kv_like(FP16, 3)
    payload = codec.compress(memoryview(block), FP16)
    assert payload is not None
    planes = zstandard.ZstdDecompressor().decompress(payload)
    assert planes == block[0::2] + block[1::2]


@pytest.mark.parametrize("layout", [FP16, BF16], ids=["fp16", "bf16"])
def test_incompressible_block_is_sent_raw(layout: KVLayout) -> None:
    block = np.random.default_rng(4).integers(0, 256, layout.block_bytes, np.uint8).tobytes()
    assert codec.compress(memoryview(block), layout) is None


def test_other_dtypes_are_never_byte_split() -> None:
    assert not codec.can_bytesplit(FP32)
    assert codec.compress(memoryview(bytes(FP32.block_bytes)), FP32) is None


def bad_payloads() -> dict[str, bytes]:
    n = FP16.block_bytes
    good = codec.compress(memoryview(kv_like(FP16, 5)), FP16)
    assert good is not None
    cctx = zstandard.ZstdCompressor(level=1)
    return {
        "garbage": np.random.default_rng(6).integers(0, 256, 600, np.uint8).tobytes(),
        "empty": b"",
        "truncated": good[: len(good) // 2],
        "shorter block": cctx.compress(bytes(n - 2)),
        "longer block": cctx.compress(bytes(n + 2)),
        "shorter, size not declared": zstandard.ZstdCompressor(
            level=1, write_content_size=False
        ).compress(bytes(n - 2)),
        "longer, size not declared": zstandard.ZstdCompressor(
            level=1, write_content_size=False
        ).compress(bytes(n + 2)),
    }


@pytest.mark.parametrize("name", sorted(bad_payloads()))
def test_corrupted_payload_is_refused(name: str) -> None:
    out = bytearray(FP16.block_bytes)
    with pytest.raises(ValueError):
        codec.decompress_into(memoryview(bad_payloads()[name]), memoryview(out))


def test_bit_flips_raise_value_error_or_decode_to_other_bytes() -> None:
    """zstd frames carry no checksum here: the receiver's blake3 of the block
    catches a flip that still decodes. What the codec must never do is raise
    anything but ValueError, or write past the block."""
    block = kv_like(FP16, 7)
    payload = codec.compress(memoryview(block), FP16)
    assert payload is not None
    refused = 0
    for i in range(0, len(payload), max(1, len(payload) // 200)):
        bad = bytearray(payload)
        bad[i] ^= 0x10
        try:
            got = roundtrip(bytes(bad), len(block))
        except ValueError:
            refused += 1
            continue
        assert len(got) == len(block)
    assert refused > 0


def test_a_decompression_bomb_is_refused_before_it_is_allocated() -> None:
    """~2 KiB of zstd that declares 64 MiB: fits under the frame's payload
    bound (the block size), so the codec must check the declared size."""
    bomb = zstandard.ZstdCompressor(level=1).compress(bytes(64 << 20))
    out = bytearray(FP16.block_bytes)
    assert len(bomb) < len(out)
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match="declares"):
            codec.decompress_into(memoryview(bomb), memoryview(out))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"decompressing a bomb set aside {peak} bytes"


def test_odd_block_size_is_refused() -> None:
    with pytest.raises(ValueError, match="even"):
        codec.decompress_into(memoryview(b"x"), memoryview(bytearray(3)))


def test_end_frame_is_a_frame_with_the_end_flag() -> None:
    _key, _digest, payload_bytes, block_bytes, flags = codec.FRAME.unpack(codec.end_frame())
    assert flags & codec.FLAG_END and payload_bytes == block_bytes == 0
