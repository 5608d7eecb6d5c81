"""The client's side of prefetch: ask the sidecar, then fill the HBM tier.

Provides ``Prefetcher``, whose ``prefetch`` sends one Prefetch call (the
sidecar promotes the keys' available prefix toward DRAM) under a policy:
``best_effort`` returns a Future at once, done when the sidecar has queued
the work, or with an HBM tier once ``pull`` has brought the available prefix
into HBM; ``wait`` and ``timeout`` return when the sidecar is done or at the
deadline, after pulling the ready blocks into HBM. ``POLICY_CODES`` and
``OUTCOME_NAMES`` map the policies and outcomes to and from local.proto.

Runs in the engine process: ``prefetch`` on the caller's thread; a
best-effort pull into HBM on one background thread ("tierstore-client"),
stopped by ``close``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from tierstore.client.control import ControlChannel
from tierstore.client.results import PrefetchResult
from tierstore.keys import BlockKey, KVLayout, check_keys
from tierstore.v1 import local_pb2

POLICY_CODES = {
    "best_effort": local_pb2.PREFETCH_BEST_EFFORT,
    "wait": local_pb2.PREFETCH_WAIT,
    "timeout": local_pb2.PREFETCH_TIMEOUT,
}
OUTCOME_NAMES = {0: "started", 1: "done", 2: "late", 3: "cancelled"}

# (layout, keys) -> length of the prefix of keys now in HBM
Pull = Callable[[KVLayout, list[BlockKey]], int]


class Prefetcher:
    """See the module docstring. ``pull`` is None without an HBM tier."""

    def __init__(self, control: ControlChannel, pull: Pull | None) -> None:
        self._control = control
        self._pull = pull
        self._background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tierstore-client")

    def prefetch(
        self, layout: KVLayout, keys: Sequence[BlockKey], policy: str, timeout_s: float
    ) -> PrefetchResult | Future[PrefetchResult]:
        """See ``StoreClient.prefetch``."""
        if policy not in POLICY_CODES:
            raise ValueError(
                f"unknown prefetch policy {policy!r}; use one of {sorted(POLICY_CODES)}"
            )
        control = self._control
        keys = check_keys(keys)[: control.max_batch_keys]
        reply = control.call(
            control.stub.Prefetch,
            local_pb2.PrefetchRequest(
                client_id=control.client_id,
                layout_id=control.register(layout),
                keys=b"".join(keys),
                policy=POLICY_CODES[policy],
                timeout_s=timeout_s,
            ),
            "prefetch",
        )
        outcome = OUTCOME_NAMES[reply.outcome]
        pull = self._pull
        if policy != "best_effort":
            if pull is not None and reply.ready_blocks:
                pull(layout, keys[: reply.ready_blocks])
            return PrefetchResult(outcome, reply.ready_blocks, reply.available_blocks)
        if pull is None or outcome == "cancelled" or not reply.available_blocks:
            done: Future[PrefetchResult] = Future()
            done.set_result(PrefetchResult(outcome, 0, reply.available_blocks))
            return done
        return self._background.submit(
            lambda: PrefetchResult(
                outcome, pull(layout, keys[: reply.available_blocks]), reply.available_blocks
            )
        )

    def close(self) -> None:
        """Wait for a pull in progress, then stop the background thread."""
        self._background.shutdown(wait=True)
