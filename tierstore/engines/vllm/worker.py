"""Worker side of the vLLM connector: copies between vLLM's pages and the arena.

Provides ``ConnectorWorker``: one engine step's loads (``load``: acquire the
planned blocks, copy them into their pages, layer by layer) and saves
(``reserve`` before the forward, ``save_layer`` after each layer's attention
wrote its pages, ``end_step`` commits the blocks whose layers were all
copied, or gives them back). Loads planned for the background go to a
``vllm.loader.BackgroundLoader``, whose finished requests ``finished_loads``
reports (vLLM's ``get_finished``). Blocks that could not be loaded are
collected for ``take_load_errors`` (vLLM recomputes them). The copies
themselves are a ``PageMover``'s (``vllm.pages``; on a CUDA device the one
in ``vllm.cuda``, imported only there).

A block in the arena is the layers' pages of that block one after another
(``vllm.layout``). No bytes cross the control socket: the copies go
straight between vLLM's pages and the sidecar's shared arena. With vLLM's
hybrid KV cache manager each layer's pages are those of its KV cache group
(``group_of``), and a load skips a group's null blocks (a sliding window's
blocks before the window hold nothing: ``vllm.plan``).

Runs in vLLM's worker process, on the thread that runs the model (the
background loader's copies on its own thread, into pages no step uses).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tierstore.client import ReserveStatus, StoreClient
from tierstore.engines.vllm.layout import ConnectorSettings
from tierstore.engines.vllm.link import StoreLink
from tierstore.engines.vllm.pages import CpuPageMover, PagedKV, PageLayoutError, PageMover
from tierstore.engines.vllm.plan import NULL_BLOCK_ID, GroupIds, LoadSpec, SaveSpec
from tierstore.errors import TierstoreError
from tierstore.keys import BlockKey, KVLayout
from tierstore.memory.memcopy import copy_thread_count

log = logging.getLogger("tierstore.engines.vllm")


@dataclass(slots=True)
class WorkerCounters:
    loaded_blocks: int = 0
    load_failed_blocks: int = 0
    saved_blocks: int = 0
    save_exists_blocks: int = 0
    save_full_blocks: int = 0
    save_aborted_blocks: int = 0


@dataclass(slots=True)
class _Reservation:
    layout: KVLayout
    keys: list[BlockKey]
    pairs: list[list[tuple[int, int]]]  # [group]: (arena offset of the block, vLLM block id)
    spec: SaveSpec | None = None
    positions: list[int] = field(default_factory=list)  # of keys, in spec
    held: list[int] = field(default_factory=list)  # positions the store already held


@dataclass(slots=True)
class _Step:
    saves: list[_Reservation] = field(default_factory=list)
    layers_saved: set[int] = field(default_factory=set)
    pins: list[Any] = field(default_factory=list)  # Pinned, released at end_step
    save_s: float = 0.0  # the saves' own time so far (reserve, copies)


class ConnectorWorker:
    """See the module docstring. Not thread-safe: vLLM calls it from one thread."""

    def __init__(
        self,
        link: StoreLink,
        settings: ConnectorSettings,
        layouts_for: Any,  # Callable[[str], tuple[KVLayout, ...]]
        tp_rank: int,
        window: Any = None,  # vllm.metrics.StatsWindow: vLLM's stats
    ) -> None:
        self.link = link
        self.window = window
        self.settings = settings
        self.layouts_for = layouts_for
        self.tp_rank = tp_rank
        self.counters = WorkerCounters()
        self.paged: PagedKV | None = None
        self.group_of: list[int] = []  # each layer's KV cache group
        self._mover: PageMover | None = None
        self._mover_arena: Any = None
        self._step = _Step()
        self._load_errors: set[int] = set()
        # Saves whose blocks the store now holds, for KV events: (spec, positions in it).
        self._stored: list[tuple[SaveSpec, list[int]]] = []
        self._loader: Any = None  # vllm.loader.BackgroundLoader, made at the first one
        self._loader_mover: tuple[Any, PageMover] | None = None  # (its arena, its mover)

    def register(
        self,
        kv_caches: dict[str, torch.Tensor],
        layer_names: Sequence[str],
        layer_bytes: int,
        group_of: Sequence[int] = (),
    ) -> None:
        """Map vLLM's KV tensors (raises PageLayoutError if they are not pages)
        and, with background loads on (always with more than one group),
        start their loader."""
        self.paged = PagedKV(kv_caches, layer_names, layer_bytes)
        self.group_of = list(group_of) if group_of else [0] * len(layer_names)
        if self.settings.async_loads or max(self.group_of) > 0:
            self._background_loader()

    def _new_mover(self, arena: torch.Tensor) -> PageMover:
        assert self.paged is not None
        if self.paged.device.type == "cuda":
            from tierstore.engines.vllm.cuda import CudaPageMover

            return CudaPageMover(self.paged, arena)
        # Resolved on the thread that copies (the model's or the loader's):
        # vLLM-CPU binds the model's thread to its cores, and a thread's
        # helpers run where it may.
        threads = copy_thread_count(self.settings.copy_threads)
        log.info(
            "TierstoreConnector: CPU page copies on %d thread(s) (copy_threads=%d; "
            "thread %s may run on %d cores)", threads, self.settings.copy_threads,
            threading.current_thread().name, len(os.sched_getaffinity(0)),
        )  # fmt: skip
        return CpuPageMover(self.paged, arena, threads)

    def _client_and_mover(self) -> tuple[StoreClient, PageMover] | None:
        client = self.link.client()
        if client is None or self.paged is None:
            return None
        if self._mover is None or self._mover_arena is not client.arena_tensor:
            self._mover = self._new_mover(client.arena_tensor)
            self._mover_arena = client.arena_tensor
        return client, self._mover

    # -- before the forward ----------------------------------------------------------------

    def reserve(self, saves: Sequence[SaveSpec]) -> None:
        """Reserve arena slots for this step's saves (blocks the store lacks)."""
        self._step = _Step()
        if not saves:
            return
        cm = self._client_and_mover()
        if cm is None:
            return
        client, _ = cm
        t0 = time.perf_counter()
        try:
            for spec in saves:
                layout = self.layouts_for(spec.salt)[self.tp_rank]
                keys = list(spec.keys[self.tp_rank])
                for lo in range(0, len(keys), client.max_batch_keys):
                    got = client.reserve(layout, keys[lo : lo + client.max_batch_keys])
                    res = _Reservation(layout, [], [[] for _ in spec.block_ids],
                                       spec if spec.block_hashes else None)  # fmt: skip
                    for j, (status, offset) in enumerate(zip(got.statuses, got.offsets)):
                        if status == ReserveStatus.OK:
                            res.keys.append(got.keys[j])
                            for pairs, ids in zip(res.pairs, spec.block_ids):
                                pairs.append((offset, ids[lo + j]))
                            res.positions.append(lo + j)
                        elif status == ReserveStatus.EXISTS:
                            self.counters.save_exists_blocks += 1
                            res.held.append(lo + j)
                        else:
                            self.counters.save_full_blocks += 1
                    if res.keys:
                        self._step.saves.append(res)
                    elif res.spec is not None and res.held:
                        self._stored.append((res.spec, res.held))
        except TierstoreError as e:
            self._step.saves = []  # the sidecar drops a dead client's reservations
            self.link.failed(e)
        self._step.save_s += time.perf_counter() - t0

    def load(self, loads: Sequence[LoadSpec]) -> None:
        """Pin each planned prefix and copy it into vLLM's pages, layer by
        layer (a background one: hand it to the loader). What is not pinned
        (gone, failed verification, sidecar down) goes to the load errors."""
        for spec in loads:
            if spec.background:
                self._background_loader().submit(spec)
                continue
            got = 0
            t0 = time.perf_counter()
            cm = self._client_and_mover()
            if cm is not None:
                client, mover = cm
                try:
                    got = self._load_one(client, mover, spec)
                except TierstoreError as e:
                    self.link.failed(e)
                self._metric_load(spec, got, time.perf_counter() - t0)
            self.counters.loaded_blocks += got
            self.counters.load_failed_blocks += len(spec.block_ids[0]) - got
            self._load_errors.update(spec.block_ids[0][got:])  # one group: see register

    def _metric_load(self, spec: LoadSpec, got: int, seconds: float) -> None:
        if self.window is not None:
            tokens = self.layouts_for(spec.salt)[self.tp_rank].block_tokens
            self.window.count("loaded_tokens", got * tokens)
            self.window.time("load_seconds", seconds)

    def _load_one(self, client: StoreClient, mover: PageMover, spec: LoadSpec) -> int:
        assert self.paged is not None
        layout = self.layouts_for(spec.salt)[self.tp_rank]
        keys = list(spec.keys[self.tp_rank])
        got = 0
        while got < len(keys):
            chunk = keys[got : got + client.max_batch_keys]
            pinned = client.acquire(
                layout,
                chunk,
                include_peers=self.settings.include_peers,
                deadline_s=self.settings.load_deadline_s,
            )
            self._step.pins.append(pinned)
            end = got + len(pinned.offsets)
            self._to_pages(mover, pinned.offsets, tuple(g[got:end] for g in spec.block_ids))
            got = end
            if len(pinned.offsets) < len(chunk):
                break
        return got

    def _to_pages(self, mover: PageMover, offsets: Sequence[int], ids: GroupIds) -> None:
        """Every layer's part of the blocks at ``offsets`` into its group's
        blocks ``ids[group]`` (a null block is skipped)."""
        assert self.paged is not None
        pairs = [[(o, b) for o, b in zip(offsets, g) if b != NULL_BLOCK_ID] for g in ids]
        for layer, group in enumerate(self.group_of):
            base = layer * self.paged.layer_bytes
            mover.to_pages(layer, [(o + base, b) for o, b in pairs[group]])

    def _background_loader(self) -> Any:
        if self._loader is None:
            from tierstore.engines.vllm.loader import BackgroundLoader

            self._loader = BackgroundLoader(
                self.settings, self.layouts_for, self.tp_rank, self._copy_in_background,
                on_ended=self._metric_load,
            )  # fmt: skip
        return self._loader

    def _copy_in_background(
        self, client: StoreClient, layout: KVLayout, offsets: list[int], ids: GroupIds
    ) -> None:
        """The loader thread's copies: every layer of the pinned blocks into
        their pages, done when it returns (its own mover: a CUDA one has its
        own stream and events)."""
        if self.paged is None:
            raise PageLayoutError("vLLM's KV caches were not registered")
        if self._loader_mover is None or self._loader_mover[0] is not client.arena_tensor:
            self._loader_mover = (client.arena_tensor, self._new_mover(client.arena_tensor))
        mover = self._loader_mover[1]
        self._to_pages(mover, offsets, ids)
        mover.sync()

    def finished_loads(self, wait_s: float = 0.0) -> tuple[set[str], set[str]]:
        """Requests whose background loads ended since the last call, and
        those of them that failed. With one group their failed blocks join
        the load errors (reported in the same step, and vLLM recomputes only
        them) and no request is failed; with more, vLLM only takes the
        failed requests (``failed_recving``). ``wait_s``: see
        ``BackgroundLoader.poll``."""
        if self._loader is None:
            return set(), set()
        finished, failed_blocks, failed_reqs = self._loader.poll(wait_s)
        if max(self.group_of, default=0) > 0:
            return finished, failed_reqs
        self._load_errors.update(failed_blocks)
        return finished, set()

    @property
    def loader_counters(self) -> Any:
        return self._loader.counters if self._loader is not None else None

    def close(self) -> None:
        if self._loader is not None:
            self._loader.close()

    def layer_loaded(self, layer_name: str) -> None:
        if self._mover is not None and self.paged is not None:
            self._mover.layer_ready(self.paged.layer_index[layer_name])

    # -- during and after the forward ------------------------------------------------------

    def save_layer(self, layer_name: str) -> None:
        """Copy this layer's part of every reserved block out of its page
        (called after the layer's attention wrote its KV)."""
        if not self._step.saves or self._mover is None or self.paged is None:
            return
        layer = self.paged.layer_index.get(layer_name)
        if layer is None or layer in self._step.layers_saved:
            return
        t0 = time.perf_counter()
        base = layer * self.paged.layer_bytes
        group = self.group_of[layer]
        for res in self._step.saves:
            self._mover.from_pages(layer, [(o + base, b) for o, b in res.pairs[group]])
        self._step.layers_saved.add(layer)
        self._step.save_s += time.perf_counter() - t0

    def end_step(self) -> None:
        """Commit the blocks whose every layer was copied (else give their
        slots back) and release this step's pins."""
        step, self._step = self._step, _Step()
        if not step.saves and not step.pins:
            return
        client = self.link.client()
        t0 = time.perf_counter()
        saved = 0
        try:
            if self._mover is not None:
                self._mover.sync()
            complete = self.paged is not None and len(step.layers_saved) == len(self.paged.pages)
            for res in step.saves:
                if client is None:
                    break
                if complete:
                    done = client.commit(res.layout, res.keys)
                    n = sum(done)
                    self.counters.saved_blocks += n
                    saved += n * res.layout.block_tokens
                    if res.spec is not None:
                        held = [p for p, ok in zip(res.positions, done) if ok]
                        self._stored.append((res.spec, sorted(held + res.held)))
                else:
                    self.counters.save_aborted_blocks += client.abort(res.layout, res.keys)
            for pinned in step.pins:
                pinned.release()
        except TierstoreError as e:
            self.link.failed(e)
        if self.window is not None and step.saves:
            self.window.count("saved_tokens", saved)
            self.window.time("save_seconds", step.save_s + time.perf_counter() - t0)

    def take_stored(self) -> list[tuple[SaveSpec, list[int]]]:
        """Saves committed (or already held) since the last call, with the
        positions of their blocks the store holds (vLLM's KV events)."""
        stored, self._stored = self._stored, []
        return stored

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors
