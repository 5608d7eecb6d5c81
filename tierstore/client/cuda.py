"""The only CUDA-specific calls: pinning the shared arena and a copy stream.

Everything else runs the same on ``device="cpu"``. Tests of this module carry
the ``cuda`` marker and skip without a GPU.

- ``register_host(tensor)``: ``cudaHostRegister`` on an existing mapping (the
  sidecar's arena), so device<->arena copies are DMA without a bounce buffer.
- ``unregister_host(tensor)``: the inverse; must run before the mapping goes
  and after every copy that touches it has ended.
- ``registered()``: the host ranges this process registered and has not
  unregistered yet (address -> bytes): a client that closed leaves none.
- ``copy_stream(device)``: a side stream for eviction and load copies.
- ``wait_for_engine(stream)``: make ``stream`` start after the work already
  queued on the calling thread's current stream.

Runs in the engine process, on the threads that call the client; the
registration book is guarded by one lock.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import torch

CUDA_HOST_REGISTER_PORTABLE = 1  # usable from every CUDA context of the process

_registered: dict[int, int] = {}
_registered_lock = threading.Lock()


def available(device: Any) -> bool:
    return torch.device(device).type == "cuda" and torch.cuda.is_available()


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _drop_pending_error(device: Any) -> None:
    """Reset the CUDA runtime's "last error" after a runtime call that failed.

    torch's bindings of cudaHostRegister/Unregister return the error without
    resetting it, and torch checks every kernel launch with
    cudaGetLastError(): the next kernel on this thread (any of the engine's)
    would raise this error as its own. A one-element fill is such a launch;
    its check reads and resets the pending error, which we expect here."""
    with contextlib.suppress(RuntimeError):
        torch.empty(1, dtype=torch.uint8, device=device).fill_(0)


def register_host(tensor: torch.Tensor, device: Any = "cuda") -> bool:
    """Pin the host memory behind a CPU tensor; False if CUDA refused (the
    copies then go through pageable memory: correct, slower)."""
    ptr, size = tensor.data_ptr(), _nbytes(tensor)
    err = torch.cuda.cudart().cudaHostRegister(ptr, size, CUDA_HOST_REGISTER_PORTABLE)
    if int(err) != 0:
        _drop_pending_error(device)
        return False
    with _registered_lock:
        _registered[ptr] = size
    return True


def unregister_host(tensor: torch.Tensor, device: Any = "cuda") -> bool:
    """Unpin a tensor ``register_host`` pinned; False if CUDA refused (it was
    not registered). The caller has waited for every copy touching it."""
    ptr = tensor.data_ptr()
    err = torch.cuda.cudart().cudaHostUnregister(ptr)
    with _registered_lock:
        _registered.pop(ptr, None)
    if int(err) != 0:
        _drop_pending_error(device)
        return False
    return True


def registered() -> dict[int, int]:
    """Host ranges registered through this module and not yet unregistered."""
    with _registered_lock:
        return dict(_registered)


def copy_stream(device: Any) -> torch.cuda.Stream:
    return torch.cuda.Stream(device=torch.device(device))


def wait_for_engine(stream: torch.cuda.Stream) -> None:
    """Order ``stream`` after what the calling thread queued on its current
    stream (the kernels that wrote a block, or still read a buffer that a
    load is about to overwrite)."""
    stream.wait_stream(torch.cuda.current_stream(stream.device))


def synchronize_engine(device: Any) -> None:
    """Block until the calling thread's current stream on ``device`` is idle
    (copies the engine queued from arena views have read them)."""
    torch.cuda.current_stream(torch.device(device)).synchronize()
