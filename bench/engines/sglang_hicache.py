"""SGLang's HiCache L3 through its real controller: tierstore against HiCacheFile.

    python -m bench.engines.sglang_hicache [--json] [--reps 7] [--pages 32] [--page-size 64]
        [--layout page_first_direct|page_first|layer_first] [--copy-threads N]
        [--dram 4.5GiB] [--ready-dram 2.5GiB] [--shm-dir DIR]

One driver process in SGLang's own environment (bench/engines/sglang_env.sh, built
on first use) runs SGLang's ``HiCacheController`` on the CPU over an
``MHATokenToKVPoolHost`` with an 8B model's KV per token (32 layers x 8 KV
heads x head_dim 128, bf16: 128 KiB a token, 8 MiB a 64-token page). Each
run backs a conversation of ``--pages`` pages up through the controller's
backup thread, timed from ``write_storage`` to its ack, and prefetches it
into a fresh host pool, timed from ``prefetch`` to the last ack (the hit
query and the transfer), then compares every page token by token.

Backends, interleaved run by run (A B C D A B C D ...), each run on new
tokens and new bytes, each backend on ranks of its own that live through
the whole bench (as in an SGLang server), after one warm-up run each that
is reported but not counted:

- ``tierstore``: ``TierstoreStorage`` on the v1 path (``interface_v1``: the
  backend copies between the host pool and the sidecar's arena), against a
  local sidecar (DRAM, NVMe behind it);
- ``tierstore_ready``: the same, with the memory each timed step copies
  out of and into read one byte a page just before it, not timed (the
  source pool and the sidecar's arena before the backup, the arena and the
  reader's pool before the prefetch): the copies as a GPU host meets them,
  its pinned memory never slow to touch. On a sidecar of its own, so that
  these reads leave the other sidecar's arena as idle as ever.
  ``tierstore_vs_ready_pairs``: each round's ``tierstore`` figure over its
  ``tierstore_ready`` one, what idle memory costs the path;
- ``copy``: SGLang's controller around a backend with no store
  (``copystorage.CopyStorage``): the v1 path's copies, made as tierstore
  makes them, between the host pool and a plain buffer of the driver, with
  no lookup, no sidecar call and no hashing. The most a backend that copies
  the bytes can do through this controller on this machine, with its
  thread hand-offs: the limit of the end-to-end figures
  (``tierstore_*_vs_copy_backend``; ``tierstore_vs_copy_pairs``, each
  round's pair);
- ``tierstore_generic``: the same on SGLang's generic path (flat pages);
- ``file``: SGLang's own ``HiCacheFile`` (one file per page, its default
  L3), in a directory on this machine's disk (``--file-dir``);
- ``file_cold``: ``HiCacheFile`` on disk with its files dropped from the
  page cache after each backup (``posix_fadvise(DONTNEED)``, not timed), so
  that its prefetch reads the disk, as it does for pages backed up long
  enough ago (``file`` reads them back from the page cache: memory speed).

After a file backend's backup the bench runs ``sync`` (not timed), so the
dirty pages it left are not written back during the next timed step.

After each backup the bench waits ``--settle-s`` (1 s): the sidecar hashes
every committed block in the background (its integrity digest), which a
backup's own figure includes but the next timed step should not.

``memcpy_gbps``: the faster of two plain copies of the same bytes between
two touched host buffers, in the same process, timed between the runs
(interleaved): torch's copy (``torch_memcpy_gbps``, on torch's threads)
and ``copy_runs`` in the host layout's own runs on the backend's
``copy_threads`` (``copy_runs_gbps``, ``copy_threads``, ``copy_loop``):
the copy the v1 path makes, without the store. ``aged_memcpy_gbps``: once
a round, the faster of the two into a buffer written when the driver
started and idle since, as the sidecar's arena units are when a backup
first writes them (populated at its start; ``bench/tiers/memage.py``: on this
VM memory left idle is slow to touch the first time), with each run's
figure and idle seconds in ``aged_memcpy_runs_gbps`` /
``aged_memcpy_idle_s``. Each figure is the median of ``--reps`` runs;
every run is in the JSON.
``byte_exact``: every page of every run came back equal.

Why ``tierstore_ready``: on this VM memory left idle for tens of seconds is
slow to touch again, locked in memory or not (``bench/tiers/memage.py``),
and every run's backup writes arena units idle since the sidecar started,
every prefetch a host pool idle since the last round; a GPU host pins both
(and its VM, with the GPU passed through, all its memory). ``tierstore``
measures the copies as this VM meets them, ``tierstore_ready`` as such a
host does. ``arena_pinned``: both sidecars' arenas were locked in memory
(``dram_lock``, on by default; ``arena_locked_bytes`` from their stats
after the runs); ``arena_page`` / ``arena_huge_bytes``: their page size,
and the bytes mapped with huge pages (``--shm-dir``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.limits import emit, ratio
from harness import REPO
from harness.sidecar import bench_sidecar
from tierstore.client import StoreClient
from tierstore.memory.memcopy import RUNS_LOOP

MODEL = {"layers": 32, "heads": 8, "head_dim": 128, "dtype": "bfloat16"}
BACKENDS = ("tierstore", "tierstore_ready", "copy", "tierstore_generic", "file", "file_cold")
DEFAULT_VENV = Path.home() / ".cache" / "tierstore-bench" / "sglang-venv"


def sglang_python() -> Path:
    venv = Path(os.environ.get("SGLANG_VENV") or DEFAULT_VENV)
    script = REPO / "bench" / "engines" / "sglang_env.sh"
    subprocess.run(["bash", str(script), str(venv)], check=True, stdout=sys.stderr, timeout=1800)
    return venv / "bin" / "python"


def specs(
    args: argparse.Namespace, sock: Path, ready_sock: Path, file_dirs: dict[str, str]
) -> list[dict[str, Any]]:
    """A warm-up run per backend (not counted), then ``reps`` rounds of one
    run per backend; each backend keeps its ranks (``session``) throughout."""
    out = []
    for rep in range(args.reps + 1):
        for i, backend in enumerate(BACKENDS):
            spec: dict[str, Any] = {
                **MODEL,
                "page_size": args.page_size,
                "pages": args.pages,
                "layout": args.layout,
                "seed": 1000 * (rep + 1) + i,
                "timeout_s": 300.0,
                "memcpy_reps": 3 if i == 0 and rep > 0 else 0,
                "settle_s": args.settle_s,
                "session": backend,
            }
            if args.copy_threads:
                spec["settings"] = {"copy_threads": args.copy_threads}
            if backend == "copy":
                spec["backend"] = "copy"
            elif backend.startswith("tierstore"):
                ready = backend == "tierstore_ready"
                spec.update(backend="tierstore", socket_path=str(ready_sock if ready else sock),
                            interface_v1=backend != "tierstore_generic",
                            ready_memory=ready)  # fmt: skip
            else:
                spec.update(backend="file", file_dir=file_dirs[backend],
                            cold_files=backend == "file_cold")  # fmt: skip
            out.append(spec)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--pages", type=int, default=32, help="pages per conversation")
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--layout", default="page_first_direct",
                        choices=["layer_first", "page_first", "page_first_direct"])  # fmt: skip
    parser.add_argument("--copy-threads", type=int, default=0, help="the backend's "
                        "copy_threads (0: its default, the cores up to 4)")  # fmt: skip
    parser.add_argument("--file-dir", default="", help="HiCacheFile's directory (default: a "
                        "new one under the system temp dir, on disk)")  # fmt: skip
    parser.add_argument("--dram", default="4.5GiB", help="the DRAM tier of the sidecar of "
                        "tierstore and tierstore_generic (holds every run's pages: no "
                        "eviction is timed; the bench fails if a block left DRAM)")  # fmt: skip
    parser.add_argument("--ready-dram", default="2.5GiB", help="the same for "
                        "tierstore_ready's sidecar")  # fmt: skip
    parser.add_argument("--shm-dir", default="", help="both sidecars' shm_dir (default: "
                        "theirs, /dev/shm); a huge=always tmpfs or a hugetlbfs mount gives "
                        "their arenas 2 MiB pages (arena_page in the output)")  # fmt: skip
    parser.add_argument("--settle-s", type=float, default=1.0, help="pause after each backup: "
                        "the sidecar hashes the blocks it got after their commit (blake3, "
                        "in the background), and the prefetch and the next backend's run "
                        "are timed without it")  # fmt: skip
    args = parser.parse_args()
    python = sglang_python()
    tmp = Path(tempfile.mkdtemp(prefix="tierstore-sglang-bench-"))
    disk_dir = Path(args.file_dir) if args.file_dir else tmp / "hicache-file"
    file_dirs = {"file": str(disk_dir), "file_cold": str(disk_dir.with_name("hicache-file-cold"))}
    try:
        (tmp / "sidecar").mkdir()
        (tmp / "sidecar-ready").mkdir()
        disk_dir.mkdir(parents=True, exist_ok=True)
        fs_type = _fs_type(disk_dir)  # before the directory is gone
        # The arena made ready before the sidecar serves: its background
        # populator would otherwise share the two cores with the first runs.
        extra = ("dram_populate=upfront", *([f"shm_dir={args.shm_dir}"] if args.shm_dir else []))
        with (
            bench_sidecar(tmp / "sidecar", _bytes(args.dram), *extra) as sock,
            bench_sidecar(tmp / "sidecar-ready", _bytes(args.ready_dram), *extra) as ready_sock,
        ):
            runs = specs(args, sock, ready_sock, file_dirs)
            env = dict(os.environ, PYTHONPATH=str(REPO))
            proc = subprocess.run(
                [str(python), "-m", "tierstore.engines.sglang.driver", json.dumps(runs)],
                capture_output=True, text=True, env=env, timeout=3600,
            )  # fmt: skip
            if proc.returncode != 0:
                sys.stderr.write(proc.stderr[-6000:])
                if proc.returncode < 0:  # no traceback to read: say what ended it
                    sys.stderr.write(f"the driver was killed by signal {-proc.returncode} "
                                     "(9: the kernel's OOM killer? lower --dram)\n")  # fmt: skip
                return 1
            results = json.loads(proc.stdout.strip().splitlines()[-1])
            locked, pages, huge = [], [], []
            for name, path in (("--dram", sock), ("--ready-dram", ready_sock)):
                with StoreClient(str(path)) as client:  # the arena locked (dram_lock)?
                    reply = client.stat()
                counters = reply.counters
                locked.append(int(counters["arena_locked_bytes"]))
                pages.append(reply.info["arena_page"])
                huge.append(int(counters["arena_huge_bytes"]))
                left = int(counters["spilled_blocks"]) + int(counters["dropped_blocks"])
                if left:  # a reserve made room synchronously: its time is the eviction's
                    sys.stderr.write(f"{left} blocks left DRAM during the runs: raise {name}\n")
                    return 1
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    out = summarize(args, runs, results, fs_type)
    out["arena_locked_bytes"] = locked
    out["arena_pinned"] = min(locked) > 0
    out["arena_page"] = pages  # each sidecar's: "4 KiB, ..." or "2048 KiB, ..."
    out["arena_huge_bytes"] = huge
    emit(out, args.json)
    return 0


def _bytes(text: str) -> int:
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    for unit, mult in units.items():
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * mult)
    return int(text)


def summarize(
    args: argparse.Namespace, runs: list[dict[str, Any]], results: list[dict[str, Any]],
    fs_type: str,
) -> dict[str, Any]:  # fmt: skip
    total = args.pages * args.page_size
    per: dict[str, dict[str, list[float]]] = {b: {"backup": [], "prefetch": []} for b in BACKENDS}
    exact, torch_copy, runs_copy, aged, aged_idle = True, [], [], [], []
    for i, r in enumerate(results[len(BACKENDS) :]):  # the warm-up round is left out
        backend = BACKENDS[i % len(BACKENDS)]
        nbytes = r["page_bytes"] * args.pages
        complete = r["backup_tokens"] == total and r["prefetched_tokens"] == total
        exact = exact and complete and r["pages_equal"] == r["pages_compared"] == args.pages
        per[backend]["backup"].append(nbytes / r["backup_s"] / 1e9 if r["backup_s"] else 0.0)
        per[backend]["prefetch"].append(nbytes / r["prefetch_s"] / 1e9 if r["prefetch_s"] else 0.0)
        torch_copy += [nbytes / s / 1e9 for s in r["memcpy_s"]]
        runs_copy += [nbytes / s / 1e9 for s in r["copy_runs_s"]]
        if r["aged_memcpy_s"]:
            aged.append(nbytes / r["aged_memcpy_s"] / 1e9)
            aged_idle.append(r["aged_idle_s"])
    med = {b: {k: statistics.median(v) for k, v in d.items()} for b, d in per.items()}
    mc = max(statistics.median(torch_copy), statistics.median(runs_copy))
    out: dict[str, Any] = {
        "model": "8B-like KV: 32 layers x 8 KV heads x 128, bf16",
        "page_size": args.page_size,
        "pages": args.pages,
        "conversation_bytes": results[0]["page_bytes"] * args.pages,
        "layout": args.layout,
        "reps": args.reps,
        "file_dir_fs": fs_type,
    }
    for backend in BACKENDS:
        out[f"{backend}_backup_gbps"] = round(med[backend]["backup"], 3)
        out[f"{backend}_prefetch_gbps"] = round(med[backend]["prefetch"], 3)
    out["memcpy_gbps"] = round(mc, 3)
    out["torch_memcpy_gbps"] = round(statistics.median(torch_copy), 3)
    out["copy_runs_gbps"] = round(statistics.median(runs_copy), 3)
    out["copy_threads"] = next(r["copy_threads"] for r in results if r["copy_threads"])
    out["copy_loop"] = RUNS_LOOP
    out["ready_bytes_per_run"] = max(r["ready_bytes"] for r in results)
    out["byte_exact"] = exact
    out["tierstore_vs_file_backup"] = ratio(med["tierstore"]["backup"], med["file"]["backup"])
    out["tierstore_vs_file_prefetch"] = ratio(med["tierstore"]["prefetch"], med["file"]["prefetch"])
    out["tierstore_vs_file_cold_prefetch"] = ratio(
        med["tierstore"]["prefetch"], med["file_cold"]["prefetch"]
    )
    out["tierstore_backup_vs_memcpy"] = ratio(med["tierstore"]["backup"], mc)
    out["tierstore_prefetch_vs_memcpy"] = ratio(med["tierstore"]["prefetch"], mc)
    out["tierstore_ready_backup_vs_memcpy"] = ratio(med["tierstore_ready"]["backup"], mc)
    out["tierstore_ready_prefetch_vs_memcpy"] = ratio(med["tierstore_ready"]["prefetch"], mc)
    for step in ("backup", "prefetch"):
        out[f"tierstore_{step}_vs_copy_backend"] = ratio(med["tierstore"][step], med["copy"][step])
    out["tierstore_vs_copy_pairs"] = {
        step: [ratio(a, c) for a, c in zip(per["tierstore"][step], per["copy"][step])]
        for step in ("backup", "prefetch")
    }
    out["tierstore_vs_ready_pairs"] = {
        step: [ratio(a, r) for a, r in zip(per["tierstore"][step], per["tierstore_ready"][step])]
        for step in ("backup", "prefetch")
    }
    if aged:
        out["aged_memcpy_gbps"] = round(statistics.median(aged), 3)
        out["tierstore_backup_vs_aged_memcpy"] = ratio(
            med["tierstore"]["backup"], statistics.median(aged)
        )
        out["aged_memcpy_runs_gbps"] = [round(x, 3) for x in aged]
        out["aged_memcpy_idle_s"] = [round(x, 1) for x in aged_idle]
    out["runs"] = {b: {k: [round(x, 3) for x in v] for k, v in d.items()} for b, d in per.items()}
    out["torch_memcpy_runs_gbps"] = [round(x, 3) for x in torch_copy]
    out["copy_runs_runs_gbps"] = [round(x, 3) for x in runs_copy]
    out["warmup_runs"] = {
        b: {"backup_s": round(r["backup_s"], 3), "prefetch_s": round(r["prefetch_s"], 3)}
        for b, r in zip(BACKENDS, results)
    }
    last = len(results) - len(BACKENDS)
    out["tierstore_backup_stats"] = results[last]["backup_stats"]
    out["tierstore_prefetch_stats"] = results[last]["prefetch_stats"]
    ready = last + BACKENDS.index("tierstore_ready")
    out["tierstore_ready_backup_stats"] = results[ready]["backup_stats"]
    out["tierstore_ready_prefetch_stats"] = results[ready]["prefetch_stats"]
    return out


def _fs_type(path: Path) -> str:
    try:
        return subprocess.run(["stat", "-f", "-c", "%T", str(path)], capture_output=True,
                              text=True, check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
