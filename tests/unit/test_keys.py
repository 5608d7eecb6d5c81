"""Block keys: golden vectors, determinism across processes, chain property."""

from __future__ import annotations

import os
import subprocess
import sys

import blake3
import numpy as np
import pytest

import tierstore.keys
from tierstore.errors import KeyFormatError, LayoutError
from tierstore.keys import KEY_VERSION, KVLayout, chain_keys, check_key, root_key

GOLDEN = KVLayout("golden-llama", 2, 2, 8, "float16", 4)
GOLDEN_FINGERPRINT = "7528e80adb838a4dd446f5874368fd0fa70e7e32a3fc50773b7390243acba275"
GOLDEN_ROOT = "5afd6332c56fb4d5491a3296ef74398bcf5df3e0a844582d3fbf8607b51c1b60"
GOLDEN_KEYS = [  # chain_keys(GOLDEN, range(10)): two full blocks, the last 2 tokens unkeyed
    "c9c4b38466518ddf8074271f005435510f6b7a56f7cba78deec0b5ebc59fba4a",
    "41540fe2ed3ce75acdc85c423b810dbcaaeb78cce327e7fe72ebc8a94c3491ba",
]
GOLDEN_TP1_FIRST = "029fcb2ff3636fde41d6ebc01aacdd1232e5cf218e84266f3a7b8e57016d6281"


@pytest.fixture(params=["c", "python"])
def chain_impl(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test through the C chain loop (when built) and through the
    pure-Python fallback that installs without a compiler use."""
    if request.param == "c":
        if tierstore.keys._c_chain is None:
            pytest.skip("the C extension tierstore._chainhash is not built")
    else:
        monkeypatch.setattr(tierstore.keys, "_c_chain", None)
    return str(request.param)


def test_golden_vectors(chain_impl: str) -> None:
    assert GOLDEN.fingerprint.hex() == GOLDEN_FINGERPRINT
    assert root_key(GOLDEN).hex() == GOLDEN_ROOT
    assert [k.hex() for k in chain_keys(GOLDEN, list(range(10)))] == GOLDEN_KEYS
    tp1 = KVLayout("golden-llama", 2, 2, 8, "float16", 4, tp_rank=1, tp_size=2)
    assert chain_keys(tp1, list(range(4)))[0].hex() == GOLDEN_TP1_FIRST


def test_matches_reference_definition(chain_impl: str) -> None:
    """key[i] = blake3(key[i-1] || LE uint32 tokens), key[-1] = blake3(tag || fp)."""
    tokens = np.random.default_rng(0).integers(0, 2**32, size=37, dtype=np.uint64)
    prev = blake3.blake3(KEY_VERSION + GOLDEN.fingerprint).digest()
    expected = []
    for i in range(len(tokens) // 4):
        block = b"".join(int(t).to_bytes(4, "little") for t in tokens[4 * i : 4 * i + 4])
        prev = blake3.blake3(prev + block).digest()
        expected.append(prev)
    assert chain_keys(GOLDEN, tokens) == expected


def test_input_types_agree(chain_impl: str) -> None:
    tokens = list(range(1000, 1064))
    as_list = chain_keys(GOLDEN, tokens)
    assert chain_keys(GOLDEN, np.array(tokens, dtype=np.int64)) == as_list
    assert chain_keys(GOLDEN, np.array(tokens, dtype=">u4")) == as_list  # big-endian input
    torch = pytest.importorskip("torch")
    assert chain_keys(GOLDEN, torch.tensor(tokens)) == as_list


def test_changed_token_changes_that_block_and_later_only(chain_impl: str) -> None:
    tokens = list(range(64))
    base = chain_keys(GOLDEN, tokens)
    for j in range(len(base)):
        changed = list(tokens)
        changed[4 * j + 2] += 1
        keys = chain_keys(GOLDEN, changed)
        assert keys[:j] == base[:j]
        assert all(a != b for a, b in zip(keys[j:], base[j:]))


def test_parent_continues_the_chain(chain_impl: str) -> None:
    tokens = list(range(40))
    whole = chain_keys(GOLDEN, tokens)
    first = chain_keys(GOLDEN, tokens[:16])
    assert first + chain_keys(GOLDEN, tokens[16:], parent=first[-1]) == whole


def test_c_and_python_chains_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    if tierstore.keys._c_chain is None:
        pytest.skip("the C extension tierstore._chainhash is not built")
    tokens = np.random.default_rng(1).integers(0, 2**32, size=16 * 500 + 7, dtype=np.uint64)
    layout = KVLayout("m", 2, 2, 8, "float16", 16)
    parent = chain_keys(layout, tokens[:16])[0]
    from_c = chain_keys(layout, tokens), chain_keys(layout, tokens[16:], parent=parent)
    monkeypatch.setattr(tierstore.keys, "_c_chain", None)
    from_python = chain_keys(layout, tokens), chain_keys(layout, tokens[16:], parent=parent)
    assert len(from_c[0]) == 500 and from_c == from_python


def test_layout_scopes_keys() -> None:
    tokens = list(range(16))
    variants = [
        GOLDEN,
        KVLayout("golden-llama", 2, 2, 8, "bfloat16", 4),
        KVLayout("golden-llama", 2, 2, 8, "float16", 4, tenant_salt="t1"),
        KVLayout("other", 2, 2, 8, "float16", 4),
    ]
    firsts = {chain_keys(v, tokens)[0] for v in variants}
    assert len(firsts) == len(variants)


def test_same_keys_in_processes_with_different_hash_seeds() -> None:
    code = (
        "from tierstore.keys import KVLayout, chain_keys;"
        "l = KVLayout('golden-llama', 2, 2, 8, 'float16', 4);"
        "print(''.join(k.hex() for k in chain_keys(l, list(range(10)))))"
    )
    outputs = set()
    for seed in ("0", "1", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run(
            [sys.executable, "-c", code],
            env=env,
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        )
        outputs.add(out.stdout.strip())
    assert outputs == {"".join(GOLDEN_KEYS)}


def test_block_bytes() -> None:
    layout = KVLayout(
        "m", num_layers=8, num_kv_heads=4, head_dim=64, dtype="bfloat16", block_tokens=16
    )
    assert layout.block_bytes == 2 * 8 * 4 * 64 * 16 * 2
    assert KVLayout.from_dict(layout.to_dict()) == layout


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"num_layers": 0}, "num_layers"),
        ({"dtype": "float64"}, "dtype"),
        ({"tp_rank": 2, "tp_size": 2}, "tp_rank"),
        ({"model": ""}, "model"),
        ({"block_tokens": True}, "block_tokens"),
    ],
)
def test_bad_layouts_name_the_field(kwargs: dict, needle: str) -> None:
    base = dict(
        model="m", num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", block_tokens=4
    )
    base.update(kwargs)
    with pytest.raises(LayoutError, match=needle):
        KVLayout(**base)


def test_bad_tokens_and_keys() -> None:
    with pytest.raises(KeyFormatError, match="uint32"):
        chain_keys(GOLDEN, [1, -1, 2, 3])
    with pytest.raises(KeyFormatError, match="uint32"):
        chain_keys(GOLDEN, [2**32, 1, 2, 3])
    with pytest.raises(KeyFormatError, match="integers"):
        chain_keys(GOLDEN, [1.5, 2.0, 3.0, 4.0])
    with pytest.raises(KeyFormatError, match="one-dimensional"):
        chain_keys(GOLDEN, [[1, 2], [3, 4]])
    with pytest.raises(KeyFormatError, match="32 bytes"):
        check_key(b"short")
    assert chain_keys(GOLDEN, []) == []
    assert chain_keys(GOLDEN, [1, 2, 3]) == []
