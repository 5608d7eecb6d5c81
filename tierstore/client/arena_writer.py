"""Two-phase writes to the sidecar: reserve arena slots, copy, commit.

Provides ``ArenaWriter``. Its ``write`` stores rows of block bytes with the
sidecar in batches of at most the sidecar's ``max_batch_keys``: two control
calls per batch (Reserve, then Commit of the slots granted), with the bytes
copied into the shared arena in between, never over the socket. The client
uses it for ``store`` without an HBM tier (or with ``write_through``) and the
HBM writer for victims and ``flush``. ``reserve``, ``commit`` and ``abort``
are the same calls for a caller that fills the slots itself (an engine
copying layer by layer out of its own pages).

Runs in the engine process, on the threads that call the client and on its
background (prefetch) thread when an eviction writes down; it keeps no state
of its own between calls.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tierstore.client.control import ControlChannel
from tierstore.client.copier import ArenaCopier
from tierstore.client.results import Reserved, ReserveStatus
from tierstore.keys import BlockKey, KVLayout
from tierstore.memory.arena import Arena
from tierstore.v1 import local_pb2


class ArenaWriter:
    """See the module docstring."""

    def __init__(self, control: ControlChannel, arena: Arena, copier: ArenaCopier) -> None:
        self._control = control
        self._arena = arena
        self._copier = copier

    def write(
        self,
        layout: KVLayout,
        keys: list[BlockKey],
        rows: Sequence[torch.Tensor],
        session: str = "",
    ) -> list[bool]:
        """Reserve, copy, commit ``rows[i]`` as ``keys[i]``. Returns whether the
        sidecar holds each block now (written, or held already); ``session``
        goes with the commit (the blocks belong to that session's turn)."""
        control = self._control
        held: list[bool] = []
        n = layout.block_bytes
        for lo in range(0, len(keys), control.max_batch_keys):
            batch = keys[lo : lo + control.max_batch_keys]
            reply = control.call(control.stub.Reserve, control.request(layout, batch), "reserve")
            ok, src, dst = [], [], []
            for j, (status, offset) in enumerate(zip(reply.statuses, reply.offsets)):
                if status == local_pb2.RESERVE_OK:
                    self._arena.ensure_ready(offset, n)  # page tables of a fresh unit, once
                    ok.append(batch[j])
                    src.append(rows[lo + j])
                    dst.append(offset)
                held.append(status != local_pb2.RESERVE_FULL)
            # One streaming copy per run of slots adjacent in the arena and in ``rows``.
            self._copier.copy_rows_to_arena(src, dst, n)
            if ok:
                self._copier.sync()
                req = control.request(layout, ok)
                req.session = session
                control.call(control.stub.Commit, req, "commit")
        return held

    def reserve(self, layout: KVLayout, keys: list[BlockKey]) -> Reserved:
        """Reserve slots for the first ``max_batch_keys`` of ``keys``."""
        control = self._control
        keys = keys[: control.max_batch_keys]
        reply = control.call(control.stub.Reserve, control.request(layout, keys), "reserve")
        return Reserved(keys, tuple(ReserveStatus(s) for s in reply.statuses), tuple(reply.offsets))

    def commit(self, layout: KVLayout, keys: list[BlockKey]) -> list[bool]:
        """Make reserved (and written) blocks readable. Returns which were committed."""
        if not keys:
            return []
        control = self._control
        reply = control.call(control.stub.Commit, control.request(layout, keys), "commit")
        return [bool(f) for f in reply.flags]

    def abort(self, layout: KVLayout, keys: list[BlockKey]) -> int:
        """Give back reservations that will not be written. Returns how many."""
        if not keys:
            return 0
        control = self._control
        reply = control.call(control.stub.Abort, control.request(layout, keys), "abort")
        return int(reply.count)
