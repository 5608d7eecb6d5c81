"""KV layouts and content-addressed block keys.

Provides:
- ``KVLayout``: the namespace of a KV cache (model, shape, dtype, block size,
  tensor-parallel rank, tenant salt) with a stable ``fingerprint``.
- ``BlockKey``: a distinct type for the 32-byte chained blake3 keys.
- ``chain_keys(layout, token_ids)``: one key per *full* block of a prompt,
  ``key[i] = blake3(key[i-1] || tokens of block i as little-endian uint32)``
  with ``key[-1] = blake3(KEY_VERSION || layout.fingerprint)``.

Keys depend only on the layout and the token ids: never on ``hash()``,
PYTHONHASHSEED, the process or the machine. Pure functions; safe from any
thread.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any, NewType, cast

import blake3
import numpy as np

from tierstore.errors import KeyFormatError, LayoutError

try:  # the C loop (tierstore/_chainhash.c); optional so that installs without a compiler work
    from tierstore._chainhash import chain as _c_chain
except ImportError:  # pragma: no cover - exercised only where the extension did not build
    _c_chain = None

BlockKey = NewType("BlockKey", bytes)
"""32-byte chained blake3 key of one full block (never a raw bytes by accident)."""

KEY_BYTES = 32
KEY_VERSION = b"tierstore.block-key.v1\x00"
LAYOUT_VERSION = b"tierstore.layout.v1\x00"

# Bytes per element of the KV dtypes engines use. Names are torch's.
DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}

_UINT32_MAX = 2**32 - 1
MAX_LAYOUT_DIM = 1 << 20  # any one dimension of a layout
MAX_BLOCK_BYTES = 1 << 34  # 16 GiB: far above any real block, far below overflow


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Shape of one block: K and V of every layer for ``block_tokens`` tokens.

    ``num_kv_heads`` is the number of KV heads held by this tensor-parallel
    rank. A block is one contiguous byte range of ``block_bytes``.
    """

    model: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    block_tokens: int
    tp_rank: int = 0
    tp_size: int = 1
    tenant_salt: str = ""
    _fingerprint: bytes = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise LayoutError(f"KVLayout.model must be a non-empty string, got {self.model!r}")
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_tokens", "tp_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise LayoutError(f"KVLayout.{name} must be a positive integer, got {value!r}")
            if value > MAX_LAYOUT_DIM:
                raise LayoutError(f"KVLayout.{name} must be at most {MAX_LAYOUT_DIM}, got {value}")
        if not isinstance(self.tp_rank, int) or not 0 <= self.tp_rank < self.tp_size:
            raise LayoutError(
                f"KVLayout.tp_rank must be in [0, tp_size={self.tp_size}), got {self.tp_rank!r}"
            )
        if self.dtype not in DTYPE_BYTES:
            raise LayoutError(
                f"KVLayout.dtype {self.dtype!r} is not supported; use one of {sorted(DTYPE_BYTES)}"
            )
        if not isinstance(self.tenant_salt, str):
            raise LayoutError(f"KVLayout.tenant_salt must be a string, got {self.tenant_salt!r}")
        if self.block_bytes > MAX_BLOCK_BYTES:
            raise LayoutError(
                f"a block of this layout is {self.block_bytes} bytes; at most {MAX_BLOCK_BYTES}"
            )
        encoded = LAYOUT_VERSION + json.dumps(
            self.to_dict(), sort_keys=True, separators=(",", ":")
        ).encode("utf-8")
        object.__setattr__(self, "_fingerprint", blake3.blake3(encoded).digest())

    @property
    def fingerprint(self) -> bytes:
        """32-byte blake3 of the layout's canonical encoding; scopes every key."""
        return self._fingerprint

    @property
    def block_bytes(self) -> int:
        """Bytes of one block: K and V, all layers, ``block_tokens`` tokens."""
        return (
            2
            * self.num_layers
            * self.num_kv_heads
            * self.head_dim
            * self.block_tokens
            * DTYPE_BYTES[self.dtype]
        )

    @property
    def bytes_per_token(self) -> int:
        return self.block_bytes // self.block_tokens

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _LAYOUT_FIELDS}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVLayout:
        unknown = set(data) - set(_LAYOUT_FIELDS)
        if unknown:
            raise LayoutError(f"unknown KVLayout fields: {sorted(unknown)}")
        try:
            return cls(**data)
        except TypeError as e:
            raise LayoutError(f"incomplete KVLayout: {e}") from e


_LAYOUT_FIELDS = tuple(f.name for f in fields(KVLayout) if f.init)


def root_key(layout: KVLayout) -> BlockKey:
    """The chain's ``key[-1]``: blake3 of the version tag and the layout fingerprint."""
    return BlockKey(blake3.blake3(KEY_VERSION + layout.fingerprint).digest())


def _as_uint32_le(token_ids: Sequence[int] | np.ndarray | Any) -> np.ndarray:
    """Token ids as a contiguous little-endian uint32 array, validated in one pass."""
    if hasattr(token_ids, "detach"):  # torch.Tensor, without importing torch here
        token_ids = token_ids.detach().cpu().numpy()
    arr = np.asarray(token_ids)
    if arr.ndim != 1:
        raise KeyFormatError(f"token_ids must be one-dimensional, got shape {arr.shape}")
    if arr.size == 0:
        return np.empty(0, dtype="<u4")
    if arr.dtype.kind not in "iu":
        raise KeyFormatError(f"token_ids must be integers, got dtype {arr.dtype}")
    if arr.dtype != np.dtype("<u4"):
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi > _UINT32_MAX:
            raise KeyFormatError(f"token ids must fit uint32, got range [{lo}, {hi}]")
        arr = arr.astype("<u4")
    return np.ascontiguousarray(arr)


def chain_keys(
    layout: KVLayout,
    token_ids: Sequence[int] | np.ndarray | Any,
    parent: BlockKey | None = None,
) -> list[BlockKey]:
    """One key per full block of ``token_ids``; a trailing partial block gets none.

    ``parent`` continues a chain (the key of the block before ``token_ids[0]``);
    by default the chain starts at ``root_key(layout)``. The tokens are packed
    once by numpy; the chain runs in C when the extension is built (one call,
    GIL released), else one blake3 call per block. No per-token Python work.
    """
    if parent is not None:
        check_key(parent)
    packed = _as_uint32_le(token_ids)
    stride = layout.block_tokens * 4
    num_blocks = packed.size // layout.block_tokens
    prev = bytes(parent) if parent is not None else root_key(layout)
    if _c_chain is not None:
        digests = _c_chain(prev, packed[: num_blocks * layout.block_tokens], stride)
        return unpack_keys(digests)
    data = packed[: num_blocks * layout.block_tokens].tobytes()
    hasher = blake3.blake3
    keys: list[BlockKey] = []
    for start in range(0, num_blocks * stride, stride):
        prev = hasher(prev + data[start : start + stride]).digest()
        keys.append(BlockKey(prev))
    return keys


def check_key(key: object) -> BlockKey:
    """Return ``key`` as a BlockKey, or raise KeyFormatError naming the problem."""
    if not isinstance(key, bytes | bytearray | memoryview):
        raise KeyFormatError(f"block key must be bytes, got {type(key).__name__}")
    raw = bytes(key)
    if len(raw) != KEY_BYTES:
        raise KeyFormatError(f"block key must be {KEY_BYTES} bytes, got {len(raw)}")
    return BlockKey(raw)


def check_keys(keys: Sequence[object]) -> list[BlockKey]:
    """``keys`` as a list of BlockKeys; raises KeyFormatError naming a bad one."""
    if all(type(k) is bytes and len(k) == KEY_BYTES for k in keys):  # the common case, fast
        return keys if isinstance(keys, list) else list(keys)  # type: ignore[return-value,arg-type]
    return [check_key(k) for k in keys]


def unpack_keys(raw: bytes | bytearray | memoryview) -> list[BlockKey]:
    """Split a packed run of 32-byte keys (a wire field, a digest run) into
    BlockKeys; raises KeyFormatError if its length is not a multiple of 32.
    The one place that does this, so every reader checks the same way."""
    if len(raw) % KEY_BYTES:
        raise KeyFormatError(f"packed keys must be a multiple of {KEY_BYTES} bytes, got {len(raw)}")
    data = bytes(raw)
    # NewType is the identity at run time: skip 10^4 no-op calls on long prompts.
    return cast("list[BlockKey]", [data[i : i + KEY_BYTES] for i in range(0, len(data), KEY_BYTES)])


def pack_keys(keys: Sequence[BlockKey]) -> bytes:
    """The wire form of ``keys``: their 32 bytes each, concatenated."""
    return b"".join(keys)
