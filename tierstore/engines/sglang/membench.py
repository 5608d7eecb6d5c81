"""The SGLang driver's memory side: the plain copies a run is measured
against, and memory made ready before a timed step, as pinned memory is.

Provides, for ``driver`` (one process, its main thread):

- ``time_memcpy``: copies of a conversation's bytes between two touched
  buffers (torch's copy, and ``copy_runs`` in the backend's runs on its
  threads), and one into a buffer idle since the driver started
  (``prepare_aged``): on a VM where idle memory is slow to touch again,
  memory as old as a sidecar arena populated at its start is written more
  slowly the first time, which a copy between touched buffers never shows;
- ``make_ready`` / ``close_arenas``: one byte of every page of the host
  pools and the sidecar's arena read before a timed step (not timed), when
  a spec asks for it (``ready_memory``): on this VM memory left idle is slow
  to touch again whether it is locked or not, and a GPU host's pinned
  memory never is.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from tierstore.client import StoreClient
from tierstore.memory.memcopy import copy_runs, flat_bytes
from tierstore.memory.warm import touch


def time_memcpy(
    num_bytes: int, reps: int, run_bytes: int, threads: int
) -> tuple[list[float], list[float], float, float]:
    """Seconds of each of ``reps`` copies of ``num_bytes`` between two touched
    host buffers, two ways: torch's copy (on torch's threads), and
    ``copy_runs`` in the backend's runs of ``run_bytes`` on the backend's
    ``threads``; then of one copy of the same bytes, the faster way, into the
    next of the idle buffers ``prepare_aged`` wrote, with how long it sat
    idle (0, 0 when none is left)."""
    src = torch.ones(num_bytes, dtype=torch.uint8)
    dst = torch.zeros(num_bytes, dtype=torch.uint8)
    offsets = np.arange(num_bytes // run_bytes, dtype=np.int64) * run_bytes
    s_np = src.numpy()

    def by_torch(out: torch.Tensor) -> None:
        out.copy_(src)

    def by_runs(out: torch.Tensor) -> None:
        copy_runs(out.numpy(), s_np, offsets, offsets, run_bytes, threads)

    by_torch(dst)
    by_runs(dst)
    torch_s: list[float] = []
    runs_s: list[float] = []
    for _ in range(reps):  # interleaved, so that both meet the same machine
        for how, times in ((by_torch, torch_s), (by_runs, runs_s)):
            t0 = time.perf_counter()
            how(dst)
            times.append(time.perf_counter() - t0)
    aged_s = idle_s = 0.0
    if _AGED and _AGED[0][0].numel() == num_bytes:
        aged, written = _AGED.pop(0)
        idle_s = time.monotonic() - written
        faster = by_runs if min(runs_s) < min(torch_s) else by_torch
        t0 = time.perf_counter()
        faster(aged)
        aged_s = time.perf_counter() - t0
    return torch_s, runs_s, aged_s, idle_s


# Buffers written once when the driver starts, each copied into once, later.
_AGED: list[tuple[torch.Tensor, float]] = []


def prepare_aged(sizes: list[int]) -> None:
    """One idle buffer of each size in ``sizes`` (a spec's conversation
    bytes, for each spec that times memcpy; in their order)."""
    for n in sizes:
        if n > 0:
            _AGED.append((torch.ones(n, dtype=torch.uint8), time.monotonic()))


_ARENAS: dict[str, StoreClient] = {}  # socket -> a client that maps its arena


def make_ready(bufs: list[Any], arena_socket: str | None) -> int:
    """Read one byte of every page of ``bufs`` and, with ``arena_socket``
    ("": tierstore's default socket; None: none), of that sidecar's whole
    arena (mapped once, through a client of the driver's own). Returns the
    bytes so passed over."""
    views = [flat_bytes(b) for b in bufs]
    if arena_socket is not None:
        if arena_socket not in _ARENAS:
            _ARENAS[arena_socket] = StoreClient(arena_socket or None, name="ready-memory")
        views.append(flat_bytes(_ARENAS[arena_socket].arena.buf))
    for view in views:
        touch(view)
    return sum(v.nbytes for v in views)


def close_arenas() -> None:
    for client in _ARENAS.values():
        client.close()
    _ARENAS.clear()
