"""Choice of etcd client: tierstore's own stubs of etcd's v3 gRPC API against
the PyPI clients, per call, on one real etcd.

    python -m bench.membership.etcd_clients --json [--calls 300]
        [--candidates-python VENV/bin/python]

Starts etcd (loopback, temporary data directory; Debian's etcd-server),
writes 300 keys under one prefix, then measures each client in turn on the
same etcd, one thread, one call in flight, ``--calls`` calls of each kind,
each figure the median call:

- ``put_ms``: a 200-byte put; ``range_ms``: a prefix get of the 300 keys;
- ``grant_ms`` / ``keepalive_ms`` / ``put_lease_ms`` / ``revoke_ms``: what
  a member's registration does (grant a lease, renew it once, put its
  record under it, revoke it on the way out);
- ``watch_ms``: from the start of a put to its event coming out of an open
  prefix watch (the put's own round trip included; so the limit next to it
  is ``put_ms``).

And what tierstore needs from a client, checked on the same etcd, not read
from its documentation: ``lease_id`` (a grant tells the lease's id),
``keepalive_ttl`` (a renewal tells the TTL left, so an expired lease is
noticed), ``lease_deletes_keys`` (a put under a lease goes when it is
revoked), ``range_revision`` (a read tells its revision) and
``watch_from_revision`` (a watch started at that revision delivers a put
made before it was opened: no event is lost between the read and the
watch).

Last, ``after_restart_s``: etcd is killed, the client fails a put while it
is down (as a member renewing its lease would), etcd is started again, and
the client's put is retried until it succeeds (see ``after_restart``).

The candidates run in ``--candidates-python``, a separate virtual
environment that holds them (they would change this one's protobuf and
grpcio); under the project's pins::

    python -m venv /tmp/etcdeval
    /tmp/etcdeval/bin/pip install 'protobuf>=7.35.1' 'grpcio>=1.85.1' \\
        etcd-sdk-python etcd-client-py etcd3gw etcd3

A candidate that does not import, or lacks a call, says so in its entry.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata
import inspect
import json
import queue
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness import REPO

RANGE_KEYS = 300
VALUE = b"x" * 200
EVENT_TIMEOUT_S = 5.0
RESTART_WAIT_S = 10.0  # a client still failing this long after etcd is back counts as not back
CANDIDATES = {  # module name to import -> PyPI distribution
    "pyetcd": "etcd-sdk-python",
    "etcd_client": "etcd-client-py",
    "etcd3gw": "etcd3gw",
    "etcd3": "etcd3",
}


async def _ret(value: Any) -> Any:
    """A call's result, awaited when the client is asyncio (etcd-client-py)."""
    return await value if inspect.isawaitable(value) else value


async def _per_call_ms(n: int, op: Callable[[int], Any]) -> float:
    """Median of ``n`` calls (ms): on a shared machine a mean is mostly other work."""
    times = []
    for i in range(n):
        t0 = time.perf_counter()
        await _ret(op(i))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


async def measure(probe: Any, n: int, run: str) -> dict[str, Any]:
    """The figures and checks of the module docstring for one client (``probe``:
    one of the ``*Probe`` classes); ``run`` keeps its keys apart from the others'."""
    out: dict[str, Any] = {}
    root = f"/bench/{run}"
    out["put_ms"] = await _per_call_ms(n, lambda i: probe.put(f"{root}/put/{i}".encode(), VALUE))
    out["range_ms"] = await _per_call_ms(n, lambda _: probe.get_prefix(b"/bench/range/"))
    count, revision = await _ret(probe.get_prefix(b"/bench/range/"))
    out["range_keys"] = count
    out["range_revision"] = revision is not None

    leases: list[Any] = []
    out["grant_ms"] = await _per_call_ms(n, lambda _: _grant(probe, leases))
    out["lease_id"] = all(isinstance(x, int) and x > 0 for x in leases)
    if out["lease_id"]:
        lease = leases[0]
        out["keepalive_ms"] = await _per_call_ms(n, lambda _: probe.keepalive(lease))
        ttl = await _ret(probe.keepalive(lease))
        out["keepalive_ttl"] = isinstance(ttl, int) and ttl > 0
        key = f"{root}/member".encode()
        out["put_lease_ms"] = await _per_call_ms(n, lambda _: probe.put(key, VALUE, lease))
        out["revoke_ms"] = await _per_call_ms(n, lambda i: probe.revoke(leases[i]))
        count, _ = await _ret(probe.get_prefix(key))
        out["lease_deletes_keys"] = count == 0
    else:
        out["lease_deletes_keys"] = out["keepalive_ttl"] = False

    prefix = f"{root}/watch/".encode()
    await _ret(probe.put(prefix + b"before", VALUE))
    _, revision = await _ret(probe.get_prefix(prefix))
    events = await _ret(probe.watch(prefix, revision))
    try:
        try:
            first = await _ret(events.get())
        except TimeoutError:  # a watch from now (no revision): by now it is open
            first = b""
        out["watch_from_revision"] = revision is not None and first == prefix + b"before"

        async def put_seen(i: int) -> None:
            key = prefix + str(i).encode()
            await _ret(probe.put(key, VALUE))
            while (await _ret(events.get())) != key:
                pass

        out["watch_ms"] = await _per_call_ms(n, put_seen)
    finally:
        await _ret(events.close())
    return out


async def after_restart(probe: Any, etcd_do: Callable[[str], None]) -> dict[str, Any]:
    """etcd is killed, the client tries a put while it is down (as a member
    renewing its lease would), etcd is started again: ``after_restart_s`` is
    from etcd answering to the client's first put that succeeds (None: none
    within RESTART_WAIT_S; ``restart_error`` is the last failure).
    ``etcd_do("kill" | "start")`` returns once done."""
    key = b"/bench/restart"
    await _ret(probe.put(key, VALUE))
    etcd_do("kill")
    with contextlib.suppress(Exception):  # etcd is down: this put fails
        await asyncio.wait_for(_ret(probe.put(key, VALUE)), EVENT_TIMEOUT_S)
    etcd_do("start")
    t0 = time.monotonic()
    error = ""
    while time.monotonic() - t0 < RESTART_WAIT_S:
        try:
            await asyncio.wait_for(_ret(probe.put(key, VALUE)), EVENT_TIMEOUT_S)
            return {"after_restart_s": time.monotonic() - t0}
        except Exception as e:  # what the client raises is the finding
            error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            await asyncio.sleep(0.05)
    return {"after_restart_s": None, "restart_error": error}


async def _grant(probe: Any, leases: list[Any]) -> None:
    leases.append(await _ret(probe.grant(60)))


class Events:
    """Keys of a watch's events, from the client's own watch thread to the
    measuring one; ``get`` raises TimeoutError after EVENT_TIMEOUT_S."""

    def __init__(self) -> None:
        self.q: queue.Queue[bytes] = queue.Queue()
        self.cancel: Callable[[], None] = lambda: None

    def get(self) -> bytes:
        try:
            return self.q.get(timeout=EVENT_TIMEOUT_S)
        except queue.Empty:
            raise TimeoutError("no watch event") from None

    def close(self) -> None:
        self.cancel()


def _drain(it: Any, q: queue.Queue[bytes], keys: Callable[[Any], list[bytes]]) -> None:
    try:
        for item in it:
            for k in keys(item):
                q.put(k)
    except Exception:  # the iterator ends with an error when cancelled
        return


def _watch_thread(
    it: Any, keys: Callable[[Any], list[bytes]], cancel: Callable[[], None]
) -> Events:
    ev = Events()
    ev.cancel = cancel
    threading.Thread(target=_drain, args=(it, ev.q, keys), daemon=True).start()
    return ev


class OwnProbe:
    """tierstore.membership.etcd_client.EtcdClient, as the sidecars use it."""

    def __init__(self, endpoint: str) -> None:
        from tierstore.membership.etcd_client import EtcdAuth, EtcdClient

        self.c = EtcdClient(EtcdAuth(endpoints=(endpoint,)), timeout_s=2.0)

    def put(self, key: bytes, value: bytes, lease: int = 0) -> None:
        self.c.put(key, value, lease)

    def get_prefix(self, prefix: bytes) -> tuple[int, int | None]:
        r = self.c.range_prefix(prefix)
        return len(r.kvs), r.header.revision

    def grant(self, ttl_s: int) -> int:
        return int(self.c.grant(ttl_s).ID)

    def keepalive(self, lease: int) -> int:
        return self.c.keepalive(lease)

    def revoke(self, lease: int) -> None:
        self.c.revoke(lease)

    def watch(self, prefix: bytes, revision: int | None) -> Events:
        stream = self.c.watch_prefix(prefix, revision or 0)
        return _watch_thread(stream, lambda r: [e.kv.key for e in r.events], stream.cancel)


class PyetcdProbe:
    """etcd-sdk-python (module ``pyetcd``): python-etcd3's API over regenerated
    stubs; also python-etcd3 itself (module ``etcd3``) where it imports."""

    def __init__(self, endpoint: str, module: str) -> None:
        lib = importlib.import_module(module)
        host, port = endpoint.rsplit(":", 1)
        self.c = lib.client(host=host, port=int(port), timeout=2.0)

    def put(self, key: bytes, value: bytes, lease: int = 0) -> None:
        self.c.put(key, value, lease=lease or None)

    def get_prefix(self, prefix: bytes) -> tuple[int, int | None]:
        r = self.c.get_prefix_response(prefix)
        return len(r.kvs), r.header.revision

    def grant(self, ttl_s: int) -> int:
        return int(self.c.lease(ttl_s).id)

    def keepalive(self, lease: int) -> int:
        return int(next(iter(self.c.refresh_lease(lease))).TTL)

    def revoke(self, lease: int) -> None:
        self.c.revoke_lease(lease)

    def watch(self, prefix: bytes, revision: int | None) -> Events:
        it, cancel = self.c.watch_prefix_response(prefix, start_revision=revision)
        return _watch_thread(it, lambda r: [e.key for e in r.events], cancel)


class Etcd3gwProbe:
    """etcd3gw: JSON over etcd's HTTP gateway."""

    def __init__(self, endpoint: str) -> None:
        import etcd3gw

        host, port = endpoint.rsplit(":", 1)
        self.c = etcd3gw.client(host=host, port=int(port), timeout=2.0)
        self.leases: dict[int, Any] = {}

    def put(self, key: bytes, value: bytes, lease: int = 0) -> None:
        self.c.put(key, value, lease=self.leases[lease] if lease else None)

    def get_prefix(self, prefix: bytes) -> tuple[int, int | None]:
        kvs = self.c.get_prefix(prefix)
        # get_prefix does not give the revision; the gateway's raw reply does
        from etcd3gw.utils import _encode, _increment_last_byte

        raw = self.c.post(self.c.get_url("/kv/range"), json={
            "key": _encode(prefix), "range_end": _encode(_increment_last_byte(prefix)),
            "count_only": True})  # fmt: skip
        return len(kvs), int(raw["header"]["revision"])

    def grant(self, ttl_s: int) -> int:
        lease = self.c.lease(ttl_s)
        self.leases[lease.id] = lease
        return int(lease.id)

    def keepalive(self, lease: int) -> int:
        return int(self.leases[lease].refresh())

    def revoke(self, lease: int) -> None:
        self.leases[lease].revoke()

    def watch(self, prefix: bytes, revision: int | None) -> Events:
        it, cancel = self.c.watch_prefix(prefix, start_revision=revision)
        return _watch_thread(it, lambda e: [e["kv"]["key"]], cancel)


class EtcdClientPyProbe:
    """etcd-client-py (module ``etcd_client``): Rust's etcd-client behind an
    asyncio API. Its calls give what they give: ``lease_grant`` and
    ``lease_keep_alive`` return nothing, ``put`` takes no lease, and
    ``get_prefix`` and ``watch_prefix`` have no revision."""

    def __init__(self, endpoint: str) -> None:
        import etcd_client

        self.client = etcd_client.Client([endpoint])
        self.c: Any = None

    async def open(self) -> None:
        self.ctx = self.client.connect()
        self.c = await self.ctx.__aenter__()

    async def put(self, key: bytes, value: bytes, lease: int = 0) -> None:
        if lease:
            raise TypeError("etcd-client-py: put takes no lease")
        await self.c.put(key, value)

    async def get_prefix(self, prefix: bytes) -> tuple[int, int | None]:
        return len(await self.c.get_prefix(prefix)), None

    async def grant(self, ttl_s: int) -> Any:
        return await self.c.lease_grant(ttl_s)

    async def watch(self, prefix: bytes, revision: int | None) -> Any:
        q: asyncio.Queue[bytes] = asyncio.Queue()
        stream = self.c.watch_prefix(prefix)

        async def drain() -> None:
            async for ev in stream:
                q.put_nowait(bytes(ev.key))

        task = asyncio.ensure_future(drain())

        class AsyncEvents:
            async def get(self) -> bytes:
                return await asyncio.wait_for(q.get(), EVENT_TIMEOUT_S)

            async def close(self) -> None:
                task.cancel()

        return AsyncEvents()


def _closure(dists: list[str]) -> set[str]:
    """``dists`` and every distribution they need that is installed here (extras left out)."""
    seen: set[str] = set()
    todo = list(dists)
    while todo:
        name = re.split(r"[ ;<>=!~\[(]", todo.pop(), maxsplit=1)[0].lower().replace("_", "-")
        if name in seen:
            continue
        try:
            reqs = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue  # a requirement for another platform or Python
        seen.add(name)
        todo += [r for r in reqs if "extra ==" not in r]
    return seen


async def measure_candidate(module: str, endpoint: str, n: int) -> dict[str, Any]:
    """In the candidates' environment: import ``module``, say what it brought, measure it."""
    dist = CANDIDATES[module]
    out: dict[str, Any] = {"client": dist, "version": importlib.metadata.version(dist)}
    out["requires"] = [r for r in importlib.metadata.requires(dist) or [] if "extra ==" not in r]
    # what installing it adds to a project that already has grpcio and protobuf
    out["adds"] = sorted(_closure([dist]) - _closure(["grpcio", "protobuf"]) - {dist})
    out.update(_pins())
    try:
        probe: Any
        if module in ("pyetcd", "etcd3"):
            probe = PyetcdProbe(endpoint, module)
        elif module == "etcd3gw":
            probe = Etcd3gwProbe(endpoint)
        else:
            probe = EtcdClientPyProbe(endpoint)
            await probe.open()
    except Exception as e:  # the finding is that it does not import or connect
        out["imports"] = False
        out["error"] = f"{type(e).__name__}: {str(e).splitlines()[0]}"
        return out
    out["imports"] = True
    out.update(await measure(probe, n, module))

    def etcd_do(what: str) -> None:  # the parent does it between these two lines
        print(what, flush=True)
        sys.stdin.readline()

    out.update(await after_restart(probe, etcd_do))
    return out


def _pins() -> dict[str, str]:
    return {pkg: importlib.metadata.version(pkg) for pkg in ("protobuf", "grpcio")}


def seed_range(endpoint: str) -> None:
    from tierstore.membership.etcd_client import EtcdAuth, EtcdClient

    c = EtcdClient(EtcdAuth(endpoints=(endpoint,)), timeout_s=2.0)
    try:
        for i in range(RANGE_KEYS):
            c.put(f"/bench/range/{i:04d}".encode(), VALUE)
    finally:
        c.close()


def etcd_do(etcd: Any, what: str) -> None:
    """ "kill": SIGKILL etcd; "start": start it again on the same data, once it answers."""
    if what == "kill":
        etcd.kill()
    else:
        etcd.start()


def run_candidate(cmd: list[str], etcd: Any, err_path: Path) -> dict[str, Any]:
    """Run one candidate's ``--measure`` in its venv (from the checkout's root);
    kill and start etcd when it asks."""
    with open(err_path, "w+") as err:
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                text=True, cwd=REPO)  # fmt: skip
        assert proc.stdin is not None and proc.stdout is not None
        result: dict[str, Any] = {}
        for line in proc.stdout:
            if line.strip() in ("kill", "start"):
                etcd_do(etcd, line.strip())
                proc.stdin.write("go\n")
                proc.stdin.flush()
            elif line.strip():
                result = json.loads(line)
        proc.wait(60)
        if not result:
            err.seek(0)
            tail = err.read().strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
            result = {"client": cmd[cmd.index("--measure") + 1], "error": tail[0]}
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--calls", type=int, default=300, help="calls of each kind per client")
    p.add_argument("--candidates-python", default="", help="python of the candidates' venv")
    p.add_argument("--only", default=",".join(CANDIDATES), help="candidate modules to measure")
    p.add_argument("--measure", default="", help=argparse.SUPPRESS)  # candidate subprocess
    p.add_argument("--endpoint", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.measure:
        result = asyncio.run(measure_candidate(args.measure, args.endpoint, args.calls))
        print(json.dumps(result), flush=True)
        return

    from bench.limits import emit
    from harness.etcd import EtcdProcess, etcd_binary

    if etcd_binary() is None:
        raise SystemExit(
            "bench/membership/etcd_clients.py needs etcd (apt-get install etcd-server)"
        )
    clients: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="tierstore-bench-etcd-clients-") as d:
        etcd = EtcdProcess(Path(d))
        try:
            seed_range(etcd.endpoint)
            own: dict[str, Any] = {"client": "tierstore (own stubs)", "imports": True, **_pins()}
            probe = OwnProbe(etcd.endpoint)
            own.update(asyncio.run(measure(probe, args.calls, "own")))
            own.update(asyncio.run(after_restart(probe, lambda what: etcd_do(etcd, what))))
            clients.append(own)
            for module in filter(None, args.only.split(",")) if args.candidates_python else ():
                cmd = [args.candidates_python, "-m", "bench.membership.etcd_clients",
                       "--measure", module, "--endpoint", etcd.endpoint,
                       "--calls", str(args.calls)]  # fmt: skip
                clients.append(run_candidate(cmd, etcd, Path(d) / f"{module}.err"))
        finally:
            etcd.stop()
    emit({"etcd": "loopback, tmpfs data", "calls": args.calls, "clients": clients}, args.json)


if __name__ == "__main__":
    main()
