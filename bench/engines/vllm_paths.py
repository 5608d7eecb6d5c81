"""The vLLM benchmark's model and what it measures without an engine
(``bench/engines/vllm_kv.py``): ``ModelSpec`` (the bench's random Llama,
``SMALL`` and ``WIDE``, and its KV layout), ``save_path_s`` (the connector's
own work for one cold prompt: keys, lookup, reserve, one save per layer,
commit, against a real sidecar) and ``copy_runs_gbps`` (the load's copies
between touched buffers, as vLLM's CPU page mover does them: the limit the
loads are compared with). Runs in the benchmark's process.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench.limits import GB, best_of
from tierstore.engines.vllm.driver import WIDE_KV
from tierstore.keys import KVLayout, chain_keys

BLOCK = 128


@dataclass(frozen=True)
class ModelSpec:
    """The bench's random Llama: its ``tiny_llama`` arguments and KV shape."""

    description: str
    num_layers: int
    kv_heads: int
    head_dim: int
    llama: dict[str, int] = field(default_factory=dict)
    llm_kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def block_bytes(self) -> int:
        return 2 * self.num_layers * self.kv_heads * self.head_dim * BLOCK * 2  # K+V, bf16

    def layout(self, name: str) -> KVLayout:
        return KVLayout(name, self.num_layers, self.kv_heads, self.head_dim, "bfloat16", BLOCK)


SMALL = ModelSpec("random Llama, 4 layers, hidden 256, 2 KV heads, bf16", 4, 2, 64)
WIDE = ModelSpec(
    "random Llama with an 8B model's KV per token: 24 layers, hidden 256, "
    "8 KV heads of 128, bf16 (96 KiB a token)",
    WIDE_KV["num_layers"],
    WIDE_KV["kv_heads"],
    WIDE_KV["head_dim"],
    WIDE_KV,
)


def save_path_s(socket: Path, n: int, spec: ModelSpec, reps: int = 5) -> float:
    """The connector's work for one cold prompt of ``n`` tokens (see vllm_kv's docstring)."""
    import torch

    from tierstore.engines.vllm.layout import ConnectorSettings
    from tierstore.engines.vllm.link import StoreLink
    from tierstore.engines.vllm.plan import SaveSpec
    from tierstore.engines.vllm.worker import ConnectorWorker

    layout = spec.layout("bench-save-path")
    names = [f"model.layers.{i}.self_attn.attn" for i in range(spec.num_layers)]
    num_blocks = n // BLOCK + 2
    page = (num_blocks, spec.kv_heads, BLOCK, 2 * spec.head_dim)
    pages = {name: torch.randn(page).to(torch.bfloat16) for name in names}
    settings = ConnectorSettings(socket_path=str(socket))
    link = StoreLink(settings, "bench")
    worker = ConnectorWorker(link, settings, lambda salt: (layout,), 0)
    worker.register(pages, names, spec.block_bytes // spec.num_layers)
    times = []
    try:
        for rep in range(reps):
            tokens = [(n * 31 + rep * 7919 + i) % 100_000 for i in range(n)]  # never stored
            t0 = time.perf_counter()
            keys = chain_keys(layout, tokens)
            client = link.client()
            assert client is not None
            client.lookup(layout, keys)
            # one KV cache group: its block ids (SaveSpec.block_ids is per group)
            worker.reserve([SaveSpec("r", "", (tuple(keys),), (tuple(range(len(keys))),))])
            for name in names:
                worker.save_layer(name)
            worker.end_step()
            times.append(time.perf_counter() - t0)
        assert worker.counters.saved_blocks == reps * (n // BLOCK), worker.counters
    finally:
        link.close()
    return statistics.median(times)


def copy_runs_gbps(
    spec: ModelSpec, num_blocks: int, repeats: int = 3, threads: int = 1,
    shm_dir: str | None = None,
) -> float:  # fmt: skip
    """The load's copies between two touched buffers: per layer, one
    ``copy_runs`` of every block's K and V plane out of an arena-ordered
    buffer (block after block, each every layer's planes) into vLLM's
    per-layer pages on ``threads`` threads, as ``vllm.pages.CpuPageMover``
    does; best of ``repeats``. By default both are numpy arrays (numpy asks
    for transparent huge pages on large ones); with ``shm_dir``, the memory
    the load itself copies between: the source a shared mapping of a file on
    that mount (the sidecar's arena's kind) and the pages torch tensors (as
    vLLM-CPU allocates its KV cache). On a hugetlbfs ``shm_dir`` the kernel's
    pool must have room for this buffer too, beside the arenas."""
    from bench.limits import shm_buffer
    from tierstore.memory.memcopy import copy_runs

    inner = spec.block_bytes // spec.num_layers // 2  # one plane of one layer
    nbytes = num_blocks * spec.block_bytes
    if shm_dir is None:
        src = np.ones(nbytes, dtype=np.uint8)
        pages = [np.zeros(2 * num_blocks * inner, dtype=np.uint8) for _ in range(spec.num_layers)]
    else:
        import torch

        src = np.frombuffer(shm_buffer(nbytes, shm_dir), dtype=np.uint8)
        src[:] = 1
        pages = [
            torch.ones(2 * num_blocks * inner, dtype=torch.uint8).numpy()
            for _ in range(spec.num_layers)
        ]
    blocks = np.arange(num_blocks, dtype=np.int64)
    page_offsets = np.concatenate([blocks * inner, (num_blocks + blocks) * inner])

    def one() -> None:
        for layer, page in enumerate(pages):
            arena = blocks * spec.block_bytes + 2 * layer * inner
            runs = np.concatenate([arena, arena + inner])
            copy_runs(page, src, page_offsets, runs, inner, threads)

    return num_blocks * spec.block_bytes / best_of(repeats, one) / GB
