"""Fixtures shared by the e2e modules."""

from __future__ import annotations

import pytest

from harness.sidecar import SidecarProcess

from ..conftest import SidecarFactory


@pytest.fixture(scope="module")
def vllm_sidecar(module_sidecar_factory: SidecarFactory) -> SidecarProcess:
    """One sidecar per module (64 MiB of DRAM and of NVMe) for the modules
    that run real vLLM engines or servers against it."""
    return module_sidecar_factory(dram="64MiB", nvme="64MiB")
