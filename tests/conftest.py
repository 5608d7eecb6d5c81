"""Shared fixtures: small store configs in temporary directories."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tierstore.config import StoreConfig
from tierstore.keys import KVLayout

# 8 KiB blocks: 2 (K,V) x 2 layers x 2 heads x 64 dim x 8 tokens x fp16.
SMALL_LAYOUT = KVLayout("test-model", 2, 2, 64, "float16", 8)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def layout() -> KVLayout:
    return SMALL_LAYOUT


@pytest.fixture
def store_config(tmp_path: Path) -> Callable[..., StoreConfig]:
    def make(**overrides: Any) -> StoreConfig:
        values: dict[str, Any] = dict(
            dram_bytes=1 << 20,
            dram_segment_bytes=64 << 10,
            nvme_dir=str(tmp_path / "nvme"),
            nvme_bytes=8 << 20,
            nvme_segment_bytes=64 << 10,
        )
        values.update(overrides)
        return StoreConfig(**values)

    return make


@pytest.fixture(autouse=True)
def _no_leaked_arenas() -> Any:
    """Every test must close the arenas this process creates (they live in
    /dev/shm). Sidecar subprocesses own theirs; their cleanup is tested apart."""
    mine = f"-{os.getpid()}-"
    before = set(os.listdir("/dev/shm"))
    yield
    leaked = {
        n for n in set(os.listdir("/dev/shm")) - before if n.startswith("tierstore-") and mine in n
    }
    for name in leaked:
        os.unlink(os.path.join("/dev/shm", name))
    assert not leaked, f"arena files left behind: {sorted(leaked)}"
