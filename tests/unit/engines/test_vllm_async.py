"""Background (async) loads of the vLLM connector without an engine: the
planner's choice of path, the loader thread's deadlines and cancels, and the
budgeted lookups."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vllm (pip install 'tierstore[vllm]')")

from tierstore.engines.vllm.connector import (
    TierstoreConnectorMetadata,
    computes_nothing,
    poll_wait_s,
)
from tierstore.engines.vllm.layout import ConnectorSettings, request_salt
from tierstore.engines.vllm.link import BudgetedCalls
from tierstore.engines.vllm.loader import IDLE_POLL_WAIT_S, BackgroundLoader
from tierstore.engines.vllm.plan import LoadSpec, Planner
from tierstore.errors import TierstoreError
from tierstore.keys import BlockKey, KVLayout, chain_keys
from tierstore.tiers import TierName

from .test_vllm_plan import BT, LAYOUTS, SETTINGS, request, session_of, step, toks

D, N, P = TierName.DRAM, TierName.NVME, TierName.PEER


class TierStore:
    """The store's answer: the tiers of the longest held prefix (None: late)."""

    def __init__(self) -> None:
        self.where: dict[BlockKey, TierName] = {}
        self.late = False

    def lookup(self, layout: KVLayout, keys: list[BlockKey]) -> tuple[TierName, ...] | None:
        if self.late:
            return None
        out: list[TierName] = []
        for k in keys:
            if k not in self.where:
                break
            out.append(self.where[k])
        return tuple(out)

    def hold(self, tokens: list[int], tiers: list[TierName]) -> None:
        for k, t in zip(chain_keys(LAYOUTS[0], tokens), tiers):
            self.where[k] = t


def planner(store: TierStore, async_loads: bool = True) -> Planner:
    salt = lambda r: request_salt(SETTINGS, r)  # noqa: E731
    return Planner(LAYOUTS, store.lookup, salt, session_of, async_loads=async_loads)


def test_a_prefix_not_all_in_dram_loads_in_the_background() -> None:
    store, p = TierStore(), toks(5 * BT)
    store.hold(p, [D, D, N, N])
    plan = planner(store)
    assert plan.match(request(p), 0) == (4 * BT, True)
    assert plan.match(request(p), 2 * BT) == (2 * BT, True)  # the NVMe blocks remain
    store.hold(p, [D, D, D, D])
    assert plan.match(request(p), 0) == (4 * BT, False)  # all in DRAM: in the step
    store.hold(p, [D, P, D, D])
    assert plan.match(request(p), 0) == (4 * BT, True)
    assert plan.match(request(p), 2 * BT) == (2 * BT, False)  # vLLM holds the peer's block
    assert planner(store, async_loads=False).match(request(p), 0) == (4 * BT, False)
    assert plan.match(request(toks(3, seed=9)), 0) == (0, False)  # nothing: never async


def test_a_late_lookup_asks_again_and_is_counted() -> None:
    store, p = TierStore(), toks(3 * BT)
    store.hold(p, [N, N])
    plan = planner(store)
    store.late = True
    assert plan.match(request(p), 0) == (None, False)
    store.late = False
    assert plan.match(request(p), 0) == (2 * BT, True)
    assert plan.counters.lookups_pending == 1


def test_a_background_load_is_sent_without_the_request_being_scheduled() -> None:
    store, p, other = TierStore(), toks(4 * BT + 1), toks(BT + 3, seed=5)
    store.hold(p, [N, N, N, N])
    plan = planner(store)
    req, busy = request(p), request(other, rid="r2")
    assert plan.match(req, 0) == (4 * BT, True)
    ids = [10, 11, 12, 13, 14]
    plan.after_alloc(req, (ids,), 4 * BT)
    plan.match(busy, 0)
    # The loading request is not in the step: only the other one runs.
    (load,), _ = plan.build(step(new=[(busy, [1, 2], 0)], scheduled={"r2": BT + 3}))
    assert load.background and load.block_ids == ((10, 11, 12, 13),)
    assert list(load.keys[0]) == chain_keys(LAYOUTS[0], p)[:4]
    assert plan.counters.background_loads == 1 and plan.counters.step_loads == 0
    # Two more steps decode r2 while the load runs; then the worker reports it.
    for n in (BT + 3, BT + 4):
        loads, _ = plan.build(step(cached=[(busy, None, n)], scheduled={"r2": 1}))
        assert loads == []
    assert plan.counters.steps_while_loading == 2 and plan.counters.tokens_while_loading == 2
    plan.loads_done({"r1"})
    assert plan.counters.background_loads_done == 1
    plan.build(step(cached=[(busy, None, BT + 5)], scheduled={"r2": 1}))
    assert plan.counters.steps_while_loading == 2  # nothing loading any more
    # Resumed after its load, the request saves only the block after the stored ones.
    req.num_computed_tokens = 4 * BT
    _, saves = plan.build(step(new=[(req, ids, 4 * BT)], scheduled={"r1": 1}))
    assert saves == []  # its 5th block is not full


def test_a_failed_background_load_is_recomputed_saved_again_and_never_rematched() -> None:
    store, p = TierStore(), toks(4 * BT + 3)
    store.hold(p, [N, N, N, N])
    plan = planner(store)
    req = request(p)
    assert plan.match(req, 0) == (4 * BT, True)
    ids = [10, 11, 12, 13, 14]
    plan.after_alloc(req, (ids,), 4 * BT)
    plan.build(step())
    plan.load_failed({12})  # before the request ever ran
    plan.loads_done({"r1"})
    assert plan.counters.load_failed_blocks == 2 and plan.counters.failed_loads == 1
    assert plan.match(req, 0) == (0, False)  # recomputed, not loaded again
    _, (s,) = plan.build(step(new=[(req, ids, 2 * BT)], scheduled={"r1": 2 * BT + 3}))
    assert s.block_ids == ((12, 13),)


# -- the loader thread -------------------------------------------------------------------


class FakePinned:
    def __init__(self, offsets: list[int]) -> None:
        self.offsets = offsets
        self.released = False

    def release(self) -> None:
        self.released = True


class FakeClient:
    """Pins ``hold`` blocks of any ask; ``gate`` (if set) holds every acquire."""

    max_batch_keys = 2

    def __init__(self, hold: int = 100, gate: threading.Event | None = None) -> None:
        self.hold = hold
        self.gate = gate
        self.pins: list[FakePinned] = []
        self.raises: Exception | None = None
        self.prefetched: list[int] = []  # keys asked of each prefetch

    def prefetch(self, layout: KVLayout, keys: list[BlockKey], policy: str) -> None:
        assert policy == "best_effort"  # never waited for: the acquires wait per piece
        if self.raises is not None:
            raise self.raises
        self.prefetched.append(len(keys))

    def acquire(self, layout: KVLayout, keys: list[BlockKey], **kw: Any) -> FakePinned:
        assert 0 < kw["deadline_s"] <= 5.0
        if self.gate is not None:
            self.gate.wait(10)
        if self.raises is not None:
            raise self.raises
        n = max(0, min(len(keys), self.hold))
        self.hold -= n
        pinned = FakePinned(list(range(n)))
        self.pins.append(pinned)
        return pinned


class FakeLink:
    def __init__(self, client: FakeClient | None) -> None:
        self._client = client
        self.failures: list[BaseException] = []

    def client(self) -> FakeClient | None:
        return self._client

    def failed(self, e: BaseException) -> None:
        self.failures.append(e)
        self._client = None

    def close(self) -> None:
        pass


def spec(rid: str, n: int) -> LoadSpec:
    keys = tuple(chain_keys(lo, toks(n * BT)) for lo in LAYOUTS)
    return LoadSpec(rid, "", tuple(tuple(k) for k in keys), (tuple(range(100, 100 + n)),), True)


def loader(
    client: FakeClient | None, timeout_s: float = 5.0, **settings_: Any
) -> tuple[BackgroundLoader, list]:
    copies: list[tuple[tuple[int, ...], ...]] = []
    settings = ConnectorSettings(async_load_timeout_s=timeout_s, **settings_)
    ld = BackgroundLoader(
        settings,
        lambda salt: LAYOUTS,
        0,
        lambda c, lo, offsets, ids: copies.append(ids),
        FakeLink(client),  # type: ignore[arg-type]
    )
    return ld, copies


def poll_until(ld: BackgroundLoader, timeout_s: float = 10.0) -> tuple[set[str], set[int]]:
    """The first requests to end and their failed blocks (the failed
    requests checked: exactly those with failed blocks)."""
    deadline = time.monotonic() + timeout_s
    while True:
        finished, failed, failed_reqs = ld.poll()
        if finished or time.monotonic() > deadline:
            assert failed_reqs == (finished if failed else set())
            return finished, failed
        time.sleep(0.005)


def test_the_loader_copies_every_block_and_reports_the_request() -> None:
    client = FakeClient()
    ld, copies = loader(client)
    ld.submit(spec("a", 5))
    assert poll_until(ld) == ({"a"}, set())
    assert copies == [((100, 101),), ((102, 103),), ((104,),)]  # chunks of max_batch_keys
    assert client.prefetched == [5]  # the whole prefix asked for at once, first
    assert all(p.released for p in client.pins)
    assert ld.in_flight == 0 and ld.counters.loaded_blocks == 5
    ld.close()


def test_pieces_follow_load_piece_bytes_and_zero_means_no_prefetch() -> None:
    block = LAYOUTS[0].block_bytes
    client = FakeClient()
    client.max_batch_keys = 100
    ld, copies = loader(client, load_piece_bytes=2 * block)  # two blocks a piece
    ld.submit(spec("a", 5))
    assert poll_until(ld) == ({"a"}, set())
    assert copies == [((100, 101),), ((102, 103),), ((104,),)]
    assert client.prefetched == [5]
    ld.close()
    client = FakeClient()
    client.max_batch_keys = 100
    ld, copies = loader(client, load_piece_bytes=0)  # the whole prefix, then the copy
    ld.submit(spec("b", 5))
    assert poll_until(ld) == ({"b"}, set())
    assert copies == [((100, 101, 102, 103, 104),)] and client.prefetched == []
    ld.close()


def test_poll_does_not_wait_for_a_copy_in_progress() -> None:
    """get_finished runs on the model's thread: a chunk being copied into
    vLLM's pages must not hold it (the copy holds the load's lock)."""
    copying, go_on = threading.Event(), threading.Event()

    def slow_copy(c: Any, lo: Any, offsets: Any, ids: tuple[tuple[int, ...], ...]) -> None:
        copying.set()
        go_on.wait(10)

    ld = BackgroundLoader(
        ConnectorSettings(async_load_timeout_s=30.0),
        lambda salt: LAYOUTS,
        0,
        slow_copy,
        FakeLink(FakeClient()),  # type: ignore[arg-type]
    )
    ld.submit(spec("a", 1))  # one piece: no prefetch (FakeClient records none)
    assert copying.wait(10)
    t0 = time.monotonic()
    assert ld.poll() == (set(), set(), set())
    waited_s = time.monotonic() - t0
    go_on.set()
    assert poll_until(ld) == ({"a"}, set())
    ld.close()
    # A poll that waited for the copy would wait 10 s; 2 s leaves room for a busy machine.
    assert waited_s < 2.0, f"poll waited {waited_s:.2f}s for the copy"


def test_a_gap_or_a_dead_sidecar_reports_the_missing_blocks() -> None:
    ld, copies = loader(FakeClient(hold=3))
    ld.submit(spec("a", 5))
    assert poll_until(ld) == ({"a"}, {103, 104})
    ld.close()
    dead = FakeClient()
    dead.raises = TierstoreError("sidecar gone")
    ld, copies = loader(dead)
    ld.submit(spec("b", 3))
    assert poll_until(ld) == ({"b"}, {100, 101, 102})
    assert copies == [] and ld.counters.failed_blocks == 3
    ld.close()
    ld, _ = loader(None)  # no sidecar at all
    ld.submit(spec("c", 1))
    assert poll_until(ld) == ({"c"}, {100})
    ld.close()


def test_a_load_past_its_deadline_is_reported_failed_and_copies_nothing_after() -> None:
    gate = threading.Event()
    client = FakeClient(gate=gate)
    ld, copies = loader(client, timeout_s=0.2)
    ld.submit(spec("slow", 3))
    ld.submit(spec("queued", 1))
    t0 = time.monotonic()
    finished, failed = poll_until(ld)
    assert 0.19 < time.monotonic() - t0 < 5.0
    while len(finished) < 2 and time.monotonic() - t0 < 5.0:  # deadlines a moment apart
        more, more_failed, _ = ld.poll()
        finished |= more
        failed |= more_failed
    assert finished == {"slow", "queued"} and failed == {100, 101, 102}
    assert ld.counters.timeouts == 2
    gate.set()  # the acquire answers at last: the cancelled load must not copy
    time.sleep(0.2)
    assert copies == [] and all(p.released for p in client.pins)
    assert ld.poll() == (set(), set(), set())  # reported once
    ld.close()


def test_an_idle_poll_waits_for_a_load_to_end_and_no_longer() -> None:
    """In a step that computes nothing, get_finished waits (bounded) for a
    load to end instead of letting vLLM step again at once; in any other
    step it never waits."""
    gate = threading.Event()
    client = FakeClient(gate=gate)
    ld, _ = loader(client)
    ld.submit(spec("a", 1))
    t0 = time.monotonic()
    assert ld.poll() == (set(), set(), set())  # no wait asked: at once
    assert time.monotonic() - t0 < 0.05
    t0 = time.monotonic()
    assert ld.poll(0.1) == (set(), set(), set())  # nothing ends: bounded by the wait
    assert 0.09 < time.monotonic() - t0 < 2.0
    threading.Timer(0.2, gate.set).start()
    t0 = time.monotonic()
    finished, failed, _ = ld.poll(5.0)  # returns when the load ends, long before 5 s
    assert finished == {"a"} and failed == set()
    assert 0.15 < time.monotonic() - t0 < 2.0
    ld.close()


def test_only_a_step_that_computes_nothing_waits() -> None:
    idle = SimpleNamespace(total_num_scheduled_tokens=0)
    busy = SimpleNamespace(total_num_scheduled_tokens=7)
    assert computes_nothing(idle) and not computes_nothing(busy)
    assert poll_wait_s(TierstoreConnectorMetadata(idle=True)) == IDLE_POLL_WAIT_S > 0
    assert poll_wait_s(TierstoreConnectorMetadata(idle=False)) == 0.0
    assert poll_wait_s(None) == 0.0  # no metadata bound: never wait


# -- budgeted lookups --------------------------------------------------------------------


def test_a_slow_call_answers_none_then_its_result_on_a_later_ask() -> None:
    calls = BudgetedCalls[int](budget_s=0.01, forget_s=5.0)
    gate = threading.Event()
    started = []

    def slow() -> int:
        started.append(1)
        gate.wait(5)
        return 7

    t0 = time.monotonic()
    assert calls.ask("k", slow) is None
    assert time.monotonic() - t0 < 1.0
    assert calls.ask("k", slow) is None and calls.late == 2
    gate.set()
    deadline = time.monotonic() + 5
    got = None
    while got is None and time.monotonic() < deadline:
        got = calls.ask("k", slow)
    assert got == 7 and started == [1]  # one call for all the asks
    assert calls.pending == 0
    assert _next_steps(calls, "fast", lambda: 3) == 3

    def broken() -> int:
        raise TierstoreError("peer gone")

    with pytest.raises(TierstoreError):
        _next_steps(calls, "broken", broken)
    assert calls.pending == 0
    calls.close()


def _next_steps(calls: BudgetedCalls[int], key: str, call: Callable[[], int]) -> int:
    """Ask in one new step after another until the answer comes (a loaded
    machine may wake the pool thread after a step's budget)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        calls.new_step()
        got = calls.ask(key, call)
        if got is not None:
            return got
    raise AssertionError(f"{key} never answered")


def test_the_asks_of_one_step_share_one_budget() -> None:
    """A step that asks for many waiting requests behind one slow call waits
    the budget once, not once per request."""
    calls = BudgetedCalls[int](budget_s=0.05, forget_s=5.0)
    gate = threading.Event()
    t0 = time.monotonic()
    for i in range(40):  # queued behind the first on the one lookup thread
        assert calls.ask(i, lambda: int(gate.wait(5))) is None
    step_s = time.monotonic() - t0
    assert step_s < 1.0, f"40 asks of one step waited {step_s:.2f}s (40 x 0.05 = 2 s)"
    calls.new_step()
    t1 = time.monotonic()
    assert calls.ask(0, lambda: 0) is None  # the next step waits its own budget again
    assert time.monotonic() - t1 >= 0.04
    gate.set()
    calls.close()


def test_a_call_asked_again_is_kept() -> None:
    calls = BudgetedCalls[int](budget_s=0.001, forget_s=0.2)
    gate = threading.Event()
    for _ in range(6):  # 0.3 s in all, never 0.2 s without an ask
        calls.new_step()
        assert calls.ask("a", lambda: int(gate.wait(5))) is None
        time.sleep(0.05)
    assert calls.pending == 1
    gate.set()
    assert _next_steps(calls, "a", lambda: 9) == 1  # the first call's answer, not a new one
    calls.close()


def test_asks_nobody_repeats_are_forgotten() -> None:
    calls = BudgetedCalls[int](budget_s=0.001, forget_s=0.05)
    gate = threading.Event()
    assert calls.ask("a", lambda: int(gate.wait(5))) is None
    time.sleep(0.1)
    assert calls.ask("b", lambda: int(gate.wait(5))) is None
    assert calls.pending == 1  # "a" was dropped
    gate.set()
    calls.close()
