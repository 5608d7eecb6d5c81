"""receive_blocks over a socket pair into a real (small) TieredStore: blocks
the receiver holds already are read past, not kept; the rest is verified
and committed in order."""

from __future__ import annotations

import socket
import threading
import time
from typing import cast

import blake3
import numpy as np

from tierstore.config.store import StoreConfig
from tierstore.keys import chain_keys
from tierstore.memory.arena import Arena
from tierstore.peer import codec
from tierstore.peer.data import Verifier, receive_blocks
from tierstore.store.nvme.tier import NvmeTier
from tierstore.store.tiered import TieredStore

from ...conftest import SMALL_LAYOUT
from ..store.fakes import FakeNvme

L = SMALL_LAYOUT


def test_blocks_held_already_are_read_past_and_the_rest_committed(tmp_path) -> None:
    cfg = StoreConfig(
        dram_bytes=16 * L.block_bytes,
        dram_segment_bytes=16 * L.block_bytes,
        nvme_dir=str(tmp_path / "unused"),
    )
    store = TieredStore(
        cfg, arena=Arena.create(cfg.dram_bytes, cfg.shm_dir), nvme=cast(NvmeTier, FakeNvme())
    )
    verifier = Verifier(2)
    keys = chain_keys(L, list(range(4 * L.block_tokens)))
    rng = np.random.default_rng(3)
    data = [rng.integers(0, 256, L.block_bytes, dtype=np.uint8).tobytes() for _ in keys]
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
        result = receive_blocks(receiver, store, L, keys, time.monotonic() + 10, verifier)
        writer.join(10)
        assert result.error == "" and result.verify_failures == 0
        assert result.keys == [keys[0], keys[2], keys[3]]  # block 1 was not ours to keep
        assert result.bytes == 4 * L.block_bytes  # but it was read off the wire
        assert store.get(L, keys) == data
    finally:
        sender.close()
        receiver.close()
        verifier.close()
        store.close()
