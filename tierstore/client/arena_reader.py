"""Reads from the sidecar: lookups, pins, and copies out of the shared arena.

Provides ``ArenaReader``, the client's read path:
- ``prefix`` and ``load``: the longest prefix held anywhere, found or
  copied out block by block: hits from the engine's HBM pool, and each run
  between them from the sidecar;
- ``lookup``: the tiers of the longest prefix the sidecar holds, and with
  ``include_peers`` the other sidecars of the group (over the fast path when
  it can answer, else over gRPC);
- ``acquire`` (pin the longest available prefix in the arena, promoting from
  NVMe and fetching from peers within a deadline, as zero-copy ``Pinned``
  views) and ``release`` (drop pins: one fast-path round trip, or over gRPC
  without waiting for the reply);
- ``load_run``: acquire, copy the pinned blocks out, offer them to the HBM
  pool, release: two control calls per run.

Runs in the engine process, on the threads that call the client and on its
background (prefetch) thread, whose HBM pulls are ``load_run``s. Keeps no
state between calls but the fast-path connection, given up for good (gRPC
answers from then on) at its first failure.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from tierstore.client.control import ControlChannel
from tierstore.client.copier import ArenaCopier
from tierstore.client.fastpath import FastLookupClient
from tierstore.client.hbm_writer import HbmWriter
from tierstore.client.releases import PendingReleases
from tierstore.client.results import Pinned
from tierstore.errors import TierstoreError
from tierstore.keys import BlockKey, KVLayout
from tierstore.memory.arena import Arena
from tierstore.tiers import TIER_BY_CODE, TierName

# (layout, keys, views into the arena): keep clean copies in the HBM pool.
Promote = Callable[[KVLayout, Sequence[BlockKey], Sequence[torch.Tensor]], None]


class ArenaReader:
    """See the module docstring. ``fast``: the fast-path lookup client, or
    None (an older sidecar has none); closed by ``close``."""

    def __init__(
        self,
        control: ControlChannel,
        arena: Arena,
        arena_tensor: torch.Tensor,
        copier: ArenaCopier,
        releases: PendingReleases,
        fast: FastLookupClient | None,
    ) -> None:
        self._control = control
        self._arena = arena
        self._arena_tensor = arena_tensor
        self._copier = copier
        self._releases = releases
        self.fast = fast

    def prefix(
        self, layout: KVLayout, keys: list[BlockKey], in_hbm: list[bool], include_peers: bool
    ) -> list[TierName]:
        """Tiers of the longest prefix of ``keys`` held anywhere: the HBM pool
        (``in_hbm[i]``: it holds ``keys[i]``), then the sidecar's tiers (and
        its peers') for each run of keys the pool lacks."""
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
            run = keys[i:run_end][: self._control.max_batch_keys]
            found = self.lookup(layout, run, include_peers)
            tiers.extend(found)
            i += len(found)
            if len(found) < len(run):
                break
        return tiers

    def lookup(
        self, layout: KVLayout, keys: list[BlockKey], include_peers: bool
    ) -> tuple[TierName, ...]:
        """Tiers of the longest prefix the sidecar (and its peers) hold: over
        the fast path when it can answer, else over gRPC."""
        control = self._control
        fp = control.register(layout)
        if self.fast is not None and not include_peers:
            try:
                return self.fast.lookup(fp, keys)
            except (OSError, ConnectionError):
                self.fast.close()  # fall back to gRPC from now on
                self.fast = None
        req = control.request(layout, keys, include_peers)
        reply = control.call(control.stub.Lookup, req, "lookup")
        return tuple(TIER_BY_CODE[c] for c in reply.tiers)

    def acquire(
        self,
        layout: KVLayout,
        keys: list[BlockKey],
        include_peers: bool,
        deadline_s: float,
        engine_copies: bool,
    ) -> Pinned:
        """Pin the longest available prefix of the first ``max_batch_keys``
        of ``keys``. ``engine_copies``: the engine copies out of the views
        (their release first waits for its stream); False for the client's
        own copies, already waited for (``Pinned``)."""
        control = self._control
        keys = keys[: control.max_batch_keys]
        req = control.request(layout, keys, include_peers, deadline_s)
        reply = control.call(control.stub.Acquire, req, "acquire")
        offsets = list(reply.offsets)
        for offset in offsets:  # page tables of units this process has not mapped yet
            self._arena.ensure_ready(offset, layout.block_bytes)
        tiers = tuple(TIER_BY_CODE[c] for c in reply.tiers)
        return Pinned(
            self._arena_tensor,
            self.release,
            self._copier.before_release,
            layout,
            keys[: len(offsets)],
            offsets,
            engine_copies,
            tiers,
        )

    def release(self, layout: KVLayout, keys: list[BlockKey]) -> None:
        """Drop the pins. Over the fast path, one round trip (~0.1 ms);
        over gRPC, without waiting for the reply: a load's copies are done
        by now, so the round trip need not be on its path. Every later
        control call of this client waits for the releases sent before it
        (``PendingReleases.settle``), so what it sees or does comes after
        them. A failed release never raises: it is logged and counted."""
        control = self._control
        if not keys or not control.connected:
            return
        request = control.request(layout, keys)
        fast = control.fast_calls
        if fast is not None:
            try:
                if fast.call("Release", request, control.call_timeout_s, "release") is not None:
                    return
            except TierstoreError as e:
                self._releases.failed(e)
                return
        # Several releases in a row go out together; at most one per
        # acquire made since the last control call is in flight.
        self._releases.add(control.stub.Release.future(request, timeout=control.call_timeout_s))

    def load(
        self,
        layout: KVLayout,
        keys: list[BlockKey],
        rows: torch.Tensor,
        in_hbm: list[bool],
        hbm: HbmWriter | None,
        promote: bool,
        include_peers: bool,
        deadline_s: float,
    ) -> list[TierName]:
        """Copy the longest available prefix of ``keys`` into ``rows``: HBM
        hits from the pool (``hbm``; ``in_hbm[i]``: it holds ``keys[i]``),
        the runs between them from the arena, kept in the pool too with
        ``promote``. One deadline for the whole load, however many calls it
        takes. Returns the tier each block came from; the caller syncs."""
        deadline = time.monotonic() + deadline_s if deadline_s > 0 else None
        promoting = hbm.promote if promote and hbm is not None else None
        max_keys = self._control.max_batch_keys
        tiers: list[TierName] = []
        i = 0
        while i < len(keys):
            if in_hbm[i] and hbm is not None and hbm.read_into(keys[i], rows[i]):
                tiers.append(TierName.HBM)
                i += 1
                continue
            end = i + 1  # a run of blocks the sidecar must supply
            while end < len(keys) and end - i < max_keys and not in_hbm[end]:
                end += 1
            remaining_s = 0.0
            if deadline is not None:
                remaining_s = deadline - time.monotonic()
                if remaining_s <= 0:
                    break
            got = self.load_run(
                layout, keys[i:end], rows[i:end], promoting, include_peers, remaining_s
            )
            tiers.extend(got)
            i += len(got)
            if len(got) < end - (i - len(got)):
                break  # a gap: the rest must be prefilled
        return tiers

    def load_run(
        self,
        layout: KVLayout,
        keys: list[BlockKey],
        rows: torch.Tensor | None,
        promote: Promote | None,
        include_peers: bool = False,
        deadline_s: float = 0.0,
    ) -> list[TierName]:
        """Copy the longest available prefix of ``keys`` (at most
        ``max_batch_keys``) into ``rows`` and offer it to ``promote``; returns
        the tier each block came from. ``rows`` None: nothing is copied out
        (a prefetch into HBM promotes only)."""
        # Acquire says where each block was found (and asks the peers, once,
        # for what is missing here): two control calls per run, acquire and release.
        with self.acquire(layout, keys, include_peers, deadline_s, False) as pinned:
            if rows is not None:
                self._copier.copy_runs(rows, pinned.offsets, layout.block_bytes)
            if promote is not None:
                promote(layout, pinned.keys, pinned.views)
            self._copier.sync()  # copies out of the arena end before the pins go
            if len(pinned.tiers) == len(pinned.keys):
                return list(pinned.tiers)
            # A sidecar that does not say (older): ask, as before.
            local = list(self.lookup(layout, pinned.keys, False))
            beyond = TierName.PEER if include_peers else TierName.DRAM
            return local + [beyond] * (len(pinned.keys) - len(local))

    def close(self) -> None:
        if self.fast is not None:
            self.fast.close()
