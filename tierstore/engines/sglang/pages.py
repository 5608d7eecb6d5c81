"""SGLang host-pool pages as tierstore blocks: one byte order for every layout.

Provides ``HostPages`` over the KV buffer of SGLang's MHA host pool
(``MHATokenToKVPoolHost``), for its three generic layouts:

- ``layer_first``:       kv_buffer (2, layers, tokens, heads, head_dim)
- ``page_first``:        kv_buffer (2, tokens, layers, heads, head_dim)
- ``page_first_direct``: kv_buffer (2, pages, layers, page_size, heads, head_dim)

and of its MLA host pool (``MLATokenToKVPoolHost``), whose buffers have no
K|V plane (one latent of ``kv_cache_dim`` per token and layer, 1 "head"):
``planes=1``, the same shapes without the leading 2.

A tierstore block holds one page in a single order, whatever the host
layout: (plane, layer, token, head, head_dim), which is also SGLang's flat
page (``get_dummy_flat_data_page``) of ``layer_first``. So a host that runs
``page_first`` reads what a ``layer_first`` host backed up, and the layout
is not part of the namespace. ``block_view`` gives the host page in that
order as a strided view (no copy): ``arena_block.copy_(view)`` writes the
block straight from the host pool, ``view.copy_(arena_block)`` reads it
back, with no tensor in between.

``store_runs`` / ``load_runs`` move a whole batch of pages between the
host pool and arena slots in one ``memcopy.copy_runs`` call (GIL-free C, no
Python per page or run, on as many threads as asked): each page is a few
contiguous runs, the same for every page of a layout (2 for
``page_first_direct``, 2 x layers for ``layer_first``, 2 x layers x
page_size for ``page_first``).

``flat_view`` does the same for the flat pages of SGLang's generic path
(``get_data_page(flat=True)`` / ``set_from_flat_data_page``), whose byte
order follows the host layout: token-major for ``page_first``.

Pure torch and numpy; no SGLang import, so it is tested without SGLang.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tierstore.memory.memcopy import copy_runs

LAYOUTS = ("layer_first", "page_first", "page_first_direct")


class PageLayoutError(ValueError):
    """A host pool this module cannot map to blocks, with the reason."""


@dataclass(frozen=True)
class PageShape:
    layers: int
    page_size: int
    heads: int
    head_dim: int
    dtype: torch.dtype
    planes: int = 2  # K and V; 1 for MLA's latent

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        return (self.planes, self.layers, self.page_size, self.heads, self.head_dim)

    @property
    def block_bytes(self) -> int:
        n = self.planes * self.layers * self.page_size * self.heads * self.head_dim
        return n * self.dtype.itemsize


class HostPages:
    """Views of one host pool's pages in the block order (module docstring)."""

    def __init__(self, kv_buffer: torch.Tensor, layout: str, shape: PageShape) -> None:
        if layout not in LAYOUTS:
            raise PageLayoutError(
                f"SGLang host layout {layout!r} is not served; use one of {', '.join(LAYOUTS)}"
            )
        if kv_buffer.device.type != "cpu":
            raise PageLayoutError(f"the host pool is on {kv_buffer.device}, not in host memory")
        if kv_buffer.dtype != shape.dtype:
            raise PageLayoutError(f"the host pool holds {kv_buffer.dtype}, not {shape.dtype}")
        s = shape
        if s.planes not in (1, 2):
            raise PageLayoutError(f"a page has 1 (MLA) or 2 (K, V) planes, not {s.planes}")
        if s.planes == 1:  # MLA's buffers have no plane dim: give them one
            kv_buffer = kv_buffer.unsqueeze(0)
        want = {
            "layer_first": (1, s.layers, None, s.heads, s.head_dim),
            "page_first": (1, None, s.layers, s.heads, s.head_dim),
            "page_first_direct": (1, None, s.layers, s.page_size, s.heads, s.head_dim),
        }[layout]
        want = (s.planes, *want[1:])
        got = tuple(kv_buffer.shape)
        if len(got) != len(want) or any(w is not None and w != g for w, g in zip(want, got)):
            raise PageLayoutError(
                f"a {layout} host pool of {s.layers} layers x {s.heads} heads x "
                f"{s.head_dim} should have shape {want} (None: any), not {got}"
            )
        if not kv_buffer.is_contiguous():
            raise PageLayoutError("the host pool's kv_buffer is not contiguous")
        self.kv = kv_buffer
        self.layout = layout
        self.shape = shape
        tokens = got[2] if layout == "layer_first" else got[1]
        self.num_tokens = tokens * (s.page_size if layout == "page_first_direct" else 1)
        self._bytes = kv_buffer.view(-1).view(torch.uint8).numpy()
        self._pattern, self.run_bytes = _runs(self.block_view(0))

    def _starts(self, starts: Sequence[int]) -> np.ndarray:
        """Byte offset of each page's first element in the host buffer."""
        item = self.shape.dtype.itemsize
        return np.array(
            [self.block_view(s).storage_offset() * item for s in starts], dtype=np.int64
        )

    def _offsets(self, starts: Sequence[int], slots: Sequence[int]) -> tuple[Any, Any]:
        if len(starts) != len(slots):
            raise ValueError(f"{len(starts)} pages, {len(slots)} arena slots")
        host = (self._starts(starts)[:, None] + self._pattern[None, :]).reshape(-1)
        runs = np.arange(len(self._pattern), dtype=np.int64) * self.run_bytes
        arena = (np.asarray(slots, dtype=np.int64)[:, None] + runs[None, :]).reshape(-1)
        return host, arena

    def store_runs(
        self, arena: Any, slots: Sequence[int], starts: Sequence[int], threads: int = 1
    ) -> None:
        """Copy the pages at host token slots ``starts`` into the arena
        (a writable buffer) at byte offsets ``slots``, in the block order,
        on ``threads`` threads."""
        host, at = self._offsets(starts, slots)
        copy_runs(arena, self._bytes, at, host, self.run_bytes, threads)

    def load_runs(
        self, arena: Any, slots: Sequence[int], starts: Sequence[int], threads: int = 1
    ) -> None:
        """Copy blocks at arena byte offsets ``slots`` into the host pages
        at token slots ``starts``, on ``threads`` threads."""
        host, at = self._offsets(starts, slots)
        copy_runs(self._bytes, arena, host, at, self.run_bytes, threads)

    def _check(self, index: int) -> None:
        ps = self.shape.page_size
        if index % ps != 0 or not 0 <= index <= self.num_tokens - ps:
            raise PageLayoutError(
                f"host index {index} does not start a page (page_size {ps}, "
                f"{self.num_tokens} token slots)"
            )

    def block_view(self, index: int) -> torch.Tensor:
        """The page that starts at host token slot ``index``, shaped (planes,
        layers, page_size, heads, head_dim): a view of the host pool."""
        self._check(index)
        ps = self.shape.page_size
        if self.layout == "layer_first":
            return self.kv[:, :, index : index + ps]
        if self.layout == "page_first":
            return self.kv[:, index : index + ps].transpose(1, 2)
        return self.kv[:, index // ps]

    def flat_view(self, flat: torch.Tensor) -> torch.Tensor:
        """A flat page of SGLang's generic path, viewed in the block order."""
        s = self.shape
        if flat.numel() * flat.element_size() != s.block_bytes or not flat.is_contiguous():
            raise PageLayoutError(
                f"a flat page must be {s.block_bytes} contiguous bytes, got "
                f"{flat.numel() * flat.element_size()} ({tuple(flat.shape)}, {flat.dtype})"
            )
        flat = flat.view(s.dtype)
        if self.layout == "page_first":  # token-major: (planes, page, layers, heads, dim)
            return flat.view(s.planes, s.page_size, s.layers, s.heads, s.head_dim).transpose(1, 2)
        return flat.view(s.block_shape)

    def as_block(self, row: torch.Tensor) -> torch.Tensor:
        """An arena row (uint8, block_bytes) viewed as a block of this dtype."""
        return row.view(self.shape.dtype).view(self.shape.block_shape)


def _runs(view: torch.Tensor) -> tuple[np.ndarray, int]:
    """The contiguous byte runs of ``view`` (in its element order), relative
    to its first element: their offsets and their common length."""
    item = view.element_size()
    shape, strides = list(view.shape), list(view.stride())
    run, dim = 1, len(shape)
    while dim > 0 and strides[dim - 1] == run:  # the contiguous suffix of dims
        run *= shape[dim - 1]
        dim -= 1
    offsets = np.zeros(1, dtype=np.int64)
    for size, stride in zip(shape[:dim], strides[:dim]):
        offsets = (offsets[:, None] + np.arange(size, dtype=np.int64)[None, :] * stride).reshape(-1)
    return offsets * item, run * item
