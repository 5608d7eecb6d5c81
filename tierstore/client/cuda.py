"""The only CUDA-specific calls: pinning the shared arena and a copy stream.

Everything else runs the same on ``device="cpu"``. Tests of this module carry
the ``cuda`` marker and skip without a GPU.

- ``register_host(buf)``: ``cudaHostRegister`` on an existing mapping (the
  sidecar's arena), so device<->arena copies are DMA without a bounce buffer.
- ``unregister_host(buf)``: the inverse; must run before the mapping goes.
- ``copy_stream(device)``: a side stream for eviction and load copies.
"""

from __future__ import annotations

from typing import Any

import torch

CUDA_HOST_REGISTER_PORTABLE = 1  # usable from every CUDA context of the process


def available(device: Any) -> bool:
    return torch.device(device).type == "cuda" and torch.cuda.is_available()


def register_host(tensor: torch.Tensor) -> bool:
    """Pin the host memory behind a CPU tensor; False if CUDA refused."""
    err = torch.cuda.cudart().cudaHostRegister(
        tensor.data_ptr(), tensor.numel() * tensor.element_size(), CUDA_HOST_REGISTER_PORTABLE
    )
    return int(err) == 0


def unregister_host(tensor: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr())


def copy_stream(device: Any) -> torch.cuda.Stream:
    return torch.cuda.Stream(device=torch.device(device))
