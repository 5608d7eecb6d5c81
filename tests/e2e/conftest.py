"""Fixtures shared by the e2e modules."""

from __future__ import annotations

import pytest

from harness.sidecar import SidecarProcess

from ..conftest import SidecarFactory


@pytest.fixture(scope="module")
def vllm_sidecar(module_sidecar_factory: SidecarFactory) -> SidecarProcess:
    """One sidecar per module (64 MiB of DRAM, 256 MiB of NVMe) for the
    modules that run real vLLM engines or servers against it. NVMe has room
    for all a module stores: the preemption test fills DRAM 1.5 times over,
    and with 64 MiB NVMe evicted one of its prompts in 2 of 6 runs counted
    (3 of 11 missed that prompt in the warm pass)."""
    return module_sidecar_factory(dram="64MiB", nvme="256MiB")
