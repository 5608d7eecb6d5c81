"""StoreClient: the engine's handle on its host's sidecar.

Control calls go over the sidecar's Unix socket, batched: one call per
batch of keys, never one per block. Lookups and the hot calls (reserve,
commit, abort, acquire, release) take the sidecar's fast path, a plain Unix
socket beside the gRPC one (``fast_path=False``: everything over gRPC); the
rest, and everything when the fast path is missing, go over gRPC. Block
bytes never cross the socket: the client maps the sidecar's shared arena
and copies between it and device memory (with CUDA the arena is registered
as pinned memory and copies run on a side stream). An optional HBM tier
(``hbm_bytes``) keeps recently stored and loaded blocks in a device pool
and writes its LRU victims down to the sidecar; a background thread reports
the pool's counters to the sidecar
every ``tier_report_s`` (``report_tiers``), so that ``tierstore stat`` shows
the host's HBM tier too.

Operations: ``register``, ``store``, ``load``, ``lookup``, ``acquire`` /
``release`` (zero-copy views into the arena), ``reserve`` / ``commit`` /
``abort`` (fill arena slots in place), ``prefetch``, ``flush``,
``stat``, ``report_load``, ``report_tiers``, ``close``.

Collaborators, a module each: ``control`` (channel, attach, calls),
``arena_writer`` (reserve, copy, commit), ``arena_reader`` (lookups, pins,
loads: HBM hits and runs from the arena), ``hbm_writer`` (the HBM pool's
fills, evictions, write-downs), ``releases``, ``prefetch``, ``tier_report``.

Runs in the engine process. A client may be used from several threads; the
HBM pool's writes are serialised by one lock (``HbmWriter``'s).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import torch

from tierstore.client.arena_reader import ArenaReader
from tierstore.client.arena_writer import ArenaWriter
from tierstore.client.control import ControlChannel
from tierstore.client.copier import ArenaCopier, as_block_rows
from tierstore.client.fastpath import FastCalls, FastLookupClient
from tierstore.client.hbm import HbmTier
from tierstore.client.hbm_writer import HbmWriter
from tierstore.client.prefetch import Prefetcher
from tierstore.client.releases import PendingReleases
from tierstore.client.results import (
    ClientLookup,
    LoadResult,
    Pinned,
    PrefetchResult,
    Reserved,
)
from tierstore.client.tier_report import TierReporter
from tierstore.config import load_config
from tierstore.errors import BlockSizeError
from tierstore.fastwire import fast_socket_path
from tierstore.keys import BlockKey, KVLayout, check_keys
from tierstore.memory.arena import Arena
from tierstore.v1 import common_pb2, local_pb2


class StoreClient:
    """See the module docstring. Use as a context manager or call ``close``."""

    def __init__(
        self,
        socket_path: str | None = None,
        *,
        name: str = "",
        hbm_bytes: int = 0,
        device: Any = "cpu",
        connect_timeout_s: float = 10.0,
        call_timeout_s: float = 60.0,
        tier_report_s: float = 2.0,
        hbm_evict_batch_blocks: int = 64,
        fast_path: bool = True,
    ) -> None:
        if not tier_report_s > 0:
            raise ValueError(f"tier_report_s must be > 0, got {tier_report_s}")
        if hbm_evict_batch_blocks < 1:
            raise ValueError(f"hbm_evict_batch_blocks must be >= 1, got {hbm_evict_batch_blocks}")
        self.socket_path = socket_path or load_config().server.socket_path
        self.device = torch.device(device)
        self._releases = PendingReleases()  # in flight: every control call waits for them
        self._control = ControlChannel(
            self.socket_path,
            name=name,
            connect_timeout_s=connect_timeout_s,
            call_timeout_s=call_timeout_s,
            before_call=self._releases.settle,
        )
        self._stub = self._control.stub
        self._channel = self._control.channel
        # A start that fails half way (no room to map the arena, pinning
        # refused, CUDA out of memory, a thread that cannot start) undoes
        # what it did, in reverse: stop threads, unpin, unmap, detach (the
        # sidecar would otherwise keep this client).
        with contextlib.ExitStack() as undo:
            undo.callback(self._control.close)
            self._start(
                undo, hbm_bytes, call_timeout_s, tier_report_s, hbm_evict_batch_blocks, fast_path
            )
            undo.pop_all()

    def _start(
        self,
        undo: contextlib.ExitStack,
        hbm_bytes: int,
        call_timeout_s: float,
        tier_report_s: float,
        hbm_evict_batch_blocks: int,
        fast_path: bool,
    ) -> None:
        """Everything after the attach; each step registers its undo."""
        self.arena = Arena.attach(self._control.arena_path, self._control.arena_bytes)
        undo.callback(self.arena.close)
        self.arena_tensor = torch.frombuffer(self.arena.buf, dtype=torch.uint8)
        undo.callback(delattr, self, "arena_tensor")
        self._copier = ArenaCopier(self.arena_tensor, self.device)
        undo.callback(self._copier.close)
        self.hbm = HbmTier(hbm_bytes, self.device) if hbm_bytes > 0 else None
        if self.hbm is not None:
            undo.callback(self.hbm.close)
        fast: FastLookupClient | None = None
        with contextlib.suppress(OSError):  # an older sidecar has none: gRPC serves lookups
            if fast_path:
                fast = FastLookupClient(fast_socket_path(self.socket_path), call_timeout_s)
        if fast is not None:  # the hot calls too (``ControlChannel.call``)
            self._control.fast_calls = FastCalls(fast_socket_path(self.socket_path), call_timeout_s)
            undo.callback(self._control.fast_calls.close)
        self._reader = ArenaReader(
            self._control, self.arena, self.arena_tensor, self._copier, self._releases, fast
        )
        undo.callback(self._reader.close)
        self._arena_writer = ArenaWriter(self._control, self.arena, self._copier)
        self._hbm_writer: HbmWriter | None = None
        if self.hbm is not None:
            reader = self._reader
            writer = HbmWriter(
                self.hbm,
                self._copier,
                self._control.layouts,
                write_down=self._arena_writer.write,
                # A prefetch copies the arena's blocks into HBM only.
                load_into=lambda layout, keys: len(
                    reader.load_run(layout, keys, None, writer.promote)
                ),
                evict_batch_blocks=hbm_evict_batch_blocks,
            )
            self._hbm_writer = writer
        self._prefetcher = Prefetcher(
            self._control, self._hbm_writer.pull if self._hbm_writer is not None else None
        )
        undo.callback(self._prefetcher.close)
        self._control.watch()
        # The HBM tier lives here: the sidecar shows it in `tierstore stat`
        # from these reports (every tier_report_s, and once at the start).
        self._stop_reports = threading.Event()
        self._reporter: TierReporter | None = None
        undo.callback(self._stop_background)
        if self.hbm is not None:
            self._reporter = TierReporter(self.hbm, self._control, self._stop_reports)
            self._reporter.start(tier_report_s)
        # Attach maps the arena without populating it (fast at any size); this
        # thread fills this process's page tables in the background (madvise,
        # no GIL), so that steady-state copies do not pay a page fault per
        # 4 KiB on each unit's first use (measured: store at 0.27 of memcpy
        # instead of 0.5 while every slot was fresh to the client).
        self._populator = threading.Thread(
            target=self.arena.populate,
            kwargs={"stop": self._stop_reports.is_set},
            name="tierstore-arena-tables",
            daemon=True,
        )
        self._populator.start()

    def _stop_background(self) -> None:
        """Stop the tier reporter and the page-table populator (they watch
        ``_stop_reports``) and wait for the reporter."""
        self._stop_reports.set()
        if self._reporter is not None:
            self._reporter.join(self.call_timeout_s)

    # -- plumbing -------------------------------------------------------------------

    @property
    def client_id(self) -> int:
        return self._control.client_id

    @property
    def max_batch_keys(self) -> int:
        """The most keys the sidecar takes in one call (its hello says)."""
        return self._control.max_batch_keys

    @property
    def server_version(self) -> str:
        return self._control.server_version

    @property
    def call_timeout_s(self) -> float:
        return self._control.call_timeout_s

    @property
    def connected(self) -> bool:
        """False once the Attach stream has ended (the sidecar is gone)."""
        return self._control.connected

    def report_tiers(self) -> None:
        """Send this client's HBM tier's counters to the sidecar now (a
        background thread does it every ``tier_report_s``)."""
        if self._reporter is not None:
            self._reporter.report()

    @property
    def release_errors(self) -> int:
        """Releases that failed (their pins stay until this client detaches)."""
        return self._releases.errors

    def _req(
        self,
        layout: KVLayout,
        keys: Sequence[BlockKey],
        include_peers: bool = False,
        deadline_s: float = 0.0,
    ) -> local_pb2.KeysRequest:
        return self._control.request(layout, keys, include_peers, deadline_s)

    def wait_arena_tables(self, timeout_s: float) -> bool:
        """Wait, at most ``timeout_s``, until this process's page tables of
        the whole arena are built (the background thread started at attach;
        copies into a unit not yet built fault its pages in). Returns
        whether they are. For benchmarks that time copies, not for hot paths."""
        self._populator.join(timeout_s)
        return not self._populator.is_alive()

    def register(self, layout: KVLayout) -> bytes:
        """Tell the sidecar about a layout (once per layout per client)."""
        return self._control.register(layout)

    # -- writes -----------------------------------------------------------------------

    def store(
        self,
        layout: KVLayout,
        keys: Sequence[BlockKey],
        blocks: Any,
        *,
        write_through: bool = False,
        session: str = "",
    ) -> list[bool]:
        """Store full blocks. With an HBM tier they go to the device pool (and
        to the sidecar only when evicted, or now with ``write_through``);
        without one, straight to the sidecar. Returns whether each is held.
        ``session``: the blocks belong to this session's running turn; the
        sidecar streams those it receives now to the session's spill host
        (blocks written down later, from HBM, wait for ``end_turn``)."""
        keys = check_keys(keys)
        rows = as_block_rows(layout, len(keys), blocks)
        self.register(layout)  # HBM victims are written down under their layout later
        if self._hbm_writer is None:
            return self._arena_writer.write(layout, keys, rows, session)
        self._copier.wait_engine()  # once: the rows were written before this call
        held = self._hbm_writer.put(layout, keys, rows, dirty=not write_through)
        if write_through:
            down = self._arena_writer.write(layout, keys, rows, session)
            held = [a or b for a, b in zip(held, down)]
        self._copier.sync()
        return held

    def reserve(self, layout: KVLayout, keys: Sequence[BlockKey]) -> Reserved:
        """Reserve arena slots for ``keys`` (at most ``max_batch_keys``) so a
        caller that writes blocks piecewise (an engine copying layer by layer
        out of its own pages) can fill them in place, then ``commit`` them (or
        ``abort``). Keys already held come back EXISTS: skip them."""
        return self._arena_writer.reserve(layout, check_keys(keys))

    def commit(self, layout: KVLayout, keys: Sequence[BlockKey]) -> list[bool]:
        """Make reserved (and written) blocks readable. Returns which were committed."""
        return self._arena_writer.commit(layout, check_keys(keys))

    def abort(self, layout: KVLayout, keys: Sequence[BlockKey]) -> int:
        """Give back reservations that will not be written. Returns how many."""
        return self._arena_writer.abort(layout, check_keys(keys))

    def flush(self) -> int:
        """Write every HBM-only block down to the sidecar. Returns how many."""
        return self._hbm_writer.flush() if self._hbm_writer is not None else 0

    # -- reads ------------------------------------------------------------------------

    def lookup(
        self, layout: KVLayout, keys: Sequence[BlockKey], *, include_peers: bool = False
    ) -> ClientLookup:
        """Longest prefix held anywhere: HBM here, the sidecar's tiers, and
        with ``include_peers`` the other sidecars of the group."""
        keys = check_keys(keys)
        in_hbm = self.hbm.contains(keys) if self.hbm is not None else [False] * len(keys)
        tiers = self._reader.prefix(layout, keys, in_hbm, include_peers)
        return ClientLookup(len(tiers), tuple(tiers))

    def acquire(
        self,
        layout: KVLayout,
        keys: Sequence[BlockKey],
        *,
        include_peers: bool = False,
        deadline_s: float = 0.0,
    ) -> Pinned:
        """Pin the longest available prefix in the arena (promoting from NVMe,
        and with ``include_peers`` fetching what a peer holds, within
        ``deadline_s``) and return zero-copy views of it. Release when done
        (on CUDA, from the thread whose current stream ran the copies)."""
        return self._reader.acquire(layout, check_keys(keys), include_peers, deadline_s, True)

    def load(
        self,
        layout: KVLayout,
        keys: Sequence[BlockKey],
        out: torch.Tensor | None = None,
        *,
        promote: bool = True,
        include_peers: bool = False,
        deadline_s: float = 0.0,
    ) -> LoadResult:
        """Load the longest available prefix into ``out`` (or a new tensor of
        shape (len(keys), block_bytes), uint8, on this client's device).
        With an HBM tier and ``promote``, loaded blocks are kept in HBM too.
        With ``include_peers``, blocks missing on this host are fetched from
        the peer that holds them (pull on switch), within ``deadline_s``."""
        keys = check_keys(keys)
        n = layout.block_bytes
        if out is None:
            out = self._copier.empty_rows(len(keys), n)
        elif not out.is_contiguous():
            # reshape would copy, and the blocks would land in the copy.
            raise BlockSizeError("out must be a contiguous tensor")
        elif out.numel() * out.element_size() < len(keys) * n:
            raise BlockSizeError(
                f"out holds {out.numel() * out.element_size()} bytes; "
                f"{len(keys)} blocks need {len(keys) * n}"
            )
        rows = out.reshape(-1).view(torch.uint8)[: len(keys) * n].view(len(keys), n)
        in_hbm = self.hbm.contains(keys) if self.hbm is not None else [False] * len(keys)
        tiers = self._reader.load(
            layout, keys, rows, in_hbm, self._hbm_writer, promote, include_peers, deadline_s
        )
        self._copier.sync()
        return LoadResult(len(tiers), tuple(tiers), out)

    def prefetch(
        self,
        layout: KVLayout,
        keys: Sequence[BlockKey],
        policy: str = "best_effort",
        timeout_s: float = 0.0,
    ) -> PrefetchResult | Future[PrefetchResult]:
        """Ask the sidecar to promote ``keys`` toward DRAM (and, with an HBM
        tier, bring them on into HBM).

        ``best_effort`` returns a Future at once: the sidecar only queues the
        work (outcome ``started``, or ``cancelled`` when its queue is full).
        Without an HBM tier the Future is already done; with one it is done
        once this client's background thread has brought the available
        prefix into HBM (``ready_blocks`` of them). ``wait`` and ``timeout``
        return when the sidecar is done or at the deadline (``timeout_s``, or
        the server's base + per-1k-tokens rule when 0), after bringing the
        ready blocks into HBM."""
        return self._prefetcher.prefetch(layout, keys, policy, timeout_s)

    def end_turn(
        self,
        session: str,
        layout: KVLayout,
        keys: Sequence[BlockKey],
        num_tokens: int,
        *,
        wait: bool = False,
        replica_target: str = "",
        durable: bool = False,
        durable_timeout_s: float = 0.0,
    ) -> local_pb2.EndTurnReply:
        """Tell the sidecar a turn of ``session`` ended with these full blocks
        (stored first: HBM-only blocks are written down). For a turn of at
        least min_tokens the sidecar pushes the blocks the session's spill
        host lacks (kv_share): ``replica_target`` (a peer's host:port, e.g.
        a router's ``spill_host``) or else the session's rendezvous spill
        host; ``wait`` returns after that push.

        A turn of at least ``remote_min_tokens`` is written through to the
        remote tier in the background: until the bucket has it (the
        sidecar's ``remote_turns_not_durable``), a crash of the host loses
        it. ``durable`` writes the turn through whatever its length and
        returns once the bucket acknowledged every block, or after
        ``durable_timeout_s`` (0, or more than the sidecar's
        ``remote_durable_timeout_s``: that setting), the call's deadline
        then being ``call_timeout_s`` past it: the reply's ``durable`` says
        which (``durable_blocks``, ``not_durable_reason``). It never raises
        for a turn that did not become durable."""
        if durable_timeout_s < 0:
            raise ValueError(f"durable_timeout_s must be >= 0, got {durable_timeout_s}")
        keys = check_keys(keys)
        self.flush()
        req = local_pb2.EndTurnRequest(
            client_id=self.client_id,
            layout_id=self.register(layout),
            session=session,
            keys=b"".join(keys),
            num_tokens=num_tokens,
            wait=wait,
            replica_target=replica_target,
            durable=durable,
            durable_timeout_s=durable_timeout_s,
        )
        extra_s = durable_timeout_s if durable else 0.0
        return self._control.call(self._stub.EndTurn, req, "end turn", extra_s)

    def report_load(
        self,
        busy_slots: int,
        slots: int,
        queue_len: int = 0,
        *,
        wait_s: float = 0.0,
        prefill_tokens_per_s: float = 0.0,
    ) -> common_pb2.HostLoad:
        """Report this engine's load (requests served now, how many it can
        serve at once, requests waiting; optionally its own estimate of the
        wait for a slot and its measured prefill speed). Routers read the
        host's sum with its lookups; a report counts for load_ttl_s, so an
        engine reports on every change and at least that often. Returns the
        host's load after this report."""
        req = local_pb2.ReportLoadRequest(
            client_id=self.client_id,
            busy_slots=busy_slots,
            slots=slots,
            queue_len=queue_len,
            wait_s=wait_s,
            prefill_tokens_per_s=prefill_tokens_per_s,
        )
        return self._control.call(self._stub.ReportLoad, req, "report load").host

    # -- inspection and shutdown ---------------------------------------------------------

    def stat(self) -> local_pb2.StatReply:
        return self._control.call(self._stub.Stat, local_pb2.StatRequest(), "stat")

    def close(self) -> None:
        """Detach (the sidecar releases anything still pinned), unmap the arena."""
        if getattr(self, "_closed", False):
            return
        self._closed = True
        with contextlib.suppress(Exception):  # a sidecar gone: detaching drops the pins
            self._releases.settle()
        self._stop_background()
        self._populator.join()  # it stops at the next unit; never madvise an unmapped range
        self._prefetcher.close()
        self._reader.close()
        self._control.close()
        self._copier.close()
        if self.hbm is not None:
            self.hbm.close()
        del self.arena_tensor
        self.arena.close()

    def __enter__(self) -> StoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
