"""RemoteTier and the store's remote paths against a real SeaweedFS: blocks
that left DRAM and NVMe come back verified, bad objects are misses,
lookups take a few waves, GC keeps the budget, configuration problems fail
at start, and a state-machine model of the tier."""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import obstore
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from harness.seaweed import ACCESS_KEY, SECRET_KEY
from tests.conftest import SMALL_LAYOUT
from tierstore.config.remote import RemoteConfig
from tierstore.config.store import StoreConfig
from tierstore.errors import ConfigError
from tierstore.keys import BlockKey, chain_keys
from tierstore.store.remote import format as fmt
from tierstore.store.remote.tier import RemoteTier
from tierstore.store.tiered import TieredStore
from tierstore.tiers import TierName

pytestmark = pytest.mark.timeout(120)
L = SMALL_LAYOUT


def chain(n: int, seed: int = 0) -> tuple[list[BlockKey], list[bytes]]:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 32000, size=n * L.block_tokens).tolist()
    blocks = [rng.integers(0, 256, L.block_bytes, dtype=np.uint8).tobytes() for _ in range(n)]
    return chain_keys(L, tokens), blocks


def raw_store(seaweed: Any) -> Any:
    from obstore.store import S3Store

    return S3Store(
        "tierstore-test", endpoint=seaweed.endpoint, access_key_id=ACCESS_KEY,
        secret_access_key=SECRET_KEY, region="us-east-1", client_options={"allow_http": True},
    )  # fmt: skip


@pytest.fixture
def make_store(
    store_config: Callable[..., StoreConfig],
    remote_config: Callable[..., RemoteConfig],
    tmp_path: Any,
) -> Iterator[Callable[..., TieredStore]]:
    """Stores on the test's bucket prefix, each with its own NVMe directory (hosts)."""
    stores: list[TieredStore] = []

    def make(store: dict[str, Any] | None = None, **remote: Any) -> TieredStore:
        local = {"nvme_dir": str(tmp_path / f"nvme-{len(stores)}"), **(store or {})}
        s = TieredStore(store_config(**local), remote=remote_config(**remote))
        stores.append(s)
        return s

    yield make
    for s in stores:
        s.close()


def test_block_gone_from_dram_and_nvme_comes_back_verified(make_store: Any) -> None:
    store = make_store()
    keys, blocks = chain(40)
    store.put(L, keys, blocks)
    assert store.demote(keys) == 40  # spilled to NVMe, and written back to the bucket
    assert store.flush_remote(30)
    store.drop(keys)  # gone from DRAM and NVMe
    assert store.lookup(L, keys).num_hits == 0
    assert store.lookup_remote(L, keys, 5.0) == 40
    assert store.pull_remote(L, keys, 10.0) == 40
    assert store.get(L, keys) == blocks
    stat = store.stat()
    assert stat["tiers"][str(TierName.REMOTE)]["hits"] == 40
    assert stat["store"]["remote_uploads"] == 40
    assert stat["store"]["remote_verify_failures"] == 0


def test_put_never_waits_for_a_full_upload_queue(make_store: Any) -> None:
    store = make_store(remote_upload_queue_bytes=fmt.HEADER_BYTES + L.block_bytes)
    keys, blocks = chain(30)
    store.put(L, keys, blocks)
    store.demote(keys)
    store.flush_remote(30)
    c = store.stat()["store"]
    assert c["remote_uploads_skipped_full"] > 0
    assert c["remote_uploads"] + c["remote_uploads_skipped_full"] == 30


@pytest.mark.parametrize("damage", ["garbage", "truncated", "other key", "other layout"])
def test_bad_object_is_a_counted_miss(make_store: Any, seaweed: Any, damage: str) -> None:
    store = make_store()
    keys, blocks = chain(6)
    store.put(L, keys, blocks)
    store.demote(keys)
    assert store.flush_remote(30)
    store.drop(keys)
    raw = raw_store(seaweed)
    assert store.remote is not None
    path = store.remote.path(L.fingerprint, keys[3])
    good = bytes(obstore.get(raw, path).bytes())
    bad = {
        "garbage": bytes(len(good)),
        "truncated": good[: len(good) // 2],
        "other key": bytes(fmt.encode_block(L.fingerprint, keys[4], blocks[3])),
        "other layout": bytes(fmt.encode_block(bytes(32), keys[3], blocks[3])),
    }[damage]
    obstore.put(raw, path, bad)
    assert store.pull_remote(L, keys, 10.0) == 3
    assert store.get(L, keys) == blocks[:3]
    assert store.stat()["store"]["remote_verify_failures"] == 1
    # The bad object is deleted, so the block's next write-back repairs it.
    deadline = time.monotonic() + 10
    while store.stat()["store"]["remote_bad_objects_deleted"] < 1:
        assert time.monotonic() < deadline, "the bad object was not deleted"
        time.sleep(0.05)
    store.drop(keys)
    store.put(L, keys[3:4], blocks[3:4])
    store.demote(keys[3:4])
    assert store.flush_remote(30)
    store.drop(keys)
    assert store.pull_remote(L, keys, 10.0) == 6
    assert store.get(L, keys) == blocks


def test_write_through_chain_of_500_is_found_in_two_waves(make_store: Any) -> None:
    writer = make_store(store={"dram_bytes": 8 << 20}, remote_min_tokens=1)
    keys, blocks = chain(500, seed=1)
    writer.put(L, keys, blocks)
    assert writer.end_turn_remote(L, keys, len(keys) * L.block_tokens)
    assert writer.flush_remote(60)
    c = writer.stat()["store"]
    assert c["remote_uploads"] == 500 and c["remote_manifests_written"] == 500 // 64
    reader = make_store()  # another host: nothing cached
    assert reader.remote is not None
    assert reader.remote.lookup_prefix(L.fingerprint, keys, 10.0) == (500, 2)
    other, _ = chain(500, seed=2)
    fresh = make_store()
    assert fresh.remote is not None
    assert fresh.remote.lookup_prefix(L.fingerprint, other, 10.0) == (0, 1)
    # A chain that extends a stored one: the stored prefix, in two waves.
    longer = chain_keys(L, [1] * L.block_tokens * 20, parent=keys[-1])
    assert fresh.remote.lookup_prefix(L.fingerprint, keys + longer, 10.0) == (500, 2)


def test_write_through_below_min_tokens_uploads_nothing(make_store: Any) -> None:
    store = make_store(remote_min_tokens=10_000, remote_placement="write_through")
    keys, blocks = chain(8)
    store.put(L, keys, blocks)
    assert not store.end_turn_remote(L, keys, 64)
    store.demote(keys)  # write_through only: leaving DRAM uploads nothing either
    assert store.flush_remote(10)
    assert store.stat()["store"]["remote_uploads"] == 0


def test_gc_deletes_least_recently_used_down_to_the_budget(make_store: Any) -> None:
    obj = fmt.HEADER_BYTES + L.block_bytes
    store = make_store(
        remote_bytes=20 * obj, remote_gc_low_watermark=0.5, remote_gc_interval_s=3600
    )
    keys, blocks = chain(30)
    for lo in range(0, 30, 10):  # three batches, written in order
        store.put(L, keys[lo : lo + 10], blocks[lo : lo + 10])
        store.demote(keys[lo : lo + 10])
        assert store.flush_remote(30)
        time.sleep(1.1)  # S3 modification times have one-second resolution
    assert store.remote is not None
    assert store.remote.gc_once() == 20
    assert store.remote.gc_once() == 0
    c = store.stat()["store"]
    assert c["remote_gc_deletions"] == 20 and c["remote_used_bytes"] == 10 * obj
    assert store.remote.contains(L.fingerprint, keys, 5.0) == [False] * 20 + [True] * 10


def test_wrong_credentials_fail_at_start(remote_config: Any, tmp_path: Any) -> None:
    creds = tmp_path / "wrong"
    creds.write_text("[default]\naws_access_key_id = nobody\naws_secret_access_key = nope\n")
    with pytest.raises(ConfigError, match="credentials"):
        RemoteTier(remote_config(remote_credentials_file=str(creds)))


def test_missing_bucket_fails_at_start(remote_config: Any) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        RemoteTier(remote_config(remote_url="s3://no-such-bucket-here/x"))


def test_unreachable_store_starts_and_answers_misses(remote_config: Any) -> None:
    from tierstore.cli.ports import free_port

    cfg = remote_config(
        remote_endpoint=f"http://127.0.0.1:{free_port()}", remote_max_retries=1,
        remote_request_timeout_s=1.0, remote_flush_on_close_s=0.5,
    )  # fmt: skip
    tier = RemoteTier(cfg, probe_timeout_s=3.0)
    try:
        assert tier.counters.remote_unreachable_at_start == 1
        keys, _ = chain(4)
        t0 = time.monotonic()
        assert tier.lookup_prefix(L.fingerprint, keys, 2.0)[0] == 0
        assert time.monotonic() - t0 < 2.5
        assert tier.offer(L.fingerprint, keys[0], memoryview(bytes(L.block_bytes)), None)
        assert tier.end_turn(L, keys, 1 << 20)  # a long turn: its job meets the dead store
        assert not tier.flush(0.2)  # the upload keeps retrying
    finally:
        tier.close()
    assert tier.counters.remote_uploads_failed == 1
    assert tier.workers.failed() == {}  # no worker died of it


class RemoteMachine(RuleBasedStateMachine):
    """A store with a remote tier against a model of what the bucket and
    the local tiers hold. Whatever is served equals the block's bytes;
    a pull reaches at least as far as the model says is available."""

    N = 12

    def __init__(self) -> None:
        super().__init__()
        self.keys, self.blocks = chain(self.N, seed=7)
        self.local: set[int] = set()  # in DRAM or NVMe
        self.remote: set[int] = set()  # good objects in the bucket
        self.bad: set[int] = set()  # objects that fail verification

    def setup(self, store: TieredStore, raw: Any) -> None:
        self.store, self.raw = store, raw
        assert store.remote is not None
        self.tier = store.remote

    @rule(i=st.integers(0, N - 1))
    def put(self, i: int) -> None:
        self.store.put(L, [self.keys[i]], [self.blocks[i]])
        self.local.add(i)

    @rule(i=st.integers(0, N - 1))
    def leave_dram(self, i: int) -> None:
        if self.store.demote([self.keys[i]]) and self.store.flush_remote(30):
            if i not in self.bad:  # content-addressed: a present object is not rewritten
                self.remote.add(i)

    @rule(i=st.integers(0, N - 1))
    def drop_local(self, i: int) -> None:
        self.store.drop([self.keys[i]])
        self.local.discard(i)

    @rule(i=st.integers(0, N - 1))
    def corrupt_remote(self, i: int) -> None:
        obstore.put(self.raw, self.tier.path(L.fingerprint, self.keys[i]), b"bad")
        self.remote.discard(i)
        self.bad.add(i)

    @rule(i=st.integers(0, N - 1))
    def delete_remote(self, i: int) -> None:
        self.tier.remove(L.fingerprint, [self.keys[i]])
        self.remote.discard(i)
        self.bad.discard(i)

    @rule(n=st.integers(1, N))
    def pull_and_read(self, n: int) -> None:
        expected = 0
        while expected < n and (expected in self.local or expected in self.remote):
            expected += 1
        got = self.store.pull_remote(L, self.keys[:n], 10.0)
        assert got >= expected
        served = self.store.get(L, self.keys[:n])
        assert len(served) >= expected
        for i, data in enumerate(served):
            assert data == self.blocks[i]
            self.local.add(i)

    @invariant()
    def nothing_pinned(self) -> None:
        if hasattr(self, "store"):
            assert self.store.dram.pin_count(0) == 0


def test_state_machine(make_store: Any, seaweed: Any) -> None:
    raw = raw_store(seaweed)
    runs = 0

    class Machine(RemoteMachine):
        def __init__(self) -> None:
            nonlocal runs
            super().__init__()
            runs += 1
            # A fresh prefix per run; a short answer cache so raw deletes are seen.
            url = f"s3://tierstore-test/state-machine-{secrets.token_hex(6)}"
            self.setup(
                make_store(remote_url=url, remote_cache_ttl_s=0.001, remote_placement="write_back"),
                raw,
            )

        def teardown(self) -> None:
            self.store.close()

    Machine.TestCase.settings = settings(
        max_examples=12,
        stateful_step_count=20,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )
    Machine.TestCase().runTest()
    assert runs >= 1
