"""The SGLang driver's memory side: the plain copies a run is measured
against, and memory kept warm as pinned memory is.

Provides, for ``driver`` (one process, its main thread):

- ``time_memcpy``: copies of a conversation's bytes between two touched
  buffers (torch's copy, and ``copy_runs`` in the backend's runs on its
  threads), and one into a buffer idle since the driver started
  (``prepare_aged``): on a VM where idle memory is slow to touch again,
  memory as old as a sidecar arena populated at its start is written more
  slowly the first time, which a copy between touched buffers never shows;
- ``keep_warm`` / ``warm_add`` / ``warm_close``: one ``KeepWarm`` thread
  (``tierstore.memory.warm``) over the host pools and the sidecars' arenas,
  when a spec asks for it.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from tierstore.client import StoreClient
from tierstore.memory.memcopy import copy_runs
from tierstore.memory.warm import KeepWarm


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


_WARM: list[KeepWarm] = []  # the driver's one KeepWarm, once a spec asked for it
_WARM_ARENAS: dict[str, StoreClient] = {}  # socket -> a client that maps its arena


def keep_warm(period_s: float, arena_socket: str | None) -> KeepWarm:
    """Start the driver's KeepWarm (the first call's period), and add the
    arena of the sidecar at ``arena_socket`` ("": tierstore's default
    socket; None: none) once. Host pools made afterwards add themselves
    (``warm_add``)."""
    if not _WARM:
        _WARM.append(KeepWarm(period_s))
    warm = _WARM[0]
    if warm.error is not None:
        raise RuntimeError(f"keeping memory warm failed: {warm.error!r}")
    if arena_socket is not None and arena_socket not in _WARM_ARENAS:
        client = StoreClient(arena_socket or None, name="keep-warm")
        _WARM_ARENAS[arena_socket] = client
        warm.add(client.arena.buf)
    return warm


def warm_add(buf: Any) -> None:
    """Keep ``buf`` warm too, when the driver keeps memory warm."""
    if _WARM:
        _WARM[0].add(buf)


def warm_passes() -> int:
    """How many passes the KeepWarm made (0 when there is none)."""
    return _WARM[0].passes if _WARM else 0


def warm_close() -> None:
    for warm in _WARM:
        warm.close()
    _WARM.clear()
    for client in _WARM_ARENAS.values():
        client.close()
    _WARM_ARENAS.clear()
