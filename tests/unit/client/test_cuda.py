"""CUDA-only paths without a sidecar: pinning an arena, the registration
book, and the copier's stream ordering against the engine's stream.

The ordering tests make the hazard real: a long kernel on the engine's
stream, then the kernel that writes (or reads) the block, then at once the
copier's copy. A copy that did not wait would read the bytes from before the
kernel; each test first shows, with a plain side-stream copy that does not
wait, that this device really runs such a copy early, so the test can fail.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

from tierstore.client import cuda
from tierstore.client.copier import ArenaCopier
from tierstore.memory.arena import Arena

pytestmark = pytest.mark.cuda

BLOCK_BYTES = 2 << 20
SLEEP_CYCLES = 1_000_000  # about 0.5 ms at 2 GHz: the copy is queued long before it ends
ROUNDS = 300


@pytest.fixture
def arena() -> Iterator[Arena]:
    a = Arena.create(8 * BLOCK_BYTES, tag="cuda-test")
    yield a
    a.close()


@contextlib.contextmanager
def engine_stream(kind: str) -> Iterator[torch.cuda.Stream]:
    """The engine's stream: the default one (HF) or one of its own (vLLM)."""
    if kind == "default":
        yield torch.cuda.current_stream()
        return
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        yield stream


def test_register_arena_and_copy_round_trip(arena: Arena) -> None:
    host = torch.frombuffer(arena.buf, dtype=torch.uint8)
    assert cuda.register_host(host)
    assert cuda.registered()[host.data_ptr()] == arena.size_bytes
    assert host.is_pinned()  # torch sees the registration
    src = torch.randint(0, 256, (4 << 20,), dtype=torch.uint8, device="cuda")
    stream = cuda.copy_stream("cuda")
    with torch.cuda.stream(stream):
        host[: 4 << 20].copy_(src, non_blocking=True)
    stream.synchronize()
    assert torch.equal(host[: 4 << 20].cuda(), src)
    assert cuda.unregister_host(host)
    assert host.data_ptr() not in cuda.registered()
    assert not host.is_pinned()
    del host


def test_a_refused_registration_leaves_no_error_for_the_next_kernel(arena: Arena) -> None:
    host = torch.frombuffer(arena.buf, dtype=torch.uint8)
    assert cuda.register_host(host)
    try:
        assert not cuda.register_host(host)  # already registered: CUDA refuses
        # Without resetting the runtime's last error, this kernel's launch
        # check would raise "part or all of the requested memory range is
        # already mapped" as its own error.
        x = torch.ones(1024, device="cuda").add_(1)
        torch.cuda.synchronize()
        assert float(x.sum()) == 2048.0
        assert cuda.registered()[host.data_ptr()] == arena.size_bytes
    finally:
        assert cuda.unregister_host(host)
    assert not cuda.unregister_host(host)  # not registered any more: refused, no error left
    assert float(torch.ones(8, device="cuda").sum()) == 8.0
    del host


def _slot(arena: Arena) -> torch.Tensor:
    return torch.frombuffer(arena.buf, dtype=torch.uint8)[:BLOCK_BYTES]


@pytest.mark.parametrize("kind", ["default", "own"])
def test_a_store_copy_reads_what_the_engine_kernel_wrote(arena: Arena, kind: str) -> None:
    copier = ArenaCopier(torch.frombuffer(arena.buf, dtype=torch.uint8), torch.device("cuda"))
    try:
        assert copier.pinned_host
        slot = copier.arena_tensor[:BLOCK_BYTES]
        block = torch.zeros(BLOCK_BYTES, dtype=torch.uint8, device="cuda")
        side = cuda.copy_stream("cuda")
        stale_without_wait = 0
        wrong: list[int] = []
        with engine_stream(kind) as engine:
            for i in range(ROUNDS):
                old, new = (2 * i) % 251, (2 * i + 1) % 251
                block.fill_(old)
                slot.fill_(255)
                torch.cuda.synchronize()
                torch.cuda._sleep(SLEEP_CYCLES)  # queued on the engine's stream
                block.fill_(new)
                if i < 5:  # the control: a copy that does not wait
                    with torch.cuda.stream(side):
                        slot.copy_(block, non_blocking=True)
                    side.synchronize()
                    stale_without_wait += int(slot[0]) != new
                    engine.synchronize()
                    continue
                copier.copy(slot, block)
                copier.sync()
                if not bool((slot == new).all()):
                    wrong.append(i)
        assert stale_without_wait > 0, "this device ran no early copy: the test cannot see a bug"
        assert not wrong, f"{len(wrong)} of {ROUNDS - 5} copies read stale bytes: {wrong[:10]}"
    finally:
        copier.close()


@pytest.mark.parametrize("kind", ["default", "own"])
def test_a_load_copy_waits_for_the_engine_still_reading_its_buffer(arena: Arena, kind: str) -> None:
    copier = ArenaCopier(torch.frombuffer(arena.buf, dtype=torch.uint8), torch.device("cuda"))
    try:
        slot = copier.arena_tensor[:BLOCK_BYTES]
        out = torch.empty(BLOCK_BYTES, dtype=torch.uint8, device="cuda")
        seen = torch.empty_like(out)
        side = cuda.copy_stream("cuda")
        overtaken_without_wait = 0
        wrong: list[int] = []
        with engine_stream(kind):
            for i in range(ROUNDS):
                old, new = (2 * i) % 251, (2 * i + 1) % 251
                out.fill_(old)
                slot.fill_(new)
                torch.cuda.synchronize()
                torch.cuda._sleep(SLEEP_CYCLES)
                seen.copy_(out)  # the engine still reads the old contents
                if i < 5:
                    with torch.cuda.stream(side):
                        out.copy_(slot, non_blocking=True)
                    torch.cuda.synchronize()
                    overtaken_without_wait += int(seen[0]) != old
                    continue
                copier.copy(out, slot)
                copier.sync()
                torch.cuda.synchronize()
                if not (bool((seen == old).all()) and bool((out == new).all())):
                    wrong.append(i)
        assert overtaken_without_wait > 0, "no early copy on this device: the test is blind"
        assert not wrong, f"{len(wrong)} loads overwrote a buffer still being read: {wrong[:10]}"
    finally:
        copier.close()


def test_close_waits_for_copies_then_unpins(arena: Arena) -> None:
    copier = ArenaCopier(torch.frombuffer(arena.buf, dtype=torch.uint8), torch.device("cuda"))
    ptr = copier.arena_tensor.data_ptr()
    assert ptr in cuda.registered()
    src = torch.full((4 * BLOCK_BYTES,), 7, dtype=torch.uint8, device="cuda")
    torch.cuda._sleep(SLEEP_CYCLES)
    copier.copy(copier.arena_tensor[: 4 * BLOCK_BYTES], src)  # in flight at close
    copier.close()
    assert ptr not in cuda.registered()
    assert bool((torch.from_numpy(arena.array[: 4 * BLOCK_BYTES]) == 7).all())
    copier.close()  # idempotent
    torch.cuda.synchronize()
