"""The DRAM arena at the edge of full, every byte checked: the short form of
``bench/reliability/arena_edge.py`` (which runs to a million blocks).

Writers (``put`` and the client's reserve / write / commit, with aborts and
owners released as a dead client's), readers (acquire, compare, release) and
the demoter run at once on an arena of 64 blocks over an NVMe tier of 512,
with two block sizes sharing the arena's segments. Proved: no block any
reader got, and none a tier lists at the end, differs from its key's bytes;
and the run reached the edge (DRAM and NVMe evictions, spills, promotions,
aborts and owner releases all happened). The
controls show the oracle fails on wrong data: a byte changed in a slot, a
block under another key, a block of the wrong size.
"""

from __future__ import annotations

from pathlib import Path

from bench.reliability.arena_edge import LAYOUTS, Chain, block_of, check_entries, make_chains, run
from tierstore.config.store import StoreConfig
from tierstore.store.tiered import TieredStore

CHECKS = 40_000


def test_every_block_read_at_the_edge_of_full_is_exact(tmp_path: Path) -> None:
    out = run(CHECKS, max_s=240.0, seed=7, workdir=tmp_path)
    assert out["thread_errors"] == [] and out["threads_alive"] == []
    assert out["workers_failed"] == {}
    assert out["checked_by_readers"] >= CHECKS
    assert out["swept"] > 0
    assert out["arena_edge_wrong"] == 0
    ops, store, tiers = out["ops"], out["store"], out["tiers"]
    # The edge was reached, every way a slot is freed and taken again.
    assert tiers["dram"]["evictions"] > 0 and tiers["nvme"]["evictions"] > 0
    assert store["spilled_blocks"] > 0 and store["promotions"] > 0
    assert ops["aborted"] > 0 and ops["owner_released"] > 0 and ops["committed"] > 0
    assert tiers["nvme"]["verify_failures"] == 0


def test_the_check_fails_on_wrong_bytes_key_or_size(tmp_path: Path) -> None:
    """Negative controls for ``check_entries``."""
    chains = make_chains(seed=3)
    first = chains[0]
    other = next(c for c in chains if c.layout != first.layout)
    config = StoreConfig(
        dram_bytes=1 << 20, dram_segment_bytes=64 << 10, nvme_bytes=0,
        nvme_dir=str(tmp_path / "unused"),
    )  # fmt: skip
    with TieredStore(config) as store:
        assert all(store.put(first.layout, first.keys, first.blocks))
        assert all(store.put(other.layout, other.keys, other.blocks))

        def check(chain: Chain, keys_of: Chain) -> tuple[int, int]:
            entries = store.acquire(keys_of.layout, keys_of.keys)
            try:
                return check_entries(store, chain, entries)
            finally:
                store.release([e.key for e in entries])

        assert check(first, first) == (len(first.keys), 0)
        # Another chain's blocks (other keys, another size) read as this chain's.
        assert check(first, other) == (len(other.keys), len(other.keys))
        # One byte changed in one slot.
        entries = store.acquire(first.layout, first.keys[2:3])
        view = store.view(entries[0])
        view[100] ^= 0xFF
        store.release(first.keys[2:3])
        assert check(first, first) == (len(first.keys), 1)
    assert block_of(LAYOUTS[0], first.keys[0]) == first.blocks[0]
