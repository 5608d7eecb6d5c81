"""HFStoreAdapter on a CUDA device: a warm resume equals a cold prefill.

A small random-weight Llama on the GPU (eager attention, float32 and
bfloat16), a StoreClient on the same device with and without an HBM pool:
the blocks saved from the cold prefill's cache go device -> (HBM pool |
pinned arena) and back, and the resume's last logits, its cache's K/V bytes
and its greedy continuation must equal those of a cold prefill of the whole
prompt. tests/e2e/test_hf.py does the same on the CPU for every tier.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from harness.sidecar import SidecarProcess
from tierstore.client import StoreClient, cuda
from tierstore.engines.hf import HFStoreAdapter
from tierstore.tiers import TierName

from ..conftest import SidecarFactory
from .test_hf import NEW_TOKENS, build, prompt, same_bytes

pytestmark = pytest.mark.cuda

LENGTHS = [33, 130]  # reuse 1 and 7 blocks; both end inside a block


@pytest.fixture(scope="module")
def sidecar(module_sidecar_factory: SidecarFactory) -> SidecarProcess:
    return module_sidecar_factory("--set", "shutdown_grace_s=0.5", dram="8MiB")


def cold_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids[None].to("cuda")).logits[0, -1]


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("tier", [TierName.HBM, TierName.DRAM])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_warm_resume_on_cuda_equals_a_cold_prefill(
    sidecar: SidecarProcess, tmp_path: Path, dtype: torch.dtype, tier: TierName, n: int
) -> None:
    model = build(dtype=dtype).to("cuda")
    hbm_bytes = 1 << 20 if tier == TierName.HBM else 0
    before = cuda.registered()
    with StoreClient(str(sidecar.socket), device="cuda", hbm_bytes=hbm_bytes) as client:
        adapter = HFStoreAdapter(model, client)
        ids = prompt(n, seed=500 + n + (1000 if tier == TierName.DRAM else 0))  # own keys
        cold = adapter.prefill(ids)
        assert adapter.save(ids, cold.cache) == n // 16
        warm = adapter.resume(ids)
        reused = adapter.reusable_blocks(n)
        assert warm.num_reused_tokens == reused * 16 and warm.tiers == (tier,) * reused
        ref = cold_logits(model, ids)
        assert warm.logits.device.type == "cuda" and warm.logits.dtype == dtype
        diff = (warm.logits.float() - ref.float()).abs().max().item()
        assert torch.equal(warm.logits, ref), f"warm logits differ from cold by up to {diff:g}"
        for w, c in zip(warm.cache.layers, adapter.prefill(ids).cache.layers, strict=True):
            assert same_bytes(w.keys, c.keys) and same_bytes(w.values, c.values)
        tokens = adapter.generate(ids, NEW_TOKENS).tokens
        assert tokens == adapter.generate(ids, NEW_TOKENS, resume=False).tokens
    assert cuda.registered() == before
    torch.cuda.synchronize()
