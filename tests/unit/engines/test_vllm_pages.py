"""vLLM's KV tensors as pages, and the CPU copies between pages and an arena."""

from __future__ import annotations

import os

import pytest
import torch

from tierstore.engines.vllm.layout import ConnectorSettings
from tierstore.engines.vllm.link import StoreLink
from tierstore.engines.vllm.pages import CpuPageMover, PagedKV, PageLayoutError
from tierstore.engines.vllm.worker import ConnectorWorker

LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]


def cpu_caches(num_blocks: int = 6, heads: int = 2, bt: int = 4, hd: int = 8) -> dict:
    """The CPU backend's per-layer [blocks, heads, block_size, 2*head_size]."""
    return {n: torch.randn(num_blocks, heads, bt, 2 * hd).to(torch.bfloat16) for n in LAYERS}


def test_cpu_pages_are_one_contiguous_range_per_block() -> None:
    caches = cpu_caches()
    layer_bytes = 2 * 4 * 16 * 2
    paged = PagedKV(caches, LAYERS, layer_bytes)
    assert (paged.outer, paged.inner) == (1, layer_bytes)
    page = paged.pages[1]
    assert page.data_ptr() == caches[LAYERS[1]].data_ptr()  # a view, not a copy
    want = caches[LAYERS[1]][3].contiguous().view(torch.uint8).reshape(-1)
    assert torch.equal(page[0, 3], want)


def test_planes_apart_give_two_ranges_per_block() -> None:
    # flash-attention's [2, blocks, block_size, heads, head_size]
    caches = {n: torch.randn(2, 5, 4, 2, 8).half() for n in LAYERS}
    paged = PagedKV(caches, LAYERS, 2 * 4 * 2 * 8 * 2)
    assert (paged.outer, paged.inner) == (2, 4 * 2 * 8 * 2)
    k3 = caches[LAYERS[0]][0, 3].contiguous().view(torch.uint8).reshape(-1)
    v3 = caches[LAYERS[0]][1, 3].contiguous().view(torch.uint8).reshape(-1)
    assert torch.equal(paged.pages[0][0, 3], k3)
    assert torch.equal(paged.pages[0][1, 3], v3)


def test_what_is_not_pages_is_refused() -> None:
    caches = cpu_caches()
    with pytest.raises(PageLayoutError, match="no KV cache"):
        PagedKV(caches, [*LAYERS, "missing"], 256)
    with pytest.raises(PageLayoutError, match="whole number"):
        PagedKV(caches, LAYERS, 300)
    strided = {n: t.transpose(1, 2) for n, t in caches.items()}
    with pytest.raises(PageLayoutError, match="not contiguous"):
        PagedKV(strided, LAYERS, 256)


@pytest.mark.parametrize("planes", [False, True])
def test_mover_round_trip_through_an_arena(planes: bool) -> None:
    if planes:
        src = {n: torch.randn(2, 6, 4, 2, 8).half() for n in LAYERS}
        dst = {n: torch.zeros(2, 6, 4, 2, 8).half() for n in LAYERS}
    else:
        src, dst = cpu_caches(), {n: torch.zeros(6, 2, 4, 16).bfloat16() for n in LAYERS}
    layer_bytes = 256
    a, b = PagedKV(src, LAYERS, layer_bytes), PagedKV(dst, LAYERS, layer_bytes)
    arena = torch.zeros(8 * 2 * layer_bytes, dtype=torch.uint8)
    blocks = [(0, 4), (3, 1)]  # (arena slot, vLLM block)
    out, back = CpuPageMover(a, arena), CpuPageMover(b, arena)
    for layer in range(2):
        out.from_pages(
            layer, [(s * 2 * layer_bytes + layer * layer_bytes, bid) for s, bid in blocks]
        )
    # A block in the arena is layer 0's page, then layer 1's.
    for s, bid in blocks:
        for layer in range(2):
            lo = s * 2 * layer_bytes + layer * layer_bytes
            assert torch.equal(arena[lo : lo + layer_bytes], a.pages[layer][:, bid].reshape(-1))
    for layer in range(2):
        back.to_pages(
            layer, [(s * 2 * layer_bytes + layer * layer_bytes, bid + 1) for s, bid in blocks]
        )
    for _, bid in blocks:
        for n in LAYERS:
            if planes:
                assert torch.equal(dst[n][:, bid + 1], src[n][:, bid])
            else:
                assert torch.equal(dst[n][bid + 1], src[n][bid])
    untouched = [i for i in range(6) if i not in (5, 2)]
    for n in LAYERS:
        idx = torch.tensor(untouched)
        assert not (dst[n][:, idx] if planes else dst[n][idx]).any()


def per_block_to_pages(paged: PagedKV, arena: torch.Tensor, layer: int, pairs) -> None:
    """The straightforward reference: one slice copy per block and plane."""
    n = paged.inner
    for offset, block_id in pairs:
        for o in range(paged.outer):
            paged.pages[layer][o, block_id] = arena[offset + o * n : offset + (o + 1) * n]


def per_block_from_pages(paged: PagedKV, arena: torch.Tensor, layer: int, pairs) -> None:
    n = paged.inner
    for offset, block_id in pairs:
        for o in range(paged.outer):
            arena[offset + o * n : offset + (o + 1) * n] = paged.pages[layer][o, block_id]


def random_pairs(layer_bytes: int, num_blocks: int, seed: int) -> list[list[tuple[int, int]]]:
    """Per layer: (arena offset of the layer's part, vLLM block id) of 5 blocks in
    scattered arena slots and vLLM blocks, as the worker passes them."""
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(12, generator=g)[:5].tolist()
    ids = torch.randperm(num_blocks, generator=g)[:5].tolist()
    return [
        [(s * 2 * layer_bytes + layer * layer_bytes, b) for s, b in zip(slots, ids)]
        for layer in range(2)
    ]


@pytest.mark.parametrize("planes", [False, True])
def test_mover_copies_what_one_copy_per_block_copies(planes: bool) -> None:
    # CPU pages: 272 KiB a layer's block, past the C loop's 256 KiB streaming floor
    # and not a whole number of its 128-byte steps; planes: 16 KiB each (memcpy).
    shape = (2, 9, 64, 4, 32) if planes else (9, 8, 64, 272)
    layer_bytes = 2 * 64 * 4 * 32 * 2 if planes else 8 * 64 * 272 * 2
    made = {n: torch.randn(shape).bfloat16() for n in LAYERS}
    paged = PagedKV(made, LAYERS, layer_bytes)
    pairs = random_pairs(layer_bytes, 9, seed=7)
    arena = torch.randint(0, 256, (12 * 2 * layer_bytes,), dtype=torch.uint8)
    ref_arena = arena.clone()
    for layer in range(2):  # out of the pages: the save path
        CpuPageMover(paged, arena).from_pages(layer, pairs[layer])
        per_block_from_pages(paged, ref_arena, layer, pairs[layer])
    assert torch.equal(arena, ref_arena)

    got = {n: torch.randn(shape).bfloat16() for n in LAYERS}  # into the pages: the load path
    want = {n: t.clone() for n, t in got.items()}
    got_paged, want_paged = PagedKV(got, LAYERS, layer_bytes), PagedKV(want, LAYERS, layer_bytes)
    for layer in range(2):
        CpuPageMover(got_paged, arena).to_pages(layer, pairs[layer])
        per_block_to_pages(want_paged, arena, layer, pairs[layer])
    for n in LAYERS:
        assert torch.equal(got[n].view(torch.uint8), want[n].view(torch.uint8))

    # Negative control: the reference with two blocks' ids swapped differs.
    wrong = {n: t.clone() for n, t in want.items()}
    wrong_paged = PagedKV(wrong, LAYERS, layer_bytes)
    (o0, b0), (o1, b1), *rest = pairs[0]
    per_block_to_pages(wrong_paged, arena, 0, [(o0, b1), (o1, b0), *rest])
    assert not torch.equal(wrong[LAYERS[0]].view(torch.uint8), got[LAYERS[0]].view(torch.uint8))


def test_mover_refuses_a_block_id_outside_the_pages() -> None:
    paged = PagedKV(cpu_caches(), LAYERS, 256)
    mover = CpuPageMover(paged, torch.zeros(4096, dtype=torch.uint8))
    with pytest.raises(IndexError, match="block id"):
        mover.to_pages(0, [(0, 6)])
    with pytest.raises(IndexError, match="block id"):
        mover.from_pages(0, [(0, -1)])


@pytest.mark.parametrize("threads", [2, 3])
def test_threaded_copies_move_the_same_bytes(threads: int) -> None:
    # 8 blocks of 1 MiB a layer out and back: 8 MiB of runs, so copy_runs starts helpers.
    layer_bytes, num_blocks = 1 << 20, 12
    src = {n: torch.randint(0, 255, (num_blocks, layer_bytes), dtype=torch.uint8) for n in LAYERS}
    one = {n: torch.zeros(num_blocks, layer_bytes, dtype=torch.uint8) for n in LAYERS}
    many = {n: torch.zeros(num_blocks, layer_bytes, dtype=torch.uint8) for n in LAYERS}
    arena = torch.zeros(8 * 2 * layer_bytes, dtype=torch.uint8)
    slot = 2 * layer_bytes  # an arena slot holds a block's two layers
    pairs = [[(s * slot + layer * layer_bytes, 11 - s) for s in range(8)] for layer in range(2)]
    out = CpuPageMover(PagedKV(src, LAYERS, layer_bytes), arena, threads)
    for layer in range(2):
        out.from_pages(layer, pairs[layer])
    for dst, t in ((one, 1), (many, threads)):
        mover = CpuPageMover(PagedKV(dst, LAYERS, layer_bytes), arena, t)
        for layer in range(2):
            mover.to_pages(layer, pairs[layer])
    for n in LAYERS:
        assert torch.equal(one[n], many[n])
        assert torch.equal(many[n][4:], src[n][4:])  # blocks 4-11 went out and back
        assert not many[n][:4].any()


def test_the_worker_copies_on_the_configured_threads(tmp_path) -> None:
    caches = cpu_caches()
    for setting, want in ((3, 3), (0, min(4, len(os.sched_getaffinity(0))))):
        settings = ConnectorSettings(socket_path=str(tmp_path / "none.sock"), async_loads=False,
                                     copy_threads=setting)  # fmt: skip
        link = StoreLink(settings, "test")
        try:
            worker = ConnectorWorker(link, settings, lambda salt: (), 0)
            worker.register(caches, LAYERS, 2 * 4 * 16 * 2)
            mover = worker._new_mover(torch.zeros(1 << 12, dtype=torch.uint8))
        finally:
            link.close()
        assert isinstance(mover, CpuPageMover) and mover.threads == want
