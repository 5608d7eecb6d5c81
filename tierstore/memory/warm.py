"""Memory made ready: one byte of every page read.

Provides ``touch(buf)``: one read of one byte of every 4 KiB page of a
buffer.

Why: on a VM whose host takes back guest memory left idle (the 2-core
Firecracker VMs here, ``bench/tiers/memage.py``), the first copy into or out of
memory nobody touched for a minute runs at half the speed of the next or
less, locked in memory or not, and a read of one byte a page every 10 s
keeps it at 0.92 of hot. A GPU host pins its host KV pools and tierstore's
arena (and a VM with a GPU passed through has all its memory pinned), so
it never meets this. The SGLang bench's ``tierstore_ready`` runs touch the
memory a timed step copies into and out of first, not timed, to measure the
copies as such a host would (``tierstore.engines.sglang.membench``); a pass
over 7 GiB is about 1.8 M reads.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tierstore.memory.memcopy import flat_bytes

PAGE_BYTES = 4096


def touch(buf: Any, page_bytes: int = PAGE_BYTES) -> int:
    """Read one byte of every page of ``buf`` (a buffer); returns their sum,
    so that the reads cannot be left out."""
    return int(flat_bytes(buf)[::page_bytes].sum(dtype=np.uint64))
