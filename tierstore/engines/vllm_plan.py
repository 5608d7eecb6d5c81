"""Scheduler-side planning of the vLLM connector: which blocks to load, which to save.

Provides:
- ``LoadSpec`` / ``SaveSpec``: one request's blocks to load into (or save
  from) vLLM's pages this step: the store's keys per tensor-parallel rank
  and vLLM's block ids, in the same order. They travel to the workers in the
  connector's metadata.
- ``EndTurn``: what ``request_finished`` tells the sidecar.
- ``Planner``: the per-request state behind ``get_num_new_matched_tokens``
  (``matched_tokens``), ``update_state_after_alloc`` (``after_alloc``),
  ``build_connector_meta`` (``build``) and ``request_finished``
  (``finished``). It asks the store only through the ``lookup`` callable it
  is given (the longest stored prefix of some keys), so it is tested
  without a sidecar.

Rules: keys chain over the request's token ids (prompt, then the tokens it
generated) in full blocks of the layout's ``block_tokens``; a match never
covers the request's last token (vLLM must compute one); a block is saved
once it is full and its KV was computed (this step or before), unless the
store is known to hold it; loaded blocks are never saved again.

Runs in vLLM's scheduler process, on the scheduler's thread (not thread-safe).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from tierstore.keys import BlockKey, KVLayout, chain_keys

Lookup = Callable[[KVLayout, list[BlockKey]], int]
"""Blocks of the longest prefix of ``keys`` the store holds (0 on any failure)."""


@dataclass(frozen=True, slots=True)
class LoadSpec:
    req_id: str
    salt: str
    keys: tuple[tuple[BlockKey, ...], ...]  # [tp_rank][i]
    block_ids: tuple[int, ...]  # vLLM's block of keys[r][i]


@dataclass(frozen=True, slots=True)
class SaveSpec:
    req_id: str
    salt: str
    keys: tuple[tuple[BlockKey, ...], ...]
    block_ids: tuple[int, ...]


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
    block_ids: list[int] = field(default_factory=list)
    stored_blocks: int = 0  # prefix the store holds (found by lookup, or saved)
    local_tokens: int = 0  # vLLM's own prefix-cache hit at the last match
    load: LoadSpec | None = None


class Planner:
    """See the module docstring."""

    def __init__(
        self,
        layouts: Sequence[KVLayout],
        lookup: Lookup,
        salt_of: Callable[[Any], str],
        session_of: Callable[[Any], str],
    ) -> None:
        self.layouts = tuple(layouts)
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

    def matched_tokens(self, request: Any, num_computed_tokens: int) -> int:
        """Tokens beyond ``num_computed_tokens`` (vLLM's own, block-aligned
        hit) that the store can supply; never the request's last token."""
        t = self._track(request)
        max_blocks = (request.num_tokens - 1) // self.block_tokens
        self._keys_upto(t, max_blocks)
        keys = t.keys[0][:max_blocks]
        hits = self._lookup(self.layouts_for(t.salt)[0], keys) if keys else 0
        t.stored_blocks = hits
        t.local_tokens = num_computed_tokens
        return max(0, hits * self.block_tokens - num_computed_tokens)

    # -- update_state_after_alloc --------------------------------------------------------

    def after_alloc(self, request: Any, block_ids: Sequence[int], num_external: int) -> None:
        """Plan the load of the ``num_external`` tokens matched for ``request``
        into the blocks vLLM allocated for them."""
        if num_external <= 0:
            return
        t = self._track(request)
        start = t.local_tokens // self.block_tokens
        end = start + num_external // self.block_tokens
        ids = tuple(block_ids[start:end])
        keys = tuple(tuple(chain[start:end]) for chain in t.keys)
        t.load = LoadSpec(request.request_id, t.salt, keys, ids)

    # -- build_connector_meta ------------------------------------------------------------

    def build(self, scheduler_output: Any) -> tuple[list[LoadSpec], list[SaveSpec]]:
        """This step's loads (planned by ``after_alloc``) and saves (blocks
        that are full once this step has computed its tokens)."""
        loads: list[LoadSpec] = []
        saves: list[SaveSpec] = []
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            t = self._reqs.get(new.req_id)
            if t is None:
                continue  # refused, or never matched
            t.block_ids = list(new.block_ids[0])
            self._plan(t, new.num_computed_tokens + scheduled.get(new.req_id, 0), loads, saves)
        cached = scheduler_output.scheduled_cached_reqs
        resumed: set[str] = getattr(cached, "resumed_req_ids", set())
        for i, req_id in enumerate(cached.req_ids):
            t = self._reqs.get(req_id)
            if t is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in resumed:  # after a preemption: the whole list, anew
                t.block_ids = list(new_ids[0]) if new_ids is not None else []
            elif new_ids is not None:
                t.block_ids.extend(new_ids[0])
            done = cached.num_computed_tokens[i] + scheduled.get(req_id, 0)
            self._plan(t, done, loads, saves)
        return loads, saves

    def _plan(
        self, t: _Tracked, computed_after: int, loads: list[LoadSpec], saves: list[SaveSpec]
    ) -> None:
        if t.load is not None:
            loads.append(t.load)
            t.load = None
        computed_after = min(computed_after, t.request.num_tokens)
        full = min(computed_after // self.block_tokens, len(t.block_ids))
        if full <= t.stored_blocks:
            return
        self._keys_upto(t, full)
        lo, hi = t.stored_blocks, min(full, len(t.keys[0]))
        if hi > lo:
            keys = tuple(tuple(chain[lo:hi]) for chain in t.keys)
            saves.append(SaveSpec(t.request.request_id, t.salt, keys, tuple(t.block_ids[lo:hi])))
            t.stored_blocks = hi

    def load_failed(self, block_ids: set[int]) -> None:
        """Blocks a worker could not load (vLLM recomputes them): the store
        does not hold them after all, so they are saved again once computed."""
        for t in self._reqs.values():
            for i, block_id in enumerate(t.block_ids[: t.stored_blocks]):
                if block_id in block_ids:
                    t.stored_blocks = i
                    break

    # -- request_finished ------------------------------------------------------------------

    def finished(self, request: Any) -> EndTurn | None:
        """Forget ``request``; the turn to tell the sidecar about, if any."""
        t = self._reqs.pop(request.request_id, None)
        if t is None or t.stored_blocks == 0:
            return None
        keys = tuple(tuple(chain[: t.stored_blocks]) for chain in t.keys)
        return EndTurn(self._session_of(request), t.salt, keys, len(request.all_token_ids))

    def tracked(self) -> int:
        """Requests with state here (for tests: finished ones must leave none)."""
        return len(self._reqs)
