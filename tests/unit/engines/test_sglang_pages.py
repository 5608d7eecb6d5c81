"""SGLang host-pool pages as tierstore blocks (tierstore.engines.sglang.pages
and .layout), without SGLang: host buffers built from SGLang's definition of
each layout, with every element naming its own (K|V, layer, token, head, dim)."""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

import blake3
import numpy as np
import pytest
import torch

from tierstore.engines.sglang.keys import block_keys
from tierstore.engines.sglang.layout import StorageSettings, host_pages, storage_layout
from tierstore.engines.sglang.pages import HostPages, PageLayoutError, PageShape
from tierstore.memory.memcopy import AUTO_COPY_THREADS, copy_runs

L, PS, H, D = 3, 4, 2, 5
PAGES = 3
TOKENS = PAGES * PS
SHAPE = PageShape(layers=L, page_size=PS, heads=H, head_dim=D, dtype=torch.float32)


def code(c: Any, layer: Any, token: Any, head: Any, dim: Any) -> Any:
    return (((c * L + layer) * TOKENS + token) * H + head) * D + dim


def logical() -> torch.Tensor:
    """(2, layers, tokens, heads, dim): element = its own code."""
    c, layer, t, h, d = torch.meshgrid(
        *(torch.arange(n) for n in (2, L, TOKENS, H, D)), indexing="ij"
    )
    return code(c, layer, t, h, d).to(torch.float32)


def host_buffer(layout: str) -> torch.Tensor:
    """The kv_buffer of SGLang's MHATokenToKVPoolHost (init_kv_buffer's dims)."""
    x = logical()
    if layout == "layer_first":  # (2, layers, tokens, heads, dim)
        return x.contiguous()
    if layout == "page_first":  # (2, tokens, layers, heads, dim)
        return x.permute(0, 2, 1, 3, 4).contiguous()
    # page_first_direct: (2, pages, layers, page_size, heads, dim)
    return x.view(2, L, PAGES, PS, H, D).permute(0, 2, 1, 3, 4, 5).contiguous()


def sglang_flat_page(kv: torch.Tensor, layout: str, index: int) -> torch.Tensor:
    """SGLang's get_data_page(index, flat=True)."""
    if layout == "layer_first":
        return kv[:, :, index : index + PS].flatten()
    if layout == "page_first":
        return kv[:, index : index + PS].flatten()
    return kv[:, index // PS : index // PS + 1].flatten()


LAYOUTS = ["layer_first", "page_first", "page_first_direct"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layouts_page_is_one_block_order(layout: str) -> None:
    kv = host_buffer(layout)
    pages = HostPages(kv, layout, SHAPE)
    want = logical()
    compared = 0
    for index in range(0, TOKENS, PS):
        block = pages.block_view(index)
        assert block.shape == SHAPE.block_shape
        assert torch.equal(block, want[:, :, index : index + PS])
        flat = sglang_flat_page(kv, layout, index).clone()
        assert torch.equal(pages.flat_view(flat), want[:, :, index : index + PS])
        compared += 1
    assert compared == PAGES


def test_the_oracle_sees_a_missing_transpose() -> None:
    """Negative control: page_first's page read without the transpose (token
    major, as its flat page is) is not the block."""
    kv = host_buffer("page_first")
    naive = kv[:, 0:PS].reshape(SHAPE.block_shape)
    assert not torch.equal(naive, logical()[:, :, 0:PS])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_copy_through_the_arena_moves_pages_between_layouts(layout: str) -> None:
    src = HostPages(host_buffer("page_first"), "page_first", SHAPE)
    dst = HostPages(torch.zeros_like(host_buffer(layout)), layout, SHAPE)
    arena = torch.zeros(PAGES * SHAPE.block_bytes, dtype=torch.uint8)
    rows = arena.view(PAGES, SHAPE.block_bytes)
    for p in range(PAGES):  # backup from page_first, then get into `layout`
        src.as_block(rows[p]).copy_(src.block_view(p * PS))
    for p in range(PAGES):
        dst.block_view(((p + 1) % PAGES) * PS).copy_(dst.as_block(rows[p]))
    for p in range(PAGES):
        assert torch.equal(dst.block_view(((p + 1) % PAGES) * PS), src.block_view(p * PS))


def test_bad_pools_and_indices_are_refused_with_the_reason() -> None:
    with pytest.raises(PageLayoutError, match="page_head"):
        HostPages(host_buffer("layer_first"), "page_head", SHAPE)
    with pytest.raises(PageLayoutError, match="should have shape"):
        HostPages(host_buffer("page_first"), "layer_first", SHAPE)
    with pytest.raises(PageLayoutError, match=r"holds torch\.float32"):
        HostPages(host_buffer("layer_first"), "layer_first",
                  PageShape(L, PS, H, D, torch.bfloat16))  # fmt: skip
    pages = HostPages(host_buffer("layer_first"), "layer_first", SHAPE)
    with pytest.raises(PageLayoutError, match="does not start a page"):
        pages.block_view(1)
    with pytest.raises(PageLayoutError, match="does not start a page"):
        pages.block_view(TOKENS)
    with pytest.raises(PageLayoutError, match="flat page must be"):
        pages.flat_view(torch.zeros(7))


def config(**kw: Any) -> SimpleNamespace:
    """HiCacheStorageConfig's fields (sglang 0.5.23)."""
    base = dict(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
                model_name="org/model", should_split_heads=False, extra_config={},
                dcp_size=1, dcp_rank=0)  # fmt: skip
    return SimpleNamespace(**{**base, **kw})


def test_the_namespace_comes_from_the_config_and_the_pool() -> None:
    s = StorageSettings()
    layout = storage_layout(config(tp_rank=1, tp_size=2), SHAPE, s)
    assert (layout.model, layout.num_layers, layout.num_kv_heads, layout.head_dim) == (
        "sglang:org/model", L, H, D)  # fmt: skip
    assert (layout.dtype, layout.block_tokens, layout.tp_rank, layout.tp_size) == (
        "float32", PS, 1, 2)  # fmt: skip
    assert layout.block_bytes == SHAPE.block_bytes
    assert storage_layout(config(pp_rank=1, pp_size=2), SHAPE, s).model == "sglang:org/model#pp1/2"
    named = storage_layout(config(), SHAPE, StorageSettings(model_name="m", tenant_salt="t"))
    assert (named.model, named.tenant_salt) == ("sglang:m", "t")
    for bad, why in [
        (config(is_mla_model=True), "MLA config over an MHA host pool"),
        (config(attn_cp_size=2), "context parallelism"),
        (config(dcp_size=2), "decode context"),
        (config(should_split_heads=True), "heads split"),
        (config(model_name=None), "no model name"),
    ]:
        with pytest.raises(PageLayoutError, match=why):
            storage_layout(bad, SHAPE, s)


def test_page_keys_are_deterministic_and_scoped_by_the_namespace() -> None:
    s = StorageSettings()
    rank0 = storage_layout(config(), SHAPE, s)
    rank1 = storage_layout(config(tp_rank=1, tp_size=2), SHAPE, s)
    keys = ["ab" * 32, "cd" * 32]
    k0 = block_keys(rank0, keys)
    assert k0 == block_keys(rank0, list(keys))
    assert k0[0] == blake3.blake3(rank0.fingerprint + keys[0].encode()).digest()
    assert all(len(k) == 32 for k in k0) and k0[0] != k0[1]
    assert set(k0).isdisjoint(block_keys(rank1, keys))


def test_settings_take_tierstores_keys_and_leave_sglangs() -> None:
    extra = {"backend_name": "tierstore", "module_path": "tierstore.engines.sglang",
             "class_name": "TierstoreStorage", "interface_v1": 1,
             "socket_path": "/run/t.sock", "include_peers": True}  # fmt: skip
    s = StorageSettings.from_extra(extra)
    assert (s.socket_path, s.include_peers) == ("/run/t.sock", True)
    with pytest.raises(ValueError, match="unknown tierstore settings \\['socket'\\]"):
        StorageSettings.from_extra({"socket": "/x"})
    with pytest.raises(ValueError, match="call_timeout_s must be a number > 0"):
        StorageSettings.from_extra({"call_timeout_s": 0})
    with pytest.raises(ValueError, match="include_peers must be true or false"):
        StorageSettings.from_extra({"include_peers": "yes"})
    assert s.fast_path and not StorageSettings.from_extra({"fast_path": False}).fast_path
    with pytest.raises(ValueError, match="fast_path must be true or false"):
        StorageSettings.from_extra({"fast_path": 0})


def test_copy_threads_default_to_the_cores_and_refuse_nonsense() -> None:
    cores = len(os.sched_getaffinity(0))
    assert StorageSettings().copy_thread_count() == min(cores, AUTO_COPY_THREADS)
    assert StorageSettings.from_extra({"copy_threads": 3}).copy_thread_count() == 3
    for bad in (-1, 65, 2.5, True, "2"):
        with pytest.raises(ValueError, match="copy_threads"):
            StorageSettings.from_extra({"copy_threads": bad})


def test_host_pages_reads_an_mha_host_pool_by_attribute() -> None:
    pool = SimpleNamespace(kv_buffer=host_buffer("page_first"), layout="page_first",
                           layer_num=L, page_size=PS, head_num=H, head_dim=D,
                           v_head_dim=D, dtype=torch.float32)  # fmt: skip
    assert host_pages(pool).shape == SHAPE
    with pytest.raises(PageLayoutError, match="only MHA and MLA host pools"):
        host_pages(SimpleNamespace(kv_buffer=None))
    with pytest.raises(PageLayoutError, match="K and V head dims differ"):
        host_pages(SimpleNamespace(**{**vars(pool), "v_head_dim": D + 1}))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_runs_copy_a_batch_like_the_views_do(layout: str) -> None:
    """store_runs / load_runs (one copy_runs call per batch) against the
    per-page copy through block_view; slots out of order, pages out of order."""
    src = HostPages(host_buffer(layout), layout, SHAPE)
    n = SHAPE.block_bytes
    arena = np.zeros(4 * n, dtype=np.uint8)
    slots, starts = [2 * n, 0, 3 * n], [PS, 2 * PS, 0]
    src.store_runs(arena, slots, starts)
    rows = torch.from_numpy(arena)
    for slot, start in zip(slots, starts):
        assert torch.equal(src.as_block(rows[slot : slot + n]), src.block_view(start))
    assert not arena[n : 2 * n].any()  # the slot not named is untouched
    dst = HostPages(torch.zeros_like(host_buffer(layout)), layout, SHAPE)
    dst.load_runs(arena, slots, starts)
    for start in starts:
        assert torch.equal(dst.block_view(start), src.block_view(start))
    assert dst.run_bytes == {"layer_first": PS * H * D, "page_first": H * D,
                             "page_first_direct": L * PS * H * D}[layout] * 4  # fmt: skip


@pytest.mark.parametrize("layout", LAYOUTS)
def test_runs_on_several_threads_copy_what_one_thread_does(layout: str) -> None:
    """Pages big enough for copy_runs to use helper threads (2 MiB blocks, 6
    pages: up to three threads), both ways, against one thread's copy."""
    layers, ps, heads, dim, pages = 4, 64, 8, 128, 6
    shape = PageShape(layers=layers, page_size=ps, heads=heads, head_dim=dim, dtype=torch.float32)
    x = torch.randn(2, layers, pages * ps, heads, dim, generator=torch.Generator().manual_seed(4))
    kv = {"layer_first": x, "page_first": x.permute(0, 2, 1, 3, 4),
          "page_first_direct": x.view(2, layers, pages, ps, heads, dim).permute(0, 2, 1, 3, 4, 5),
          }[layout].contiguous()  # fmt: skip
    src = HostPages(kv, layout, shape)
    n = shape.block_bytes
    slots, starts = [p * n for p in (3, 0, 5, 1, 4, 2)], [p * ps for p in range(pages)]
    one, many = np.zeros(pages * n, np.uint8), np.zeros(pages * n, np.uint8)
    src.store_runs(one, slots, starts)
    src.store_runs(many, slots, starts, threads=3)
    assert one.any() and np.array_equal(one, many)
    back = HostPages(torch.zeros_like(kv), layout, shape)
    back.load_runs(many, slots, starts, threads=3)
    assert torch.equal(back.kv, kv)
    many[slots[2] + n - 1] ^= 1  # negative control: one byte of one block
    back.load_runs(many, slots, starts, threads=3)
    assert not torch.equal(back.kv, kv)


def test_runs_in_the_wrong_order_would_fail_the_copy_check() -> None:
    """Negative control: the page_first pattern read as if the layout were
    layer_first (runs of a whole page of one layer) is not the block."""
    kv = host_buffer("page_first")
    src = HostPages(kv, "page_first", SHAPE)
    n = SHAPE.block_bytes
    arena = np.zeros(n, dtype=np.uint8)
    wrong = np.arange(2 * L, dtype=np.int64) * PS * H * D * 4  # layer_first's pattern
    copy_runs(arena, kv.view(-1).view(torch.uint8).numpy(), wrong, wrong, PS * H * D * 4)
    assert not torch.equal(src.as_block(torch.from_numpy(arena)), src.block_view(0))


MLA = PageShape(layers=L, page_size=PS, heads=1, head_dim=D * 2, dtype=torch.float32, planes=1)


def mla_buffer(layout: str) -> torch.Tensor:
    """MLATokenToKVPoolHost's kv_buffer: no plane dim, 1 head of the latent."""
    x = torch.arange(L * TOKENS * 2 * D, dtype=torch.float32).view(L, TOKENS, 1, 2 * D)
    if layout == "layer_first":  # (layers, tokens, 1, latent)
        return x.contiguous()
    if layout == "page_first":  # (tokens, layers, 1, latent)
        return x.permute(1, 0, 2, 3).contiguous()
    # page_first_direct: (pages, layers, page_size, 1, latent)
    return x.view(L, PAGES, PS, 1, 2 * D).permute(1, 0, 2, 3, 4).contiguous()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_mla_pages_are_one_block_order_too(layout: str) -> None:
    want = torch.arange(L * TOKENS * 2 * D, dtype=torch.float32).view(1, L, TOKENS, 1, 2 * D)
    src = HostPages(mla_buffer(layout), layout, MLA)
    arena = np.zeros(PAGES * MLA.block_bytes, dtype=np.uint8)
    slots = [p * MLA.block_bytes for p in range(PAGES)]
    src.store_runs(arena, slots, [p * PS for p in range(PAGES)])
    rows = torch.from_numpy(arena).view(PAGES, MLA.block_bytes)
    for p in range(PAGES):
        assert torch.equal(src.block_view(p * PS), want[:, :, p * PS : (p + 1) * PS])
        assert torch.equal(src.as_block(rows[p]), want[:, :, p * PS : (p + 1) * PS])
    pool = SimpleNamespace(kv_buffer=mla_buffer(layout), layout=layout, layer_num=L,
                           page_size=PS, kv_cache_dim=2 * D, dtype=torch.float32)  # fmt: skip
    assert host_pages(pool).shape == MLA


def test_the_mla_namespace_is_one_for_every_rank() -> None:
    s = StorageSettings()
    ranks = [
        storage_layout(config(is_mla_model=True, tp_rank=r, tp_size=2), MLA, s) for r in (0, 1)
    ]
    assert ranks[0] == ranks[1]
    layout = ranks[0]
    assert (layout.model, layout.num_kv_heads, layout.head_dim, layout.tp_size) == (
        "sglang:org/model#mla", 1, D, 1)  # fmt: skip
    assert layout.block_bytes == MLA.block_bytes
    with pytest.raises(PageLayoutError, match="over an MHA host pool, or the reverse"):
        storage_layout(config(), MLA, s)
    odd = PageShape(L, PS, 1, 2 * D + 1, torch.float32, planes=1)
    with pytest.raises(PageLayoutError, match="odd width"):
        storage_layout(config(is_mla_model=True), odd, s)
