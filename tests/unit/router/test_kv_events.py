"""vLLM's KV events decoded without vLLM (``tierstore.router.kv_events``): what
vLLM's own classes encode decodes to the same fields; an event kind we do not
know is skipped and counted, a malformed one fails the batch; blocks keyed by
more than their tokens (a cache salt) are not indexed."""

from __future__ import annotations

import msgspec
import pytest

pytest.importorskip("vllm")
from vllm.distributed import kv_events as vllm_events

from tierstore.keys import chain_keys
from tierstore.router.engine_events import EngineIndex
from tierstore.router.kv_events import BlockRemoved, BlockStored, decode_batch

from ...conftest import SMALL_LAYOUT as L

ENC = msgspec.msgpack.Encoder()


def stored(hashes: list[object], tokens: list[int], **kw: object) -> object:
    fields: dict[str, object] = dict(
        block_hashes=hashes, parent_block_hash=None, token_ids=tokens,
        block_size=L.block_tokens, lora_id=None, medium="GPU", lora_name=None,
    )  # fmt: skip
    fields.update(kw)
    return vllm_events.BlockStored(**fields)  # type: ignore[arg-type]


def test_what_vllm_encodes_decodes_to_the_same_fields() -> None:
    tokens = list(range(2 * L.block_tokens))
    batch = vllm_events.KVEventBatch(
        ts=1.5,
        events=[
            stored([b"\x01" * 32, 7], tokens, medium="CPU"),
            vllm_events.BlockRemoved(block_hashes=[7], medium="GPU"),
            vllm_events.AllBlocksCleared(),
        ],
    )
    got = decode_batch(ENC.encode(batch))
    assert got.unknown == 0 and len(got.events) == 3
    s, r, c = got.events
    assert isinstance(s, BlockStored) and isinstance(r, BlockRemoved)
    assert (s.block_hashes, s.token_ids, s.block_size, s.medium) == (
        [b"\x01" * 32, 7], tokens, L.block_tokens, "CPU")  # fmt: skip
    assert s.parent_block_hash is None and r.block_hashes == [7] and r.medium == "GPU"
    assert type(c).__name__ == "AllBlocksCleared"


def test_an_unknown_event_kind_is_skipped_and_a_malformed_one_fails() -> None:
    tokens = list(range(L.block_tokens))
    ok = ENC.encode(stored([1], tokens))
    payload = ENC.encode([0.0, [msgspec.Raw(ok), {"type": "BlockPinned", "x": 1}], None])
    got = decode_batch(payload)
    assert [type(e).__name__ for e in got.events] == ["BlockStored"] and got.unknown == 1
    bad = ENC.encode([0.0, [{"type": "BlockStored", "block_hashes": "nope"}], None])
    with pytest.raises(msgspec.ValidationError):
        decode_batch(bad)
    with pytest.raises(msgspec.DecodeError):
        decode_batch(b"\xc1 not msgpack")


def test_salted_blocks_are_not_indexed_as_the_plain_prompts() -> None:
    tokens = list(range(L.block_tokens))
    index = EngineIndex(L)
    salted = decode_batch(ENC.encode(vllm_events.KVEventBatch(
        ts=0.0, events=[stored([1], tokens, extra_keys=[("tenant-a",)])]))).events  # fmt: skip
    index.apply("h", 0, salted)
    keys = chain_keys(L, tokens)
    assert index.prefix("h", keys) == b"" and index.counters.snapshot()["salted_blocks"] == 1
    plain = decode_batch(ENC.encode(vllm_events.KVEventBatch(
        ts=0.0, events=[stored([2], tokens)]))).events  # fmt: skip
    index.apply("h", 1, plain)
    assert len(index.prefix("h", keys)) == 1  # the control: the same tokens, unsalted, count
