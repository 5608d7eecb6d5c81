"""Garbage collection of the remote tier: keep the bucket's prefix under
``remote_bytes``.

Provides ``RemoteGC``: ``gc_once`` lists the objects under the prefix
(at most ``remote_gc_max_objects``), refreshes the ``remote_objects`` /
``remote_used_bytes`` gauges, and deletes the victims that
``tierstore.policies.remote.remote_gc_victims`` chooses (least recently used
first, down to ``remote_gc_low_watermark`` of the budget), 1000 per
request; ``start`` runs it every ``remote_gc_interval_s`` on the
``tierstore-remote-gc`` thread; ``stop`` / ``join`` end that thread.
Recency is this host's last use (``LastUse``), else the object's
modification time; deleted keys are forgotten by the answers cache.

It gets its collaborators explicitly (the S3 client, the tier's counters,
the answers cache, the last-use record) and never calls back into the tier.
Threads: ``gc_once`` on the GC thread or a caller's (tests); the requests
run on the client's ``tierstore-remote-io`` loop thread.
"""

from __future__ import annotations

import threading

from tierstore.config.remote import RemoteConfig
from tierstore.counters import Counters
from tierstore.keys import BlockKey
from tierstore.policies.remote import RemoteObject, remote_gc_victims
from tierstore.store.remote.cache import Answers, LastUse
from tierstore.store.remote.client import ClientClosed, RemoteClient
from tierstore.workers import Workers

GC_COUNTERS = (
    "remote_gc_runs", "remote_gc_deletions", "remote_gc_bytes_deleted", "remote_gc_failures",
    "remote_objects", "remote_used_bytes",  # gauges, as of the last GC listing
)  # fmt: skip

_DELETE_BATCH = 1000  # keys per S3 DeleteObjects request: the protocol's maximum


class RemoteGC:
    """The remote tier's budget keeper. See the module docstring."""

    def __init__(
        self,
        cfg: RemoteConfig,
        client: RemoteClient,
        counters: Counters,
        answers: Answers,
        last_use: LastUse,
    ) -> None:
        self.cfg, self.client, self.counters = cfg, client, counters
        self.answers, self.last_use = answers, last_use
        self.prefix = client.prefix
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, workers: Workers) -> None:
        """Start the ``tierstore-remote-gc`` thread (once)."""
        self._thread = workers.start("tierstore-remote-gc", self._loop)

    def _loop(self) -> None:
        while not self._wake.wait(self.cfg.remote_gc_interval_s):
            try:
                self.gc_once()
            except ClientClosed:  # the client closed under the pass: shutting down
                return

    def gc_once(self) -> int:
        """List the bucket's objects under the prefix and delete the least
        recently used until under the budget; returns how many went."""
        self.counters.add("remote_gc_runs")
        under = f"{self.prefix}/" if self.prefix else None
        try:
            listed = self.client.call(
                self.client.list_objects(under or "", self.cfg.remote_gc_max_objects),
                self.cfg.remote_gc_list_timeout_s,
            )
        except TimeoutError:
            listed = None
        if listed is None:
            self.counters.add("remote_gc_failures")
            return 0
        used = self.last_use.snapshot()
        objects = [
            RemoteObject(o.path, o.size, o.last_modified_s, used.get(o.path, 0.0))
            for o in listed
            if "/_probe/" not in f"/{o.path}"
        ]
        self.counters.set("remote_objects", len(objects))
        self.counters.set("remote_used_bytes", sum(o.size for o in objects))
        if self.cfg.remote_bytes <= 0:
            return 0
        victims = remote_gc_victims(
            objects, self.cfg.remote_bytes, self.cfg.remote_gc_low_watermark
        )
        deleted = self._delete(victims)
        self.counters.set("remote_objects", len(objects) - deleted)
        self.counters.set(
            "remote_used_bytes",
            sum(o.size for o in objects) - sum(v.size for v in victims[:deleted]),
        )
        return deleted

    def _delete(self, victims: list[RemoteObject]) -> int:
        """Delete ``victims`` in batches, in order; stops at the first failed
        batch. Returns how many went."""
        deleted = 0
        for lo in range(0, len(victims), _DELETE_BATCH):
            batch = victims[lo : lo + _DELETE_BATCH]
            try:
                ok = self.client.call(
                    self.client.delete([v.path for v in batch]), self.cfg.remote_request_timeout_s
                )
            except TimeoutError:
                ok = False
            if not ok:
                self.counters.add("remote_gc_failures")
                break
            self.answers.forget([_key_of(v.path) for v in batch])
            deleted += len(batch)
            self.counters.add_many(
                {
                    "remote_gc_deletions": len(batch),
                    "remote_gc_bytes_deleted": sum(v.size for v in batch),
                }
            )
        return deleted

    def stop(self) -> None:
        """Wake the GC thread to end (does not wait: ``join`` does)."""
        self._wake.set()

    def join(self, timeout_s: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)


def _key_of(path: str) -> BlockKey:
    name = path.rsplit("/", 1)[-1]
    try:
        return BlockKey(bytes.fromhex(name))
    except ValueError:
        return BlockKey(b"")
