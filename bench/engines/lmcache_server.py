"""LMCache 0.5.6 beside the benches: its virtualenv, its server, its connector config.

Provides:
- ``lmcache_venv()`` / ``lmcache_python()``: the separate virtualenv that
  ``bench/engines/lmcache_env.sh`` makes (``LMCACHE_VENV``, default
  ``~/.cache/tierstore-bench/lmcache-venv``) and its python; a clear error
  naming the script when it is missing.
- ``lmcache_server(tmp, l1_size_gb=...)``: a context manager that starts
  ``lmcache server`` from that virtualenv in multiprocess mode on free
  loopback ports (engine-driven transfer through shared memory, LRU
  eviction, no telemetry, no observability), waits for its HTTP port with a
  deadline, yields an ``LMCacheServer`` (ports, shm name, the environment
  an engine needs) and kills its process group on exit, even on error.
- ``lmcache_transfer_config(server)``: the ``LMCacheMPConnector``
  ``kv_transfer_config`` of a vLLM engine that talks to that server.
- ``ENGINE_ENV``: what every process of LMCache's gets (telemetry off).

The vLLM engine that uses LMCache must run from the virtualenv's python too
(``lmcache_python()``): LMCache is not installed in tierstore's environment
(it pulls protobuf 6 and grpcio 1.78, below tierstore's needs). The repo's
``tierstore.engines.vllm.driver`` child needs only vllm, torch and
transformers, which the virtualenv has: with ``PYTHONPATH=<repo root>`` it
runs there as well.

Runs in the benchmark's process; the server is a child of it. Its name is
not ``lmcache``: the real package of that name lives in the virtualenv.

Facts this follows (measured here, /work/shared/notes/lmcache-on-vllm-cpu.md):
the in-process ``LMCacheConnectorV1`` refuses CPU ("No supported cpu
connector found"); the server needs ``--eviction-policy`` and, for CPU
workers, ``--supported-transfer-mode engine_driven``; with ``--shm-name``
the KV moves through shared memory, without it by pickle (2.5x slower).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tierstore.cli.ports import free_port

VENV_ENV = "LMCACHE_VENV"
DEFAULT_VENV = Path.home() / ".cache" / "tierstore-bench" / "lmcache-venv"
ENV_SCRIPT = "bench/engines/lmcache_env.sh"
ENGINE_ENV = {"LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1"}
CHUNK_TOKENS = 256  # LMCache's chunk (the notes' measured setting)
START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 20.0
POLL_S = 0.25


class LMCacheMissing(RuntimeError):
    """The LMCache virtualenv is not there: run bench/engines/lmcache_env.sh."""


def lmcache_venv() -> Path:
    return Path(os.environ.get(VENV_ENV) or DEFAULT_VENV)


def lmcache_python() -> Path:
    """The LMCache virtualenv's python; raises ``LMCacheMissing`` naming the
    script that makes it (and the venv it looked in) when it is missing."""
    venv = lmcache_venv()
    python = venv / "bin" / "python"
    if not python.exists() or not (venv / "bin" / "lmcache").exists():
        raise LMCacheMissing(
            f"no LMCache virtualenv at {venv} (${VENV_ENV}): run `bash {ENV_SCRIPT}` first"
        )
    return python


@dataclass(frozen=True)
class LMCacheServer:
    """A running ``lmcache server``: what an engine needs to reach it."""

    host: str
    port: int  # the ZMQ port engines connect to
    http_port: int  # answers once the server is ready
    shm_name: str
    l1_size_gb: float
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)  # for the engine's process


def lmcache_transfer_config(server: LMCacheServer) -> dict[str, Any]:
    """``kv_transfer_config`` of a vLLM engine using ``server`` (LMCacheMPConnector)."""
    return {
        "kv_connector": "LMCacheMPConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "lmcache.mp.host": f"tcp://{server.host}",
            "lmcache.mp.port": server.port,
            "lmcache.mp.mp_transfer_mode": "engine_driven",
        },
    }


def server_command(
    host: str, port: int, http_port: int, l1_size_gb: float, shm_name: str
) -> list[str]:
    lmcache = str(lmcache_python().parent / "lmcache")
    return [
        lmcache, "server", "--host", host, "--port", str(port),
        "--http-host", host, "--http-port", str(http_port),
        "--chunk-size", str(CHUNK_TOKENS), "--l1-size-gb", f"{l1_size_gb:g}",
        "--no-l1-use-lazy", "--eviction-policy", "LRU",
        "--supported-transfer-mode", "engine_driven", "--disable-observability",
        "--shm-name", shm_name,
    ]  # fmt: skip


def _answers(url: str) -> bool:
    """True once anything answers HTTP at ``url`` (even an error status)."""
    try:
        with urllib.request.urlopen(url, timeout=2.0):
            return True
    except urllib.error.HTTPError:
        return True
    except (urllib.error.URLError, OSError):
        return False


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the server's process group, SIGKILL it after a timeout."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(STOP_TIMEOUT_S)
    except ProcessLookupError:
        proc.wait(STOP_TIMEOUT_S)


@contextmanager
def lmcache_server(
    tmp: Path,
    l1_size_gb: float = 2.0,
    *,
    host: str = "127.0.0.1",
    start_timeout_s: float = START_TIMEOUT_S,
) -> Iterator[LMCacheServer]:
    """``lmcache server`` for the duration of the block (see the module
    docstring); its log is ``tmp/lmcache-server.log``, whose tail is in the
    error when it exits or does not answer within ``start_timeout_s``."""
    tmp.mkdir(parents=True, exist_ok=True)
    port, http_port = free_port(host), free_port(host)
    shm_name = f"tierstore-bench-lmcache-{os.getpid()}-{port}"
    log_path = tmp / "lmcache-server.log"
    env = dict(os.environ, **ENGINE_ENV)
    env.pop("PYTHONPATH", None)  # the server is LMCache's own: nothing of tierstore's
    cmd = server_command(host, port, http_port, l1_size_gb, shm_name)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            cmd, cwd=tmp, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        deadline = time.monotonic() + start_timeout_s
        while not _answers(f"http://{host}:{http_port}/"):
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = log_path.read_text(errors="replace")[-3000:]
                why = f"exit {proc.poll()}" if proc.poll() is not None else "no answer"
                raise RuntimeError(
                    f"lmcache server did not start ({why} within {start_timeout_s:.0f}s; "
                    f"{' '.join(cmd)}):\n{tail}"
                )
            time.sleep(POLL_S)
        yield LMCacheServer(host, port, http_port, shm_name, l1_size_gb, log_path, dict(ENGINE_ENV))
    finally:
        _stop(proc)
        leftover = Path("/dev/shm") / shm_name.lstrip("/")
        if leftover.exists():
            leftover.unlink()
