"""tierstore as vLLM's KV store: ``TierstoreConnector``, a ``KVConnectorBase_V1``.

Load it the way LMCache's and Mooncake's connectors plug in::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "TierstoreConnector",
        "kv_connector_module_path": "tierstore.engines.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"socket_path": "/run/tierstore/tierstore.sock"}}'

(settings: ``vllm.layout.ConnectorSettings``). vLLM builds one connector
in its scheduler process and one in each worker:

- **scheduler** (``vllm.plan.Planner``): ``get_num_new_matched_tokens``
  asks the sidecar (fast-path lookup; peers too with ``include_peers``) how
  much of the request's prefix it holds beyond vLLM's own prefix cache, and
  where: a prefix not all in DRAM is loaded in the background (``(n,
  True)``, vLLM's async load; ``async_loads``), and a lookup that asks
  peers or the bucket and has not answered within ``lookup_budget_s``
  answers None (vLLM asks again next step);
  ``update_state_after_alloc`` and ``build_connector_meta`` plan this
  step's loads and saves; ``update_connector_output`` learns which
  background loads ended and which blocks failed; ``request_finished`` ends the turn
  (``StoreClient.end_turn``: the sidecar pushes a long turn's blocks to the
  session's spill host). The session is ``kv_transfer_params["session"]``,
  else vLLM's ``session_id``, else the request id.
- **worker** (``vllm.worker.ConnectorWorker``): ``start_load_kv`` pins the
  planned blocks in the sidecar's arena and copies them into vLLM's pages,
  one copy per block and layer (on CUDA on a side stream, waited for per
  layer in ``wait_for_layer_load``), or hands a background load to the
  loader thread (``vllm.loader``), whose ended loads ``get_finished``
  reports (a load not done within ``async_load_timeout_s`` is reported
  with its blocks failed); ``bind_connector_metadata`` reserves
  slots for the step's new full blocks, ``save_kv_layer`` copies each layer
  out as soon as its attention has written it, ``wait_for_save`` commits
  (one control call; the bytes are in place by then, so vLLM may reuse the
  pages at once and no block free is delayed). Blocks that could not be
  loaded (evicted, failed verification, sidecar gone) are reported by
  ``get_block_ids_with_load_errors`` and vLLM recomputes them: a lost block
  costs a prefill, never a wrong token.

Hybrid models: the connector declares ``SupportsHMA``, so vLLM keeps its
hybrid KV cache manager on and hands block ids per KV cache group
(``request_finished_all_groups``); full-attention layers load every stored
block, sliding-window layers only their window's, and with more than one
group a failed load fails its request (``get_transfer_results``), which
vLLM recomputes (``vllm.plan``, ``vllm.layout.kv_groups``).

Both sides count what they did into vLLM's connector stats, which ``vllm
serve`` shows in its ``/metrics`` as ``vllm:tierstore_*`` (``vllm.metrics``).

Keys are tierstore's chained blake3 keys over the token ids (prompt, then
generated tokens), with a KVLayout per tensor-parallel rank from vLLM's
config (``vllm.layout``), independent of vLLM's own block hashing. Engines
and requests whose KV cannot be restored by prefix are not served from the
store, with one log line per reason and a counter (``refusals``).

The engine side only: imports tierstore.client, keys, errors, memory and
tiers, never the sidecar's store. Runs in vLLM's processes, on the threads
vLLM calls the connector from.
"""

from __future__ import annotations

import json
import logging
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from tierstore.engines.vllm.layout import (
    ConnectorSettings,
    engine_layouts,
    engine_refusal,
    kv_groups,
    request_refusal,
    request_salt,
)
from tierstore.engines.vllm.link import BudgetedCalls, StoreLink
from tierstore.engines.vllm.loader import IDLE_POLL_WAIT_S
from tierstore.engines.vllm.metrics import StatsWindow, TierstoreKVStats, TierstorePromMetrics
from tierstore.engines.vllm.pages import PageLayoutError
from tierstore.engines.vllm.plan import EndTurn, LoadSpec, Planner, SaveSpec
from tierstore.engines.vllm.worker import ConnectorWorker
from tierstore.errors import TierstoreError
from tierstore.keys import BlockKey, KVLayout
from tierstore.tiers import TierName

if TYPE_CHECKING:
    import torch

log = logging.getLogger("tierstore.engines.vllm")

__all__ = ["TierstoreConnector", "TierstoreConnectorMetadata"]


@dataclass
class TierstoreConnectorMetadata(KVConnectorMetadata):
    """One step's plan, from the scheduler to the workers."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    idle: bool = False  # the step computes nothing: the engine only waits on loads


def computes_nothing(scheduler_output: Any) -> bool:
    """The step schedules no token: the engine only waits on loads."""
    return getattr(scheduler_output, "total_num_scheduled_tokens", 1) == 0


def poll_wait_s(meta: Any) -> float:
    """How long the worker may wait for a background load to end before
    answering this step's ``get_finished``: only in a step that computes
    nothing (``vllm.loader.IDLE_POLL_WAIT_S``), never while tokens wait."""
    idle = isinstance(meta, TierstoreConnectorMetadata) and meta.idle
    return IDLE_POLL_WAIT_S if idle else 0.0


def _kv_events_on(vllm_config: Any) -> bool:
    cfg = getattr(vllm_config, "kv_events_config", None)
    return bool(cfg is not None and getattr(cfg, "enable_kv_cache_events", False))


def _removal_watcher(settings: ConnectorSettings) -> Any:
    if not settings.removed_events_peer:
        log.info("tierstore connector: KV events without BlockRemoved (no removed_events_peer)")
        return None
    from pathlib import Path

    from tierstore.config.peer import PeerConfig
    from tierstore.engines.vllm.removals import RemovalWatcher, StoredBlocks
    from tierstore.peer.client import PeerClient

    token = Path(settings.removed_events_token_file).read_text().strip()
    client = PeerClient(settings.removed_events_peer, PeerConfig(), token)
    return RemovalWatcher(
        StoredBlocks(settings.removed_events_max_blocks),
        client.watch_blocks,
        settings.removed_events_stream_s,
    )


def session_of(request: Any) -> str:
    params = request.kv_transfer_params or {}
    return str(params.get("session") or getattr(request, "session_id", None) or request.request_id)


class TierstoreConnector(KVConnectorBase_V1, SupportsHMA):
    """See the module docstring. ``SupportsHMA``: vLLM keeps its hybrid KV
    cache manager on (sliding-window layers keep only their window's
    blocks); ``vllm.plan`` says how loads and saves follow its groups."""

    def __init__(
        self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.settings = ConnectorSettings.from_extra(
            self._kv_transfer_config.kv_connector_extra_config
        )
        self.refusals: Counter[str] = Counter()
        self.window = StatsWindow()  # vLLM's stats: see vllm.metrics
        self._events: Any = None  # vllm.events.TierstoreKVEvents not yet taken
        self._removals: Any = None  # vllm.removals.RemovalWatcher (BlockRemoved)
        policy = getattr(self._kv_transfer_config, "kv_load_failure_policy", "recompute")
        if policy != "recompute" and role == KVConnectorRole.SCHEDULER:
            log.warning(
                "tierstore connector: kv_load_failure_policy is %r: a block the store "
                'loses fails its request; set "kv_load_failure_policy": "recompute" '
                "to prefill it instead",
                policy,
            )
        self.worker: ConnectorWorker | None = None
        self.disabled = engine_refusal(vllm_config, kv_cache_config)
        if self.disabled is not None:
            self._refuse(f"engine: {self.disabled}", "the KV store is off for this engine")
            return
        self.layouts = engine_layouts(vllm_config, kv_cache_config, self.settings)
        self.groups = kv_groups(kv_cache_config)
        name = "vllm-scheduler" if role == KVConnectorRole.SCHEDULER else "vllm-worker"
        self.link = StoreLink(self.settings, name, self.layouts)
        if role == KVConnectorRole.SCHEDULER:
            self.link.client()  # registers the layouts now (a sidecar that is down: later)
        self.planner = Planner(
            self.layouts,
            self._lookup,
            lambda r: request_salt(self.settings, r),
            session_of,
            async_loads=self.settings.async_loads,
            count=self.window.count,
            events=_kv_events_on(vllm_config),
            num_groups=self.groups.num_groups,
            windowed=self.groups.windowed,
        )
        # Lookups that ask peers or the bucket run off the scheduler's thread.
        self._slow_lookups: BudgetedCalls[tuple[TierName, ...]] | None = None
        if role == KVConnectorRole.SCHEDULER and self.settings.include_peers:
            self._slow_lookups = BudgetedCalls(
                self.settings.lookup_budget_s, self.settings.call_timeout_s
            )
        self._stats_written: dict[str, Any] | None = None
        if role == KVConnectorRole.SCHEDULER and self.planner.events:
            self._removals = _removal_watcher(self.settings)
        # Connect now, not in the first request's time to first token (attach,
        # arena mapping); a sidecar that is not there only starts the retry clock.
        self.link.client()
        if role == KVConnectorRole.WORKER:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self.worker = ConnectorWorker(
                self.link, self.settings, self.planner.layouts_for,
                get_tensor_model_parallel_rank(), self.window,
            )  # fmt: skip

    def _refuse(self, reason: str, what: str) -> None:
        if not self.refusals[reason]:
            log.warning("tierstore connector: %s (%s); further ones only counted", what, reason)
        self.refusals[reason] += 1
        self.window.count("refusals", 1, reason)

    # ==============================  scheduler side  ==============================

    def _lookup(self, layout: KVLayout, keys: list[BlockKey]) -> Sequence[TierName] | None:
        client = self.link.client()
        if client is None:
            return ()
        try:
            if self._slow_lookups is None:
                return client.lookup(layout, keys).tiers
            # Keys chain: the last one and the count name the prefix asked about. The
            # client is part of the key: a call queued on a client the link closed
            # since (a failure) is never collected, a new one goes to the new client.
            ask = (id(client), layout.fingerprint, keys[-1], len(keys))
            return self._slow_lookups.ask(
                ask, lambda: client.lookup(layout, keys, include_peers=True).tiers
            )
        except TierstoreError as e:
            self.link.failed(e)
            return ()

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if self.disabled is not None:
            return 0, False
        reason = request_refusal(request)
        if reason is not None:
            self._refuse(f"request: {reason}", f"request {request.request_id} not served")
            return 0, False
        return self.planner.match(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if self.disabled is None:
            self.planner.after_alloc(request, blocks.get_block_ids(), num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        if self.disabled is not None:
            return TierstoreConnectorMetadata()
        loads, saves = self.planner.build(scheduler_output)
        if self._slow_lookups is not None:
            self._slow_lookups.new_step()
        self._write_stats()
        return TierstoreConnectorMetadata(loads, saves, computes_nothing(scheduler_output))

    def update_connector_output(self, connector_output: Any) -> None:
        if self.disabled is not None:
            return
        if connector_output.kv_cache_events is not None:
            from tierstore.engines.vllm.events import merge

            self._events = merge(self._events, connector_output.kv_cache_events)
        if connector_output.invalid_block_ids:
            self.planner.load_failed(set(connector_output.invalid_block_ids))
        if getattr(connector_output, "failed_recving", None):
            self.planner.requests_failed(set(connector_output.failed_recving))
        if connector_output.finished_recving:
            self.planner.loads_done(set(connector_output.finished_recving))
        self._write_stats()

    def stats(self) -> dict[str, Any]:
        """The scheduler side's counters (``stats_path`` holds the latest)."""
        return {
            "plan": asdict(self.planner.counters),
            "link": asdict(self.link.counters),
            "refusals": dict(self.refusals),
            **({"removals": self._removals.stats()} if self._removals is not None else {}),
        }

    # vLLM's stats: each side's window since vLLM last took it; vLLM sums the
    # workers' and the scheduler's and feeds them to TierstorePromMetrics.
    def get_kv_connector_stats(self) -> TierstoreKVStats | None:
        return self.window.take()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> TierstoreKVStats:
        return TierstoreKVStats(data=data) if data else TierstoreKVStats()

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> TierstorePromMetrics:
        return TierstorePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # vLLM's KV events (vllm.events): the workers' BlockStored of what the
    # saves left in tierstore, published by the scheduler with vLLM's own.
    def get_kv_connector_kv_cache_events(self) -> Any:
        if self.worker is None or not self.planner.events:
            return None
        stored = self.worker.take_stored()
        if not stored:
            return None
        from tierstore.engines.vllm.events import (
            TierstoreKVEvents,
            stored_blocks,
            stored_events,
        )

        events = TierstoreKVEvents(num_workers=1)
        events.add_events(stored_events(stored, self.layouts[0].block_tokens))
        if self.settings.removed_events_peer:  # the scheduler's watcher wants the keys
            events.blocks = stored_blocks(stored)
        return events

    # The scheduler's own: BlockRemoved for the blocks of those BlockStored
    # that left tierstore since (vllm.removals, with removed_events_peer).
    def take_events(self) -> Any:
        from tierstore.engines.vllm.events import taken

        events, self._events = self._events, None
        return taken(events, self._removals.blocks if self._removals is not None else None)

    def _write_stats(self) -> None:
        """Rewrite ``stats_path`` when a counter changed (at most twice a step)."""
        if not self.settings.stats_path:
            return
        stats = self.stats()
        if stats == self._stats_written:
            return
        tmp = f"{self.settings.stats_path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(stats, f)
        os.replace(tmp, self.settings.stats_path)
        self._stats_written = stats

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        if self.disabled is not None:
            return False, None
        turn = self.planner.finished(request)
        if turn is not None and self.settings.end_turn:
            self._end_turn(turn)
        return False, None  # saves are in the arena by the end of each step

    def _end_turn(self, turn: EndTurn) -> None:
        client = self.link.client()
        if client is None:
            return
        try:
            for layout, keys in zip(self.planner.layouts_for(turn.salt), turn.keys):
                client.end_turn(turn.session, layout, list(keys), turn.num_tokens)
        except TierstoreError as e:
            self.link.failed(e)

    # ==============================  worker side  ==============================

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self.worker is None:
            return
        layer_bytes = self.layouts[0].block_bytes // self.layouts[0].num_layers
        try:
            self.worker.register(
                kv_caches, self.groups.layer_names, layer_bytes, self.groups.group_of
            )
        except PageLayoutError as e:
            self._refuse(f"pages: {e}", "vLLM's KV pages cannot be copied; loads will fail")

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self.worker is not None and isinstance(connector_metadata, TierstoreConnectorMetadata):
            self.worker.reserve(connector_metadata.saves)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if self.worker is not None and isinstance(meta, TierstoreConnectorMetadata):
            self.worker.load(meta.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self.worker is not None:
            self.worker.layer_loaded(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        if self.worker is not None:
            self.worker.save_layer(layer_name)

    def wait_for_save(self) -> None:
        if self.worker is not None:
            self.worker.end_step()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Requests whose background loads ended (their failed blocks come
        from ``get_block_ids_with_load_errors`` in the same step; with more
        than one KV cache group, use ``get_transfer_results``)."""
        return None, self.get_transfer_results(finished_req_ids).finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """``get_finished``'s requests, and those of them whose load failed
        as a whole (more than one KV cache group: vLLM recomputes them). In
        a step that computed nothing, waits a moment for a load to end
        (``vllm.loader.IDLE_POLL_WAIT_S``)."""
        if self.worker is None:
            return KVConnectorTransferResults()
        finished, failed = self.worker.finished_loads(poll_wait_s(self._connector_metadata))
        return KVConnectorTransferResults(finished_recving=finished, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_load_errors() if self.worker is not None else set()

    def shutdown(self) -> None:
        if self.disabled is None:
            if self.worker is not None:
                self.worker.close()
                log.info(
                    "tierstore connector worker: %s %s",
                    self.worker.counters,
                    self.worker.loader_counters,
                )
            if self._slow_lookups is not None:
                self._slow_lookups.close()
            if self._removals is not None:
                self._removals.close()
            self.link.close()
