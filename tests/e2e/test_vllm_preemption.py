"""Preemption and client aborts in a real ``vllm serve`` with TierstoreConnector.

One server (``vllm_server``) whose KV cache holds 12 blocks of 128 tokens:
six streamed requests of 500 prompt + 200 new tokens (6 blocks each once
decoded) run at once, so vLLM preempts some (recompute: their blocks are
freed and they start again), while the client closes two of the streams
early (vLLM aborts them). Twice: first with the store empty (the connector
saves every full block as it is computed, through all of that; the two
streams are closed after their first and fifth tokens), then, with vLLM's
own cache emptied and the stored blocks pushed to NVMe by filler, again (the
prefixes load in the background under preemption; one stream is closed as
soon as it is sent, before its first token: queued, or while its load is
in flight). Each run must preempt at least once. Afterwards:

- no block is left pinned in the sidecar;
- with vLLM's own prefix cache emptied, the six prompts asked one at a time
  are served from what the store kept, and each one's ids equal a cold
  computation of it (the same prompt with a ``cache_salt`` of its own: a
  namespace neither vLLM nor the store has seen) -- a half-written block
  committed under preemption or abort would change them;
- the completed streams of the concurrent run equal those cold ids too.
"""

from __future__ import annotations

import json
import random
import threading
import time
from http.client import HTTPConnection
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest

pytest.importorskip("vllm", reason="needs vllm (pip install 'tierstore[vllm]', see README)")

from harness.sidecar import SidecarProcess
from harness.vllm_server import BLOCK, api_server, complete, http, metrics
from tierstore.client import StoreClient
from tierstore.engines.vllm.driver import kv_transfer_config, tiny_llama
from tierstore.keys import KVLayout, chain_keys

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

USERS = 6
PROMPT_TOKENS = 500
NEW_TOKENS = 200
# float32: on CPUs with AMX, vLLM's bf16 kernels (AMX attention and GEMMs) sum a
# whole prompt and the same prompt recomputed in other chunks (as preemption
# does) in other orders, and greedy ids part with no store involved (measured:
# a preempted stream at its 15th token, on a Sapphire Rapids VM); in float32 it
# runs its vector kernels (AMX attention is bf16 only), and the test passed
# every run there.
DTYPE = "float32"
BLOCK_BYTES = 4 * 2 * 2 * 64 * BLOCK * 4  # tiny_llama: 4 layers, K+V, 2 heads of 64, float32
# Three prompts fill the cache (4 blocks each), and vLLM admits three of the
# six waiting at once: the first to decode into its fifth block finds none
# free, and a running request is preempted, in each run whatever the timing.
# (With 20 blocks five fit, and a run preempted only if four were still
# running when they needed their sixth: in one CI run the two runs together
# preempted once.)
KV_CACHE_BLOCKS = 12
# the streams the client closes, and after how many chunks (0: once sent);
# in the first run each has its prompt computed, so the store holds all six
FIRST_ABORTED = {1: 1, 4: 5}
SECOND_ABORTED = {1: 0, 4: 5}
PROMPTS = [
    [random.Random(100 + u).randrange(1, 1000) for _ in range(PROMPT_TOKENS)] for u in range(USERS)
]


def stream(url: str, prompt: list[int], stop_after: int | None, out: dict[str, Any]) -> None:
    """One streamed completion; ``stop_after``: close the connection after
    that many chunks (0: right after sending it; vLLM aborts the request)."""
    u = urlparse(url)
    conn = HTTPConnection(u.hostname or "", u.port, timeout=300)
    body = {"model": "m", "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "return_token_ids": True}  # fmt: skip
    ids: list[int] = []
    out["ids"] = ids
    try:
        conn.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        if stop_after == 0:  # closed before a token: vLLM aborts it queued or loading
            return
        resp = conn.getresponse()
        chunks = 0
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ids.extend(json.loads(line[6:])["choices"][0].get("token_ids") or [])
            chunks += 1
            if stop_after is not None and chunks >= stop_after:
                break
    except Exception as e:  # reported to the test, never lost in a thread
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        conn.close()


def test_preempted_and_aborted_requests_leave_nothing_pinned_and_store_only_exact_blocks(
    tmp_path: Path, vllm_sidecar: SidecarProcess
) -> None:
    model = tiny_llama(tmp_path / "model")
    transfer = kv_transfer_config(vllm_sidecar.socket)
    flags = ("--dtype", DTYPE, "--kv-cache-memory-bytes", str(KV_CACHE_BLOCKS * BLOCK_BYTES),
             "--max-num-seqs", str(USERS), "--max-model-len", "1024")  # fmt: skip
    with api_server(model, transfer, tmp_path / "server.log", *flags) as url:
        first = concurrent(url, vllm_sidecar, FIRST_ABORTED)
        preempted = [preemptions(url)]
        with StoreClient(str(vllm_sidecar.socket)) as c:  # the stored blocks go to NVMe
            filler = KVLayout("filler", 4, 2, 64, DTYPE, BLOCK)
            n = (64 << 20) * 3 // 2 // BLOCK_BYTES
            keys = chain_keys(filler, list(range(n * BLOCK)))
            for lo in range(0, n, 16):
                assert all(c.store(filler, keys[lo : lo + 16], bytearray(16 * BLOCK_BYTES)))
        http(f"{url}/reset_prefix_cache", {})
        second = concurrent(url, vllm_sidecar, SECOND_ABORTED)
        with StoreClient(str(vllm_sidecar.socket)) as c:
            nvme = {t.name: t for t in c.stat().tiers}["nvme"]
        assert nvme.evictions == 0, "NVMe dropped blocks: the warm pass cannot hit them all"
        assert hit_tokens(url, "nvme") > 0  # the second run's loads ran in the background
        preempted.append(preemptions(url) - preempted[0])
        print(f"preemptions in the two runs: {preempted}")
        assert min(preempted) >= 1, f"vLLM preempted {preempted}: the test did not test it"
        hits_before = hit_tokens(url)
        http(f"{url}/reset_prefix_cache", {})
        warm = [complete(url, p, NEW_TOKENS) for p in PROMPTS]
        time.sleep(2)  # the stats travel with a later step's output
        hits = hit_tokens(url)
        cold = [complete(url, p, NEW_TOKENS, cache_salt=f"cold-{u}") for u, p in enumerate(PROMPTS)]
        time.sleep(2)
        assert hit_tokens(url) == hits  # the salted reference was computed, not loaded
    print(f"store hit tokens in the warm pass {hits - hits_before:.0f}")
    assert hits - hits_before >= USERS * (PROMPT_TOKENS // BLOCK) * BLOCK  # the store served them
    for u in range(USERS):
        assert len(cold[u]) == NEW_TOKENS
        assert warm[u] == cold[u], f"user {u}: warm from the store differs from cold"
        if u not in FIRST_ABORTED:
            assert first[u] == cold[u], f"user {u}: the preempted run differs from cold"
            assert second[u] == cold[u], f"user {u}: the preempted loaded run differs from cold"


def preemptions(url: str) -> float:
    """``vllm:num_preemptions_total``: requests vLLM has preempted so far."""
    return metrics(url).get(("vllm:num_preemptions_total", ""), 0.0)


def hit_tokens(url: str, tier: str = "") -> float:
    """``vllm:tierstore_hit_tokens_total`` of one tier, or of all."""
    got = metrics(url, "vllm:tierstore_hit_tokens")
    return sum(v for (name, t), v in got.items() if name.endswith("_total") and tier in ("", t))


def concurrent(url: str, vllm_sidecar: SidecarProcess, aborted: dict[int, int]) -> list[list[int]]:
    """The six streams at once (two closed early); their ids, once every
    pin in the sidecar is released (bounded wait)."""
    outs: list[dict[str, Any]] = [{} for _ in range(USERS)]
    threads = [
        threading.Thread(target=stream, args=(url, PROMPTS[u], aborted.get(u), outs[u]))
        for u in range(USERS)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not any(t.is_alive() for t in threads)
    assert [o.get("error") for o in outs] == [None] * USERS
    assert all(len(outs[u]["ids"]) < NEW_TOKENS for u in aborted)
    deadline = time.monotonic() + 30
    with StoreClient(str(vllm_sidecar.socket)) as c:
        while (pins := sum(cl.pins for cl in c.stat().clients)) and time.monotonic() < deadline:
            time.sleep(0.2)
    assert pins == 0, f"{pins} blocks still pinned after the requests ended"
    return [o["ids"] for o in outs]
