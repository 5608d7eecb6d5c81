"""StoreClient: the engine's handle on its host's sidecar.

Control calls go over the sidecar's Unix socket (gRPC), batched: one call
per batch of keys, never one per block. Block bytes never cross the socket:
the client maps the sidecar's shared arena and copies between it and device
memory (with CUDA the arena is registered as pinned memory and copies run on
a side stream). An optional HBM tier (``hbm_bytes``) keeps recently stored
and loaded blocks in a device pool and writes its LRU victims down to the
sidecar; a background thread reports the pool's counters to the sidecar
every ``tier_report_s`` (``report_tiers``), so that ``tierstore stat`` shows
the host's HBM tier too.

Operations: ``register``, ``store``, ``load``, ``lookup``, ``acquire`` /
``release`` (zero-copy views into the arena), ``reserve`` / ``commit`` /
``abort`` (fill arena slots in place), ``prefetch``, ``flush``,
``stat``, ``report_load``, ``report_tiers``, ``close``.

Runs in the engine process. A client may be used from several threads; the
HBM pool's writes are serialised by one lock.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict
from typing import Any

import grpc
import torch

from tierstore.client.copier import ArenaCopier, as_block_rows
from tierstore.client.fastpath import FastLookupClient
from tierstore.client.hbm import HbmEntry, HbmTier
from tierstore.client.results import (
    ClientLookup,
    LoadResult,
    Pinned,
    PrefetchResult,
    Reserved,
    ReserveStatus,
    SidecarUnavailable,
    rpc_error,
)
from tierstore.config import ServerConfig, load_config
from tierstore.errors import BlockSizeError, LayoutError, TierstoreError
from tierstore.fastwire import fast_socket_path
from tierstore.keys import BlockKey, KVLayout, check_keys
from tierstore.memory.arena import Arena
from tierstore.tiers import TIER_BY_CODE, TierName
from tierstore.v1 import common_pb2, local_pb2, local_pb2_grpc

log = logging.getLogger(__name__)

POLICY_CODES = {
    "best_effort": local_pb2.PREFETCH_BEST_EFFORT,
    "wait": local_pb2.PREFETCH_WAIT,
    "timeout": local_pb2.PREFETCH_TIMEOUT,
}
OUTCOME_NAMES = {0: "started", 1: "done", 2: "late", 3: "cancelled"}
HBM_PULL_CHUNK_BLOCKS = 64  # arena pins held at once while a prefetch fills HBM


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
    ) -> None:
        if not tier_report_s > 0:
            raise ValueError(f"tier_report_s must be > 0, got {tier_report_s}")
        if hbm_evict_batch_blocks < 1:
            raise ValueError(f"hbm_evict_batch_blocks must be >= 1, got {hbm_evict_batch_blocks}")
        self.hbm_evict_batch_blocks = hbm_evict_batch_blocks
        self.socket_path = socket_path or load_config().server.socket_path
        self.call_timeout_s = call_timeout_s
        self.device = torch.device(device)
        self._channel = grpc.insecure_channel(
            f"unix:{self.socket_path}",
            options=[
                ("grpc.max_receive_message_length", 4 << 20),
                ("grpc.max_send_message_length", 4 << 20),
            ],
        )
        try:
            grpc.channel_ready_future(self._channel).result(timeout=connect_timeout_s)
        except grpc.FutureTimeoutError:
            self._channel.close()
            raise SidecarUnavailable(
                f"no tierstore sidecar answers on unix:{self.socket_path} within "
                f"{connect_timeout_s}s; start one with `tierstore serve`"
            ) from None
        self._stub = local_pb2_grpc.LocalServiceStub(self._channel)
        self._attach = self._stub.Attach(
            local_pb2.AttachRequest(client_name=name or f"pid-{os.getpid()}", pid=os.getpid())
        )
        try:
            hello = next(self._attach)
        except grpc.RpcError as e:
            self._channel.close()
            raise rpc_error(e, "attach") from e
        self.client_id = hello.client_id
        self.max_batch_keys = hello.max_batch_keys or ServerConfig().max_batch_keys
        self.server_version = hello.server_version
        self.arena = Arena.attach(hello.arena_path, hello.arena_bytes)
        self.arena_tensor = torch.frombuffer(self.arena.buf, dtype=torch.uint8)
        self._copier = ArenaCopier(self.arena_tensor, self.device)
        try:
            self.hbm = HbmTier(hbm_bytes, self.device) if hbm_bytes > 0 else None
        except BaseException:  # e.g. CUDA out of memory: unpin and unmap before raising
            self._copier.close()
            del self.arena_tensor
            self.arena.close()
            self._attach.cancel()
            self._channel.close()
            raise
        self._hbm_lock = threading.Lock()
        # Releases in flight: sent without waiting for the reply; the next
        # control call waits for them first (see _release).
        self._releases: list[grpc.Future] = []
        self._releases_lock = threading.Lock()
        self.release_errors = 0
        self._layouts: dict[bytes, KVLayout] = {}
        self._background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tierstore-client")
        self._fast: FastLookupClient | None = None
        with contextlib.suppress(OSError):  # an older sidecar has none: gRPC serves lookups
            self._fast = FastLookupClient(fast_socket_path(self.socket_path), call_timeout_s)
        self.connected = True
        self._watcher = threading.Thread(target=self._watch, name="tierstore-attach", daemon=True)
        self._watcher.start()
        # The HBM tier lives here: the sidecar shows it in `tierstore stat`
        # from these reports (every tier_report_s, and once at the start).
        self._stop_reports = threading.Event()
        self._reporter: threading.Thread | None = None
        if self.hbm is not None:
            self._reporter = threading.Thread(
                target=self._report_tiers_loop,
                args=(tier_report_s,),
                name="tierstore-tier-report",
                daemon=True,
            )
            self._reporter.start()
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

    # -- plumbing -------------------------------------------------------------------

    def _watch(self) -> None:
        try:
            for _ in self._attach:
                pass
        except grpc.RpcError:
            pass
        self.connected = False

    def report_tiers(self) -> None:
        """Send this client's HBM tier's counters to the sidecar now (a
        background thread does it every ``tier_report_s``)."""
        if self.hbm is None:
            return
        s = self.hbm.stats()
        tier = common_pb2.TierStat(name=str(TierName.HBM), **asdict(s))
        req = local_pb2.ReportTiersRequest(client_id=self.client_id, tiers=[tier])
        self._call(self._stub.ReportTiers, req, "report tiers")

    def _report_tiers_loop(self, every_s: float) -> None:
        while True:
            with contextlib.suppress(TierstoreError):  # a sidecar gone: nobody to tell
                self.report_tiers()
            if self._stop_reports.wait(every_s) or not self.connected:
                return

    def _call(self, method: Any, request: Any, what: str) -> Any:
        self._settle_releases()
        try:
            return method(request, timeout=self.call_timeout_s)
        except grpc.RpcError as e:
            raise rpc_error(e, what) from e

    def _batches(self, keys: list[BlockKey]) -> Iterator[list[BlockKey]]:
        for lo in range(0, len(keys), self.max_batch_keys):
            yield keys[lo : lo + self.max_batch_keys]

    def _req(
        self,
        layout: KVLayout,
        keys: Sequence[BlockKey],
        include_peers: bool = False,
        deadline_s: float = 0.0,
    ) -> local_pb2.KeysRequest:
        return local_pb2.KeysRequest(
            client_id=self.client_id,
            layout_id=self.register(layout),
            keys=b"".join(keys),
            include_peers=include_peers,
            deadline_s=deadline_s,
        )

    def register(self, layout: KVLayout) -> bytes:
        """Tell the sidecar about a layout (once per layout per client)."""
        fp = layout.fingerprint
        if fp not in self._layouts:
            reply = self._call(
                self._stub.RegisterLayout,
                local_pb2.RegisterLayoutRequest(layout=common_pb2.Layout(**layout.to_dict())),
                "register layout",
            )
            if reply.layout_id != fp:
                raise LayoutError(
                    "the sidecar computed another fingerprint for this layout: "
                    "client and server versions disagree"
                )
            self._layouts[fp] = layout
        return fp

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
        if self.hbm is None:
            return self._write_down(layout, keys, rows, session)
        held = [True] * len(keys)
        self._copier.wait_engine()  # once: the rows were written before this call
        with self._hbm_lock:
            in_hbm = self.hbm.contains(keys)
            for i, (key, row) in enumerate(zip(keys, rows)):
                if in_hbm[i]:
                    continue
                slot = self._hbm_slot(key, layout, dirty=not write_through)
                if slot is None:
                    held[i] = False
                    continue
                self._copier.copy(slot, row, wait=False)
        if write_through:
            down = self._write_down(layout, keys, rows, session)
            held = [a or b for a, b in zip(held, down)]
        self._copier.sync()
        return held

    def _hbm_slot(self, key: BlockKey, layout: KVLayout, dirty: bool) -> torch.Tensor | None:
        """A pool slot for ``key``, evicting (and writing down) LRU blocks. Lock held."""
        assert self.hbm is not None
        nbytes = layout.block_bytes
        slot = self.hbm.allocate(key, layout.fingerprint, nbytes, dirty)
        while slot is None and not self.hbm.contains([key])[0]:
            victims = self.hbm.take_victims(nbytes, max_blocks=self.hbm_evict_batch_blocks)
            if not victims:
                return None
            self._evict_hbm(victims)
            slot = self.hbm.allocate(key, layout.fingerprint, nbytes, dirty)
        return slot

    def _evict_hbm(self, victims: list[HbmEntry]) -> None:
        """Write dirty victims down, then free their slots. Called with
        ``_hbm_lock`` held; the lock is let go during the write-down (control
        calls and copies), so other threads' HBM hits do not wait on the
        sidecar. The victims stay readable and are not reused meanwhile
        (taken, not freed)."""
        assert self.hbm is not None
        by_layout: dict[bytes, list[HbmEntry]] = {}
        for v in victims:
            if v.dirty:
                by_layout.setdefault(v.layout_fp, []).append(v)
        if by_layout:
            self._hbm_lock.release()
            try:
                for fp, entries in by_layout.items():
                    keys = [e.key for e in entries]
                    self._write_down(self._layouts[fp], keys, [self.hbm.view(e) for e in entries])
            finally:
                self._hbm_lock.acquire()
        self.hbm.free(victims)

    def _write_down(
        self, layout: KVLayout, keys: list[BlockKey], rows: list[torch.Tensor], session: str = ""
    ) -> list[bool]:
        """Reserve arena slots, copy, commit: two control calls per batch."""
        held: list[bool] = []
        n = layout.block_bytes
        for lo in range(0, len(keys), self.max_batch_keys):
            batch = keys[lo : lo + self.max_batch_keys]
            reply = self._call(self._stub.Reserve, self._req(layout, batch), "reserve")
            ok, src, dst = [], [], []
            for j, (status, offset) in enumerate(zip(reply.statuses, reply.offsets)):
                if status == local_pb2.RESERVE_OK:
                    self.arena.ensure_ready(offset, n)  # page tables of a fresh unit, once
                    ok.append(batch[j])
                    src.append(rows[lo + j])
                    dst.append(offset)
                held.append(status != local_pb2.RESERVE_FULL)
            # One streaming copy per run of slots adjacent in the arena and in ``rows``.
            self._copier.copy_rows_to_arena(src, dst, n)
            if ok:
                self._copier.sync()
                req = self._req(layout, ok)
                req.session = session
                self._call(self._stub.Commit, req, "commit")
        return held

    def reserve(self, layout: KVLayout, keys: Sequence[BlockKey]) -> Reserved:
        """Reserve arena slots for ``keys`` (at most ``max_batch_keys``) so a
        caller that writes blocks piecewise (an engine copying layer by layer
        out of its own pages) can fill them in place, then ``commit`` them (or
        ``abort``). Keys already held come back EXISTS: skip them."""
        keys = check_keys(keys)[: self.max_batch_keys]
        reply = self._call(self._stub.Reserve, self._req(layout, keys), "reserve")
        return Reserved(keys, tuple(ReserveStatus(s) for s in reply.statuses), tuple(reply.offsets))

    def commit(self, layout: KVLayout, keys: Sequence[BlockKey]) -> list[bool]:
        """Make reserved (and written) blocks readable. Returns which were committed."""
        keys = check_keys(keys)
        if not keys:
            return []
        reply = self._call(self._stub.Commit, self._req(layout, keys), "commit")
        return [bool(f) for f in reply.flags]

    def abort(self, layout: KVLayout, keys: Sequence[BlockKey]) -> int:
        """Give back reservations that will not be written. Returns how many."""
        keys = check_keys(keys)
        if not keys:
            return 0
        return int(self._call(self._stub.Abort, self._req(layout, keys), "abort").count)

    def flush(self) -> int:
        """Write every HBM-only block down to the sidecar. Returns how many."""
        if self.hbm is None:
            return 0
        with self._hbm_lock:
            # Held: out of eviction's way, so their slots are not reused while
            # they are written down without the lock.
            dirty = self.hbm.hold_dirty()
        try:
            by_layout: dict[bytes, list[HbmEntry]] = {}
            for e in dirty:
                by_layout.setdefault(e.layout_fp, []).append(e)
            for fp, entries in by_layout.items():
                keys = [e.key for e in entries]
                self._write_down(self._layouts[fp], keys, [self.hbm.view(e) for e in entries])
                self.hbm.mark_clean(keys)
        finally:
            self.hbm.unhold(dirty)
        return len(dirty)

    # -- reads ------------------------------------------------------------------------

    def lookup(
        self, layout: KVLayout, keys: Sequence[BlockKey], *, include_peers: bool = False
    ) -> ClientLookup:
        """Longest prefix held anywhere: HBM here, the sidecar's tiers, and
        with ``include_peers`` the other sidecars of the group."""
        keys = check_keys(keys)
        in_hbm = self.hbm.contains(keys) if self.hbm is not None else [False] * len(keys)
        tiers: list[TierName] = []
        i = 0
        while i < len(keys):
            if in_hbm[i]:
                tiers.append(TierName.HBM)
                i += 1
                continue
            run_end = i
            while run_end < len(keys) and not in_hbm[run_end]:
                run_end += 1
            run = keys[i:run_end][: self.max_batch_keys]
            found = self._sidecar_lookup(layout, run, include_peers)
            tiers.extend(found)
            i += len(found)
            if len(found) < len(run):
                break
        return ClientLookup(len(tiers), tuple(tiers))

    def _sidecar_lookup(
        self, layout: KVLayout, keys: list[BlockKey], include_peers: bool
    ) -> tuple[TierName, ...]:
        """Tiers of the longest prefix the sidecar (and its peers) hold: over
        the fast path when it can answer, else over gRPC."""
        fp = self.register(layout)
        if self._fast is not None and not include_peers:
            try:
                return self._fast.lookup(fp, keys)
            except (OSError, ConnectionError):
                self._fast.close()  # fall back to gRPC from now on
                self._fast = None
        reply = self._call(self._stub.Lookup, self._req(layout, keys, include_peers), "lookup")
        return tuple(TIER_BY_CODE[c] for c in reply.tiers)

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
        return self._acquire(layout, check_keys(keys), include_peers, deadline_s, True)

    def _acquire(
        self,
        layout: KVLayout,
        keys: list[BlockKey],
        include_peers: bool,
        deadline_s: float,
        engine_copies: bool,
    ) -> Pinned:
        keys = keys[: self.max_batch_keys]
        req = self._req(layout, keys, include_peers, deadline_s)
        reply = self._call(self._stub.Acquire, req, "acquire")
        offsets = list(reply.offsets)
        for offset in offsets:  # page tables of units this process has not mapped yet
            self.arena.ensure_ready(offset, layout.block_bytes)
        tiers = tuple(TIER_BY_CODE[c] for c in reply.tiers)
        return Pinned(self, layout, keys[: len(offsets)], offsets, engine_copies, tiers)

    def _release(self, layout: KVLayout, keys: list[BlockKey]) -> None:
        """Drop the pins without waiting for the reply: a load's copies are
        done by now, so the round trip need not be on its path. Every later
        control call of this client waits for the releases sent before it
        (``_settle_releases``), so what it sees or does comes after them."""
        if keys and self.connected:
            # Several releases in a row go out together; at most one per
            # acquire made since the last control call is in flight.
            future = self._stub.Release.future(self._req(layout, keys), timeout=self.call_timeout_s)
            with self._releases_lock:
                self._releases.append(future)

    def _settle_releases(self) -> None:
        """Wait for the releases in flight (each within the call timeout). A
        failed one is logged and counted (``release_errors``) once, by the
        thread that takes it off the list: its pins stay until this client
        detaches, when the sidecar drops them all."""
        if not self._releases:
            return
        with self._releases_lock:
            pending = list(self._releases)
        for future in pending:
            future.exception()  # waits; bounded by the call's own timeout
        with self._releases_lock:
            waited = {id(f) for f in pending}
            mine = [f for f in self._releases if id(f) in waited]
            self._releases = [f for f in self._releases if id(f) not in waited]
        for future in mine:
            error = future.exception()
            if isinstance(error, grpc.RpcError):
                self.release_errors += 1
                log.warning(
                    "release: %s (pins kept until this client detaches)",
                    rpc_error(error, "release"),
                )

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
        # One deadline for the whole load, however many calls it takes.
        deadline = time.monotonic() + deadline_s if deadline_s > 0 else None
        in_hbm = self.hbm.contains(keys) if self.hbm is not None else [False] * len(keys)
        tiers: list[TierName] = []
        i = 0
        while i < len(keys):
            if in_hbm[i] and self.hbm is not None:
                # Under the pool's lock: a prefetch thread evicting this block
                # could otherwise reuse its slot between get and copy.
                with self._hbm_lock:
                    (view,) = self.hbm.get([keys[i]])
                    if view is not None:
                        self._copier.copy(rows[i], view)
                if view is not None:
                    tiers.append(TierName.HBM)
                    i += 1
                    continue
            end = i + 1  # a run of blocks the sidecar must supply
            while end < len(keys) and end - i < self.max_batch_keys and not in_hbm[end]:
                end += 1
            remaining_s = 0.0
            if deadline is not None:
                remaining_s = deadline - time.monotonic()
                if remaining_s <= 0:
                    break
            got = self._load_run(
                layout, keys[i:end], rows[i:end], promote, include_peers, remaining_s
            )
            tiers.extend(got)
            i += len(got)
            if len(got) < end - (i - len(got)):
                break  # a gap: the rest must be prefilled
        self._copier.sync()
        return LoadResult(len(tiers), tuple(tiers), out)

    def _load_run(
        self,
        layout: KVLayout,
        keys: list[BlockKey],
        rows: torch.Tensor,
        promote: bool,
        include_peers: bool = False,
        deadline_s: float = 0.0,
    ) -> list[TierName]:
        # Acquire says where each block was found (and asks the peers, once,
        # for what is missing here): two control calls per run, acquire and release.
        with self._acquire(layout, keys, include_peers, deadline_s, False) as pinned:
            self._copier.copy_runs(rows, pinned.offsets, layout.block_bytes)
            if promote and self.hbm is not None:
                with self._hbm_lock:
                    for key, view in zip(pinned.keys, pinned.views):
                        slot = self._hbm_slot(key, layout, dirty=False)
                        if slot is not None:
                            self._copier.copy(slot, view)
            self._copier.sync()  # copies out of the arena end before the pins go
            if len(pinned.tiers) == len(pinned.keys):
                return list(pinned.tiers)
            # A sidecar that does not say (older): ask, as before.
            local = list(self._sidecar_lookup(layout, pinned.keys, False))
            beyond = TierName.PEER if include_peers else TierName.DRAM
            return local + [beyond] * (len(pinned.keys) - len(local))

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
        if policy not in POLICY_CODES:
            raise ValueError(
                f"unknown prefetch policy {policy!r}; use one of {sorted(POLICY_CODES)}"
            )
        keys = check_keys(keys)[: self.max_batch_keys]
        reply = self._call(
            self._stub.Prefetch,
            local_pb2.PrefetchRequest(
                client_id=self.client_id,
                layout_id=self.register(layout),
                keys=b"".join(keys),
                policy=POLICY_CODES[policy],
                timeout_s=timeout_s,
            ),
            "prefetch",
        )
        outcome = OUTCOME_NAMES[reply.outcome]
        if policy != "best_effort":
            if self.hbm is not None and reply.ready_blocks:
                self._pull_into_hbm(layout, keys[: reply.ready_blocks])
            return PrefetchResult(outcome, reply.ready_blocks, reply.available_blocks)
        if self.hbm is None or outcome == "cancelled" or not reply.available_blocks:
            done: Future[PrefetchResult] = Future()
            done.set_result(PrefetchResult(outcome, 0, reply.available_blocks))
            return done
        return self._background.submit(
            lambda: PrefetchResult(
                outcome,
                self._pull_into_hbm(layout, keys[: reply.available_blocks]),
                reply.available_blocks,
            )
        )

    def _pull_into_hbm(self, layout: KVLayout, keys: list[BlockKey]) -> int:
        """Copy the available prefix of ``keys`` into HBM (what is not there
        yet), ``HBM_PULL_CHUNK_BLOCKS`` pins at a time. Returns the length of
        the prefix now in HBM."""
        assert self.hbm is not None
        for lo in range(0, len(keys), HBM_PULL_CHUNK_BLOCKS):
            chunk = keys[lo : lo + HBM_PULL_CHUNK_BLOCKS]
            missing = [k for k, held in zip(chunk, self.hbm.contains(chunk)) if not held]
            if missing:
                scratch = self._copier.empty_rows(len(missing), layout.block_bytes)
                if len(self._load_run(layout, missing, scratch, promote=True)) < len(missing):
                    break  # a gap: evicted meanwhile
        in_hbm = self.hbm.contains(keys)
        return in_hbm.index(False) if False in in_hbm else len(keys)

    def end_turn(
        self,
        session: str,
        layout: KVLayout,
        keys: Sequence[BlockKey],
        num_tokens: int,
        *,
        wait: bool = False,
        replica_target: str = "",
    ) -> local_pb2.EndTurnReply:
        """Tell the sidecar a turn of ``session`` ended with these full blocks
        (stored first: HBM-only blocks are written down). For a turn of at
        least min_tokens the sidecar pushes the blocks the session's spill
        host lacks (kv_share): ``replica_target`` (a peer's host:port, e.g.
        a router's ``spill_host``) or else the session's rendezvous spill
        host; ``wait`` returns after that push."""
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
        )
        return self._call(self._stub.EndTurn, req, "end turn")

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
        return self._call(self._stub.ReportLoad, req, "report load").host

    # -- inspection and shutdown ---------------------------------------------------------

    def stat(self) -> local_pb2.StatReply:
        return self._call(self._stub.Stat, local_pb2.StatRequest(), "stat")

    def close(self) -> None:
        """Detach (the sidecar releases anything still pinned), unmap the arena."""
        if getattr(self, "_closed", False):
            return
        self._closed = True
        with contextlib.suppress(Exception):  # a sidecar gone: detaching drops the pins
            self._settle_releases()
        self._stop_reports.set()
        if self._reporter is not None:
            self._reporter.join(timeout=self.call_timeout_s)
        self._populator.join()  # it stops at the next unit; never madvise an unmapped range
        self._background.shutdown(wait=True)
        if self._fast is not None:
            self._fast.close()
        self._attach.cancel()
        self._channel.close()
        self._watcher.join(timeout=5)
        self._copier.close()
        if self.hbm is not None:
            self.hbm.close()
        del self.arena_tensor
        self.arena.close()

    def __enter__(self) -> StoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
