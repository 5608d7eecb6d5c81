"""Remote object format and the remote tier's pure policies: every object
that is not exactly the block asked for decodes to None."""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierstore.errors import ConfigError
from tierstore.keys import BlockKey
from tierstore.policies.remote import RemoteObject, RemotePlacement, remote_gc_victims
from tierstore.store.remote import format as fmt
from tierstore.store.remote.client import parse_remote_url, read_credentials_file

FP = bytes(range(32))
KEY = BlockKey(b"k" * 32)
PAYLOAD = os.urandom(4096)


def test_round_trip() -> None:
    obj = fmt.encode_block(FP, KEY, PAYLOAD)
    assert len(obj) == fmt.HEADER_BYTES + len(PAYLOAD)
    got = fmt.decode_block(bytes(obj), FP, KEY, len(PAYLOAD))
    assert got is not None and bytes(got) == PAYLOAD


@pytest.mark.parametrize(
    "fp, key, nbytes",
    [(bytes(32), KEY, len(PAYLOAD)), (FP, BlockKey(b"x" * 32), len(PAYLOAD)), (FP, KEY, 4095)],
    ids=["foreign layout", "other key", "other size"],
)
def test_mislabelled_is_none(fp: bytes, key: BlockKey, nbytes: int) -> None:
    assert fmt.decode_block(bytes(fmt.encode_block(FP, KEY, PAYLOAD)), fp, key, nbytes) is None


@settings(max_examples=200, deadline=None)
@given(st.integers(0, fmt.HEADER_BYTES + 4095), st.integers(1, 255))
def test_any_flipped_byte_is_none(where: int, xor: int) -> None:
    obj = fmt.encode_block(FP, KEY, PAYLOAD)
    obj[where] ^= xor
    assert fmt.decode_block(bytes(obj), FP, KEY, len(PAYLOAD)) is None


@settings(max_examples=100, deadline=None)
@given(st.integers(0, fmt.HEADER_BYTES + 4095))
def test_truncated_or_padded_is_none(cut: int) -> None:
    obj = bytes(fmt.encode_block(FP, KEY, PAYLOAD))
    assert fmt.decode_block(obj[:cut], FP, KEY, len(PAYLOAD)) is None
    assert fmt.decode_block(obj + b"\0", FP, KEY, len(PAYLOAD)) is None


def test_given_digest_is_used_and_a_wrong_one_fails_verify() -> None:
    obj = fmt.encode_block(FP, KEY, PAYLOAD, digest=b"\0" * 32)
    assert fmt.decode_block(bytes(obj), FP, KEY, len(PAYLOAD)) is None


def test_manifest_round_trip_and_block_is_not_a_manifest() -> None:
    assert fmt.decode_manifest(fmt.encode_manifest(FP, KEY, 64), FP, KEY) == 64
    assert fmt.decode_manifest(fmt.encode_manifest(FP, KEY, 64), FP, BlockKey(b"y" * 32)) is None
    block = fmt.encode_block(FP, KEY, b"12345678")
    assert fmt.decode_manifest(bytes(block), FP, KEY) is None
    assert fmt.decode_block(fmt.encode_manifest(FP, KEY, 1), FP, KEY, 8) is None


def test_paths_are_under_prefix_and_layout() -> None:
    assert fmt.object_path("a/b/", FP, KEY) == f"a/b/{FP.hex()}/b/{KEY.hex()}"
    assert fmt.manifest_path("", FP, KEY) == f"{FP.hex()}/m/{KEY.hex()}"


def test_remote_url() -> None:
    assert parse_remote_url("s3://my-bucket/kv/prod/") == ("my-bucket", "kv/prod")
    for bad in ("http://b/p", "s3:///p", "s3://ab/p", "s3://Bad_Name/p"):
        with pytest.raises(ConfigError):
            parse_remote_url(bad)


def test_credentials_file(tmp_path: os.PathLike[str]) -> None:
    path = os.path.join(tmp_path, "c")
    with open(path, "w") as f:
        f.write("[default]\naws_access_key_id = A\naws_secret_access_key = S\n[x]\nfoo = 1\n")
    assert read_credentials_file(path, "default") == {
        "access_key_id": "A",
        "secret_access_key": "S",
    }
    with pytest.raises(ConfigError, match="lacks"):
        read_credentials_file(path, "x")
    with pytest.raises(ConfigError, match="no \\[y\\]"):
        read_credentials_file(path, "y")
    with pytest.raises(ConfigError, match="cannot read"):
        read_credentials_file(path + "-missing", "default")


@pytest.mark.parametrize("mode", ["write_back", "write_through", "both"])
def test_placement(mode: str) -> None:
    p = RemotePlacement(mode, min_tokens=100)
    assert p.on_demote(KEY) == (mode != "write_through")
    assert p.on_end_turn(100) == (mode != "write_back")
    assert not p.on_end_turn(99)
    with pytest.raises(ConfigError):
        RemotePlacement("sometimes")


def test_gc_victims_least_recently_used_first_down_to_the_watermark() -> None:
    objs = [RemoteObject(f"o{i}", 10, last_modified_s=float(i)) for i in range(10)]
    assert remote_gc_victims(objs, 100, 0.5) == []
    victims = remote_gc_victims(objs, 90, 0.5)
    assert [v.path for v in victims] == ["o0", "o1", "o2", "o3", "o4", "o5"]
    # This host read o0 lately: it goes last.
    objs[0] = RemoteObject("o0", 10, 0.0, last_used_s=100.0)
    assert [v.path for v in remote_gc_victims(objs, 90, 0.9)] == ["o1", "o2"]


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 100), st.floats(0, 1e6)), max_size=40),
    st.integers(0, 2000),
    st.floats(0.1, 1.0),
)
def test_gc_victims_property(items: list[tuple[int, float]], budget: int, low: float) -> None:
    objs = [RemoteObject(f"o{i}", size, t) for i, (size, t) in enumerate(items)]
    victims = remote_gc_victims(objs, budget, low)
    total = sum(o.size for o in objs)
    left = total - sum(v.size for v in victims)
    if total <= budget:
        assert victims == []
    else:
        assert left <= int(budget * low)
        # Nothing newer went while something older stayed.
        kept = [o for o in objs if o not in victims]
        if victims and kept:
            assert max(v.recency_s for v in victims) <= min(k.recency_s for k in kept)
