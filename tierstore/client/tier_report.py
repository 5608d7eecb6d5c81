"""Reports the engine's HBM tier to its sidecar, so ``tierstore stat`` shows it.

Provides ``TierReporter``: ``report`` sends the pool's counters now (one
ReportTiers call over the client's control channel); ``start`` runs a thread
that reports at once and then every ``every_s`` until ``stop`` is set or the
client is no longer attached. A report that fails because the sidecar is gone
is dropped: there is nobody to tell.

Runs in the engine process: on its own thread ("tierstore-tier-report") and
on whichever thread calls ``StoreClient.report_tiers``.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import asdict

from tierstore.client.control import ControlChannel
from tierstore.client.hbm import HbmTier
from tierstore.errors import TierstoreError
from tierstore.tiers import TierName
from tierstore.v1 import common_pb2, local_pb2


class TierReporter:
    """See the module docstring. ``stop`` is the owner's: set when it closes."""

    def __init__(self, hbm: HbmTier, control: ControlChannel, stop: threading.Event) -> None:
        self._hbm = hbm
        self._control = control
        self._stop = stop
        self._thread: threading.Thread | None = None

    def report(self) -> None:
        s = self._hbm.stats()
        tier = common_pb2.TierStat(name=str(TierName.HBM), **asdict(s))
        req = local_pb2.ReportTiersRequest(client_id=self._control.client_id, tiers=[tier])
        self._control.call(self._control.stub.ReportTiers, req, "report tiers")

    def start(self, every_s: float) -> None:
        self._thread = threading.Thread(
            target=self._loop, args=(every_s,), name="tierstore-tier-report", daemon=True
        )
        self._thread.start()

    def join(self, timeout_s: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)

    def _loop(self, every_s: float) -> None:
        while True:
            with contextlib.suppress(TierstoreError):  # a sidecar gone: nobody to tell
                self.report()
            if self._stop.wait(every_s) or not self._control.connected:
                return
