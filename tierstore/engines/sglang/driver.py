"""SGLang's real HiCache controller on the CPU, backed by tierstore or HiCacheFile.

Runs in SGLang's own environment (``bench/engines/sglang_env.sh``), with the
checkout on PYTHONPATH::

    python -m tierstore.engines.sglang.driver '{"socket_path": "...", ...}'

It builds SGLang's ``MHATokenToKVPool`` on "cpu", an ``MHATokenToKVPoolHost``
over it (``pin_memory=False``: pinning calls CUDA) and a
``HiCacheController`` with the storage backend (``dynamic`` with tierstore's
``TierstoreStorage``, or SGLang's own ``file``), inside SGLang's
parallel-state override for one rank. Then, as ``Spec`` asks:

- **backup**: fills the host pool with random bytes (from ``data_seed``), and
  backs a conversation of ``pages`` pages up through the controller's
  backup thread (``write_storage``, keys from SGLang's own page hash), timed
  to the ack;
- **prefetch**: a fresh host pool asks the controller to prefetch the same
  tokens (its prefetch thread queries ``batch_exists``, its transfer thread
  gets the pages), timed to the last ack, and compares each page it got with
  the page the backup wrote, token by token, layer by layer, in SGLang's own
  layout terms. The writer's pool is rebuilt from ``data_seed`` and
  ``source_layout``, so the backup may have run in another process, on
  another host's sidecar.

With ``ready_memory`` the memory each timed step copies out of and into
(the host pool, the sidecar's arena) is read once just before it, not
timed (``membench.make_ready``), and with ``memcpy_reps`` plain copies are
timed next to the run (``membench.time_memcpy``).

Prints one JSON object (``Result``), or a list of them for a list of specs
(run one after the other in this process). Used by tests/e2e/test_sglang.py and
bench/engines/sglang_hicache.py; not part of the backend SGLang loads.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
import time
from dataclasses import asdict, dataclass, field, fields
from queue import Empty
from typing import Any

import torch

from tierstore.engines.sglang import membench
from tierstore.engines.sglang.layout import StorageSettings, host_pages

log = logging.getLogger("tierstore.engines.sglang.driver")


@dataclass
class Spec:
    # or "file": SGLang's HiCacheFile; or "copy": copystorage.CopyStorage, no store
    backend: str = "tierstore"
    socket_path: str = ""
    file_dir: str = ""  # HiCacheFile's directory
    interface_v1: bool = True  # the zero-copy path (batch_get_v1 / batch_set_v1)
    layout: str = "page_first"  # this process's host pool
    source_layout: str = ""  # the pool the backup ran from ("" = layout)
    layers: int = 4
    heads: int = 2
    head_dim: int = 64
    dtype: str = "bfloat16"
    page_size: int = 16
    mla: bool = False  # an MLA model: MLATokenToKVPool(Host), one latent per token
    kv_lora_rank: int = 64  # MLA's latent: kv_lora_rank + qk_rope_head_dim wide
    qk_rope_head_dim: int = 32
    pages: int = 8  # the conversation's length in pages
    seed: int = 0  # the tokens, and the pool's bytes unless data_seed is set
    data_seed: int = -1  # the source pool's bytes (-1: seed); another seed for the
    # reference pool than the backup used is the oracle's negative control
    backup: bool = True
    prefetch: bool = True
    model: str = "tierstore-test/tiny"
    timeout_s: float = 60.0  # each wait on a controller queue
    memcpy_reps: int = 0  # also time plain copies of the conversation's bytes, this often
    settle_s: float = 0.0  # pause after the backup (the sidecar hashes what it got)
    # Read one byte of every page of the memory a timed step copies out of and
    # into just before it (not timed): the source pool and the sidecar's arena
    # before the backup, the arena and the reader's pool before the prefetch.
    # On this VM idle memory is slow to touch the first time, locked or not;
    # a GPU host's pinned memory is not, and this measures the copies as
    # such a host meets them.
    ready_memory: bool = False
    # HiCacheFile: its files' pages dropped from the page cache after the backup,
    # so the prefetch reads the disk (as pages backed up long ago are read).
    cold_files: bool = False
    # Specs with the same session share their two ranks (pools, controllers,
    # sidecar links), as one SGLang process serves many requests: a bench's
    # runs after the first meet warm links. "" = ranks of its own.
    session: str = ""
    settings: dict[str, Any] = field(default_factory=dict)  # tierstore's extra config

    @property
    def tokens(self) -> list[int]:
        g = torch.Generator().manual_seed(self.seed + 7919)
        n = self.pages * self.page_size
        return torch.randint(0, 32000, (n,), generator=g).tolist()


@dataclass
class Result:
    backup_tokens: int = 0  # backed up, as the controller acked
    backup_s: float = 0.0
    hit_tokens: int = 0  # the prefetch's storage hit query
    prefetched_tokens: int = 0  # brought into the host pool
    prefetch_s: float = 0.0
    pages_compared: int = 0
    pages_equal: int = 0
    first_unequal: int = -1
    page_bytes: int = 0
    memcpy_s: list[float] = field(default_factory=list)  # each torch copy of pages * page_bytes
    copy_runs_s: list[float] = field(default_factory=list)  # each copy_runs of the same
    copy_threads: int = 0  # copy_runs' threads: the backend's copy_threads
    # With memcpy_reps: one copy of the same bytes into memory written when the
    # driver started and idle since (as old as a sidecar arena populated then).
    aged_memcpy_s: float = 0.0
    aged_idle_s: float = 0.0
    ready_bytes: int = 0  # with ready_memory: bytes read through before the timed steps
    backup_stats: dict[str, Any] = field(default_factory=dict)  # TierstoreStorage.stats
    prefetch_stats: dict[str, Any] = field(default_factory=dict)


class Rank:
    """One SGLang rank's device pool, host pool and controller."""

    def __init__(self, spec: Spec, layout: str) -> None:
        from sglang.srt.managers.cache_controller import HiCacheController
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
        from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
        from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

        dtype = getattr(torch, spec.dtype)
        ps = spec.page_size
        size = (spec.pages + 1) * ps
        self.device: Any
        self.host: Any
        if spec.mla:
            self.device = MLATokenToKVPool(
                size, ps, dtype, spec.kv_lora_rank, spec.qk_rope_head_dim, spec.layers, "cpu",
                False, start_layer=0, end_layer=spec.layers,
            )  # fmt: skip
            self.host = MLATokenToKVPoolHost(
                self.device.get_device_pool_infos()[0].buffer_info, 2.0, 0, ps, layout,
                pin_memory=False, device_capacity_tokens=self.device.size,
                start_layer=self.device.start_layer, end_layer=self.device.end_layer,
                target_layer_num=spec.layers,
            )  # fmt: skip
        else:
            self.device = MHATokenToKVPool(
                size, ps, dtype, spec.heads, spec.head_dim, spec.layers, "cpu", False,
                start_layer=0, end_layer=spec.layers,
            )  # fmt: skip
            self.host = MHATokenToKVPoolHost(
                self.device.get_device_pool_infos()[0].buffer_info, 2.0, 0, ps, layout,
                pin_memory=False, device_capacity_tokens=self.device.size,
                start_layer=self.device.start_layer, end_layer=self.device.end_layer,
                write_back_staging=self.device.hicache_write_back_staging,
            )  # fmt: skip
        # On a GPU host the pool is pinned (cudaHostRegister), which faults
        # every page in at start; unpinned here, its pages would be faulted in
        # by the first copies into them: touch them once now, the same.
        self.host.kv_buffer.view(-1).view(torch.uint8).fill_(0)
        allocator = PagedTokenToKVPoolAllocator(size, ps, dtype, "cpu", self.device, False)
        if spec.backend == "tierstore":
            backend = "dynamic"
            extra: dict[str, Any] = {
                "backend_name": "tierstore",
                "module_path": "tierstore.engines.sglang",
                "class_name": "TierstoreStorage",
                "interface_v1": int(spec.interface_v1),
                "socket_path": spec.socket_path,
                **spec.settings,
            }
        elif spec.backend == "file":
            backend, extra = "file", {"file_storage_path": spec.file_dir}
        elif spec.backend == "copy":
            backend = "dynamic"
            extra = {
                "backend_name": "copy",
                "module_path": "tierstore.engines.sglang.copystorage",
                "class_name": "CopyStorage",
                "interface_v1": 1,
                "capacity_pages": spec.pages,
                **spec.settings,
            }
        else:
            raise ValueError(f"backend must be tierstore, file or copy, not {spec.backend!r}")
        self.controller = HiCacheController(
            allocator,
            self.host,
            ps,
            tp_group=None,
            load_cache_event=threading.Event(),
            io_backend="direct",
            storage_backend=backend,
            model_name=spec.model,
            storage_backend_extra_config=extra,
        )
        self.timeout_s = spec.timeout_s

    def fill(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        raw = self.host.kv_buffer.view(-1).view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))

    def alloc(self, num_tokens: int) -> torch.Tensor:
        host_indices = self.host.alloc(num_tokens)
        if host_indices is None:
            raise RuntimeError(f"the host pool has no room for {num_tokens} tokens")
        return host_indices

    def backup(
        self, host_indices: torch.Tensor, tokens: list[int], keys: list[str]
    ) -> tuple[int, float]:
        t0 = time.perf_counter()
        op_id = self.controller.write_storage(host_indices, tokens, hash_value=keys)
        op = self.controller.ack_backup_queue.get(timeout=self.timeout_s)
        seconds = time.perf_counter() - t0
        if op.id != op_id:
            raise RuntimeError(f"acked backup {op.id}, expected {op_id}")
        return op.completed_tokens, seconds

    def prefetch(self, tokens: list[int]) -> tuple[torch.Tensor | None, int, int, float]:
        cc = self.controller
        t0 = time.perf_counter()
        op = cc.prefetch("request-0", tokens)
        hit = cc.prefetch_hit_queue.get(timeout=self.timeout_s)
        if hit is not op:
            raise RuntimeError("the hit queue answered another prefetch")
        hit_tokens = op.storage_hit_count
        if hit_tokens == 0:
            return None, 0, 0, time.perf_counter() - t0
        host_indices = cc.alloc_prefetch_host_buffers(op, hit_tokens)
        if host_indices is None:
            raise RuntimeError(f"the host pool has no room for {hit_tokens} tokens")
        op.host_indices = host_indices
        cc.prefetch_buffer.put(op)
        done = 0
        deadline = time.monotonic() + self.timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"prefetch not acked in {self.timeout_s}s")
            try:
                ack = cc.ack_prefetch_queue.get(timeout=left)
            except Empty:
                continue
            if ack.completed_tokens is not None:
                done = max(done, ack.completed_tokens)
            if ack.completed_req:
                break
        return host_indices, hit_tokens, done, time.perf_counter() - t0

    def wait_arena_tables(self, timeout_s: float) -> None:
        wait = getattr(self.controller.storage_backend, "wait_arena_tables", None)
        if wait is not None and not wait(timeout_s):
            raise TimeoutError(f"the sidecar clients' arena page tables took over {timeout_s}s")

    def pool_bytes(self) -> Any:
        """The host pool's memory, as a flat uint8 array (no copy)."""
        return self.host.kv_buffer.view(-1).view(torch.uint8).numpy()

    def stats(self) -> dict[str, Any]:
        backend = self.controller.storage_backend
        stats = getattr(backend, "stats", None)
        return asdict(stats) if stats is not None else {}

    def close(self) -> None:
        cc = self.controller
        cc.storage_stop_event.set()
        if hasattr(cc.storage_backend, "close"):
            cc.storage_backend.close()


def token_kv(host: Any, slot: int) -> torch.Tensor:
    """K and V of every layer at host token ``slot``: (2, layers, heads, dim)
    (MLA: the latent of every layer, (layers, 1, latent)). Written from
    SGLang's definition of each layout (``init_kv_buffer``), one token at a
    time, independently of tierstore's ``pages`` module."""
    kv, ps = host.kv_buffer, host.page_size
    if hasattr(host, "kv_cache_dim"):  # MLA: the same dims without the K|V one
        if host.layout == "layer_first":  # (layers, tokens, 1, latent)
            return kv[:, slot]
        if host.layout == "page_first":  # (tokens, layers, 1, latent)
            return kv[slot]
        if host.layout == "page_first_direct":  # (pages, layers, page, 1, latent)
            return kv[slot // ps, :, slot % ps]
        raise ValueError(f"no oracle for layout {host.layout!r}")
    if host.layout == "layer_first":  # (2, layers, tokens, heads, dim)
        return kv[:, :, slot]
    if host.layout == "page_first":  # (2, tokens, layers, heads, dim)
        return kv[:, slot]
    if host.layout == "page_first_direct":  # (2, pages, layers, page, heads, dim)
        return kv[:, slot // ps, :, slot % ps]
    raise ValueError(f"no oracle for layout {host.layout!r}")


def compare(
    got: Any, got_idx: torch.Tensor, want: Any, want_idx: torch.Tensor, num_tokens: int
) -> tuple[int, int, int]:
    """Pages compared, pages equal, first unequal page (-1: none)."""
    ps = got.page_size
    equal, first_bad = 0, -1
    pages = num_tokens // ps
    for p in range(pages):
        same = all(
            torch.equal(
                token_kv(got, int(got_idx[p * ps + t])).view(torch.uint8),
                token_kv(want, int(want_idx[p * ps + t])).view(torch.uint8),
            )
            for t in range(ps)
        )
        equal += same
        if not same and first_bad < 0:
            first_bad = p
    return pages, equal, first_bad


def _aged_bytes(spec: Spec) -> int:
    """The conversation's bytes, for a spec that times memcpy (else 0): worked
    out from the spec, as the aged buffers are made before any pool exists."""
    if spec.memcpy_reps <= 0 or spec.mla:
        return 0
    per_token = 2 * spec.layers * spec.heads * spec.head_dim  # K and V
    return per_token * getattr(torch, spec.dtype).itemsize * spec.page_size * spec.pages


_SESSIONS: dict[str, tuple[Rank, Rank]] = {}


def run(spec: Spec) -> Result:
    from sglang.srt.mem_cache.utils import get_storage_hash_str
    from sglang.srt.runtime_context import get_parallel

    if spec.backend == "file" and spec.file_dir:
        os.environ["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] = spec.file_dir
    tokens = spec.tokens
    keys = get_storage_hash_str(tokens, None, page_size=spec.page_size)
    result = Result()
    with get_parallel().override(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_dcp_size=1, attn_dcp_rank=0
    ):
        if spec.session in _SESSIONS:
            source, reader = _SESSIONS[spec.session]
        else:
            source, reader = _ranks(spec)
        try:
            _run(spec, source, reader, tokens, keys, result)
            if spec.session and spec.session not in _SESSIONS:
                # A long-lived rank's sidecar clients build their page tables of
                # the arena in the background after attach; later runs are timed
                # once that is done, as in a server that has been up a while.
                for rank in (source, reader):
                    rank.wait_arena_tables(120.0)
        finally:
            if spec.session:
                _SESSIONS[spec.session] = (source, reader)
            else:
                source.close()
                reader.close()
    return result


def _ranks(spec: Spec) -> tuple[Rank, Rank]:
    """The source and reader ranks. SGLang keeps 10 GiB of host memory out
    of every HiCache pool's budget (HICACHE_HOST_MEMORY_RESERVE_BYTES, sized
    for GPU servers); on a 24 GiB test machine that leaves nothing, so the
    pools are booked against what the machine has free, through SGLang's own
    host_memory_budget_scope."""
    import psutil
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope

    with host_memory_budget_scope(psutil.virtual_memory().available):
        source = Rank(spec, spec.source_layout or spec.layout)
        try:
            return source, Rank(spec, spec.layout)
        except BaseException:
            source.close()
            raise


def _run(
    spec: Spec, source: Rank, reader: Rank, tokens: list[int], keys: list[str], result: Result
) -> None:
    source.fill(spec.seed if spec.data_seed < 0 else spec.data_seed)
    result.page_bytes = source.host.get_size_per_token() * spec.page_size
    if spec.memcpy_reps > 0:
        run_bytes = host_pages(source.host).run_bytes
        threads = StorageSettings.from_extra(spec.settings).copy_thread_count()
        result.copy_threads = threads
        (result.memcpy_s, result.copy_runs_s, result.aged_memcpy_s,
         result.aged_idle_s) = membench.time_memcpy(
            result.page_bytes * spec.pages, spec.memcpy_reps, run_bytes, threads
        )  # fmt: skip
    # The pages the backup wrote: the first alloc of a fresh pool, in this
    # process or in the one that ran the backup.
    written = source.alloc(len(tokens))
    arena = spec.socket_path if spec.backend == "tierstore" else None
    try:
        if spec.backup:
            if spec.ready_memory:
                result.ready_bytes += membench.make_ready([source.pool_bytes()], arena)
            result.backup_tokens, result.backup_s = source.backup(written, tokens, keys)
            result.backup_stats = source.stats()
            if spec.backend == "file":
                # Not timed: the disk writes the backup left dirty, so they do not
                # land in the next timed step (or another backend's run).
                os.sync()
                if spec.cold_files:
                    _drop_cached(spec.file_dir)
            time.sleep(spec.settle_s)
        if spec.prefetch:
            if spec.ready_memory:
                result.ready_bytes += membench.make_ready([reader.pool_bytes()], arena)
            got, result.hit_tokens, done, result.prefetch_s = reader.prefetch(tokens)
            result.prefetched_tokens = done
            if got is not None:
                result.pages_compared, result.pages_equal, result.first_unequal = compare(
                    reader.host, got, source.host, written, done
                )
                reader.host.free(got)
            result.prefetch_stats = reader.stats()
    finally:
        source.host.free(written)


def _drop_cached(directory: str) -> None:
    """Drop the page cache's copy of every file under ``directory``."""
    for root, _, names in os.walk(directory):
        for name in names:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def close_sessions() -> None:
    membench.close_arenas()
    for source, reader in _SESSIONS.values():
        source.close()
        reader.close()
    _SESSIONS.clear()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tierstore.engines.sglang.driver")
    parser.add_argument("spec", help="a JSON object of Spec's fields, or a list of them")
    args = parser.parse_args(argv)
    raw = json.loads(args.spec)
    specs = raw if isinstance(raw, list) else [raw]
    known = {f.name for f in fields(Spec)}
    for one in specs:
        unknown = sorted(set(one) - known)
        if unknown:
            parser.error(f"unknown spec fields {unknown}; known: {sorted(known)}")
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    # One after the other in this process (SGLang imports once), each with
    # pools and a controller of its own.
    try:
        membench.prepare_aged([_aged_bytes(Spec(**one)) for one in specs])
        results = []
        for one in specs:
            results.append(asdict(run(Spec(**one))))
    finally:
        close_sessions()
    print(json.dumps(results if isinstance(raw, list) else results[0]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
