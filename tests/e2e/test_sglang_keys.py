"""The keys a gateway derives for SGLang engines are SGLang's own: HiCache's
page hashes (``get_storage_hash_str``, run in SGLang's environment) equal
``tierstore.engines.sglang.keys.page_hashes`` for every full page, and a
changed token changes its page's hash and every later one."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from harness import REPO
from tierstore.engines.sglang.keys import page_hashes

from .test_sglang import sglang_python  # noqa: F401  (the environment's fixture)

pytestmark = pytest.mark.sglang

SGLANG_HASHES = """
import json, sys
from sglang.srt.mem_cache.utils import get_storage_hash_str
cases = json.loads(sys.stdin.read())
print(json.dumps([get_storage_hash_str(t, None, page_size=p) for t, p in cases]))
"""


def sglang_hashes(python: Path, cases: list[tuple[list[int], int]]) -> list[list[str]]:
    proc = subprocess.run(
        [str(python), "-c", SGLANG_HASHES], input=json.dumps(cases), capture_output=True,
        text=True, timeout=300, env=dict(os.environ, PYTHONPATH=str(REPO)),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return list(json.loads(proc.stdout.strip().splitlines()[-1]))


def test_page_keys_are_sglangs(sglang_python: Path) -> None:  # noqa: F811
    rng = np.random.default_rng(7)
    cases = [
        (rng.integers(0, 1 << 31, n).tolist(), page)
        for n, page in ((16 * 40 + 5, 16), (64 * 9, 64), (1, 16), (0, 16), (4096, 1))
    ]
    changed = list(cases[0][0])
    changed[16 * 20 + 3] += 1  # the negative control: one token of page 20
    theirs = sglang_hashes(sglang_python, [*cases, (changed, 16)])
    compared = 0
    for (tokens, page), ref in zip(cases, theirs):
        ours = page_hashes(tokens, page)
        assert ours == ref[: len(tokens) // page]  # SGLang also hashes a partial last page
        compared += len(ours)
    assert compared > 4000
    ours = page_hashes(changed, 16)
    assert ours[:20] == theirs[0][:20] and all(a != b for a, b in zip(ours[20:], theirs[0][20:]))
    assert ours == theirs[-1][:40]
