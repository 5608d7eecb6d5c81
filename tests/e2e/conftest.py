"""Fixtures shared by the e2e modules."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ..integration.sidecar import SidecarProcess


@pytest.fixture(scope="module")
def vllm_sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SidecarProcess]:
    """One sidecar per module (64 MiB of DRAM and of NVMe) for the modules
    that run real vLLM engines or servers against it."""
    proc = SidecarProcess(tmp_path_factory.mktemp("sidecar"), dram="64MiB", nvme="64MiB")
    try:
        yield proc
    finally:
        proc.stop()
