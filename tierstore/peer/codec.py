"""Wire format of the peer data channel and its optional compression.

A transfer is: the receiver sends the 32-byte ticket; the sender answers
with one frame per block and an end frame. A frame is a fixed header
(``FRAME``: key, blake3 digest of the *uncompressed* block, payload length,
uncompressed length, flags) followed by the payload. Every length is checked
against the layout's block size before a byte is read into memory.

Compression is zstd (level 1) over a byte-plane split of 2-byte dtypes
(fp16/bf16): all low bytes, then all high bytes, so that the exponent bytes
sit together and compress. A block that does not shrink is sent raw.
A payload is decompressed only into exactly its block's size: a frame that
declares another size is refused before any memory is set aside for it (a
few KiB of zstd can declare gigabytes).

Pure functions; safe from any thread.
"""

from __future__ import annotations

import struct
import threading

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
    words = np.frombuffer(block, dtype="<u2")
    planes = np.empty(len(block), dtype=np.uint8)
    half = len(words)
    # Low bytes, then high bytes: shifts on 16-bit words run at memory speed,
    # a strided byte transpose does not (4x slower here).
    np.bitwise_and(words, 0xFF, out=planes[:half], casting="unsafe")
    np.right_shift(words, 8, out=planes[half:], casting="unsafe")
    out = _compressor().compress(planes.data)
    return out if len(out) < len(block) else None


def decompress_into(payload: memoryview, out: memoryview) -> None:
    """Undo ``compress`` into ``out`` (exactly the block's size) or raise
    ValueError: the payload comes from the network and may be anything."""
    n = len(out)
    if n % 2:
        raise ValueError(f"byte-split blocks have an even size, got {n}")
    try:
        # max_output_size bounds only frames that omit their size; a declared
        # size is allocated as declared, so it is checked first.
        declared = zstandard.frame_content_size(payload)
        if declared not in (n, -1):
            raise ValueError(f"the frame declares {declared} bytes, expected {n}")
        planes = _decompressor().decompress(payload, max_output_size=n)
    except zstandard.ZstdError as e:
        raise ValueError(f"not a zstd frame of this block: {e}") from e
    if len(planes) != n:
        raise ValueError(f"decompressed {len(planes)} bytes, expected {n}")
    raw = np.frombuffer(planes, dtype=np.uint8)
    words = np.frombuffer(out, dtype="<u2")
    np.left_shift(raw[n // 2 :], 8, out=words, dtype=np.uint16)
    np.bitwise_or(words, raw[: n // 2], out=words)


_local = threading.local()


def _compressor() -> zstandard.ZstdCompressor:
    """One compression context per thread: contexts are not thread-safe, and
    making one per block costs more than compressing a small block."""
    if not hasattr(_local, "cctx"):
        _local.cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
    return _local.cctx


def _decompressor() -> zstandard.ZstdDecompressor:
    if not hasattr(_local, "dctx"):
        _local.dctx = zstandard.ZstdDecompressor()
    return _local.dctx


def end_frame() -> bytes:
    return FRAME.pack(b"\0" * 32, b"\0" * 32, 0, 0, FLAG_END)
