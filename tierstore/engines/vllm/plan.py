"""Scheduler-side planning of the vLLM connector: which blocks to load, which to save.

Provides:
- ``LoadSpec`` / ``SaveSpec``: one request's blocks to load into (or save
  from) vLLM's pages this step: the store's keys per tensor-parallel rank
  and vLLM's block ids per KV cache group, in the same order. They travel
  to the workers in the connector's metadata.
- ``EndTurn``: what ``request_finished`` tells the sidecar.
- ``Planner``: the per-request state behind ``get_num_new_matched_tokens``
  (``match``), ``update_state_after_alloc`` (``after_alloc``),
  ``build_connector_meta`` (``build``), ``update_connector_output``
  (``loads_done``, ``load_failed``) and ``request_finished`` (``finished``).
  It asks the store only through the ``lookup`` callable it is given (the
  tiers of the longest stored prefix of some keys), so it is tested without
  a sidecar.
- ``PlanCounters``: what the planner decided (exported by the connector).

Rules: keys chain over the request's token ids (prompt, then the tokens it
generated) in full blocks of the layout's ``block_tokens``; a match never
covers the request's last token (vLLM must compute one); a block is saved
once it is full and its KV was computed (this step or before), unless the
store is known to hold it; loaded blocks are never saved again.

Hybrid models (vLLM's hybrid KV cache manager, ``SupportsHMA``): each KV
cache group (full-attention layers, sliding-window layers) has its own
block ids for the same token blocks. A stored block holds every layer's KV,
so a match is the same for every group; a sliding-window group's blocks
before its window are vLLM's null block (``NULL_BLOCK_ID``), and the
workers load only the others: exactly what vLLM itself keeps. A block is
saved only in the step that completes it (``windowed``): vLLM frees a
window's older blocks in later steps, and a block id held from before may
belong to another request by then. A prefix that vLLM's own cache holds
beyond what the store holds cannot be saved from such a group (its pages
outside the window are gone), so that request saves nothing more
(``save_gaps``). With more than one group every load runs in the
background: vLLM takes a multi-group request's failed load only as a
failed request (``failed_recving``: it recomputes it whole), never as
failed blocks.

Background loads (vLLM's async loads, with ``async_loads``): a match whose
blocks are not all in DRAM (NVMe, a peer, the bucket) is loaded by the
worker's loader thread while the engine keeps running other requests; the
request waits in vLLM's WAITING_FOR_REMOTE_KVS until the worker reports it
through ``get_finished``. A match that is all in DRAM is loaded in the step
(a DRAM copy is faster than a step's wait). A request whose load failed is
never matched again: it is recomputed, not retried.

Runs in vLLM's scheduler process, on the scheduler's thread (not thread-safe).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from tierstore.keys import BlockKey, KVLayout, chain_keys
from tierstore.tiers import TierName

Lookup = Callable[[KVLayout, list[BlockKey]], Sequence[TierName] | None]
"""Where each block of the longest prefix of ``keys`` the store holds is
(empty on any failure); None while the answer is not known yet (peers or the
bucket are slow to answer): vLLM asks again at its next step."""

Count = Callable[[str, int, str], None]
"""Adds to one of the connector's metrics (name, amount, label; see
``vllm.metrics``)."""

IN_STEP_TIERS = frozenset({TierName.HBM, TierName.DRAM})
"""Tiers a load is copied from inside the step (no background load)."""

NULL_BLOCK_ID = 0
"""vLLM's null block (its BlockPool takes block 0 for it): the place of a
sliding-window group's block that holds no KV (before the window)."""

GroupIds = tuple[tuple[int, ...], ...]
"""vLLM's block ids per KV cache group: ``ids[group][i]``."""


@dataclass(frozen=True, slots=True)
class LoadSpec:
    req_id: str
    salt: str
    keys: tuple[tuple[BlockKey, ...], ...]  # [tp_rank][i]
    block_ids: GroupIds  # [group][i]: vLLM's block of keys[r][i] in that group
    background: bool = False  # the worker's loader thread loads it; see get_finished


@dataclass(frozen=True, slots=True)
class SaveSpec:
    req_id: str
    salt: str
    keys: tuple[tuple[BlockKey, ...], ...]
    block_ids: GroupIds  # never NULL_BLOCK_ID
    # With KV events on: vLLM's hashes of these blocks, the one before them,
    # and their tokens (for the BlockStored events of the blocks once stored).
    block_hashes: tuple[Any, ...] = ()
    parent_hash: Any = None
    token_ids: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class EndTurn:
    session: str
    salt: str
    keys: tuple[tuple[BlockKey, ...], ...]  # every full block of the turn, per rank
    num_tokens: int


@dataclass(slots=True)
class _Tracked:
    request: Any  # vllm.v1.request.Request (its token ids grow as it decodes)
    salt: str
    keys: list[list[BlockKey]]  # [tp_rank]: chain over request.all_token_ids
    block_ids: list[list[int]] = field(default_factory=list)  # [group]
    stored_blocks: int = 0  # prefix the store holds (found by lookup, or saved)
    local_tokens: int = 0  # vLLM's own prefix-cache hit at the last match
    load: LoadSpec | None = None
    tiers: Sequence[TierName] = ()  # where the stored prefix was at the last match
    queried: bool = False  # counted in the metrics' queried tokens
    background: bool = False  # the last match is loaded in the background
    load_failed: bool = False  # a load of it failed: recompute, never match again


@dataclass(slots=True)
class PlanCounters:
    """What the scheduler side decided, since the engine started."""

    lookups_pending: int = 0  # matches answered None (the store's answer was late)
    step_loads: int = 0  # loads copied inside a step (DRAM)
    background_loads: int = 0  # loads run by the worker's loader thread
    background_loads_done: int = 0  # ... reported through get_finished
    load_failed_blocks: int = 0  # blocks vLLM was told to recompute
    failed_loads: int = 0  # requests with such blocks (or failed whole)
    save_gaps: int = 0  # requests that stopped saving: a window's pages were gone
    steps_while_loading: int = 0  # steps that computed tokens while a background load ran
    tokens_while_loading: int = 0  # the tokens those steps computed


class Planner:
    """See the module docstring."""

    def __init__(
        self,
        layouts: Sequence[KVLayout],
        lookup: Lookup,
        salt_of: Callable[[Any], str],
        session_of: Callable[[Any], str],
        async_loads: bool = False,
        count: Count | None = None,
        events: bool = False,
        num_groups: int = 1,
        windowed: bool = False,
    ) -> None:
        self.layouts = tuple(layouts)
        self.events = events  # saves carry what KV events need
        self._count: Count = count or (lambda name, n, label: None)
        self.async_loads = async_loads
        self.windowed = windowed  # a group frees its blocks before the window
        # More than one group: every load in the background (see the module docstring).
        self.all_background = num_groups > 1
        self.counters = PlanCounters()
        self._background: list[LoadSpec] = []  # planned, not yet sent to the workers
        self._loading: set[str] = set()  # sent, not yet reported done
        self.block_tokens = self.layouts[0].block_tokens
        self._lookup = lookup
        self._salt_of = salt_of
        self._session_of = session_of
        self._reqs: dict[str, _Tracked] = {}
        self._salted: dict[str, tuple[KVLayout, ...]] = {}

    def layouts_for(self, salt: str) -> tuple[KVLayout, ...]:
        if salt not in self._salted:
            self._salted[salt] = tuple(replace(lo, tenant_salt=salt) for lo in self.layouts)
        return self._salted[salt]

    def _track(self, request: Any) -> _Tracked:
        t = self._reqs.get(request.request_id)
        if t is None or t.request is not request:
            salt = self._salt_of(request)
            t = _Tracked(request, salt, [[] for _ in self.layouts])
            self._reqs[request.request_id] = t
        return t

    def _keys_upto(self, t: _Tracked, num_blocks: int) -> None:
        """Extend every rank's chain to ``num_blocks`` full blocks (as far as
        the request's tokens go)."""
        have = len(t.keys[0])
        if num_blocks <= have:
            return
        bt = self.block_tokens
        tokens = t.request.all_token_ids[have * bt : num_blocks * bt]
        for rank, layout in enumerate(self.layouts_for(t.salt)):
            parent = t.keys[rank][-1] if have else None
            t.keys[rank].extend(chain_keys(layout, list(tokens), parent))

    # -- get_num_new_matched_tokens ----------------------------------------------------

    def match(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """``get_num_new_matched_tokens``: tokens beyond ``num_computed_tokens``
        (vLLM's own, block-aligned hit) that the store can supply, never the
        request's last token (None: ask again next step), and whether they
        are loaded in the background."""
        t = self._track(request)
        if t.load_failed:
            return 0, False
        max_blocks = (request.num_tokens - 1) // self.block_tokens
        self._keys_upto(t, max_blocks)
        keys = t.keys[0][:max_blocks]
        tiers = self._lookup(self.layouts_for(t.salt)[0], keys) if keys else ()
        if tiers is None:
            self.counters.lookups_pending += 1
            return None, False
        t.stored_blocks = len(tiers)
        t.tiers = tiers
        t.local_tokens = num_computed_tokens
        tokens = max(0, len(tiers) * self.block_tokens - num_computed_tokens)
        beyond = tiers[num_computed_tokens // self.block_tokens :]
        t.background = tokens > 0 and (
            self.all_background
            or (self.async_loads and any(x not in IN_STEP_TIERS for x in beyond))
        )
        return tokens, t.background

    def matched_tokens(self, request: Any, num_computed_tokens: int) -> int | None:
        """The tokens of ``match`` alone."""
        return self.match(request, num_computed_tokens)[0]

    # -- update_state_after_alloc --------------------------------------------------------

    def after_alloc(
        self, request: Any, block_ids: Sequence[Sequence[int]], num_external: int
    ) -> None:
        """Plan the load of the ``num_external`` tokens matched for ``request``
        into the blocks vLLM allocated for them (called once per request
        vLLM schedules, matched or not: the metrics count its query here);
        ``block_ids``: the request's blocks per group."""
        t = self._reqs.get(request.request_id)
        if t is None or t.request is not request:
            return  # refused: never matched
        bt = self.block_tokens
        if not t.queried:  # a background load's request is allocated again once loaded
            t.queried = True
            self._count(
                "queried_tokens", max(0, (request.num_tokens - 1) // bt * bt - t.local_tokens), ""
            )
        if num_external <= 0:
            return
        start = t.local_tokens // bt
        end = start + num_external // bt
        for tier in t.tiers[start:end]:
            self._count("hit_tokens", bt, str(tier))
        ids = tuple(tuple(group[start:end]) for group in block_ids)
        keys = tuple(tuple(chain[start:end]) for chain in t.keys)
        spec = LoadSpec(request.request_id, t.salt, keys, ids, t.background)
        # A failed load is matched to these blocks before the request runs.
        t.block_ids = [list(group) for group in block_ids]
        if t.background:  # the request waits: it is not in this step's output
            self._background.append(spec)
            self.counters.background_loads += 1
        else:
            t.load = spec
            self.counters.step_loads += 1

    # -- build_connector_meta ------------------------------------------------------------

    def build(self, scheduler_output: Any) -> tuple[list[LoadSpec], list[SaveSpec]]:
        """This step's loads (planned by ``after_alloc``) and saves (blocks
        that are full once this step has computed its tokens)."""
        loads, self._background = self._background, []
        saves: list[SaveSpec] = []
        scheduled = scheduler_output.num_scheduled_tokens
        if self._loading and scheduler_output.total_num_scheduled_tokens > 0:
            self.counters.steps_while_loading += 1
            self.counters.tokens_while_loading += scheduler_output.total_num_scheduled_tokens
        self._loading.update(spec.req_id for spec in loads)
        for new in scheduler_output.scheduled_new_reqs:
            t = self._reqs.get(new.req_id)
            if t is None:
                continue  # refused, or never matched
            t.block_ids = [list(group) for group in new.block_ids]
            done = new.num_computed_tokens + scheduled.get(new.req_id, 0)
            self._plan(t, new.num_computed_tokens, done, loads, saves)
        cached = scheduler_output.scheduled_cached_reqs
        resumed: set[str] = getattr(cached, "resumed_req_ids", set())
        for i, req_id in enumerate(cached.req_ids):
            t = self._reqs.get(req_id)
            if t is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in resumed:  # after a preemption: the whole list, anew
                t.block_ids = [list(g) for g in new_ids] if new_ids is not None else []
            elif new_ids is not None:
                for have, new_group in zip(t.block_ids, new_ids):
                    have.extend(new_group)
            before = cached.num_computed_tokens[i]
            self._plan(t, before, before + scheduled.get(req_id, 0), loads, saves)
        return loads, saves

    def _plan(
        self,
        t: _Tracked,
        computed_before: int,
        computed_after: int,
        loads: list[LoadSpec],
        saves: list[SaveSpec],
    ) -> None:
        if t.load is not None:
            loads.append(t.load)
            t.load = None
        if not t.block_ids:
            return
        computed_after = min(computed_after, t.request.num_tokens)
        full = min(computed_after // self.block_tokens, *(len(g) for g in t.block_ids))
        if full <= t.stored_blocks:
            return
        self._keys_upto(t, full)
        lo, hi = t.stored_blocks, min(full, len(t.keys[0]))
        if self.windowed and lo < computed_before // self.block_tokens:
            # Blocks computed in an earlier step: a window's pages of them may be
            # gone, and without them the rest of the chain is out of reach.
            self.counters.save_gaps += 1
            t.stored_blocks = hi
            return
        if hi > lo:
            keys = tuple(tuple(chain[lo:hi]) for chain in t.keys)
            ids = tuple(tuple(group[lo:hi]) for group in t.block_ids)
            hashes = getattr(t.request, "block_hashes", ()) if self.events else ()
            if len(hashes) >= hi:  # vLLM hashes blocks of our size (else: no events)
                bt = self.block_tokens
                spec = SaveSpec(
                    t.request.request_id, t.salt, keys, ids, tuple(hashes[lo:hi]),
                    hashes[lo - 1] if lo else None,
                    tuple(t.request.all_token_ids[lo * bt : hi * bt]),
                )  # fmt: skip
            else:
                spec = SaveSpec(t.request.request_id, t.salt, keys, ids)
            saves.append(spec)
            t.stored_blocks = hi

    def load_failed(self, block_ids: set[int]) -> None:
        """Blocks a worker could not load (vLLM recomputes them; one group
        only): the store does not hold them after all, so they are saved
        again once computed, and the request is not matched again."""
        for t in self._reqs.values():
            for i, block_id in enumerate(t.block_ids[0][: t.stored_blocks] if t.block_ids else ()):
                if block_id in block_ids:
                    self._failed(t, i)
                    break

    def requests_failed(self, req_ids: set[str]) -> None:
        """Requests whose background load failed (vLLM's ``failed_recving``):
        vLLM recomputes them from their first token."""
        for req_id in req_ids:
            t = self._reqs.get(req_id)
            if t is not None:
                self._failed(t, 0)

    def _failed(self, t: _Tracked, first_missing: int) -> None:
        self.counters.load_failed_blocks += t.stored_blocks - first_missing
        self._count("load_error_blocks", t.stored_blocks - first_missing, "")
        self.counters.failed_loads += 1
        t.stored_blocks = first_missing
        t.load_failed = True

    def loads_done(self, req_ids: set[str]) -> None:
        """The workers finished these requests' background loads (whole or
        not: failed blocks came through ``load_failed``)."""
        for req_id in req_ids:
            if req_id in self._loading:
                self._loading.discard(req_id)
                self.counters.background_loads_done += 1

    # -- request_finished ------------------------------------------------------------------

    def finished(self, request: Any) -> EndTurn | None:
        """Forget ``request``; the turn to tell the sidecar about, if any."""
        t = self._reqs.pop(request.request_id, None)
        # A load in flight is still reported done by the workers (vLLM holds
        # the blocks until then): _loading keeps it until loads_done.
        if t is None or t.stored_blocks == 0:
            return None
        keys = tuple(tuple(chain[: t.stored_blocks]) for chain in t.keys)
        return EndTurn(self._session_of(request), t.salt, keys, len(request.all_token_ids))

    def tracked(self) -> int:
        """Requests with state here (for tests: finished ones must leave none)."""
        return len(self._reqs)
