"""What a host crash loses of a finished turn, between real sidecars and a
real SeaweedFS: a durable EndTurn returns once the bucket holds every block,
so a SIGKILL right after it loses nothing (a fresh host with empty disks
reuses the whole turn, and says it came from the remote tier); a plain
EndTurn only queues the write-through, and a SIGKILL inside that window
loses the turn, which the sidecar's stat showed as not yet durable. The HF
adapter's resume on the fresh host reports the bucket's blocks as
``remote`` and gives the logits of a cold prefill.

Every wait is bounded; every process this file starts is stopped.
"""

from __future__ import annotations

import secrets
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from harness.seaweed import ACCESS_KEY, SECRET_KEY, FaultProxy
from harness.sidecar import SidecarProcess, start_sidecar
from tests.conftest import SMALL_LAYOUT
from tierstore.cli.stat import _stat_dict, format_stat
from tierstore.client import StoreClient
from tierstore.keys import BlockKey, KVLayout, chain_keys
from tierstore.tiers import TierName

pytestmark = pytest.mark.timeout(180)
L: KVLayout = SMALL_LAYOUT
REMOTE = TierName.REMOTE
# Nothing reaches the bucket unless a turn is written through: no write-back
# of blocks leaving DRAM, and plain EndTurns of these turns are too short.
ONLY_DURABLE = ("--set", "remote_placement=write_through", "--set", "remote_min_tokens=1000000")


@pytest.fixture
def hosts(
    seaweed: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[..., SidecarProcess]]:
    """Sidecars on one bucket prefix, each in its own (empty) directory."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    started: list[SidecarProcess] = []
    url = f"s3://tierstore-test/durable-{secrets.token_hex(6)}"

    def start(name: str, *extra: str, endpoint: str = "") -> SidecarProcess:
        root = tmp_path / name
        root.mkdir()
        proc = start_sidecar(
            root, "--remote-url", url, "--remote-endpoint", endpoint or seaweed.endpoint,
            "--set", "remote_request_timeout_s=2", "--set", "remote_max_retries=1",
            "--set", "remote_upload_backoff_s=0.1", "--set", "remote_upload_backoff_max_s=0.2",
            "--set", "shutdown_grace_s=0.5", *extra, dram="4MiB", nvme="4MiB",
        )  # fmt: skip
        started.append(proc)
        return proc

    yield start
    for p in started:
        p.stop(timeout_s=20)


def blocks_of(n: int, seed: int) -> tuple[list[BlockKey], torch.Tensor]:
    rng = np.random.default_rng(seed)
    toks = rng.integers(0, 32000, size=n * L.block_tokens)
    data = rng.integers(0, 256, size=(n, L.block_bytes), dtype=np.uint8)
    return chain_keys(L, toks), torch.from_numpy(data)


def counters(client: StoreClient) -> dict[str, int]:
    return dict(client.stat().counters)


def test_a_durable_end_turn_survives_a_sigkill_and_a_fresh_host_reuses_it_all(
    hosts: Any,
) -> None:
    keys, data = blocks_of(48, 1)
    a = hosts("a", *ONLY_DURABLE)
    with StoreClient(str(a.socket)) as c:
        assert all(c.store(L, keys, data))
        reply = c.end_turn("s", L, keys, len(keys) * L.block_tokens, durable=True)
        assert reply.durable and reply.durable_blocks == len(keys), reply
        assert reply.not_durable_reason == "" and reply.durable_wait_s > 0
        stat = counters(c)
        assert stat["remote_turns_not_durable"] == 0 and stat["remote_turns_durable"] == 1
        assert stat["remote_durable_end_turns"] == 1
        assert stat["remote_durable_end_turns_failed"] == 0
    a.stop(signal.SIGKILL)  # right after end_turn returned
    b = hosts("b", *ONLY_DURABLE)  # another host: empty DRAM and NVMe, the same bucket
    with StoreClient(str(b.socket)) as c:
        got = c.load(L, keys, include_peers=True, deadline_s=30)
        assert got.num_blocks == len(keys) and torch.equal(got.blocks.cpu(), data)
        assert got.tiers == (REMOTE,) * len(keys)  # pulled from the bucket, not from a peer


def test_a_plain_end_turn_is_lost_by_a_sigkill_before_the_bucket_has_it(
    seaweed: Any, hosts: Any
) -> None:
    """The window of a plain EndTurn, made wide on purpose: the store refuses
    connections, so the turn waits in the sidecar (and stat says so) when
    the SIGKILL comes. A durable EndTurn in the same state says it is not
    durable, at its deadline."""
    keys, data = blocks_of(24, 2)
    short, short_data = blocks_of(4, 3)
    proxy = FaultProxy(int(seaweed.endpoint.rsplit(":", 1)[1]))
    try:
        a = hosts(
            "a", "--set", "remote_min_tokens=64", "--set", "remote_durable_timeout_s=1.5",
            endpoint=proxy.endpoint,
        )  # fmt: skip
        with StoreClient(str(a.socket)) as c:
            assert all(c.store(L, keys, data)) and all(c.store(L, short, short_data))
            proxy.set_mode("refuse")
            t0 = time.monotonic()
            c.end_turn("s", L, keys, len(keys) * L.block_tokens)  # queued: returns at once
            assert time.monotonic() - t0 < 2.0
            stat = counters(c)
            assert stat["remote_turns_not_durable"] == 1  # what a crash now would lose
            assert stat["remote_turn_blocks_not_durable"] == len(keys)
            text = format_stat(_stat_dict(c.stat()))  # what `tierstore stat` prints
            assert f"not yet in the bucket: 1 turns ({len(keys)} blocks)" in text
            reply = c.end_turn(
                "t", L, short, len(short) * L.block_tokens, durable=True, durable_timeout_s=1.0
            )
            assert not reply.durable and reply.durable_blocks == 0
            assert "had not acknowledged" in reply.not_durable_reason, reply
            assert 1.0 <= reply.durable_wait_s < 3.0
            stat = counters(c)
            assert stat["remote_turns_not_durable"] == 2
            assert stat["remote_durable_end_turns_failed"] == 1
            # A longer wait than the sidecar allows is cut to remote_durable_timeout_s:
            # a handler thread is not held for as long as any client asks.
            t0 = time.monotonic()
            reply = c.end_turn(
                "t", L, short, 4 * L.block_tokens, durable=True, durable_timeout_s=60
            )
            assert not reply.durable and 1.5 <= reply.durable_wait_s < 4.0, reply
            assert time.monotonic() - t0 < 6.0
        # A client whose call deadline comes first gets the reply before it, not an error.
        with StoreClient(str(a.socket), call_timeout_s=1.0) as c:
            reply = c.end_turn("t", L, short, 4 * L.block_tokens, durable=True)
            assert not reply.durable and reply.durable_wait_s < 1.0, reply
        a.stop(signal.SIGKILL)
    finally:
        proxy.close()
    b = hosts("b")
    with StoreClient(str(b.socket)) as c:
        assert c.lookup(L, keys, include_peers=True).num_hits == 0  # the turn was lost
        assert c.lookup(L, short, include_peers=True).num_hits == 0


def test_a_durable_end_turn_without_a_remote_tier_says_so(tmp_path: Path) -> None:
    keys, data = blocks_of(4, 4)
    p = start_sidecar(tmp_path)
    try:
        with StoreClient(str(p.socket)) as c:
            assert all(c.store(L, keys, data))
            reply = c.end_turn("s", L, keys, len(keys) * L.block_tokens, durable=True)
            assert not reply.durable and "no remote tier" in reply.not_durable_reason
    finally:
        p.stop()


def test_hf_resume_on_a_fresh_host_reports_the_bucket_and_cold_logits(hosts: Any) -> None:
    """The operator's run of the issue: a session's turn ends durably, the
    host is SIGKILLed, and the session resumes on a host with empty disks."""
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    from tierstore.engines.hf import HFStoreAdapter

    config = LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
    )  # fmt: skip
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 512, (300,), generator=torch.Generator().manual_seed(1))
    a = hosts("a", *ONLY_DURABLE)
    with StoreClient(str(a.socket)) as c:
        adapter = HFStoreAdapter(model, c)
        first = adapter.resume(ids)
        assert first.num_reused_tokens == 0
        stored = adapter.save(ids, first.cache)
        assert stored == len(adapter.keys(ids)) > 0
        reply = adapter.end_turn("s", ids, durable=True)
        assert reply.durable and reply.durable_blocks == stored, reply
    a.stop(signal.SIGKILL)
    b = hosts("b", *ONLY_DURABLE)
    with StoreClient(str(b.socket)) as c:
        adapter = HFStoreAdapter(model, c)
        res = adapter.resume(ids, include_peers=True, deadline_s=30)
        want = adapter.reusable_blocks(len(ids))
        assert len(res.tiers) == want > 0 and res.tiers == (REMOTE,) * want
        assert res.num_reused_tokens == want * adapter.layout.block_tokens
        with torch.no_grad():
            cold = model(ids[None]).logits[0, -1]
        assert torch.equal(res.logits, cold)
