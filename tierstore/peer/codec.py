"""Wire format of the peer data channel and its optional compression.

A transfer is: the receiver sends the 32-byte ticket; the sender answers
with one frame per block and an end frame. A frame is a fixed header
(``FRAME``: key, blake3 digest of the *uncompressed* block, payload length,
uncompressed length, flags) followed by the payload. Every length is checked
against the layout's block size before a byte is read into memory.

Compression is zstd (level 1) over a byte-plane split of 2-byte dtypes
(fp16/bf16): all low bytes, then all high bytes, so that the exponent bytes
sit together and compress. A block that does not shrink is sent raw.

Pure functions; safe from any thread.
"""

from __future__ import annotations

import struct

import numpy as np
import zstandard

from tierstore.keys import DTYPE_BYTES, KVLayout

FRAME = struct.Struct("<32s32sQQB")  # key, digest, payload bytes, block bytes, flags
FLAG_ZSTD_BYTESPLIT = 1
FLAG_END = 2
TICKET_BYTES = 32
ZSTD_LEVEL = 1


def can_bytesplit(layout: KVLayout) -> bool:
    return DTYPE_BYTES[layout.dtype] == 2


def compress(block: memoryview, layout: KVLayout) -> bytes | None:
    """Byte-split zstd of a block, or None when it would not shrink."""
    if not can_bytesplit(layout):
        return None
    planes = np.frombuffer(block, dtype=np.uint8).reshape(-1, 2).T
    out = zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(np.ascontiguousarray(planes).data)
    return out if len(out) < len(block) else None


def decompress_into(payload: memoryview, out: memoryview) -> None:
    """Undo ``compress`` into ``out`` (exactly the block's size) or raise ValueError."""
    n = len(out)
    planes = zstandard.ZstdDecompressor().decompress(payload, max_output_size=n)
    if len(planes) != n:
        raise ValueError(f"decompressed {len(planes)} bytes, expected {n}")
    dst = np.frombuffer(out, dtype=np.uint8).reshape(-1, 2)
    dst[:] = np.frombuffer(planes, dtype=np.uint8).reshape(2, -1).T


def max_payload_bytes(block_bytes: int) -> int:
    """Upper bound of a frame's payload: a compressed block never exceeds this."""
    return block_bytes


def end_frame() -> bytes:
    return FRAME.pack(b"\0" * 32, b"\0" * 32, 0, 0, FLAG_END)
