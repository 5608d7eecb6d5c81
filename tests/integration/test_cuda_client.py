"""StoreClient on a CUDA device against a real sidecar.

Blocks stored from device memory come back byte-exact through the pinned
arena and through the HBM pool's eviction; a store issued right after the
engine's kernel that writes the block copies the kernel's result (many
times, each behind a long kernel, with a control that shows the hazard is
real on this device); views released from ``acquire`` are no longer read by
the engine's copies; close unpins the arena and leaves no CUDA error.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from harness.sidecar import SidecarProcess
from tierstore.client import StoreClient, cuda
from tierstore.keys import BlockKey, KVLayout, chain_keys
from tierstore.tiers import TierName

from ..conftest import SidecarFactory

pytestmark = pytest.mark.cuda

# 64 KiB blocks: 2 (K,V) x 4 layers x 4 KV heads x 64 dims x 16 tokens x 2 bytes.
LAYOUT = KVLayout("cuda-test-model", 4, 4, 64, "bfloat16", 16)
BLOCK = LAYOUT.block_bytes
RPC_COVER_CYCLES = 40_000_000  # about 20 ms at 2 GHz: longer than a Reserve call
SHORT_CYCLES = 1_000_000  # about 0.5 ms: an HBM store queues its copy at once


def keys_for(n: int, start: int = 0) -> list[BlockKey]:
    return chain_keys(LAYOUT, np.arange(start, start + LAYOUT.block_tokens * n) % 50_000)


def device_blocks(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randint(0, 256, (n, BLOCK), dtype=torch.uint8, device="cuda", generator=g)


@pytest.fixture
def sidecar(sidecar_factory: SidecarFactory) -> SidecarProcess:
    return sidecar_factory("--set", "shutdown_grace_s=0.5", dram="16MiB", nvme="64MiB")


def test_blocks_round_trip_byte_exact_through_the_pinned_arena(sidecar: SidecarProcess) -> None:
    with StoreClient(str(sidecar.socket), device="cuda") as client:
        assert client._copier.pinned_host and client.arena_tensor.is_pinned()
        keys, blocks = keys_for(48), device_blocks(48, seed=1)
        assert all(client.store(LAYOUT, keys, blocks))
        got = client.load(LAYOUT, keys)  # into a new device tensor: merged runs
        assert got.num_blocks == 48 and set(got.tiers) == {TierName.DRAM}
        assert got.blocks.device.type == "cuda"
        assert torch.equal(got.blocks, blocks)
        out = torch.zeros(48 * BLOCK, dtype=torch.uint8, device="cuda")
        client.load(LAYOUT, keys, out)
        assert torch.equal(out.view(48, BLOCK), blocks)


def test_hbm_pool_eviction_writes_victims_down_byte_exact(sidecar: SidecarProcess) -> None:
    with StoreClient(str(sidecar.socket), device="cuda", hbm_bytes=8 * BLOCK) as client:
        assert client.hbm is not None and client.hbm.pool.device.type == "cuda"
        keys, blocks = keys_for(32, 1000), device_blocks(32, seed=2)
        for lo in range(0, 32, 4):  # four at a time: each store evicts the oldest
            assert all(client.store(LAYOUT, keys[lo : lo + 4], blocks[lo : lo + 4]))
        assert client.hbm.stats().evictions >= 24
        got = client.load(LAYOUT, keys, promote=False)
        assert got.num_blocks == 32
        assert got.tiers[:24] == (TierName.DRAM,) * 24
        assert got.tiers[24:] == (TierName.HBM,) * 8
        assert torch.equal(got.blocks, blocks)
        # Loaded back and promoted: the pool evicts again on the way in.
        got = client.load(LAYOUT, keys[:16])
        assert torch.equal(got.blocks, blocks[:16])
        assert torch.equal(client.load(LAYOUT, keys[8:16]).blocks, blocks[8:16])
        assert client.flush() == 0  # what HBM holds now came from the sidecar: clean
        assert torch.equal(client.load(LAYOUT, keys, promote=False).blocks, blocks)


@pytest.mark.parametrize(("hbm_blocks", "rounds", "cycles"), [(0, 40, RPC_COVER_CYCLES),
                                                             (256, 300, SHORT_CYCLES)])  # fmt: skip
def test_a_store_right_after_the_writing_kernel_copies_its_result(
    sidecar: SidecarProcess, hbm_blocks: int, rounds: int, cycles: int
) -> None:
    with StoreClient(str(sidecar.socket), device="cuda", hbm_bytes=hbm_blocks * BLOCK) as client:
        engine = torch.cuda.Stream()
        block = torch.zeros(BLOCK, dtype=torch.uint8, device="cuda")
        keys = keys_for(rounds, 20_000)
        with torch.cuda.stream(engine):
            for i, key in enumerate(keys):
                block.fill_(255)
                engine.synchronize()
                torch.cuda._sleep(cycles)
                block.fill_(i % 251)  # the engine's kernel writes the block
                assert client.store(LAYOUT, [key], block) == [True]
        engine.synchronize()
        got = client.load(LAYOUT, keys, promote=False)
        assert got.num_blocks == rounds
        firsts = got.blocks[:, 0].tolist()
        stale = [i for i, v in enumerate(firsts) if v != i % 251]
        assert not stale, f"{len(stale)} of {rounds} stores copied stale bytes: {stale[:10]}"
        expected = (torch.arange(rounds, device="cuda") % 251).to(torch.uint8)[:, None]
        assert torch.equal(got.blocks, expected.expand(rounds, BLOCK))


def test_a_load_waits_for_the_engine_still_reading_its_output(sidecar: SidecarProcess) -> None:
    with StoreClient(str(sidecar.socket), device="cuda") as client:
        key = keys_for(1, 30_000)
        client.store(LAYOUT, key, torch.full((BLOCK,), 9, dtype=torch.uint8, device="cuda"))
        out = torch.empty(BLOCK, dtype=torch.uint8, device="cuda")
        seen = torch.empty_like(out)
        for _ in range(40):
            out.fill_(3)
            torch.cuda.synchronize()
            torch.cuda._sleep(RPC_COVER_CYCLES)
            seen.copy_(out)  # the engine reads the buffer the load will overwrite
            assert client.load(LAYOUT, key, out).num_blocks == 1
            torch.cuda.synchronize()
            assert bool((seen == 3).all()) and bool((out == 9).all())


def test_release_returns_after_the_engine_copied_out_of_the_views(
    sidecar: SidecarProcess,
) -> None:
    with StoreClient(str(sidecar.socket), device="cuda") as client:
        keys, blocks = keys_for(4, 40_000), device_blocks(4, seed=3)
        client.store(LAYOUT, keys, blocks)
        dst = torch.empty_like(blocks)
        with client.acquire(LAYOUT, keys) as pinned:
            assert len(pinned.views) == 4
            torch.cuda._sleep(RPC_COVER_CYCLES)
            for j, view in enumerate(pinned.views):
                dst[j].copy_(view, non_blocking=True)  # async: the arena is pinned
        assert torch.cuda.current_stream().query()  # done before the slots were released
        assert torch.equal(dst, blocks)


def test_close_unpins_the_arena_and_leaves_no_cuda_error(sidecar: SidecarProcess) -> None:
    before = cuda.registered()
    client = StoreClient(str(sidecar.socket), device="cuda", hbm_bytes=16 * BLOCK)
    ptr, size = client.arena_tensor.data_ptr(), client.arena.size_bytes
    assert cuda.registered()[ptr] == size
    client.store(LAYOUT, keys_for(24, 50_000), device_blocks(24, seed=4))
    client.close()
    assert cuda.registered() == before
    # CUDA itself agrees: the range is not registered any more.
    err = torch.cuda.cudart().cudaHostUnregister(ptr)
    cuda._drop_pending_error("cuda")
    assert int(err) != 0
    torch.cuda.synchronize()
    assert float(torch.ones(16, device="cuda").sum()) == 16.0


def test_a_client_that_fails_to_start_unpins_what_it_pinned(sidecar: SidecarProcess) -> None:
    before = cuda.registered()
    free, _ = torch.cuda.mem_get_info()
    with pytest.raises(RuntimeError):  # torch.OutOfMemoryError
        StoreClient(str(sidecar.socket), device="cuda", hbm_bytes=4 * free)
    assert cuda.registered() == before
    torch.cuda.synchronize()
    assert float(torch.ones(16, device="cuda").sum()) == 16.0
