"""SGLang's real HiCache controller on tierstore (tierstore.engines.sglang).

Each test runs ``tierstore.engines.sglang.driver`` in SGLang's own
environment (built by bench/engines/sglang_env.sh on first use: torch 2.14.1 and
sglang 0.5.23, next to this environment's CPU torch 2.13.0): SGLang's
``MHATokenToKVPool`` on the CPU, its ``MHATokenToKVPoolHost`` in each of its
three layouts and its ``HiCacheController`` with ``--hicache-storage-backend
dynamic`` loading ``TierstoreStorage``. The controller's backup thread
writes a conversation's pages to a real sidecar, a fresh host pool's
prefetch brings them back, and the driver compares every page token by
token with what was backed up.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harness import REPO
from harness.sidecar import SidecarProcess, overwrite_nvme_blocks, start_sidecar
from tierstore.cli.ports import free_port
from tierstore.client import StoreClient
from tierstore.keys import KVLayout, chain_keys

from ..conftest import SidecarFactory

pytestmark = pytest.mark.sglang

PAGES = 8
PAGE = 16
ENV_TIMEOUT_S = 1200  # a fresh environment: about 6 GB from this machine's disk
DRIVER_TIMEOUT_S = 240
QUICK = ("--set", "shutdown_grace_s=0.5")  # the tests' sidecars stop at once


@pytest.fixture(scope="module")
def sglang_python() -> Path:
    """SGLang's environment's python; a failed build fails the tests."""
    venv = Path(
        os.environ.get("SGLANG_VENV") or Path.home() / ".cache" / "tierstore-bench" / "sglang-venv"
    )
    proc = subprocess.run(
        ["bash", str(REPO / "bench" / "engines" / "sglang_env.sh"), str(venv)],
        capture_output=True,
        text=True,
        timeout=ENV_TIMEOUT_S,
    )
    assert proc.returncode == 0, f"sglang_env.sh failed:\n{proc.stdout}\n{proc.stderr}"
    return venv / "bin" / "python"


def spec(socket: Path | str, **fields: Any) -> dict[str, Any]:
    return {"socket_path": str(socket), "pages": PAGES, "page_size": PAGE, **fields}


def drive_all(python: Path, specs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Run the driver's specs one after the other in one process (SGLang's
    imports take about 10 s)."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [str(python), "-m", "tierstore.engines.sglang.driver", json.dumps(specs)],
        capture_output=True,
        text=True,
        timeout=DRIVER_TIMEOUT_S,
        env=env,
    )
    assert proc.returncode == 0, f"driver failed ({specs}):\n{proc.stderr[-4000:]}"
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == len(specs)
    return results


def drive(python: Path, socket: Path | str, **fields: Any) -> dict[str, Any]:
    return drive_all(python, [spec(socket, **fields)])[0]


@pytest.fixture(scope="module")
def sidecar(module_sidecar_factory: SidecarFactory) -> SidecarProcess:
    return module_sidecar_factory(*QUICK, dram="64MiB", nvme="256MiB")


def _all_equal(r: dict[str, Any]) -> None:
    tokens = PAGES * PAGE
    assert r["hit_tokens"] == tokens
    assert r["prefetched_tokens"] == tokens
    assert r["pages_compared"] == PAGES
    assert r["pages_equal"] == PAGES, f"page {r['first_unequal']} differs"


LAYOUTS = ("layer_first", "page_first", "page_first_direct")
CASES = [(layout, v1) for layout in LAYOUTS for v1 in (True, False)]


# The v1 path with pages big enough for its copies to run on helper threads
# (1 MiB blocks, 8 pages: two threads), the driver reading the host pools and
# the arena through before each timed step and timing its plain copies, as
# bench/engines/sglang_hicache.py's tierstore_ready runs do.
THREADED = ("threaded", True)
THREADED_SPEC = dict(layout="page_first_direct", interface_v1=True, layers=4, heads=8,
                     head_dim=128, page_size=64, settings={"copy_threads": 2},
                     ready_memory=True, memcpy_reps=1)  # fmt: skip


# The bench's limit: SGLang's controller around copystorage.CopyStorage (no store).
COPY = ("copy", True)


@pytest.fixture(scope="module")
def round_trips(sglang_python: Path, sidecar: SidecarProcess) -> dict[tuple[str, bool], Any]:
    """Backup then prefetch, each layout on each path, in one driver run;
    the threaded case last."""
    specs = [
        spec(sidecar.socket, layout=layout, interface_v1=v1, seed=100 + i)
        for i, (layout, v1) in enumerate(CASES)
    ]
    specs.append(spec(sidecar.socket, seed=200, **THREADED_SPEC))
    specs.append(spec(sidecar.socket, seed=300, backend="copy", layout="page_first_direct"))
    return dict(zip([*CASES, THREADED, COPY], drive_all(sglang_python, specs)))


@pytest.mark.parametrize("interface_v1", [True, False], ids=["v1", "generic"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_backup_then_prefetch_is_byte_exact(
    round_trips: dict[tuple[str, bool], Any], layout: str, interface_v1: bool
) -> None:
    r = round_trips[layout, interface_v1]
    assert r["backup_tokens"] == PAGES * PAGE
    assert r["backup_stats"]["stored_pages"] == PAGES
    _all_equal(r)
    assert r["prefetch_stats"]["loaded_pages"] == PAGES
    assert r["prefetch_stats"]["hit_tiers"] == {"dram": PAGES}
    # The copies' share of the sets and gets is timed, within them.
    assert 0 < r["backup_stats"]["store_copy_s"] <= r["backup_stats"]["store_s"]
    assert 0 < r["prefetch_stats"]["load_copy_s"] <= r["prefetch_stats"]["load_s"]


def test_v1_copies_on_threads_with_memory_made_ready(round_trips: dict[Any, Any]) -> None:
    r = round_trips[THREADED]
    assert r["page_bytes"] == 1 << 20 and r["copy_threads"] == 2
    assert r["backup_tokens"] == PAGES * 64
    assert r["prefetched_tokens"] == PAGES * 64
    assert r["pages_compared"] == PAGES
    assert r["pages_equal"] == PAGES, f"page {r['first_unequal']} differs"
    # The pools and the arena were read through before each of the two steps.
    assert r["ready_bytes"] > 2 * r["page_bytes"] * PAGES
    assert len(r["memcpy_s"]) == len(r["copy_runs_s"]) == 1 and r["aged_memcpy_s"] > 0


def test_the_bench_limit_backend_copies_the_pages_through_the_controller(
    round_trips: dict[Any, Any],
) -> None:
    r = round_trips[COPY]
    assert r["backup_tokens"] == r["hit_tokens"] == r["prefetched_tokens"] == PAGES * PAGE
    assert r["pages_compared"] == PAGES
    assert r["pages_equal"] == PAGES, f"page {r['first_unequal']} differs"
    assert r["backup_stats"] == r["prefetch_stats"] == {}  # no sidecar was asked


def test_pages_move_between_layouts_and_paths_and_the_oracle_sees_wrong_bytes(
    sglang_python: Path, sidecar: SidecarProcess
) -> None:
    """One host backs up from page_first on the generic path; others, in
    other processes, read layer_first and page_first_direct on the v1 path:
    one byte order for every layout. The same read against a reference built
    from other bytes compares every page and finds none equal."""
    first, *reads, wrong = drive_all(sglang_python, [
        spec(sidecar.socket, layout="page_first", interface_v1=False, seed=200, prefetch=False),
        spec(sidecar.socket, layout="layer_first", source_layout="page_first", seed=200,
             backup=False),
        spec(sidecar.socket, layout="page_first_direct", source_layout="page_first", seed=200,
             backup=False),
        spec(sidecar.socket, layout="layer_first", source_layout="page_first", seed=200,
             data_seed=201, backup=False),
    ])  # fmt: skip
    assert first["backup_stats"]["stored_pages"] == PAGES
    for r in reads:
        _all_equal(r)
    assert wrong["pages_compared"] == PAGES
    assert wrong["pages_equal"] == 0


def test_mla_pages_round_trip_in_every_layout_and_between_layouts(
    sglang_python: Path, sidecar: SidecarProcess
) -> None:
    """SGLang's MLATokenToKVPool(Host) (one 96-wide latent per token and
    layer, no K and V): backup then prefetch per layout, then a page_first
    backup on the generic path read layer_first on the v1 path, and that
    read against other bytes as the negative control."""
    mla = {"mla": True, "kv_lora_rank": 64, "qk_rope_head_dim": 32}
    *same, cross_write, cross_read, wrong = drive_all(sglang_python, [
        *(spec(sidecar.socket, layout=layout, seed=700 + i, **mla)
          for i, layout in enumerate(LAYOUTS)),
        spec(sidecar.socket, layout="page_first", interface_v1=False, seed=710, prefetch=False,
             **mla),
        spec(sidecar.socket, layout="layer_first", source_layout="page_first", seed=710,
             backup=False, **mla),
        spec(sidecar.socket, layout="layer_first", source_layout="page_first", seed=710,
             data_seed=711, backup=False, **mla),
    ])  # fmt: skip
    for r in same:
        assert r["backup_stats"]["stored_pages"] == PAGES
        _all_equal(r)
        assert r["page_bytes"] == 4 * PAGE * 96 * 2  # 4 layers of a bf16 latent of 96
    assert cross_write["backup_stats"]["stored_pages"] == PAGES
    _all_equal(cross_read)
    assert wrong["pages_compared"] == PAGES
    assert wrong["pages_equal"] == 0


def test_a_second_backup_of_the_same_pages_finds_them_held(
    sglang_python: Path, sidecar: SidecarProcess
) -> None:
    once = spec(sidecar.socket, seed=300, prefetch=False)
    _, again = drive_all(sglang_python, [once, once])
    assert again["backup_tokens"] == PAGES * PAGE
    assert again["backup_stats"]["existing_pages"] == PAGES
    assert again["backup_stats"]["stored_pages"] == 0


@pytest.fixture(scope="module")
def peers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[SidecarProcess, ...]]:
    pa, pb = free_port(), free_port()
    procs: list[SidecarProcess] = []
    try:
        for name, port, other in (("a", pa, pb), ("b", pb, pa)):
            flags = (
                "--set", f"peer_port={port}", "--set", f"peers=127.0.0.1:{other}",
                "--set", "peer_token=sglang-e2e", *QUICK,
                # No replicas: host b holds nothing until it pulls.
                "--set", "min_tokens=1000000000", "--set", "replicate_policy=kv_share",
            )  # fmt: skip
            root = tmp_path_factory.mktemp(f"peer-{name}")
            procs.append(start_sidecar(root, *flags, dram="64MiB", nvme="64MiB"))
        yield tuple(procs)
    finally:
        for p in procs:
            p.stop()


def test_a_second_host_reads_the_first_hosts_pages_through_the_peer_tier(
    sglang_python: Path, peers: tuple[SidecarProcess, ...]
) -> None:
    a, b = peers
    _, alone, r = drive_all(sglang_python, [
        spec(a.socket, seed=400, prefetch=False),
        spec(b.socket, seed=400, backup=False),
        spec(b.socket, seed=400, backup=False, settings={"include_peers": True}),
    ])  # fmt: skip
    assert alone["hit_tokens"] == 0  # without include_peers, host b has nothing
    _all_equal(r)
    assert r["prefetch_stats"]["hit_tiers"] == {"peer": PAGES}


def _verify_failures(socket: Path) -> int:
    with StoreClient(str(socket)) as c:
        return next(t.verify_failures for t in c.stat().tiers if t.name == "nvme")


def test_a_corrupt_block_is_a_miss_and_the_controller_goes_on(
    sglang_python: Path, tmp_path: Path
) -> None:
    """Pages pushed from DRAM to NVMe, whose bytes are then overwritten: the
    lookup finds them, the get fails the sidecar's verification, SGLang is
    told 0 pages came and acks the prefetch (it recomputes them)."""
    sc = start_sidecar(tmp_path, "--set", "dram_segment_bytes=1MiB", "--set",
                        "nvme_segment_bytes=1MiB", *QUICK, dram="8MiB", nvme="64MiB")  # fmt: skip
    try:
        drive(sglang_python, sc.socket, seed=500, prefetch=False)
        with StoreClient(str(sc.socket)) as c:  # fill DRAM twice over: the pages go to NVMe
            filler = KVLayout("filler", 4, 2, 64, "bfloat16", 16)
            n = 2 * 8 * 1024 * 1024 // filler.block_bytes
            keys = chain_keys(filler, list(range(n * 16)))
            for lo in range(0, n, 16):
                assert all(c.store(filler, keys[lo : lo + 16], bytearray(16 * filler.block_bytes)))
        before = _verify_failures(sc.socket)
        overwrite_nvme_blocks(sc.nvme_dir)
        r = drive(sglang_python, sc.socket, seed=500, backup=False)
        assert r["hit_tokens"] == PAGES * PAGE  # the index still lists them
        assert r["prefetched_tokens"] == 0
        assert r["prefetch_stats"]["missed_pages"] == PAGES
        assert _verify_failures(sc.socket) > before
    finally:
        sc.stop()


@pytest.mark.parametrize("how", ["killed", "stopped"])
def test_a_dead_or_hung_sidecar_gives_misses_and_never_hangs_sglang(
    sglang_python: Path, tmp_path: Path, how: str
) -> None:
    """Killed: the socket is gone. Stopped (SIGSTOP): it accepts and never
    answers. Either way the backup is acked with nothing stored and the
    prefetch finds nothing, within the link's timeouts."""
    sc = start_sidecar(tmp_path, *QUICK, dram="8MiB", nvme="8MiB")
    settings = {"connect_timeout_s": 1.0, "call_timeout_s": 1.0, "reconnect_s": 0.5}
    try:
        if how == "killed":
            sc.proc.kill()
            sc.proc.wait(10)
        else:
            sc.freeze()
        r = drive(sglang_python, sc.socket, seed=600, settings=settings, timeout_s=30.0)
        assert r["backup_tokens"] == 0
        assert r["hit_tokens"] == 0
        assert r["backup_stats"]["stored_pages"] == 0
    finally:
        if how == "stopped":
            sc.thaw()
        sc.stop()
