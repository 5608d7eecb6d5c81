"""CUDA-only paths: pinning the arena and copying on a side stream."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.cuda


def test_register_arena_and_copy_round_trip() -> None:
    import torch

    from tierstore.client import cuda
    from tierstore.memory.arena import Arena

    arena = Arena.create(8 << 20, tag="cuda-test")
    try:
        host = torch.frombuffer(arena.buf, dtype=torch.uint8)
        assert cuda.register_host(host)
        src = torch.randint(0, 256, (4 << 20,), dtype=torch.uint8, device="cuda")
        stream = cuda.copy_stream("cuda")
        with torch.cuda.stream(stream):
            host[: 4 << 20].copy_(src, non_blocking=True)
        stream.synchronize()
        assert torch.equal(host[: 4 << 20].cuda(), src)
        cuda.unregister_host(host)
        del host
    finally:
        arena.close()
