"""Copies between an engine's memory and the sidecar's shared arena.

Provides ``ArenaCopier`` (one per client: on a CUDA device it registers the
arena as pinned host memory and copies on a side stream; on the CPU each
run of blocks is one streaming copy, see ``tierstore.memory.memcopy``) and
``as_block_rows``, which views a caller's blocks as one flat uint8 row per
block without copying where it can.

Stream contract on CUDA: every copy starts after the work the calling thread
already queued on its current stream (the kernels that wrote a block, or
still read a buffer a load overwrites); the client ``sync``s the side stream
before it commits, unpins or returns, so the engine's later work sees the
bytes; ``close`` waits for the side stream before it unpins the arena.

Runs in the engine process, on the threads that call the client.
"""

from __future__ import annotations

import mmap
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from tierstore.client import cuda
from tierstore.errors import BlockSizeError
from tierstore.keys import KVLayout
from tierstore.memory.memcopy import copy_into


class ArenaCopier:
    def __init__(self, arena_tensor: torch.Tensor, device: torch.device) -> None:
        self.arena_tensor = arena_tensor
        self.device = device
        self._pinned_host = False
        self._stream: Any = None
        self.register_s = 0.0  # time cudaHostRegister took (0 without CUDA)
        if cuda.available(device):
            self._stream = cuda.copy_stream(device)
            t0 = time.perf_counter()
            self._pinned_host = cuda.register_host(arena_tensor, device)
            self.register_s = time.perf_counter() - t0

    @property
    def pinned_host(self) -> bool:
        """Whether the arena is registered as pinned memory now."""
        return self._pinned_host

    def sync(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()

    def before_release(self) -> None:
        """Wait until copies out of (or into) arena views that the calling
        thread queued on its current stream have ended: the sidecar may
        reuse the slots as soon as they are released."""
        if self._stream is not None:
            cuda.synchronize_engine(self.device)
            self._stream.synchronize()

    def copy(self, dst: torch.Tensor, src: torch.Tensor, *, wait: bool = True) -> None:
        """One copy; ``wait=False`` after ``wait_engine`` for a batch of them."""
        self.copy_pairs([(dst, src)], wait=wait)

    def wait_engine(self) -> None:
        """Make the side stream wait for the work queued on the engine's
        stream so far (once per batch of copies; no-op without CUDA)."""
        if self._stream is not None:
            cuda.wait_for_engine(self._stream)

    def copy_pairs(
        self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], *, wait: bool = True
    ) -> None:
        """Copy each ``src`` into its ``dst``; on CUDA the side stream waits for
        the engine's stream once for the whole batch (``wait``), not once per block."""
        if not pairs:
            return
        if self._stream is not None and not all(
            d.device.type == "cpu" and s.device.type == "cpu" for d, s in pairs
        ):
            # The side stream must not start before the work already queued on
            # the engine's stream (the kernels that wrote the sources) has run.
            if wait:
                self.wait_engine()
            with torch.cuda.stream(self._stream):
                for dst, src in pairs:
                    dst.copy_(src, non_blocking=True)
            return
        for dst, src in pairs:
            self._copy_one(dst, src)

    def _copy_one(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if dst.device.type == "cpu" and src.device.type == "cpu":
            # One streaming copy (tierstore.memory.memcopy). torch's copy_ splits a
            # block over its intra-op threads, and when the cores are busy (the
            # engine computing) those threads spin-wait: block copies ran 40x
            # slower than memcpy.
            copy_into(dst.numpy(), src.numpy())
        else:
            dst.copy_(src)

    def empty_rows(self, num_rows: int, row_bytes: int) -> torch.Tensor:
        """An uninitialised (num_rows, row_bytes) uint8 tensor on this client's
        device; on the CPU page-aligned like the arena (a destination a few
        bytes past a page boundary halves memcpy speed: 4 KiB aliasing)."""
        if self.device.type != "cpu":
            return torch.empty((num_rows, row_bytes), dtype=torch.uint8, device=self.device)
        buf = mmap.mmap(-1, max(num_rows * row_bytes, mmap.PAGESIZE))
        return torch.frombuffer(buf, dtype=torch.uint8)[: num_rows * row_bytes].view(
            num_rows, row_bytes
        )

    def copy_runs(self, rows: torch.Tensor, offsets: Sequence[int], block_bytes: int) -> None:
        """Copy the arena slot at ``offsets[j]`` into ``rows[j]``, merging slots
        that sit back to back in the arena into one copy (a slab run holds
        consecutive blocks: 2048 blocks went 45 -> 20 ms)."""
        pairs = []
        for j, k in _runs(offsets, block_bytes):
            arena = self.arena_tensor[offsets[j] : offsets[j] + (k - j) * block_bytes]
            pairs.append((rows[j:k].reshape(-1), arena))
        self.copy_pairs(pairs)

    def copy_rows_to_arena(
        self, rows: Sequence[torch.Tensor], offsets: Sequence[int], block_bytes: int
    ) -> None:
        """Copy ``rows[j]`` into the arena slot at ``offsets[j]``: one copy per
        run of slots that are adjacent in the arena and whose rows are adjacent
        in the caller's memory (a batch stored from one tensor is one copy)."""
        pairs = []
        j = 0
        while j < len(offsets):
            k = j + 1
            while (
                k < len(offsets)
                and offsets[k] == offsets[k - 1] + block_bytes
                and _follows(rows[k - 1], rows[k], block_bytes)
            ):
                k += 1
            arena = self.arena_tensor[offsets[j] : offsets[j] + (k - j) * block_bytes]
            pairs.append((arena, _span(rows[j], (k - j) * block_bytes)))
            j = k
        self.copy_pairs(pairs)

    def close(self) -> None:
        """Wait for the side stream, unpin the arena and drop this copier's
        reference to it (the client unmaps it next). Idempotent."""
        if self._stream is not None:
            self._stream.synchronize()  # no DMA may touch the pages once unpinned
        if self._pinned_host:
            self._pinned_host = False
            cuda.unregister_host(self.arena_tensor, self.device)
        self.arena_tensor = torch.empty(0, dtype=torch.uint8)


def _runs(offsets: Sequence[int], block_bytes: int) -> list[tuple[int, int]]:
    """[j, k) index ranges of slots that sit back to back in the arena."""
    out = []
    j = 0
    while j < len(offsets):
        k = j + 1
        while k < len(offsets) and offsets[k] == offsets[k - 1] + block_bytes:
            k += 1
        out.append((j, k))
        j = k
    return out


def _follows(a: torch.Tensor, b: torch.Tensor, block_bytes: int) -> bool:
    """Whether flat uint8 row ``b`` starts where ``a`` ends, in one storage."""
    return (
        a.device == b.device
        and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        and b.data_ptr() == a.data_ptr() + block_bytes
    )


def _span(first: torch.Tensor, nbytes: int) -> torch.Tensor:
    """A flat uint8 view of ``nbytes`` from ``first``'s start, in its storage."""
    out = torch.empty(0, dtype=torch.uint8, device=first.device)
    return out.set_(first.untyped_storage(), first.storage_offset(), (nbytes,), (1,))


def as_block_rows(layout: KVLayout, num_blocks: int, blocks: Any) -> list[torch.Tensor]:
    """One flat uint8 tensor per block from a tensor/array/buffer holding
    ``num_blocks`` blocks, or from a list of per-block ones. Zero-copy where
    the input is contiguous; raises BlockSizeError before anything is stored."""
    size = layout.block_bytes
    if isinstance(blocks, list | tuple):
        if len(blocks) != num_blocks:
            raise BlockSizeError(f"{len(blocks)} blocks given for {num_blocks} keys")
        rows = [_flat_bytes(b) for b in blocks]
        for i, row in enumerate(rows):
            if row.numel() != size:
                raise BlockSizeError(f"block {i} has {row.numel()} bytes; the layout needs {size}")
        return rows
    flat = _flat_bytes(blocks)
    if flat.numel() != size * num_blocks:
        raise BlockSizeError(
            f"{flat.numel()} bytes given for {num_blocks} blocks of {size} bytes; "
            f"expected {size * num_blocks}"
        )
    return list(flat.view(num_blocks, size)) if num_blocks else []


def _flat_bytes(obj: Any) -> torch.Tensor:
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        if not t.is_contiguous():
            t = t.contiguous()
        return t.reshape(-1).view(torch.uint8)
    arr = (
        np.ascontiguousarray(
            np.frombuffer(obj, dtype=np.uint8) if not isinstance(obj, np.ndarray) else obj
        )
        .reshape(-1)
        .view(np.uint8)
    )
    return torch.from_numpy(arr)
