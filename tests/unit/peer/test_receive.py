"""receive_blocks over a socket pair into a real (small) TieredStore: blocks
the receiver holds already are read past, not kept; the rest is verified
and committed in order."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from typing import cast

import blake3
import numpy as np
import pytest

from tierstore.config.store import StoreConfig
from tierstore.keys import KVLayout, chain_keys
from tierstore.memory.arena import Arena
from tierstore.peer import codec
from tierstore.peer.data import WIRE_PIECE_BYTES, receive_blocks
from tierstore.store.nvme.tier import NvmeTier
from tierstore.store.tiered import TieredStore

from ...conftest import SMALL_LAYOUT
from ..store.fakes import FakeNvme

L = SMALL_LAYOUT


def _store_and_blocks(
    tmp_path, layout: KVLayout, slots: int, seed: int
) -> tuple[TieredStore, list, list[bytes]]:
    """A small store of ``slots`` blocks (no NVMe) and 4 blocks of random bytes."""
    cfg = StoreConfig(
        dram_bytes=slots * layout.block_bytes,
        dram_segment_bytes=slots * layout.block_bytes,
        nvme_dir=str(tmp_path / "unused"),
    )
    store = TieredStore(
        cfg, arena=Arena.create(cfg.dram_bytes, cfg.shm_dir), nvme=cast(NvmeTier, FakeNvme())
    )
    keys = chain_keys(layout, list(range(4 * layout.block_tokens)))
    rng = np.random.default_rng(seed)
    data = [rng.integers(0, 256, layout.block_bytes, dtype=np.uint8).tobytes() for _ in keys]
    return store, keys, data


def test_blocks_held_already_are_read_past_and_the_rest_committed(tmp_path) -> None:
    store, keys, data = _store_and_blocks(tmp_path, L, 16, seed=3)
    sender, receiver = socket.socketpair()
    try:
        store.put(L, keys[1:2], [data[1]])  # the receiver holds block 1 already

        def send() -> None:
            for key, block in zip(keys, data):
                digest = blake3.blake3(block).digest()
                sender.sendall(codec.FRAME.pack(key, digest, len(block), len(block), 0) + block)
            sender.sendall(codec.end_frame())

        writer = threading.Thread(target=send)
        writer.start()
        result = receive_blocks(receiver, store, L, keys, time.monotonic() + 10)
        writer.join(10)
        assert result.error == "" and result.verify_failures == 0
        assert result.keys == [keys[0], keys[2], keys[3]]  # block 1 was not ours to keep
        assert result.bytes == 4 * L.block_bytes  # but it was read off the wire
        assert store.get(L, keys) == data
    finally:
        sender.close()
        receiver.close()
        store.close()


# Blocks of 2.6 wire pieces: a block is hashed piece by piece as it arrives
# (the last piece short), and checked once its last piece is in.
BIG = KVLayout("multi-piece", 3, 2, 64, "float16", 880)


def _receive_big(tmp_path, corrupt: tuple[int, int] | None):
    """Send 4 BIG blocks (``corrupt``: flip the byte at (block, offset) after
    its digest was taken) and receive them into a fresh store."""
    assert BIG.block_bytes % WIRE_PIECE_BYTES and BIG.block_bytes > 2 * WIRE_PIECE_BYTES
    store, keys, data = _store_and_blocks(tmp_path, BIG, 8, seed=5)
    sender, receiver = socket.socketpair()

    def send() -> None:
        for i, (key, block) in enumerate(zip(keys, data)):
            digest = blake3.blake3(block).digest()
            wire = bytearray(block)
            if corrupt is not None and corrupt[0] == i:
                wire[corrupt[1]] ^= 0x01
            frame = codec.FRAME.pack(key, digest, len(block), len(block), 0)
            with contextlib.suppress(OSError):  # the receiver stops reading at a bad block
                sender.sendall(frame + wire)

    writer = threading.Thread(target=send)
    writer.start()
    try:
        result = receive_blocks(receiver, store, BIG, keys, time.monotonic() + 10)
        receiver.close()
        writer.join(10)
        return result, keys, data, store
    finally:
        sender.close()
        receiver.close()


def test_blocks_of_several_pieces_are_verified_whole(tmp_path) -> None:
    result, keys, data, store = _receive_big(tmp_path, corrupt=None)
    try:
        assert result.error == "" and result.verify_failures == 0
        assert result.keys == keys and result.received == 4
        assert store.get(BIG, keys) == data
    finally:
        store.close()


@pytest.mark.parametrize("offset_in_piece", [0, 2])  # the first piece, the short last one
def test_a_byte_flipped_in_any_piece_ends_the_transfer_there(
    tmp_path, offset_in_piece: int
) -> None:
    offset = min(offset_in_piece * WIRE_PIECE_BYTES + 17, BIG.block_bytes - 1)
    result, keys, data, store = _receive_big(tmp_path, corrupt=(2, offset))
    try:
        assert result.verify_failures == 1
        assert result.keys == keys[:2]  # verified before the bad block: kept
        assert store.get(BIG, keys[:2]) == data[:2]
        assert store.lookup(BIG, keys).num_hits == 2  # the bad block and after: a miss
    finally:
        store.close()
