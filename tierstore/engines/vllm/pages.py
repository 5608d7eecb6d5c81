"""vLLM's KV pages as bytes, and the copies between them and the arena.

Provides:
- ``PagedKV``: vLLM's per-layer KV cache tensors viewed as
  ``[outer, num_blocks, inner]`` bytes (the CPU backend's pages have
  ``outer == 1``: one block of one layer is one contiguous range; a layout
  with K and V planes apart, like flash-attention's ``[2, blocks, ...]``,
  has ``outer == 2``); ``PageLayoutError`` when they are not pages.
- ``PageMover``: the protocol of the copies of one layer's blocks between
  its pages and arena offsets (``Pairs``), with ``layer_ready`` and ``sync``
  for movers whose copies run on another stream.
- ``CpuPageMover``: the copies on the CPU, one ``memcopy.copy_runs`` call
  per layer for all its blocks and planes (no Python per block). The CUDA
  one is in ``vllm.cuda``, which depends on this module (never the reverse).

Runs in vLLM's worker process: a mover on the thread that runs the model, or
on the background loader's thread (each thread has its own mover).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from tierstore.memory.memcopy import copy_runs

Pairs = Sequence[tuple[int, int]]  # (arena offset of this layer's part, vLLM block id)


class PageLayoutError(ValueError):
    """vLLM's KV tensors are not pages this connector can copy."""


class PagedKV:
    """See the module docstring. ``pages[layer]`` is a uint8 tensor
    ``[outer, num_blocks, inner]`` over the same memory as vLLM's cache."""

    def __init__(
        self, kv_caches: dict[str, torch.Tensor], layer_names: Sequence[str], layer_bytes: int
    ) -> None:
        missing = [n for n in layer_names if n not in kv_caches]
        if missing:
            raise PageLayoutError(f"no KV cache for layers {missing}")
        self.layer_index = {name: i for i, name in enumerate(layer_names)}
        self.layer_bytes = layer_bytes
        self.pages = [self._paged(kv_caches[n], layer_bytes, n) for n in layer_names]
        self.device = self.pages[0].device
        self.outer = self.pages[0].shape[0]
        self.inner = self.pages[0].shape[2]

    @staticmethod
    def _paged(t: torch.Tensor, layer_bytes: int, name: str) -> torch.Tensor:
        if not t.is_contiguous():
            raise PageLayoutError(f"layer {name}: KV cache of shape {tuple(t.shape)} strides "
                                  f"{t.stride()} is not contiguous")  # fmt: skip
        total = t.numel() * t.element_size()
        if total % layer_bytes:
            raise PageLayoutError(f"layer {name}: {total} bytes is no whole number of pages")
        num_blocks = total // layer_bytes
        shape = list(t.shape)
        for d, size in enumerate(shape):
            if size == num_blocks:
                outer = int(np.prod(shape[:d], dtype=np.int64))
                inner_bytes = layer_bytes // outer if layer_bytes % outer == 0 else 0
                if inner_bytes and outer * num_blocks * inner_bytes == total:
                    flat = t.view(-1).view(torch.uint8) if t.dim() else t.view(torch.uint8)
                    return flat.view(outer, num_blocks, inner_bytes)
        raise PageLayoutError(
            f"layer {name}: no block dimension of size {num_blocks} in shape {tuple(shape)}"
        )


class PageMover(Protocol):
    def to_pages(self, layer: int, pairs: Pairs) -> None: ...
    def from_pages(self, layer: int, pairs: Pairs) -> None: ...
    def layer_ready(self, layer: int) -> None: ...
    def sync(self) -> None: ...


class CpuPageMover:
    """Synchronous copies: one ``copy_runs`` per layer (its GIL-free C loop
    copies every block's planes of that layer) on ``threads`` threads, the
    calling one and helpers started for the call (``copy_runs``: at most one
    per 4 MiB of the layer's runs)."""

    def __init__(self, paged: PagedKV, arena: torch.Tensor, threads: int = 1) -> None:
        self.threads = threads
        self.arena = arena.numpy()
        self.pages = [p.numpy() for p in paged.pages]
        self.inner = paged.inner
        outer, self.num_blocks = paged.pages[0].shape[:2]
        # Where plane o of a block starts, in the arena's part (o * inner) and
        # in a layer's page past the block's own start (o * num_blocks * inner).
        planes = np.arange(outer, dtype=np.int64)
        self._arena_planes = planes * self.inner
        self._page_planes = planes * (self.num_blocks * self.inner)

    def _runs(self, pairs: Pairs) -> tuple[np.ndarray, np.ndarray]:
        """(arena offsets, page offsets) of every plane of every pair."""
        a = np.asarray(pairs, dtype=np.int64).reshape(-1, 2)
        if len(a) and not 0 <= a[:, 1].min() <= a[:, 1].max() < self.num_blocks:
            raise IndexError(f"a vLLM block id outside 0..{self.num_blocks - 1}")
        arena = (a[:, :1] + self._arena_planes).reshape(-1)
        page = (a[:, 1:] * self.inner + self._page_planes).reshape(-1)
        return arena, page

    def to_pages(self, layer: int, pairs: Pairs) -> None:
        arena, page = self._runs(pairs)
        copy_runs(self.pages[layer], self.arena, page, arena, self.inner, self.threads)

    def from_pages(self, layer: int, pairs: Pairs) -> None:
        arena, page = self._runs(pairs)
        copy_runs(self.arena, self.pages[layer], arena, page, self.inner, self.threads)

    def layer_ready(self, layer: int) -> None:
        return

    def sync(self) -> None:
        return
