"""The CUDA module's bookkeeping and the order of the copier's CUDA calls,
on any machine: torch's cudart bindings and the side stream are replaced by
recorders (the real calls run in test_cuda.py, on a GPU)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tierstore.client import cuda
from tierstore.client.copier import ArenaCopier
from tierstore.client.results import Pinned
from tierstore.keys import chain_keys

from ...conftest import SMALL_LAYOUT

NOT_REGISTERED = 713  # cudaErrorHostMemoryNotRegistered
ALREADY_REGISTERED = 712


class FakeCudart:
    def __init__(self, log: list[Any]) -> None:
        self.log = log
        self.pinned: set[int] = set()

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        self.log.append(("register", ptr, size, flags))
        if ptr in self.pinned:
            return ALREADY_REGISTERED
        self.pinned.add(ptr)
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:
        self.log.append(("unregister", ptr))
        if ptr not in self.pinned:
            return NOT_REGISTERED
        self.pinned.discard(ptr)
        return 0


class FakeStream:
    def __init__(self, log: list[Any]) -> None:
        self.log = log

    def synchronize(self) -> None:
        self.log.append(("side stream synchronize",))


@pytest.fixture
def log(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    calls: list[Any] = []
    fake = FakeCudart(calls)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    monkeypatch.setattr(cuda, "_drop_pending_error", lambda device: calls.append(("drop error",)))
    monkeypatch.setattr(cuda, "available", lambda device: True)
    monkeypatch.setattr(cuda, "copy_stream", lambda device: FakeStream(calls))
    monkeypatch.setattr(cuda, "synchronize_engine", lambda device: calls.append(("engine sync",)))
    return calls


def test_the_book_holds_exactly_the_live_registrations(log: list[Any]) -> None:
    buf = torch.zeros(4096, dtype=torch.uint8)
    ptr = buf.data_ptr()
    assert cuda.register_host(buf)
    assert cuda.registered() == {ptr: 4096}
    assert ("register", ptr, 4096, cuda.CUDA_HOST_REGISTER_PORTABLE) in log
    assert not cuda.register_host(buf)  # refused: still one entry, error dropped
    assert log[-1] == ("drop error",)
    assert cuda.registered() == {ptr: 4096}
    assert cuda.unregister_host(buf)
    assert ptr not in cuda.registered()
    assert not cuda.unregister_host(buf)
    assert log[-1] == ("drop error",)


def test_copier_close_waits_for_the_side_stream_before_unpinning(log: list[Any]) -> None:
    arena = torch.zeros(8192, dtype=torch.uint8)
    ptr = arena.data_ptr()
    copier = ArenaCopier(arena, torch.device("cuda"))
    assert copier.pinned_host
    assert cuda.registered() == {ptr: 8192}
    log.clear()
    copier.close()
    assert log == [("side stream synchronize",), ("unregister", ptr)]
    assert not copier.pinned_host and ptr not in cuda.registered()
    assert copier.arena_tensor.numel() == 0  # the mapping is not kept alive
    log.clear()
    copier.close()
    assert log == [("side stream synchronize",)]


def test_a_refused_registration_is_not_unregistered(log: list[Any]) -> None:
    arena = torch.zeros(8192, dtype=torch.uint8)
    assert cuda.register_host(arena)  # someone else pinned it first
    copier = ArenaCopier(arena, torch.device("cuda"))
    assert not copier.pinned_host
    log.clear()
    copier.close()
    assert log == [("side stream synchronize",)]
    assert cuda.unregister_host(arena)


def _pinned(log: list[Any], engine_copies: bool) -> Pinned:
    arena = torch.zeros(4 * SMALL_LAYOUT.block_bytes, dtype=torch.uint8)
    keys = chain_keys(SMALL_LAYOUT, list(range(16)))
    return Pinned(
        arena,
        lambda layout, keys: log.append(("release rpc", len(keys))),
        lambda: log.append(("before release",)),
        SMALL_LAYOUT,
        keys,
        [0, SMALL_LAYOUT.block_bytes],
        engine_copies,
    )


def test_release_waits_for_the_engine_copies_before_the_sidecar_may_reuse(
    log: list[Any],
) -> None:
    pinned = _pinned(log, engine_copies=True)
    pinned.release()
    pinned.release()
    assert log == [("before release",), ("release rpc", 2)]


def test_the_clients_own_pins_skip_the_engine_wait(log: list[Any]) -> None:
    with _pinned(log, engine_copies=False):
        pass
    assert log == [("release rpc", 2)]


def test_before_release_syncs_the_engine_then_the_side_stream(log: list[Any]) -> None:
    copier = ArenaCopier(torch.zeros(4096, dtype=torch.uint8), torch.device("cuda"))
    log.clear()
    copier.before_release()
    assert log == [("engine sync",), ("side stream synchronize",)]
    copier.close()
