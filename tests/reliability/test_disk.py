"""Disk faults under a running sidecar: a full disk (an 8 MiB tmpfs the test
mounts, with an NVMe budget far above it), a data file corrupted, truncated
and deleted under the store, and an NVMe directory that is not writable at
start.

Proved: stores keep working (DRAM), failed spills are counted misses
(``spill_failures``, NVMe ``write_failures``), failed reads are counted
(``verify_failures``, ``read_failures``), the sidecar never crashes, lookups
stay truthful (a key looked up as held loads byte-exact, one looked up as
missing does not load), nothing is served wrong, and an unwritable directory
is refused at start with a message naming it. Each fault leaves its log line
in the sidecar's log (rate-limited: one per kind every 10 s): the failed NVMe
write with its error and the store's failed spill (tierstore/store/nvme/batch.py
``write_and_hash``, tierstore/store/demoter.py ``_spill``), and a block that failed
blake3 or could not be read in full, with its offset and file (nvme.py
``_drop_failed``).

On a full disk the NVMe tier caps itself at what its data file holds and
evicts old blocks for new ones (nvme.py ``_full_at_bytes``); its LMDB index
lives on the same full filesystem but keeps room reserved past its end
(``nvme_index_reserve_bytes``), so index commits, and with them spills, keep
succeeding while the disk stays full. When room is freed, the first write
once the tier's look at the free space is due sees it and lifts the cap: the
tier grows again without a restart (``nvme_full_resumed``). The look is due
``nvme_full_backoff_s`` after the cap or the last look, doubling to at most
16x, and another ENOSPC does not postpone it (nvme.py ``_recheck_full``), so
the test stores one chain at a time (each spills through the 1 MiB arena)
until the counter says the cap lifted, within that bound plus slack, instead
of sleeping and hoping the look came.

Mounting needs root and mount(8); those tests skip without them.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness import REPO
from harness.reliability import LAYOUT, SETTINGS, blocks_of, chain, count_wrong
from harness.sidecar import SidecarProcess, arenas_of
from tierstore.client import StoreClient
from tierstore.tiers import TierName

CHAIN_BLOCKS = 32
FULL_BACKOFF_S = 0.2  # nvme_full_backoff_s of the full-disk sidecar
RESUME_BOUND_S = 16 * FULL_BACKOFF_S  # the longest wait between looks (nvme.py)
RESUME_SLACK_S = 10.0  # a loaded machine: spills of the chains stored meanwhile

needs_mount = pytest.mark.skipif(
    os.geteuid() != 0 or not (shutil.which("mount") and shutil.which("umount")),
    reason="mounts a tmpfs: needs root and mount(8)/umount(8)",
)


def mount_tmpfs(path: Path, options: str) -> None:
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], check=True)


def umount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], check=False, capture_output=True)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    mnt = tmp_path / "disk"
    mount_tmpfs(mnt, "size=8m,mode=0700")
    try:
        yield mnt
    finally:
        umount(mnt)


def store_chains(client: StoreClient, seeds: range) -> None:
    for seed in seeds:
        keys = chain(seed, CHAIN_BLOCKS)
        assert all(client.store(LAYOUT, keys, blocks_of(keys))), f"store of chain {seed} refused"


def check_truthful(client: StoreClient, keys: list[bytes]) -> tuple[int, int]:
    """Per key: held by lookup <=> loads, byte-exact. Returns (held, missing)."""
    held = missing = 0
    for key in keys:
        said = client.lookup(LAYOUT, [key]).num_hits  # type: ignore[list-item]
        res = client.load(LAYOUT, [key])  # type: ignore[list-item]
        assert count_wrong([key], res.blocks, res.num_blocks) == 0, "wrong bytes served"
        if said:
            # A block looked up as held may still fail its read now (that is
            # the fault); it must then be gone, not served.
            if res.num_blocks == 0:
                assert client.lookup(LAYOUT, [key]).num_hits == 0  # type: ignore[list-item]
                missing += 1
            else:
                held += 1
        else:
            assert res.num_blocks == 0, "lookup said missing, load returned a block"
            missing += 1
    return held, missing


def log_line(sidecar: SidecarProcess, pattern: str) -> str:
    """The first line of the sidecar's log matching ``pattern`` (a regex); fails without one."""
    for line in sidecar.output().splitlines():
        if re.search(pattern, line):
            return line
    raise AssertionError(f"no log line matches {pattern!r}:\n{sidecar.output()[-3000:]}")


def store_until_resumed(
    sidecar: SidecarProcess, client: StoreClient, first_seed: int
) -> tuple[float, int]:
    """Store one chain at a time until ``nvme_full_resumed`` counts the lifted
    cap; returns (seconds it took, chains stored). Fails past the bound."""
    t0 = time.monotonic()
    deadline = t0 + RESUME_BOUND_S + RESUME_SLACK_S
    for n in range(1, 10_000):
        store_chains(client, range(first_seed + n - 1, first_seed + n))
        c = sidecar.counters()
        if c["nvme_full_resumed"] >= 1:
            return time.monotonic() - t0, n
        assert time.monotonic() < deadline, (
            f"the cap did not lift within {RESUME_BOUND_S + RESUME_SLACK_S} s of the room "
            f"being freed ({n} chains stored): {c}"
        )
        time.sleep(FULL_BACKOFF_S / 4)  # a few stores per backoff: the look needs one
    raise AssertionError("unreachable: the deadline ends the loop")


@needs_mount
def test_full_disk(tmp_path: Path, small_disk: Path) -> None:
    ballast = small_disk / "ballast"  # the operator's other files on that disk
    ballast.write_bytes(b"\1" * (3 << 20))
    sidecar = SidecarProcess(
        tmp_path, "--set", "nvme_index_reserve_bytes=1MiB",
        "--set", f"nvme_full_backoff_s={FULL_BACKOFF_S}",
        settings=SETTINGS, dram="1MiB", nvme="64MiB", nvme_dir=small_disk / "nvme",
    )  # fmt: skip
    sidecar.start()
    try:
        with StoreClient(str(sidecar.socket)) as client:
            store_chains(client, range(60))  # 15 MiB through a 1 MiB arena onto 8 MiB
            c = sidecar.counters()
            nvme = sidecar.tier("nvme")
            assert c["nvme_full_events"] > 0 and c["nvme_disk_full"] == 1, c
            assert c["spill_failures"] > 0 and nvme.write_failures > 0, (c, nvme)
            assert c["spilled_blocks"] > 0
            assert sidecar.alive()
            keys = [
                k
                for s in random.Random(1).sample(range(60), 12)
                for k in chain(s, CHAIN_BLOCKS)[::4]
            ]
            held, missing = check_truthful(client, keys)
            assert held > 0 and missing > 0  # some spilled in time, some were lost
            full = sidecar.counters(), sidecar.tier("nvme")

            # The disk stays full: the capped tier evicts old blocks for new
            # ones, and the index commits from its reserve: spills go on.
            store_chains(client, range(100, 120))
            stuck = sidecar.counters(), sidecar.tier("nvme")
            assert stuck[0]["spilled_blocks"] > full[0]["spilled_blocks"], (full[0], stuck[0])
            assert stuck[1].evictions > full[1].evictions
            assert stuck[0]["nvme_disk_full"] == 1
            assert "NVMe index commit" not in sidecar.output()
            capped = stuck[1].used_bytes

            # Room freed (the ballast goes): the first spill once the look is
            # due sees it and lifts the cap; then the tier grows past what it held.
            assert stuck[0]["nvme_full_resumed"] == 0, stuck[0]
            ballast.unlink()
            resume_s, resume_chains = store_until_resumed(sidecar, client, 200)
            assert resume_s <= RESUME_BOUND_S + RESUME_SLACK_S, resume_s
            grown = range(200 + resume_chains, 220 + resume_chains)
            store_chains(client, grown)
            c, nvme = sidecar.counters(), sidecar.tier("nvme")
            assert c["nvme_full_rechecks"] > stuck[0]["nvme_full_rechecks"], (stuck[0], c)
            assert nvme.used_bytes > capped, (capped, nvme)
            assert c["spilled_blocks"] > stuck[0]["spilled_blocks"], (stuck[0], c)
            assert sidecar.alive()
            check_truthful(client, keys[:40])
            # Still a working cache: the newest chain is in DRAM and exact.
            last = chain(grown[-1], CHAIN_BLOCKS)
            res = client.load(LAYOUT, last)
            assert (
                res.num_blocks == CHAIN_BLOCKS and count_wrong(last, res.blocks, CHAIN_BLOCKS) == 0
            )
        data = re.escape(str(small_disk / "nvme" / "blocks.dat"))
        write_line = log_line(
            sidecar, rf"WARNING.*NVMe write of \d+ blocks to {data} failed: .*No space left"
        )
        resume_line = log_line(sidecar, r"the disk has room again")
        # Nothing stored is damaged: a restart on the same directory reads
        # every indexed block back verified.
        sidecar.stop()
        sidecar.start()
        with StoreClient(str(sidecar.socket)) as client:
            check_truthful(client, keys[:40] + chain(grown[5], CHAIN_BLOCKS))
            assert sidecar.tier("nvme").verify_failures == 0
        print(
            f"\ndisk full (filled, still full, freed): spill_failures "
            f"{'/'.join(str(x[0]['spill_failures']) for x in (full, stuck, (c, nvme)))}, "
            f"spilled {'/'.join(str(x[0]['spilled_blocks']) for x in (full, stuck, (c, nvme)))}"
            f", nvme used {full[1].used_bytes >> 10}/{capped >> 10}/{nvme.used_bytes >> 10} KiB"
            f", rechecks {c['nvme_full_rechecks']}, resumed {c['nvme_full_resumed']} "
            f"{resume_s:.2f} s after the room was freed ({resume_chains} chains stored); "
            f"logged:\n"
            f"  {write_line}\n  {resume_line}"
        )
    finally:
        sidecar.stop()


def nvme_keys(client: StoreClient, seeds: range) -> list[bytes]:
    out = []
    for seed in seeds:
        keys = chain(seed, CHAIN_BLOCKS)
        tiers = client.lookup(LAYOUT, keys).tiers
        out += [k for k, t in zip(keys, tiers) if t == TierName.NVME]
    return out


def test_data_file_corrupted_truncated_deleted(tmp_path: Path) -> None:
    sidecar = SidecarProcess(tmp_path, settings=SETTINGS, dram="1MiB", nvme="16MiB")
    data = sidecar.nvme_dir / "blocks.dat"
    sidecar.start()
    try:
        with StoreClient(str(sidecar.socket)) as client:
            store_chains(client, range(24))  # 6 MiB: all but ~4 chains spill to NVMe
            on_nvme = nvme_keys(client, range(24))
            assert len(on_nvme) > 400

            # Corrupt: flip one byte in every 4 KiB page of the file's first 2 MiB.
            with open(data, "r+b") as f:
                for off in range(0, 2 << 20, 4096):
                    f.seek(off + 100)
                    b = f.read(1)
                    if b:
                        f.seek(off + 100)
                        f.write(bytes([b[0] ^ 0xFF]))
                f.flush()
                os.fsync(f.fileno())
            _, missing = check_truthful(client, on_nvme[::3])
            verify_failures = sidecar.tier("nvme").verify_failures
            assert verify_failures > 0 and missing > 0

            # Truncate under the running store: reads beyond the end are misses.
            os.truncate(data, 1 << 20)
            check_truthful(client, on_nvme[1::3])
            nvme = sidecar.tier("nvme")
            assert nvme.read_failures > 0
            assert sidecar.alive()

            # The tier keeps working: new spills land (the file grows again) and read back.
            store_chains(client, range(200, 212))
            again = nvme_keys(client, range(200, 212))
            assert again
            res = client.load(LAYOUT, again[:CHAIN_BLOCKS])
            assert res.num_blocks == min(CHAIN_BLOCKS, len(again))
            assert count_wrong(again, res.blocks, res.num_blocks) == 0
            counts = (nvme.verify_failures, nvme.read_failures)
        at = rf"WARNING.*NVMe block at offset \d+ of {re.escape(str(data))}"
        verify_line = log_line(sidecar, at + r" failed blake3 verification; dropped")
        read_line = log_line(sidecar, at + r" could not be read in full; dropped")

        # Deleted under the store, then a restart: every row is dropped (logged), all misses.
        os.unlink(data)
        sidecar.stop()
        sidecar.start()
        with StoreClient(str(sidecar.socket)) as client:
            assert check_truthful(client, on_nvme[::7] + again[:10])[0] == 0
        assert "dropped" in sidecar.output()
        print(
            f"\ncorrupted/truncated/deleted: verify_failures {counts[0]}, read_failures "
            f"{counts[1]}, 0 wrong bytes; deleted data file on restart: logged 'dropped ... "
            f"index rows'; logged:\n  {verify_line}\n  {read_line}"
        )
    finally:
        sidecar.stop()


@needs_mount
def test_unwritable_nvme_dir_is_refused_at_start(tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    mount_tmpfs(ro, "size=1m,ro")
    try:
        for nvme_dir, words in ((ro / "nvme", "cannot be created"), (ro, "not writable")):
            proc = subprocess.Popen(
                [
                    sys.executable, "-m", "tierstore.cli", "serve",
                    "--socket", str(tmp_path / "s.sock"), "--nvme-dir", str(nvme_dir),
                    "--dram-bytes", "1MiB", "--metrics-port", "0",
                ],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                env=dict(os.environ, PYTHONPATH=str(REPO)),
            )  # fmt: skip
            try:
                out, _ = proc.communicate(timeout=60)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(10)
            assert proc.returncode != 0
            assert str(nvme_dir) in out and words in out, out[-2000:]
            assert "Traceback" not in out, f"a traceback instead of a message:\n{out[-3000:]}"
            assert not arenas_of(proc.pid), "the refused sidecar left its arena in /dev/shm"
            assert not (tmp_path / "s.sock").exists()
    finally:
        umount(ro)
