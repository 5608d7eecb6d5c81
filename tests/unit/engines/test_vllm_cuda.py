"""The vLLM connector's CUDA page mover on a device (skipped without one):
byte-exact copies both ways, a save issued right after the kernel that writes
the page reads that kernel's result, a load waits for the engine's earlier
kernels on the pages it fills, and layer_ready orders attention after the load."""

from __future__ import annotations

import pytest
import torch

from tierstore.engines.vllm.pages import PagedKV

pytestmark = pytest.mark.cuda

LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
BLOCKS, LAYER_BYTES = 8, 2 * 16 * 2 * 64 * 2  # [blocks, heads, block, 2*head] bf16
ROUNDS = 200


def device_caches(fill: float | None = None) -> dict[str, torch.Tensor]:
    shape = (BLOCKS, 2, 16, 128)
    return {
        n: (torch.full(shape, fill) if fill is not None else torch.randn(shape))
        .to(torch.bfloat16)
        .cuda()
        for n in LAYERS
    }


def mover_for(caches: dict[str, torch.Tensor], arena: torch.Tensor | None = None):
    from tierstore.engines.vllm.cuda import CudaPageMover

    if arena is None:
        arena = torch.zeros(BLOCKS * len(LAYERS) * LAYER_BYTES, dtype=torch.uint8)
    return CudaPageMover(PagedKV(caches, LAYERS, LAYER_BYTES), arena), arena


def spin(t: torch.Tensor, n: int = 40) -> None:
    """Keep the engine's stream busy for a while (then write ``t``)."""
    x = torch.randn(2048, 2048, device=t.device)
    for _ in range(n):
        x = x @ x
        x = x / x.norm()


def test_round_trip_is_byte_exact() -> None:
    src, dst = device_caches(), device_caches(0.0)
    out, arena = mover_for(src)
    back, _ = mover_for(dst, arena)  # both movers over one arena
    pairs = [(i * LAYER_BYTES, b) for i, b in enumerate([3, 5, 0])]
    for layer in range(len(LAYERS)):
        out.from_pages(layer, pairs)
    out.sync()
    for layer in range(len(LAYERS)):
        back.to_pages(layer, pairs)
        back.layer_ready(layer)
    back.sync()
    for name in LAYERS:
        for b in (3, 5, 0):
            assert torch.equal(src[name][b], dst[name][b])
    out.close()
    back.close()


def test_a_save_right_after_the_writing_kernel_reads_its_result() -> None:
    caches = device_caches(0.0)
    mover, arena = mover_for(caches)
    page = caches[LAYERS[0]]
    for r in range(ROUNDS):
        value = float(r % 7 + 1)
        spin(page, 4)
        page[2].fill_(value)  # the engine's attention writes the block...
        mover.from_pages(0, [(0, 2)])  # ...and the save is issued at once
        mover.sync()
        got = arena[:LAYER_BYTES].view(torch.bfloat16)
        assert torch.all(got == value), f"round {r}: the save read stale bytes"
    mover.close()


def test_a_load_waits_for_earlier_kernels_on_its_pages_and_attention_for_the_load() -> None:
    caches = device_caches(0.0)
    mover, arena = mover_for(caches)
    page = caches[LAYERS[1]]
    arena[LAYER_BYTES : 2 * LAYER_BYTES].view(torch.bfloat16).fill_(3.0)
    for r in range(ROUNDS):
        spin(page, 4)
        page[4].fill_(-1.0)  # an earlier request's kernel, still queued
        mover.to_pages(1, [(LAYER_BYTES, 4)])
        mover.layer_ready(1)  # attention of layer 1 runs after its pages arrived
        seen = page[4].float().sum().item()
        assert seen == 3.0 * page[4].numel(), f"round {r}: the load raced the engine"
        mover.sync()
    mover.close()
