"""The peer tier: other sidecars of the group, as seen from this one.

Provides:
- ``PeerClient``: calls to one remote sidecar (lookup, fetch over the data
  channel, replicate), every call authenticated and under a deadline;
- ``PeerTier``: the group. ``lookup`` asks every peer at once and takes the
  longest continuation that answers in time; ``pull`` fetches blocks missing
  here from the peer that holds them; ``stream`` and ``end_turn`` are the
  sending side of kv_share, the ``Replicator``'s (``tierstore.peer.replicator``:
  blocks pushed to a session's spill host while its turn runs, and what is
  left at its end, when the replication policy agrees);
  ``import_replica`` is the receiving side of a push.

Runs in the sidecar: lookups, pulls and imports on RPC threads (pushes on
the replicator's threads). A timeout, refusal or error of a peer is a miss,
counted, never an exception to the engine.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc

from tierstore.config.peer import PeerConfig
from tierstore.counters import Counters
from tierstore.keys import BlockKey, KVLayout
from tierstore.membership.members import MemberSet, StaticMembers
from tierstore.peer import codec
from tierstore.peer.client import PeerClient, TransferStalled, rpc_text
from tierstore.peer.clients import PeerClients
from tierstore.peer.data import ReceiveResult, receive_blocks
from tierstore.peer.replicator import Push, Replicator
from tierstore.peer.stream import STREAM_COUNTERS
from tierstore.policies.compression import compress_transfer
from tierstore.policies.replication import rendezvous_target
from tierstore.ratelog import RateLimitedLog
from tierstore.store.tiered import TieredStore
from tierstore.v1 import peer_pb2

log = logging.getLogger(__name__)
_faults = RateLimitedLog(log)  # per kind and peer: a flapping peer must not flood the log

LINK_PROBE_MIN_BYTES = 16 << 20  # raw transfers at least this large measure the link
LINK_REPROBE_EVERY = 8  # every 8th replica import re-times the way not preferred now


# A dead peer and a stalled one call for different fixes (restart it; look at
# its load or the link), so their misses are counted apart.
PEER_COUNTERS = (
    "lookups",
    "lookup_errors",  # a peer refused, unreachable or reset (dead)
    "lookup_timeouts",  # a peer that did not answer by the deadline (stalled)
    "fetches",
    "fetches_compressed",  # fetches over byte-split zstd (compression = zstd, or auto's choice)
    "fetched_blocks",
    "fetched_bytes",  # payload bytes on the wire (compressed where it was)
    "fetch_errors",  # transfers that failed before their deadline: refused, reset, bad stream
    "fetch_timeouts",  # transfers cut by their deadline: a peer or link too slow for it
    "fetch_stalls",  # transfers cut before it, nothing having moved for fetch_stall_s
    "fetch_verify_failures",
    "pulls",  # pulls of a prefix this host lacked (an engine's load, a pre-positioning)
    "pulls_joined",  # pulls that waited for blocks another pull or a replica import was fetching
    "pull_ms",  # time spent in pulls, all of it: mean = pull_ms / pulls
    "pull_join_ms",  # ... of which waiting for blocks another transfer here was fetching
    "slow_pulls",  # pulls that took over slow_pull_s (each logged with where its time went)
    "pushes",
    "pushed_blocks",
    "push_errors",
    "pushes_dropped",
    "pushes_skipped",  # turns the replication policy did not replicate (link or budget pressure)
    *STREAM_COUNTERS,
    "replicas_imported",
    "replicas_rejected",
    "replicas_joined",  # blocks an import left to a pull already fetching them
    "watchers",  # routers' WatchBlocks streams open now
    "watch_snapshots",  # snapshots sent (new watchers, and resyncs after a gap)
    "watch_refused",  # streams refused: max_watchers reached
    "bad_requests",  # peer calls refused as malformed (INVALID_ARGUMENT)
    "prepositions",  # routers' Preposition hints queued here
    "prepositions_refused",  # ... not queued (prefetch queue full, or no prefetcher)
)


class _Claim:
    """One transfer into this host (a pull or a replica import) and the
    blocks it claimed: others wait for the blocks they need, as each batch
    lands, instead of fetching them."""

    __slots__ = ("_cond", "_done", "_landed", "kind")

    def __init__(self, kind: str) -> None:
        self.kind = kind  # "pull" or "import"
        self._landed: set[BlockKey] = set()  # committed so far
        self._done = False
        self._cond = threading.Condition()

    def land(self, keys: Sequence[BlockKey]) -> None:
        """These blocks were committed here (the transfer's receiving thread)."""
        with self._cond:
            self._landed.update(keys)
            self._cond.notify_all()

    def finish(self) -> None:
        with self._cond:
            self._done = True
            self._cond.notify_all()

    def wait_for(self, keys: Sequence[BlockKey], deadline: float) -> None:
        """Until every one of ``keys`` landed, the transfer ended, or ``deadline``."""
        with self._cond:
            self._cond.wait_for(
                lambda: self._done or self._landed.issuperset(keys),
                max(deadline - time.monotonic(), 0.0),
            )


class PeerTier:
    """The group of peers. See the module docstring."""

    def __init__(
        self,
        store: TieredStore,
        cfg: PeerConfig,
        self_address: str,
        members: MemberSet | None = None,
    ) -> None:
        self.store = store
        self.cfg = cfg
        self.address = self_address
        self.counters = Counters(PEER_COUNTERS)
        token = cfg.token()
        # Who the peers are is the member set's business (the static list, or
        # etcd's live group); this tier asks it on every use.
        self._peers = PeerClients(
            members if members is not None else StaticMembers(cfg.peers),
            lambda addr: PeerClient(addr, cfg, token),
            exclude=self_address,
        )
        self._codec_bytes_per_s = _measure_codec()
        # The blocks a pull or a replica import here is fetching now, each
        # with that transfer's claim (see ``pull`` and ``_claim``).
        self._pulling: dict[BlockKey, _Claim] = {}
        self._pulls_lock = threading.Lock()
        self.replicator = Replicator(
            cfg, self_address, self._peers, self.spill_target,
            counters=self.counters, workers=store.workers,
        )  # fmt: skip

    @property
    def clients(self) -> dict[str, PeerClient]:
        """address -> client of every live peer (this host excluded), now."""
        return self._peers.clients()

    def members(self) -> list[str]:
        return [self.address, *self.clients]

    # -- lookups and pulls ---------------------------------------------------------

    def lookup(
        self, layout: KVLayout, keys: Sequence[BlockKey], timeout_s: float
    ) -> tuple[PeerClient | None, int]:
        """The peer holding the longest prefix of ``keys``, asked all at once."""
        clients = self.clients  # one view of the group for the whole lookup
        if not keys or not clients:
            return None, 0
        self.counters.add("lookups")
        futures = {addr: c.lookup_future(layout, keys, timeout_s) for addr, c in clients.items()}
        best: tuple[PeerClient | None, int] = (None, 0)
        for addr, fut in futures.items():
            try:
                hits = fut.result().num_hits
            except grpc.RpcError as e:
                stalled = e.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                self.counters.add("lookup_timeouts" if stalled else "lookup_errors")
                continue
            if hits > best[1]:
                best = (clients[addr], hits)
        return best

    def pull(self, layout: KVLayout, keys: Sequence[BlockKey], timeout_s: float) -> int:
        """Fetch as much of the prefix ``keys`` as a peer holds, within
        ``timeout_s``. Returns how long a prefix of ``keys`` is held here now.

        Blocks that another transfer here is already fetching (a gateway's
        pre-positioning, then the engine's own load of the same turn; a
        replica pushed while the turn was on its way; an engine's prefetch
        of the whole prefix, then its loads of it piece by piece) are waited
        for, within ``timeout_s``, instead of fetched a second time: two
        receivers of one block would also contend for its slot, and the
        second would read past it and end with a shorter prefix than the
        peer held. The wait ends as soon as the blocks asked for have landed,
        not when the other transfer ends."""
        started = time.monotonic()
        deadline = started + timeout_s
        with self._pulls_lock:
            running: dict[_Claim, list[BlockKey]] = {}
            for k in keys:
                if k in self._pulling:
                    running.setdefault(self._pulling[k], []).append(k)
        if running:
            self.counters.add("pulls_joined")
            for claim, theirs in running.items():
                claim.wait_for(theirs, deadline)
        timing = _PullTiming(started, joined=time.monotonic(), asked=len(keys))
        timing.joined_kinds = sorted({c.kind for c in running})
        timing.had = _held_prefix(self.store.held(keys))
        rest = list(keys[timing.had :])
        if not rest or time.monotonic() >= deadline:
            self._pulled(timing)
            return timing.had
        mine, claimed = self._claim(rest, "pull")
        try:
            lookup_s = min(deadline - time.monotonic(), self.cfg.peer_lookup_timeout_s)
            peer, hits = self.lookup(layout, rest, lookup_s)
            timing.looked = time.monotonic()
            if peer is not None:
                result = self._fetch(peer, layout, rest[:hits], deadline, mine, background=False)
                timing.got, timing.reserve_s = result.received, result.reserve_s
            return timing.had + timing.got
        finally:
            self._release(mine, claimed)
            self._pulled(timing)

    def _claim(self, keys: Sequence[BlockKey], kind: str) -> tuple[_Claim, list[BlockKey]]:
        """Register ``keys`` not claimed already as being fetched by the
        caller's transfer; returns its claim and the keys it took (the caller
        fetches those and ``_release``s them, however it ends)."""
        mine = _Claim(kind)
        with self._pulls_lock:
            claimed = [k for k in keys if k not in self._pulling]
            for k in claimed:
                self._pulling[k] = mine
        return mine, claimed

    def _release(self, mine: _Claim, claimed: list[BlockKey]) -> None:
        with self._pulls_lock:
            for k in claimed:
                if self._pulling.get(k) is mine:
                    del self._pulling[k]
        mine.finish()

    def _pulled(self, t: _PullTiming) -> None:
        """Count one pull's time; log where a slow one's went (rate-limited)."""
        ended = time.monotonic()
        looked = t.looked or t.joined
        total_s = ended - t.started
        slow = total_s > self.cfg.slow_pull_s
        self.counters.add_many({
            "pulls": 1,
            "pull_ms": round(total_s * 1000),
            "pull_join_ms": round((t.joined - t.started) * 1000),
            "slow_pulls": int(slow),
        })  # fmt: skip
        if slow:
            _faults.warning(
                "slow-pull",
                "pull of %d blocks took %.2f s: %.2f s waiting for a %s here, %.2f s lookup, "
                "%.2f s fetch (%.2f s of it reserving slots); %d held before, %d fetched",
                t.asked, total_s, t.joined - t.started, "/".join(t.joined_kinds) or "transfer",
                looked - t.joined, ended - looked, t.reserve_s, t.had, t.got,
            )  # fmt: skip

    def _fetch(
        self,
        peer: PeerClient,
        layout: KVLayout,
        keys: list[BlockKey],
        deadline: float,
        claim: _Claim,
        background: bool,
    ) -> ReceiveResult:
        """``claim``: told of each batch as it lands. ``background``: no
        request waits on this transfer (a replica import): it may re-time
        the way of transferring not in use."""
        compress = self._compress(peer, layout, background)
        self.counters.add_many({"fetches": 1, "fetches_compressed": int(compress)})
        try:
            result = self._receive(peer, layout, keys, deadline, compress, claim)
        except (grpc.RpcError, OSError) as e:
            self.counters.add("fetch_timeouts" if _timed_out(e, deadline) else "fetch_errors")
            _faults.warning(
                f"fetch:{peer.address}", "fetch from %s failed: %s", peer.address, rpc_text(e)
            )
            return ReceiveResult(error=str(e))
        self.counters.add("fetched_blocks", result.received)
        self.counters.add("fetched_bytes", result.bytes)
        if result.verify_failures:
            self.counters.add("fetch_verify_failures", result.verify_failures)
            _faults.warning(
                f"verify:{peer.address}", "fetch from %s: a block failed verification", peer.address
            )
        if result.stalled:
            self.counters.add("fetch_stalls")
            _faults.warning(
                f"stall:{peer.address}", "fetch from %s cut: %s", peer.address, result.error
            )
        elif result.error:
            self.counters.add("fetch_timeouts" if _timed_out(None, deadline) else "fetch_errors")
            _faults.warning(
                f"early:{peer.address}", "fetch from %s ended early: %s", peer.address, result.error
            )
        return result

    def _receive(
        self,
        peer: PeerClient,
        layout: KVLayout,
        keys: list[BlockKey],
        deadline: float,
        compress: bool,
        claim: _Claim,
    ) -> ReceiveResult:
        """Open a transfer from ``peer`` and read it into the store (verified);
        large raw transfers measure the link to it."""
        started = time.monotonic()
        stall_s = self.cfg.fetch_stall_s
        try:
            num_blocks, conn = peer.open_fetch(layout, keys, deadline, compress, stall_s)
        except TransferStalled as e:  # OpenFetch unanswered, or no data connection
            return ReceiveResult(error=str(e), stalled=True)
        if conn is None:
            return ReceiveResult()
        try:
            result = receive_blocks(
                conn, self.store, layout, keys[:num_blocks], deadline, claim.land, stall_s
            )
        finally:
            conn.close()
        # Raw transfers measure the link (the cost model's pull rate too), and
        # only large ones: a small one is mostly connection set-up and would
        # read as a slow link. Compressed ones measure what compression
        # delivers, every one: their set-up makes the rate err low, toward
        # raw transfers, the safe side (with only small ones timed, it stayed
        # on untimed, at 0.3 s a block against 0.02 s raw).
        seconds = time.monotonic() - started
        if compress:
            peer.packed.add(result.received * layout.block_bytes, seconds)
        elif result.bytes >= LINK_PROBE_MIN_BYTES:
            peer.link.add(result.bytes, seconds)
        return result

    def _compress(self, peer: PeerClient, layout: KVLayout, background: bool) -> bool:
        """Compress only when it makes transfers from this peer faster
        (``tierstore.policies.compression``). Only transfers no request waits
        on re-time the way not preferred: a probe of the slower way on an
        engine's load cost a moved turn seconds."""
        if self.cfg.compression == "none" or not codec.can_bytesplit(layout):
            return False
        if self.cfg.compression == "zstd":
            return True
        probe = False
        if background:
            peer.background_transfers += 1
            probe = peer.background_transfers % LINK_REPROBE_EVERY == 0
        return compress_transfer(
            peer.link.bytes_per_s, peer.packed.bytes_per_s, self._codec_bytes_per_s, probe
        )

    # -- kv_share: the sending side (the replicator's) -----------------------------------

    def stream(self, session: str, layout: KVLayout, keys: list[BlockKey]) -> None:
        """Blocks just committed for ``session``'s running turn (``Replicator.stream``)."""
        self.replicator.stream(session, layout, keys)

    def end_turn(
        self,
        session: str,
        layout: KVLayout,
        keys: list[BlockKey],
        num_tokens: int,
        wait: bool,
        target: str | None,
    ) -> Push | None:
        """A session's turn ended: push what its replica on ``target`` lacks
        (``Replicator.end_turn``)."""
        return self.replicator.end_turn(session, layout, keys, num_tokens, wait, target)

    def fetch_bytes_per_s(self) -> float:
        """Mean link speed measured to the peers (0: none measured yet)."""
        rates = [r for r in (c.link.bytes_per_s for c in self.clients.values()) if r > 0]
        return sum(rates) / len(rates) if rates else 0.0

    def spill_target(self, session: str) -> str | None:
        return rendezvous_target(session, self.members(), exclude=self.address)

    # -- kv_share: the receiving side ---------------------------------------------------

    def import_replica(
        self, layout: KVLayout, keys: list[BlockKey], source: str, timeout_s: float
    ) -> peer_pb2.ReplicateReply:
        """Fetch the blocks of ``keys`` this host lacks from ``source``, within
        the replica budget. Residency is asked of the tiers, never remembered."""
        started = time.monotonic()
        deadline = started + min(timeout_s, self.cfg.replicate_timeout_s)
        held = self.store.held(keys)
        missing = [k for k, h in zip(keys, held) if not h]
        # The session's replica is as fresh as this push, head last: else
        # its head, imported first, stays the oldest replica and is the first
        # dropped for room or evicted, which loses the whole prefix.
        ledger = self.store.replicas
        ledger.refresh(reversed([k for k, h in zip(keys, held) if h]))
        reply = peer_pb2.ReplicateReply(offered=len(keys), missing=len(missing))
        if not missing:
            return reply
        fits = len(missing)
        while fits and not self.store.make_replica_room(
            fits * layout.block_bytes, self.cfg.replica_bytes
        ):
            fits //= 2
        reply.rejected = len(missing) - fits
        self.counters.add("replicas_rejected", reply.rejected)
        peer = self.clients.get(source)
        reserved = fits * layout.block_bytes
        committed: list[BlockKey] = []
        # Blocks a pull here is fetching already are left to it; a pull that
        # comes while this import runs waits for it (``pull``).
        mine, claimed = self._claim(missing[:fits], "import")
        self.counters.add("replicas_joined", fits - len(claimed))
        result = ReceiveResult()
        try:
            if peer is None:
                # One kind for every unknown source: the name comes off the wire.
                _faults.warning(
                    "push-unknown",
                    "replica push from %s, which is not in this group's peers",
                    source,
                )
                return reply
            if claimed:
                result = self._fetch(peer, layout, claimed, deadline, mine, background=True)
                committed = result.keys
                reply.bytes = result.bytes
        finally:
            self._release(mine, claimed)
            self.store.finish_replica_import(reserved, layout, committed)
            ledger.refresh(reversed(keys))
        self.counters.add("replicas_imported", len(committed))
        reply.imported = len(committed)
        now = time.monotonic()
        reply.import_s = now - started
        if committed and result.last_byte_at:
            reply.tail_s = now - result.last_byte_at
        return reply

    def close(self) -> None:
        self.replicator.close()
        self._peers.close()


@dataclass(slots=True)
class _PullTiming:
    """Where one pull's time went (``PeerTier._pulled``); times are time.monotonic()."""

    started: float
    joined: float  # done waiting for transfers of the same blocks already running here
    asked: int  # blocks asked for
    joined_kinds: list[str] = field(default_factory=list)
    looked: float = 0.0  # the lookup answered (0: no lookup)
    had: int = 0  # held prefix once the joined transfers ended
    got: int = 0  # blocks fetched
    reserve_s: float = 0.0  # of the fetch: reserving slots (evicting to make room)


def _timed_out(e: BaseException | None, deadline: float) -> bool:
    """Whether a failed transfer was cut by its deadline rather than refused
    or reset. The stream's reader reports only text, but it ends early for a
    stall only once the deadline has passed (socket timeouts are re-armed with
    what is left of it, rounded up)."""
    if isinstance(e, grpc.RpcError) and hasattr(e, "code"):
        return bool(e.code() == grpc.StatusCode.DEADLINE_EXCEEDED)
    return isinstance(e, TimeoutError) or time.monotonic() >= deadline


def _measure_codec() -> float:
    """Bytes/s of the slower of byte-split zstd compression and decompression
    on fp16-like data on this host (a few ms): a link slower than this gains
    from compression, a faster one loses."""
    import numpy as np

    sample = np.random.default_rng(0).standard_normal(1 << 19).astype(np.float16).tobytes()
    layout = KVLayout("probe", 1, 1, 64, "float16", 16)
    t0 = time.perf_counter()
    packed = codec.compress(memoryview(sample), layout)
    t1 = time.perf_counter()
    if packed is None:
        return 0.0
    codec.decompress_into(memoryview(packed), memoryview(bytearray(len(sample))))
    t2 = time.perf_counter()
    return len(sample) / max(t1 - t0, t2 - t1, 1e-6)


def _held_prefix(held: Sequence[bool]) -> int:
    """How many of the first keys are held (the length of the held prefix)."""
    for i, h in enumerate(held):
        if not h:
            return i
    return len(held)
