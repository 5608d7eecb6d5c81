"""Fixtures shared by the integration modules: a real etcd."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.etcd import MISSING, EtcdProcess, etcd_binary


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdProcess]:
    """A single-node etcd for this test (skipped when etcd is not installed)."""
    if etcd_binary() is None:
        pytest.skip(MISSING)
    (tmp_path / "etcd").mkdir()
    proc = EtcdProcess(tmp_path / "etcd")
    try:
        yield proc
    finally:
        proc.stop()
