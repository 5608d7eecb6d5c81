"""SGLang's page keys, and the same keys in a tierstore layout's namespace.

Provides:
- ``page_hashes(token_ids, page_size)``: the key SGLang's HiCache gives each
  full page of a prompt (its ``get_hash_str`` with SHA-256, the default: a
  chain over each page's token ids as little-endian uint32, each page's hash
  seeded with the previous page's digest), so a process without SGLang (the
  gateway) derives the keys SGLang will ask the store for;
- ``block_keys(layout, keys)``: SGLang's page keys as tierstore BlockKeys,
  scoped by the layout's fingerprint.

Pure; no torch, no SGLang. Any thread.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import blake3
import numpy as np

from tierstore.keys import BlockKey, KVLayout


def page_hashes(token_ids: Sequence[int], page_size: int) -> list[str]:
    """SGLang's hex key of each full page of ``token_ids``."""
    packed = np.asarray(token_ids, dtype="<u4").tobytes()
    stride = page_size * 4
    out: list[str] = []
    prior = b""
    for start in range(0, len(packed) // stride * stride, stride):
        h = hashlib.sha256(prior)
        h.update(packed[start : start + stride])
        out.append(h.hexdigest())
        prior = h.digest()
    return out


def block_keys(layout: KVLayout, keys: Sequence[str]) -> list[BlockKey]:
    """SGLang's page keys as tierstore keys in ``layout``'s namespace."""
    fp = layout.fingerprint
    return [BlockKey(blake3.blake3(fp + k.encode()).digest()) for k in keys]
