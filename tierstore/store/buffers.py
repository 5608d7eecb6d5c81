"""Caller buffers as per-block byte views, for ``TieredStore.put``.

Provides ``as_byte_view`` (a flat, zero-copy byte view of a buffer, numpy
array or CPU torch tensor) and ``split_blocks`` (one view per key of a
batch given as one buffer or one buffer per key, with sizes checked before
anything is stored). Pure: no I/O, no locks; torch is imported only when a
tensor is passed. Runs on the caller's thread (sidecar process).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tierstore.errors import BlockSizeError
from tierstore.keys import BlockKey, KVLayout


def as_byte_view(obj: Any) -> memoryview:
    """A flat, zero-copy byte view of a buffer, numpy array or CPU torch tensor."""
    if type(obj).__module__.startswith("torch"):
        import torch  # only when a tensor is passed: the store itself needs no torch

        obj = obj.detach().contiguous().view(-1).view(torch.uint8).numpy()
    view = memoryview(obj)
    if not view.c_contiguous:
        raise BlockSizeError("block buffers must be contiguous")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def split_blocks(layout: KVLayout, keys: Sequence[BlockKey], blocks: Any) -> list[memoryview]:
    """Per-key views of ``blocks``; raises BlockSizeError before anything is stored."""
    size = layout.block_bytes
    if isinstance(blocks, list | tuple):
        if len(blocks) != len(keys):
            raise BlockSizeError(f"{len(blocks)} blocks given for {len(keys)} keys")
        views = [as_byte_view(b) for b in blocks]
        for i, v in enumerate(views):
            if v.nbytes != size:
                raise BlockSizeError(
                    f"block {i} has {v.nbytes} bytes; layout {layout.model!r} needs {size}"
                )
        return views
    view = as_byte_view(blocks)
    if view.nbytes != size * len(keys):
        raise BlockSizeError(
            f"{view.nbytes} bytes given for {len(keys)} blocks of {size} bytes "
            f"(layout {layout.model!r}); expected {size * len(keys)}"
        )
    return [view[i * size : (i + 1) * size] for i in range(len(keys))]
