"""The vLLM connector's copies on a CUDA device (not runnable on CPU hosts).

Provides ``CudaPageMover``, the CUDA ``PageMover`` of ``vllm.pages``:
copies between vLLM's device pages and the sidecar's arena (registered as
pinned host memory by ``tierstore.client.cuda``, so each copy is one DMA)
on a side stream, with the rules the HBM tier uses:

- a save (device -> arena) first makes the side stream wait for the
  engine's current stream, so it never reads a page before the kernels that
  write it have run;
- a load (arena -> device) first waits for the engine's stream too (the
  pages it fills were freed by earlier requests whose kernels may still read
  them), then records one event per layer on the side stream;
  ``layer_ready(i)`` makes the engine's stream wait for layer i's event, so
  layer i's attention waits for its own pages only, and the copies of the
  later layers overlap the compute of the earlier ones;
- ``sync`` waits for the side stream before slots are committed or pins
  released (the arena must not change under a copy in flight).

Runs in vLLM's worker process, on the thread that runs the model. Tests
carry the ``cuda`` marker.
"""

from __future__ import annotations

from typing import Any

import torch

from tierstore.client import cuda
from tierstore.engines.vllm.pages import PagedKV, Pairs


class CudaPageMover:
    def __init__(self, paged: PagedKV, arena: torch.Tensor) -> None:
        self.paged = paged
        self.arena = arena
        self.device = paged.device
        self._pinned = cuda.register_host(arena)
        self.stream = cuda.copy_stream(self.device)
        self._events: dict[int, Any] = {}

    def to_pages(self, layer: int, pairs: Pairs) -> None:
        page, n = self.paged.pages[layer], self.paged.inner
        # The pages being filled were freed by earlier requests: kernels the
        # engine queued before this step may still read them. Write after those.
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            for offset, block_id in pairs:
                for o in range(self.paged.outer):
                    src = self.arena[offset + o * n : offset + (o + 1) * n]
                    page[o, block_id].copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        self._events[layer] = event

    def from_pages(self, layer: int, pairs: Pairs) -> None:
        page, n = self.paged.pages[layer], self.paged.inner
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            for offset, block_id in pairs:
                for o in range(self.paged.outer):
                    dst = self.arena[offset + o * n : offset + (o + 1) * n]
                    dst.copy_(page[o, block_id], non_blocking=True)

    def layer_ready(self, layer: int) -> None:
        event = self._events.pop(layer, None)
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def sync(self) -> None:
        self.stream.synchronize()
        self._events.clear()

    def close(self) -> None:
        if self._pinned:
            cuda.unregister_host(self.arena)
            self._pinned = False
