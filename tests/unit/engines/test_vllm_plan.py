"""The vLLM connector's scheduling logic, with vLLM's own request and
scheduler-output objects and a store that is a set of keys."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vllm (pip install 'tierstore[vllm]')")

from vllm import SamplingParams
from vllm.lora.request import LoRARequest
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.request import Request

from tierstore.engines.vllm.connector import session_of
from tierstore.engines.vllm.layout import ConnectorSettings, request_refusal, request_salt
from tierstore.engines.vllm.plan import Planner
from tierstore.keys import BlockKey, KVLayout, chain_keys
from tierstore.tiers import TierName

BT = 16
LAYOUTS = (
    KVLayout("vllm:test", 2, 2, 64, "bfloat16", BT, tp_rank=0, tp_size=2),
    KVLayout("vllm:test", 2, 2, 64, "bfloat16", BT, tp_rank=1, tp_size=2),
)
SETTINGS = ConnectorSettings()


class FakeStore:
    """What the sidecar holds: a set of keys; lookups answer the longest prefix."""

    def __init__(self) -> None:
        self.keys: set[BlockKey] = set()
        self.lookups = 0

    def lookup(self, layout: KVLayout, keys: list[BlockKey]) -> int:
        self.lookups += 1
        n = 0
        while n < len(keys) and keys[n] in self.keys:
            n += 1
        return (TierName.DRAM,) * n

    def hold(self, layout: KVLayout, tokens: list[int], num_blocks: int) -> None:
        self.keys.update(chain_keys(layout, tokens)[:num_blocks])


def planner(store: FakeStore) -> Planner:
    return Planner(LAYOUTS, store.lookup, lambda r: request_salt(SETTINGS, r), session_of)


def request(tokens: list[int], rid: str = "r1", **kw: Any) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=16), None, **kw)


def blocks(ids: list[int]) -> KVCacheBlocks:
    return KVCacheBlocks(([KVCacheBlock(block_id=i) for i in ids],))


def groups(ids: Any) -> tuple[list[int], ...]:
    """Block ids per KV cache group: a list is the one group's."""
    return ids if isinstance(ids, tuple) else (ids,)


def step(
    new: list[tuple[Request, list[int], int]] = (),  # type: ignore[assignment]
    cached: list[tuple[Request, list[int] | None, int]] = (),  # type: ignore[assignment]
    scheduled: dict[str, int] | None = None,
    resumed: set[str] | None = None,
) -> SchedulerOutput:
    """A SchedulerOutput: new requests (request, block ids, computed tokens),
    running ones (request, new block ids, computed tokens)."""
    cdata = CachedRequestData.make_empty()
    cdata.req_ids = [r.request_id for r, _, _ in cached]
    cdata.resumed_req_ids = resumed or set()
    cdata.new_token_ids = [[] for _ in cached]
    cdata.new_block_ids = [groups(ids) if ids is not None else None for _, ids, _ in cached]
    cdata.num_computed_tokens = [n for _, _, n in cached]
    cdata.num_output_tokens = [r.num_output_tokens for r, _, _ in cached]
    out = SchedulerOutput.make_empty()
    out.scheduled_new_reqs = [NewRequestData.from_request(r, groups(ids)) for r, ids, _ in new]  # type: ignore[call-arg]
    for nd, (_, _, n) in zip(out.scheduled_new_reqs, new):
        nd.num_computed_tokens = n
    out.scheduled_cached_reqs = cdata
    out.num_scheduled_tokens = scheduled or {}
    out.total_num_scheduled_tokens = sum(out.num_scheduled_tokens.values())
    return out


def toks(n: int, seed: int = 0) -> list[int]:
    return [(i * 7 + seed * 13) % 500 + 1 for i in range(n)]


def test_match_is_the_stored_prefix_beyond_vllms_own_and_never_the_last_token() -> None:
    store, p = FakeStore(), toks(5 * BT)
    plan = planner(store)
    assert plan.matched_tokens(request(p), 0) == 0
    store.hold(LAYOUTS[0], p, 5)
    # 5 full blocks stored, but the request's last token must be computed: 4.
    assert plan.matched_tokens(request(p), 0) == 4 * BT
    assert plan.matched_tokens(request(p), 2 * BT) == 2 * BT  # vLLM holds 2 itself
    assert plan.matched_tokens(request(p), 4 * BT) == 0
    store2 = FakeStore()
    store2.hold(LAYOUTS[0], p, 2)
    assert planner(store2).matched_tokens(request([*p, 1]), 0) == 2 * BT


def test_keys_are_the_chain_over_token_ids_per_rank_and_salt() -> None:
    store, p = FakeStore(), toks(3 * BT + 5)
    plan = planner(store)
    req = request(p)
    store.hold(LAYOUTS[0], p, 3)
    assert plan.matched_tokens(req, 0) == 3 * BT
    plan.after_alloc(req, blocks([7, 8, 9, 10]).get_block_ids(), 3 * BT)
    (load,), saves = plan.build(step(new=[(req, [7, 8, 9, 10], 3 * BT)], scheduled={"r1": 5}))
    assert load.block_ids == ((7, 8, 9),)
    for rank, layout in enumerate(LAYOUTS):
        assert list(load.keys[rank]) == chain_keys(layout, p)
    assert load.keys[0] != load.keys[1]
    assert saves == []  # the stored blocks are not saved again; block 3 is partial
    salted = request(p, rid="r2", cache_salt="tenant-a")
    assert plan.matched_tokens(salted, 0) == 0  # another tenant's keys: nothing shared


def test_load_plan_starts_after_vllms_own_prefix() -> None:
    store, p = FakeStore(), toks(6 * BT)
    store.hold(LAYOUTS[0], p, 5)
    plan = planner(store)
    req = request(p)
    assert plan.matched_tokens(req, 2 * BT) == 3 * BT
    ids = [20, 21, 22, 23, 24, 25]
    plan.after_alloc(req, (ids,), 3 * BT)
    (load,), _ = plan.build(step(new=[(req, ids, 5 * BT)], scheduled={"r1": BT}))
    assert load.block_ids == ((22, 23, 24),)
    assert list(load.keys[0]) == chain_keys(LAYOUTS[0], p)[2:5]


def test_saves_follow_chunked_prefill_and_decode() -> None:
    store, plan = FakeStore(), None
    plan = planner(store)
    p = toks(3 * BT + 4)
    req = request(p)
    assert plan.matched_tokens(req, 0) == 0
    ids = [1, 2, 3, 4]
    # Chunk 1 computes 20 tokens: one full block.
    loads, (s1,) = plan.build(step(new=[(req, ids, 0)], scheduled={"r1": 20}))
    assert loads == [] and s1.block_ids == ((1,),)
    assert list(s1.keys[0]) == chain_keys(LAYOUTS[0], p)[:1]
    # Chunk 2 computes the rest of the prompt: blocks 2 and 3 are full.
    _, (s2,) = plan.build(step(cached=[(req, None, 20)], scheduled={"r1": len(p) - 20}))
    assert s2.block_ids == ((2, 3),)
    assert list(s2.keys[1]) == chain_keys(LAYOUTS[1], p)[1:3]
    # Decoding: the block fills when its last token's KV is computed.
    for t in range(BT - 4):
        req.append_output_token_ids(100 + t)
    _, saves = plan.build(step(cached=[(req, None, req.num_tokens - 2)], scheduled={"r1": 1}))
    assert saves == []  # one token of block 4 is not computed yet
    req.append_output_token_ids(999)
    _, (s3,) = plan.build(step(cached=[(req, [5], req.num_tokens - 2)], scheduled={"r1": 1}))
    assert s3.block_ids == ((4,),)
    assert list(s3.keys[0]) == chain_keys(LAYOUTS[0], list(req.all_token_ids))[3:4]


def test_a_preempted_request_gets_its_new_blocks() -> None:
    store, p = FakeStore(), toks(2 * BT + 1)
    plan = planner(store)
    req = request(p)
    plan.matched_tokens(req, 0)
    _, (s,) = plan.build(step(new=[(req, [1, 2, 3], 0)], scheduled={"r1": BT}))
    assert s.block_ids == ((1,),)
    _, (s,) = plan.build(
        step(cached=[(req, [7, 8, 9], 0)], scheduled={"r1": 2 * BT}, resumed={"r1"})
    )
    assert s.block_ids == ((8,),)  # block 0 was saved already; block 1 now lives in 8


def test_failed_loads_are_saved_again_once_recomputed() -> None:
    store, p = FakeStore(), toks(4 * BT + 3)
    store.hold(LAYOUTS[0], p, 4)
    plan = planner(store)
    req = request(p)
    assert plan.matched_tokens(req, 0) == 4 * BT
    ids = [10, 11, 12, 13, 14]
    plan.after_alloc(req, (ids,), 4 * BT)
    (load,), saves = plan.build(step(new=[(req, ids, 4 * BT)], scheduled={"r1": 3}))
    assert load.block_ids == ((10, 11, 12, 13),) and saves == []
    plan.load_failed({12, 13})  # the worker could not load blocks 2 and 3
    _, (s,) = plan.build(step(cached=[(req, None, 2 * BT)], scheduled={"r1": 2 * BT + 3}))
    assert s.block_ids == ((12, 13),)


def test_finished_ends_the_turn_with_its_stored_blocks_and_forgets_it() -> None:
    store, p = FakeStore(), toks(3 * BT)
    plan = planner(store)
    req = request(p, kv_hints=None)
    req.kv_transfer_params = {"session": "conv-1"}
    plan.matched_tokens(req, 0)
    plan.build(step(new=[(req, [1, 2, 3], 0)], scheduled={"r1": 3 * BT}))
    turn = plan.finished(req)
    assert turn is not None and turn.session == "conv-1"
    assert [list(k) for k in turn.keys] == [chain_keys(lo, p) for lo in LAYOUTS]
    assert turn.num_tokens == 3 * BT
    assert plan.tracked() == 0
    assert plan.finished(req) is None
    other = request(toks(5), rid="r9")
    plan.matched_tokens(other, 0)
    assert plan.finished(other) is None  # no full block: no turn to tell
    assert session_of(other) == "r9"


def test_refusals() -> None:
    assert request_refusal(request(toks(4))) is None
    assert request_refusal(request(toks(4), lora_request=LoRARequest("a", 1, "/x"))) == "lora"
    embeds = Request(
        "e", None, SamplingParams(), None, prompt_embeds=__import__("torch").ones(3, 8)
    )
    assert request_refusal(embeds) == "prompt_embeds"


def test_settings_are_validated() -> None:
    assert ConnectorSettings.from_extra({"include_peers": True}).include_peers
    with pytest.raises(ValueError, match="unknown"):
        ConnectorSettings.from_extra({"socket": "/x"})
    with pytest.raises(ValueError, match="reconnect_s"):
        ConnectorSettings.from_extra({"reconnect_s": 0})
    assert ConnectorSettings.from_extra({"copy_threads": 2}).copy_threads == 2
    for bad in (-1, 65, 1.5, True):
        with pytest.raises(ValueError, match="copy_threads"):
            ConnectorSettings.from_extra({"copy_threads": bad})
    assert ConnectorSettings.from_extra({"load_piece_bytes": 0}).load_piece_bytes == 0
    for bad in (-1, 1.5, True, "64MiB"):
        with pytest.raises(ValueError, match="load_piece_bytes"):
            ConnectorSettings.from_extra({"load_piece_bytes": bad})
    assert ConnectorSettings.from_extra({}).fast_path
    assert not ConnectorSettings.from_extra({"fast_path": False}).fast_path
    for name in ("include_peers", "async_loads", "end_turn", "fast_path"):
        with pytest.raises(ValueError, match=f"{name} must be true or false"):
            ConnectorSettings.from_extra({name: "false"})


# -- hybrid models: vLLM's KV cache groups ------------------------------------------------


def hybrid_planner(store: FakeStore) -> Planner:
    """A full-attention group (0) and a sliding-window group (1)."""
    return Planner(LAYOUTS, store.lookup, lambda r: request_salt(SETTINGS, r), session_of,
                   num_groups=2, windowed=True)  # fmt: skip


def test_a_hybrid_load_carries_every_groups_blocks_and_runs_in_the_background() -> None:
    """Each group has its own block ids for the same token blocks; the
    window's group has vLLM's null block (0) before its window. Even a DRAM
    hit loads in the background: vLLM takes a multi-group failure only as
    a failed request."""
    store, p = FakeStore(), toks(4 * BT + 3)
    store.hold(LAYOUTS[0], p, 4)
    plan = hybrid_planner(store)
    req = request(p)
    assert plan.match(req, 0) == (4 * BT, True)
    full_ids, window_ids = [10, 11, 12, 13, 14], [0, 0, 21, 22, 23]
    plan.after_alloc(req, (full_ids, window_ids), 4 * BT)
    (load,), saves = plan.build(step())
    assert load.background and saves == []
    assert load.block_ids == ((10, 11, 12, 13), (0, 0, 21, 22))
    # Failed whole (failed_recving): recomputed from its first token, saved again.
    plan.requests_failed({"r1"})
    assert plan.counters.failed_loads == 1 and plan.counters.load_failed_blocks == 4
    assert plan.match(req, 0) == (0, False)
    _, (s,) = plan.build(step(new=[(req, ([1, 2, 3, 4, 5], [6, 7, 8, 9, 10]), 0)],
                              scheduled={"r1": len(p)}))  # fmt: skip
    assert s.block_ids == ((1, 2, 3, 4), (6, 7, 8, 9))


def test_a_hybrid_block_is_saved_only_in_the_step_that_completes_it() -> None:
    store, p = FakeStore(), toks(4 * BT)
    plan = hybrid_planner(store)
    req = request(p)
    assert plan.match(req, 0) == (0, False)
    # Chunk 1: blocks 0 and 1 (both groups' blocks hold them now).
    _, (s1,) = plan.build(step(new=[(req, ([1, 2, 3, 4], [5, 6, 7, 8]), 0)],
                               scheduled={"r1": 2 * BT + 3}))  # fmt: skip
    assert s1.block_ids == ((1, 2), (5, 6))
    # Chunk 2 completes blocks 2 and 3; the window freed block 0 (null now).
    _, (s2,) = plan.build(step(cached=[(req, None, 2 * BT + 3)], scheduled={"r1": 2 * BT - 3}))
    assert s2.block_ids == ((3, 4), (7, 8)) and plan.counters.save_gaps == 0
    # vLLM's own cache holds 3 blocks that the store lacks: a window's pages of
    # the first ones are gone, so this request saves nothing.
    other, q = FakeStore(), toks(5 * BT, seed=3)
    plan = hybrid_planner(other)
    req = request(q, rid="r2")
    assert plan.match(req, 3 * BT) == (0, False)
    _, saves = plan.build(step(new=[(req, ([1, 2, 3, 4, 5], [0, 0, 6, 7, 8]), 3 * BT)],
                               scheduled={"r2": 2 * BT}))  # fmt: skip
    assert saves == [] and plan.counters.save_gaps == 1
    # One group (vLLM without its hybrid manager): the same request saves them all.
    plan = planner(other)
    req = request(q, rid="r3")
    plan.match(req, 3 * BT)
    _, (s,) = plan.build(step(new=[(req, [1, 2, 3, 4, 5], 3 * BT)], scheduled={"r3": 2 * BT}))
    assert s.block_ids == ((1, 2, 3, 4, 5),)
