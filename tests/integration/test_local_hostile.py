"""Hostile input on the sidecar's local socket.

One real sidecar (``python -m tierstore.cli serve`` in a subprocess, small
tiers, ``max_batch_keys=64``) serves every test of this module. Requests go
through the raw generated stub, or as raw bytes, so that no client-side
check hides a server-side gap; ``StoreClient`` plays the legitimate engine
that must keep working. Covered: malformed fields (the status details must
name the problem), callers that are not attached, invalid layouts, commits
of reservations the caller does not own, bad prefetch arguments, a seeded
fuzzer, the socket's mode, and a client SIGKILLed while it holds pins and
reservations. Regression tests of the sidecar bugs this module found are at the end.
"""

from __future__ import annotations

import json
import math
import os
import random
import select
import signal
import subprocess
import sys
import textwrap
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tierstore.client import StoreClient
from tierstore.keys import KEY_BYTES, BlockKey, KVLayout, chain_keys
from tierstore.sidecar.service import MAX_MESSAGE_BYTES
from tierstore.v1 import common_pb2, local_pb2, local_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
# 8 KiB blocks: 2 (K,V) x 2 layers x 2 heads x 64 dim x 8 tokens x fp16.
LAYOUT = KVLayout("hostile", 2, 2, 64, "float16", 8)
DRAM_BYTES = 16 << 20
NVME_BYTES = 64 << 20
MAX_BATCH_KEYS = 64
CALL_TIMEOUT_S = 10.0
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0
DETACH_TIMEOUT_S = 5.0
FUZZ_SEED = 20240229
FUZZ_MESSAGES = 2000
FUZZ_BUDGET_S = 40.0
FUZZ_DEADLINE_S = 2.0

SERVICE = "/tierstore.v1.LocalService/"
UNARY_METHODS = (
    "RegisterLayout",
    "Reserve",
    "Commit",
    "Abort",
    "Lookup",
    "Acquire",
    "Release",
    "Prefetch",
    "EndTurn",
    "ReportLoad",
    "ReportTiers",
    "Stat",
)
KEYED_METHODS = ("Reserve", "Commit", "Abort", "Lookup", "Acquire", "Release", "Prefetch")
ATTACHED_METHODS = ("Reserve", "Commit", "Abort", "Acquire", "Release")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


@dataclass
class Sidecar:
    socket_path: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    def stat(self) -> dict[str, Any]:
        """``tierstore stat --json``, run as a user would."""
        out = subprocess.run(
            [sys.executable, "-m", "tierstore.cli", "stat", "--socket", self.socket_path, "--json"],
            cwd=ROOT,
            env=_env(),
            capture_output=True,
            timeout=60,
            check=True,
        )
        return json.loads(out.stdout)

    def counters(self) -> dict[str, int]:
        return {k: int(v) for k, v in self.stat()["counters"].items()}


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sidecar]:
    tmp = tmp_path_factory.mktemp("hostile")
    sock = tmp / "s.sock"
    log_path = tmp / "sidecar.log"
    cmd = [
        sys.executable, "-m", "tierstore.cli", "serve",
        "--socket", str(sock),
        "--nvme-dir", str(tmp / "nvme"),
        "--dram-bytes", str(DRAM_BYTES),
        "--nvme-bytes", str(NVME_BYTES),
        "--metrics-port", "0",
        "--set", "dram_segment_bytes=1MiB",
        "--set", "nvme_segment_bytes=1MiB",
        "--set", f"max_batch_keys={MAX_BATCH_KEYS}",
    ]  # fmt: skip
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not sock.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"sidecar did not start:\n{log_path.read_text(errors='replace')}")
            time.sleep(0.05)
        yield Sidecar(str(sock), proc, log_path)
    finally:
        ignored_sigterm = False
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                ignored_sigterm = True
                proc.kill()
                proc.wait()
        for name in os.listdir("/dev/shm"):  # left behind only by a killed sidecar
            if name.startswith(f"tierstore-{proc.pid}-"):
                os.unlink(os.path.join("/dev/shm", name))
    assert not ignored_sigterm, f"sidecar ignored SIGTERM for {STOP_TIMEOUT_S}s"
    assert proc.returncode == 0, log_path.read_text(errors="replace")[-4000:]


@pytest.fixture(scope="module")
def channel(sidecar: Sidecar) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(f"unix:{sidecar.socket_path}") as ch:
        grpc.channel_ready_future(ch).result(timeout=CALL_TIMEOUT_S)
        yield ch


@pytest.fixture(scope="module")
def stub(channel: grpc.Channel) -> local_pb2_grpc.LocalServiceStub:
    return local_pb2_grpc.LocalServiceStub(channel)


@pytest.fixture(scope="module")
def client(sidecar: Sidecar) -> Iterator[StoreClient]:
    """The legitimate engine: attached for the whole module, LAYOUT registered."""
    with StoreClient(sidecar.socket_path, name="legit") as c:
        c.register(LAYOUT)
        yield c


# -- helpers ---------------------------------------------------------------------------

_key_rng = random.Random(7)


def fresh_keys(n: int, layout: KVLayout = LAYOUT) -> list[BlockKey]:
    """Keys of a prompt nobody stored before (random tokens)."""
    start = _key_rng.randrange(1 << 30)
    return chain_keys(layout, np.arange(n * layout.block_tokens, dtype=np.int64) + start)


def random_blocks(n: int, layout: KVLayout = LAYOUT, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, layout.block_bytes), dtype=np.uint8)


def request(
    method: str, client_id: int, layout_id: bytes, keys: bytes, **extra: Any
) -> local_pb2.KeysRequest | local_pb2.PrefetchRequest:
    cls = local_pb2.PrefetchRequest if method == "Prefetch" else local_pb2.KeysRequest
    return cls(client_id=client_id, layout_id=layout_id, keys=keys, **extra)


def refused(fn: Callable[..., Any], req: Any) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        fn(req, timeout=CALL_TIMEOUT_S)
    return info.value  # type: ignore[return-value]


def assert_refused(fn: Callable[..., Any], req: Any, code: grpc.StatusCode, *words: str) -> None:
    err = refused(fn, req)
    assert err.code() == code, f"{err.code()}: {err.details()}"
    details = err.details() or ""
    for word in words:
        assert word in details, f"{word!r} not in the details {details!r}"


def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} not within {timeout_s}s")
        time.sleep(0.1)


def client_names(sidecar: Sidecar) -> list[str]:
    return [c["name"] for c in sidecar.stat()["clients"]]


# -- malformed fields ----------------------------------------------------------------------


@pytest.mark.parametrize("method", UNARY_METHODS)
def test_messages_past_the_size_limit_are_refused(
    channel: grpc.Channel, client: StoreClient, method: str
) -> None:
    """Refused by gRPC before any handler (RESOURCE_EXHAUSTED); one just
    under the limit that does not parse is refused too; nothing is lost."""
    keys = chain_keys(LAYOUT, np.arange(16) + 77_000 + 100 * UNARY_METHODS.index(method))
    data = torch.randint(0, 256, (2, LAYOUT.block_bytes), dtype=torch.uint8)
    assert all(client.store(LAYOUT, keys, data))
    call = channel.unary_unary(SERVICE + method)
    with pytest.raises(grpc.RpcError) as err:
        call(b"\x0a" * (MAX_MESSAGE_BYTES + 1), timeout=CALL_TIMEOUT_S)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    with pytest.raises(grpc.RpcError) as err:
        call(random.Random(7).randbytes(MAX_MESSAGE_BYTES - 64), timeout=CALL_TIMEOUT_S)
    assert err.value.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.INVALID_ARGUMENT)
    assert torch.equal(client.load(LAYOUT, keys).blocks, data)


@pytest.mark.parametrize("nbytes", [1, 31, 33, 32 * 5 + 7])
@pytest.mark.parametrize("method", KEYED_METHODS)
def test_keys_field_not_a_multiple_of_32(
    stub: Any, client: StoreClient, method: str, nbytes: int
) -> None:
    req = request(method, client.client_id, LAYOUT.fingerprint, b"\x01" * nbytes)
    assert_refused(getattr(stub, method), req, grpc.StatusCode.INVALID_ARGUMENT, "multiple of 32")


@pytest.mark.parametrize("method", KEYED_METHODS)
def test_more_keys_than_max_batch_keys(stub: Any, client: StoreClient, method: str) -> None:
    keys = b"".join(fresh_keys(MAX_BATCH_KEYS + 1))
    req = request(method, client.client_id, LAYOUT.fingerprint, keys)
    assert_refused(
        getattr(stub, method),
        req,
        grpc.StatusCode.INVALID_ARGUMENT,
        "max_batch_keys",
        str(MAX_BATCH_KEYS),
    )


def test_max_batch_keys_itself_is_accepted(stub: Any, client: StoreClient) -> None:
    keys = b"".join(fresh_keys(MAX_BATCH_KEYS))
    reply = stub.Lookup(
        request("Lookup", client.client_id, LAYOUT.fingerprint, keys), timeout=CALL_TIMEOUT_S
    )
    assert reply.num_hits == 0


@pytest.mark.parametrize("length", [0, 1, 31, 33, 64])
@pytest.mark.parametrize("method", KEYED_METHODS)
def test_layout_id_of_wrong_length(
    stub: Any, client: StoreClient, method: str, length: int
) -> None:
    req = request(method, client.client_id, b"\x02" * length, b"".join(fresh_keys(2)))
    assert_refused(
        getattr(stub, method), req, grpc.StatusCode.INVALID_ARGUMENT, "layout_id", "32 bytes"
    )


@pytest.mark.parametrize("method", KEYED_METHODS)
def test_unknown_layout_id(stub: Any, client: StoreClient, method: str) -> None:
    layout_id = random.Random(method).randbytes(32)
    req = request(method, client.client_id, layout_id, b"".join(fresh_keys(2)))
    assert_refused(getattr(stub, method), req, grpc.StatusCode.NOT_FOUND, "unknown layout")


@pytest.mark.parametrize("client_id", [0, 987_654_321, 2**64 - 1])
@pytest.mark.parametrize("method", ATTACHED_METHODS)
def test_client_never_attached(stub: Any, client: StoreClient, method: str, client_id: int) -> None:
    # 0 is the store's own owner id: a caller must never be able to act as it.
    req = request(method, client_id, LAYOUT.fingerprint, b"".join(fresh_keys(2)))
    assert_refused(getattr(stub, method), req, grpc.StatusCode.FAILED_PRECONDITION, "not attached")


def test_client_id_is_refused_after_detach(
    sidecar: Sidecar, stub: Any, client: StoreClient
) -> None:
    gone = StoreClient(sidecar.socket_path, name="short-lived")
    gone_id = gone.client_id
    gone.close()
    wait_for(lambda: "short-lived" not in client_names(sidecar), DETACH_TIMEOUT_S, "detach")
    req = request("Reserve", gone_id, LAYOUT.fingerprint, b"".join(fresh_keys(1)))
    assert_refused(stub.Reserve, req, grpc.StatusCode.FAILED_PRECONDITION, "not attached")


# -- layouts ---------------------------------------------------------------------------------


def _layout_msg(**changes: Any) -> common_pb2.Layout:
    return common_pb2.Layout(**{**LAYOUT.to_dict(), **changes})


@pytest.mark.parametrize(
    ("req", "words"),
    [
        (local_pb2.RegisterLayoutRequest(), ("needs a layout",)),
        (local_pb2.RegisterLayoutRequest(layout=_layout_msg(num_layers=0)), ("num_layers",)),
        (local_pb2.RegisterLayoutRequest(layout=_layout_msg(dtype="float64")), ("float64",)),
        (local_pb2.RegisterLayoutRequest(layout=_layout_msg(dtype="")), ("dtype",)),
        (local_pb2.RegisterLayoutRequest(layout=_layout_msg(model="")), ("model",)),
        (local_pb2.RegisterLayoutRequest(layout=_layout_msg(block_tokens=0)), ("block_tokens",)),
        (
            local_pb2.RegisterLayoutRequest(layout=_layout_msg(tp_rank=4, tp_size=4)),
            ("tp_rank",),
        ),
    ],
    ids=["no-layout", "num_layers-0", "float64", "no-dtype", "no-model", "block_tokens-0", "rank"],
)
def test_register_layout_refuses_invalid(stub: Any, req: Any, words: tuple[str, ...]) -> None:
    assert_refused(stub.RegisterLayout, req, grpc.StatusCode.INVALID_ARGUMENT, *words)


# -- two-phase writes across clients ----------------------------------------------------------


def test_commit_of_keys_reserved_by_another_client(
    sidecar: Sidecar, stub: Any, client: StoreClient
) -> None:
    n = 8
    keys = fresh_keys(n)
    data = random_blocks(n, seed=11)
    reply = client._stub.Reserve(client._req(LAYOUT, keys), timeout=CALL_TIMEOUT_S)
    assert list(reply.statuses) == [local_pb2.RESERVE_OK] * n
    size = LAYOUT.block_bytes
    for offset, row in zip(reply.offsets, data):
        client.arena.array[offset : offset + size] = row
    with StoreClient(sidecar.socket_path, name="intruder") as intruder:
        intruder.register(LAYOUT)
        # Reserved by another attached client.
        assert_refused(
            stub.Commit,
            intruder._req(LAYOUT, keys),
            grpc.StatusCode.INVALID_ARGUMENT,
            "not reserved by client",
            "nothing was committed",
        )
        # Never reserved by anyone.
        assert_refused(
            stub.Commit,
            intruder._req(LAYOUT, fresh_keys(3)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "3 of 3 keys are not reserved",
        )
        # Aborting them is not possible either.
        assert stub.Abort(intruder._req(LAYOUT, keys), timeout=CALL_TIMEOUT_S).count == 0
    # The owner's own commit is all or nothing: one stranger key refuses the batch.
    assert_refused(
        stub.Commit,
        client._req(LAYOUT, [*keys, *fresh_keys(1)]),
        grpc.StatusCode.INVALID_ARGUMENT,
        "1 of 9 keys",
        "nothing was committed",
    )
    assert client.lookup(LAYOUT, keys).num_hits == 0
    flags = stub.Commit(client._req(LAYOUT, keys), timeout=CALL_TIMEOUT_S).flags
    assert list(flags) == [1] * n
    got = client.load(LAYOUT, keys)
    assert got.num_blocks == n
    assert np.array_equal(got.blocks.numpy(), data)


# -- prefetch arguments -----------------------------------------------------------------------


@pytest.mark.parametrize("policy", [3, 7, 2**31 - 1, -1])
def test_prefetch_unknown_policy(stub: Any, client: StoreClient, policy: int) -> None:
    req = request(
        "Prefetch", client.client_id, LAYOUT.fingerprint, b"".join(fresh_keys(2)), policy=policy
    )
    assert_refused(stub.Prefetch, req, grpc.StatusCode.INVALID_ARGUMENT, "prefetch policy")


@pytest.mark.parametrize("timeout_s", [-1.0, -1e-9, math.nan, math.inf, 1e9])
@pytest.mark.parametrize("policy", [local_pb2.PREFETCH_TIMEOUT, local_pb2.PREFETCH_WAIT])
def test_prefetch_bad_timeout(
    stub: Any, client: StoreClient, policy: int, timeout_s: float
) -> None:
    req = request(
        "Prefetch",
        client.client_id,
        LAYOUT.fingerprint,
        b"".join(fresh_keys(2)),
        policy=policy,
        timeout_s=timeout_s,
    )
    assert_refused(stub.Prefetch, req, grpc.StatusCode.INVALID_ARGUMENT, "timeout_s")


# -- the socket ---------------------------------------------------------------------------------


def test_socket_and_arena_are_owner_only(sidecar: Sidecar, client: StoreClient) -> None:
    assert os.stat(sidecar.socket_path).st_mode & 0o777 == 0o600
    assert os.stat(sidecar.socket_path + ".lock").st_mode & 0o777 == 0o600
    assert os.stat(client.arena.path).st_mode & 0o777 == 0o600


# -- fuzzing ------------------------------------------------------------------------------------


class Fuzzer:
    """Seeded random and malformed requests, typed and as raw bytes."""

    def __init__(
        self,
        channel: grpc.Channel,
        stub: Any,
        seed: int,
        fuzz_ids: list[int],
        avoid_ids: set[int],
        stored_keys: list[BlockKey],
    ) -> None:
        self.rng = random.Random(seed)
        self.channel = channel
        self.stub = stub
        self.fuzz_ids = fuzz_ids
        self.avoid_ids = avoid_ids
        self.stored_keys = stored_keys
        self.layout_ids: list[bytes] = [LAYOUT.fingerprint]
        self.reserved: list[tuple[bytes, bytes]] = []  # (layout id, keys) OK'd to a fuzz id
        self.codes: Counter[str] = Counter()
        self.unexpected: list[str] = []
        self.sent = 0
        self.raw = {m: channel.unary_unary(SERVICE + m) for m in UNARY_METHODS}
        self.raw_attach = channel.unary_stream(SERVICE + "Attach")

    # -- field generators --------------------------------------------------------------

    def client_id(self) -> int:
        r = self.rng.random()
        if r < 0.6:
            return self.rng.choice(self.fuzz_ids)
        if r < 0.7:
            return 0
        cid = self.rng.choice([self.rng.randrange(1, 64), self.rng.getrandbits(64)])
        # Impersonating the legitimate client is a separate finding
        # (test_client_id_is_bound_to_its_connection); here it would only
        # let the fuzzer fill DRAM with reservations in its name.
        return cid if cid not in self.avoid_ids else 0

    def layout_id(self) -> bytes:
        r = self.rng.random()
        if r < 0.75:
            return self.rng.choice(self.layout_ids)
        if r < 0.9:
            return self.rng.randbytes(32)
        return self.rng.randbytes(self.rng.choice([0, 1, 16, 31, 33, 64]))

    def keys(self, layout_id: bytes) -> bytes:
        r = self.rng.random()
        n = self.rng.choice([0, 1, 2, 8, 32, MAX_BATCH_KEYS, MAX_BATCH_KEYS + 1, 200])
        if r < 0.15 and self.reserved:
            lid, keys = self.rng.choice(self.reserved)
            if lid == layout_id:
                return keys
        if r < 0.3 and layout_id == LAYOUT.fingerprint:
            # Blocks stored before the fuzzing, with their own layout only, so
            # that the check afterwards can expect every one of them intact.
            lo = self.rng.randrange(len(self.stored_keys))
            return b"".join(self.stored_keys[lo : lo + n])
        if r < 0.9:
            return self.rng.randbytes(KEY_BYTES * n)
        return self.rng.randbytes(self.rng.randrange(0, 300))

    def layout(self) -> common_pb2.Layout:
        rng = self.rng

        def dim() -> int:
            return rng.choice([0, 1, 2, 3, 8, 64, 128, rng.randrange(1 << 16), (1 << 32) - 1])

        tp_size = rng.choice([0, 1, 2, 8, (1 << 32) - 1])
        return common_pb2.Layout(
            model=rng.choice(["", "m", "fuzz-" + rng.randbytes(4).hex(), "\u00e9\u2603" * 40]),
            num_layers=dim(),
            num_kv_heads=dim(),
            head_dim=dim(),
            dtype=rng.choice(["float16", "bfloat16", "uint8", "float32", "float64", "", "x"]),
            block_tokens=dim(),
            tp_rank=rng.choice([0, 1, 7, (1 << 32) - 1]),
            tp_size=tp_size,
            tenant_salt=rng.choice(["", "salt", rng.randbytes(8).hex()]),
        )

    # -- messages ------------------------------------------------------------------------

    def typed(self, method: str) -> Any:
        if method == "RegisterLayout":
            if self.rng.random() < 0.1:
                return local_pb2.RegisterLayoutRequest()
            return local_pb2.RegisterLayoutRequest(layout=self.layout())
        if method == "Stat":
            return local_pb2.StatRequest()
        if method == "ReportLoad":
            big = [0, 1, 7, (1 << 32) - 1]
            return local_pb2.ReportLoadRequest(
                client_id=self.client_id(),
                busy_slots=self.rng.choice(big),
                slots=self.rng.choice(big),
                queue_len=self.rng.choice(big),
                wait_s=self.rng.choice([0.0, 1.5, -1.0, math.nan, math.inf, 1e300]),
                prefill_tokens_per_s=self.rng.choice([0.0, 5e3, -3.0, math.nan, math.inf]),
            )
        if method == "ReportTiers":
            names = ["hbm", "hbm", "dram", "nvme", "", "\u2603" * 50]
            tiers = [
                common_pb2.TierStat(
                    name=self.rng.choice(names),
                    num_blocks=self.rng.choice([0, 5, (1 << 64) - 1]),
                    capacity_bytes=self.rng.choice([0, 1 << 30, (1 << 64) - 1]),
                )
                for _ in range(self.rng.choice([0, 1, 1, 2, 40]))
            ]
            return local_pb2.ReportTiersRequest(client_id=self.client_id(), tiers=tiers)
        layout_id = self.layout_id()
        if method == "EndTurn":
            return local_pb2.EndTurnRequest(
                client_id=self.client_id(),
                layout_id=layout_id,
                session=self.rng.choice(["", "s", "\u2603" * 300, self.rng.randbytes(8).hex()]),
                keys=self.keys(layout_id),
                num_tokens=self.rng.choice([0, 1, 9000, (1 << 64) - 1]),
                wait=self.rng.random() < 0.5,
                replica_target=self.rng.choice(["", "127.0.0.1:1", "nowhere:x", "a" * 300]),
            )
        extra: dict[str, Any] = {}
        if method == "Prefetch":
            extra["policy"] = self.rng.choice([0, 1, 2, 2, 3, 99, -5])
            extra["timeout_s"] = self.rng.choice(
                [0.0, 0.01, 0.5, -1.0, math.nan, math.inf, 1e300, self.rng.uniform(-10, 40)]
            )
        return request(method, self.client_id(), layout_id, self.keys(layout_id), **extra)

    def mutate(self, data: bytes) -> bytes:
        """Flip, cut, splice or extend a serialised request."""
        buf = bytearray(data)
        for _ in range(self.rng.randrange(1, 4)):
            op = self.rng.randrange(4)
            if op == 0 and buf:
                buf[self.rng.randrange(len(buf))] ^= 1 << self.rng.randrange(8)
            elif op == 1 and buf:
                del buf[self.rng.randrange(len(buf)) :]
            elif op == 2:
                at = self.rng.randrange(len(buf) + 1)
                buf[at:at] = self.rng.randbytes(self.rng.randrange(1, 16))
            else:
                buf += bytes([self.rng.randrange(256)]) + self.rng.randbytes(self.rng.randrange(9))
        return bytes(buf)

    # -- sending --------------------------------------------------------------------------

    def one(self) -> None:
        method = self.rng.choice(UNARY_METHODS)
        r = self.rng.random()
        kind = "attach" if r < 0.02 else "typed" if r < 0.7 else "mutated" if r < 0.85 else "bytes"
        try:
            if kind == "attach":
                self._attach_garbage()
                return
            if kind == "typed":
                msg = self.typed(method)
                reply = getattr(self.stub, method)(msg, timeout=FUZZ_DEADLINE_S)
                self._learn(method, msg, reply)
            elif kind == "mutated":
                data = self.mutate(self.typed(method).SerializeToString())
                self.raw[method](data, timeout=FUZZ_DEADLINE_S)
            else:
                data = self.rng.randbytes(self.rng.randrange(0, 512))
                self.raw[method](data, timeout=FUZZ_DEADLINE_S)
            self.codes["OK"] += 1
        except grpc.RpcError as e:
            code = e.code()
            self.codes[code.name] += 1
            # UNKNOWN is an exception that escaped a handler; so is INTERNAL
            # for a well-formed message (raw bytes may fail to parse: INTERNAL).
            if code == grpc.StatusCode.UNKNOWN or (
                code == grpc.StatusCode.INTERNAL and kind == "typed"
            ):
                self.unexpected.append(f"{method} ({kind}): {code.name}: {e.details()}")
        finally:
            self.sent += 1

    def _attach_garbage(self) -> None:
        data = self.mutate(local_pb2.AttachRequest(client_name="fuzz-attach").SerializeToString())
        stream = self.raw_attach(data, timeout=FUZZ_DEADLINE_S)
        try:
            next(stream)
            self.codes["ATTACH_OK"] += 1
        finally:
            stream.cancel()

    def _learn(self, method: str, msg: Any, reply: Any) -> None:
        if method == "RegisterLayout" and len(self.layout_ids) < 32:
            self.layout_ids.append(reply.layout_id)
        elif method == "Reserve" and msg.client_id in self.fuzz_ids and reply.statuses:
            self.reserved.append((msg.layout_id, msg.keys))
            del self.reserved[:-64]


def test_fuzzing_leaves_the_sidecar_serving(
    sidecar: Sidecar, channel: grpc.Channel, stub: Any, client: StoreClient
) -> None:
    before_keys = fresh_keys(48)
    before = random_blocks(len(before_keys), seed=21)
    assert all(client.store(LAYOUT, before_keys, before))
    # Two fuzz clients attached on the raw stub; detached by cancelling.
    streams = [stub.Attach(local_pb2.AttachRequest(client_name=f"fuzz-{i}")) for i in range(2)]
    fuzz_ids = [next(s).client_id for s in streams]
    fuzzer = Fuzzer(channel, stub, FUZZ_SEED, fuzz_ids, {client.client_id}, before_keys)
    t0 = time.monotonic()
    try:
        while fuzzer.sent < FUZZ_MESSAGES and time.monotonic() - t0 < FUZZ_BUDGET_S:
            fuzzer.one()
    finally:
        for s in streams:
            s.cancel()
    elapsed = time.monotonic() - t0
    print(f"fuzz: {fuzzer.sent} messages in {elapsed:.1f}s: {dict(fuzzer.codes)}")
    assert fuzzer.sent >= FUZZ_MESSAGES // 4, f"only {fuzzer.sent} messages in {elapsed:.0f}s"
    assert sidecar.proc.poll() is None, "the sidecar died"
    assert not fuzzer.unexpected, "exceptions escaped handlers:\n" + "\n".join(
        sorted(set(fuzzer.unexpected))[:20]
    )
    wait_for(
        lambda: not any(n.startswith("fuzz-") for n in client_names(sidecar)),
        DETACH_TIMEOUT_S,
        "fuzz clients detached",
    )
    health = health_pb2_grpc.HealthStub(channel)
    status = health.Check(health_pb2.HealthCheckRequest(), timeout=CALL_TIMEOUT_S).status
    assert status == health_pb2.HealthCheckResponse.SERVING
    # A legitimate client still stores and loads byte-exact ...
    after_keys = fresh_keys(32)
    after = random_blocks(len(after_keys), seed=22)
    assert all(client.store(LAYOUT, after_keys, after))
    got = client.load(LAYOUT, after_keys)
    assert got.num_blocks == len(after_keys)
    assert np.array_equal(got.blocks.numpy(), after)
    # ... and every block stored before the fuzzing is still there, byte-exact.
    got = client.load(LAYOUT, before_keys)
    assert got.num_blocks == len(before_keys)
    assert np.array_equal(got.blocks.numpy(), before)


# -- a client killed while holding pins and reservations ----------------------------------------

CHILD = textwrap.dedent(
    """
    import sys, time
    import numpy as np
    from tierstore.client import StoreClient
    from tierstore.keys import KVLayout
    sock, pinned_hex, reserved_hex = sys.argv[1:4]
    layout = KVLayout(*{layout_args!r})
    pinned_keys = [bytes.fromhex(h) for h in pinned_hex.split(",")]
    reserved_keys = [bytes.fromhex(h) for h in reserved_hex.split(",")]
    c = StoreClient(sock, name="doomed")
    blocks = np.full((len(pinned_keys), layout.block_bytes), 7, dtype=np.uint8)
    assert all(c.store(layout, pinned_keys, blocks))
    pinned = c.acquire(layout, pinned_keys)
    assert len(pinned.views) == len(pinned_keys)
    reply = c._stub.Reserve(c._req(layout, reserved_keys), timeout=30)
    assert list(reply.statuses) == [0] * len(reserved_keys), list(reply.statuses)
    print("ready", c.client_id, flush=True)
    time.sleep(600)
    """
)


def test_sigkilled_client_releases_pins_and_reservations(
    sidecar: Sidecar, client: StoreClient
) -> None:
    pinned_keys = fresh_keys(MAX_BATCH_KEYS)
    reserved_keys = fresh_keys(32)
    before = sidecar.counters()
    layout_args = (
        LAYOUT.model,
        LAYOUT.num_layers,
        LAYOUT.num_kv_heads,
        LAYOUT.head_dim,
        LAYOUT.dtype,
        LAYOUT.block_tokens,
    )
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            CHILD.format(layout_args=layout_args),
            sidecar.socket_path,
            ",".join(k.hex() for k in pinned_keys),
            ",".join(k.hex() for k in reserved_keys),
        ],
        cwd=ROOT,
        env=_env(),
        stdout=subprocess.PIPE,
    )
    try:
        assert child.stdout is not None
        ready, _, _ = select.select([child.stdout], [], [], 60)
        line = child.stdout.readline().decode() if ready else ""
        assert line.startswith("ready"), f"child not ready: {line!r} (exit {child.poll()})"
        doomed = [c for c in sidecar.stat()["clients"] if c["name"] == "doomed"]
        assert len(doomed) == 1 and int(doomed[0]["pins"]) == len(pinned_keys)
        child.send_signal(signal.SIGKILL)
        child.wait(10)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    wait_for(lambda: "doomed" not in client_names(sidecar), DETACH_TIMEOUT_S, "detach")
    after = sidecar.counters()
    assert after["leaked_pins_released"] - before["leaked_pins_released"] == len(pinned_keys)
    assert after["leaked_reservations_released"] - before["leaked_reservations_released"] == len(
        reserved_keys
    )
    # The reservations are gone: the keys are free to reserve again.
    reply = client._stub.Reserve(client._req(LAYOUT, reserved_keys), timeout=CALL_TIMEOUT_S)
    assert list(reply.statuses) == [local_pb2.RESERVE_OK] * len(reserved_keys)
    client._stub.Abort(client._req(LAYOUT, reserved_keys), timeout=CALL_TIMEOUT_S)
    # The pinned blocks are evictable again: storing more than DRAM holds
    # succeeds and pushes them (the least recently used) out of DRAM.
    assert client.lookup(LAYOUT, pinned_keys).tiers == ("dram",) * len(pinned_keys)
    n = DRAM_BYTES // LAYOUT.block_bytes + 256
    filler_keys = fresh_keys(n)
    filler = np.zeros((MAX_BATCH_KEYS, LAYOUT.block_bytes), dtype=np.uint8)
    for lo in range(0, n, MAX_BATCH_KEYS):
        batch = filler_keys[lo : lo + MAX_BATCH_KEYS]
        assert all(client.store(LAYOUT, batch, filler[: len(batch)]))
    tiers = client.lookup(LAYOUT, pinned_keys).tiers
    assert "dram" not in tiers, tiers
    got = client.load(LAYOUT, pinned_keys)  # spilled, not lost
    assert got.num_blocks == len(pinned_keys)
    assert bool((got.blocks == 7).all())


# -- regressions: oversize blocks, layout mix-ups, client ids, cancelled attaches -------------


def _register(stub: Any, layout: common_pb2.Layout) -> bytes:
    req = local_pb2.RegisterLayoutRequest(layout=layout)
    return stub.RegisterLayout(req, timeout=CALL_TIMEOUT_S).layout_id


def test_reserve_of_a_block_larger_than_dram_evicts_nothing(stub: Any, client: StoreClient) -> None:
    keys = fresh_keys(8)
    assert all(client.store(LAYOUT, keys, random_blocks(8, seed=31)))
    assert client.lookup(LAYOUT, keys).tiers == ("dram",) * 8
    huge = _layout_msg(model="huge", num_layers=64, num_kv_heads=64, head_dim=256)  # 64 MiB
    huge_id = _register(stub, huge)
    req = request("Reserve", client.client_id, huge_id, b"".join(fresh_keys(1)))
    try:
        reply = stub.Reserve(req, timeout=CALL_TIMEOUT_S)
        assert list(reply.statuses) == [local_pb2.RESERVE_FULL]
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert client.lookup(LAYOUT, keys).tiers == ("dram",) * 8


def test_key_stored_under_one_layout_is_a_miss_under_another(
    stub: Any, client: StoreClient
) -> None:
    keys = fresh_keys(2)
    assert all(client.store(LAYOUT, keys, random_blocks(2, seed=41)))
    bigger = _layout_msg(model="bigger", block_tokens=2 * LAYOUT.block_tokens)
    bigger_id = _register(stub, bigger)
    reply = stub.Acquire(
        request("Acquire", client.client_id, bigger_id, b"".join(keys)), timeout=CALL_TIMEOUT_S
    )
    stub.Release(
        request("Release", client.client_id, bigger_id, b"".join(keys)), timeout=CALL_TIMEOUT_S
    )
    assert list(reply.offsets) == []


def test_wrong_layout_promotion_does_not_wedge_the_block(stub: Any, client: StoreClient) -> None:
    keys = fresh_keys(1)
    data = random_blocks(1, seed=51)
    assert all(client.store(LAYOUT, keys, data))
    n = DRAM_BYTES // LAYOUT.block_bytes + 256
    filler_keys = fresh_keys(n)
    filler = np.zeros((MAX_BATCH_KEYS, LAYOUT.block_bytes), dtype=np.uint8)
    for lo in range(0, n, MAX_BATCH_KEYS):
        batch = filler_keys[lo : lo + MAX_BATCH_KEYS]
        client.store(LAYOUT, batch, filler[: len(batch)])
    assert client.lookup(LAYOUT, keys).tiers == ("nvme",)
    smaller_id = _register(stub, _layout_msg(model="smaller", block_tokens=4))
    req = request("Acquire", client.client_id, smaller_id, b"".join(keys))
    try:
        stub.Acquire(req, timeout=CALL_TIMEOUT_S)
    except grpc.RpcError:
        pass
    stub.Release(request("Release", client.client_id, smaller_id, b"".join(keys)))
    got = client.load(LAYOUT, keys)
    assert got.num_blocks == 1
    assert np.array_equal(got.blocks.numpy(), data)


def test_client_ids_cannot_be_guessed(sidecar: Sidecar, stub: Any, client: StoreClient) -> None:
    """Another process on the socket cannot act for a live client by trying
    the ids next to its own (ids are random, not sequential)."""
    keys = fresh_keys(4)
    assert all(client.store(LAYOUT, keys, random_blocks(4, seed=61)))
    with client.acquire(LAYOUT, keys) as pinned:
        assert len(pinned.views) == 4
        with StoreClient(str(sidecar.socket_path), name="attacker") as attacker:
            guesses = {attacker.client_id + d for d in range(-200, 201)} | set(range(1, 200))
            guesses -= {client.client_id}
            with grpc.insecure_channel(f"unix:{sidecar.socket_path}") as other:
                other_stub = local_pb2_grpc.LocalServiceStub(other)
                released = 0
                for guess in sorted(guesses - {attacker.client_id}):
                    req = request("Release", guess, LAYOUT.fingerprint, b"".join(keys))
                    try:
                        released += other_stub.Release(req, timeout=CALL_TIMEOUT_S).count
                    except grpc.RpcError as e:
                        assert e.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert released == 0
        assert abs(attacker.client_id - client.client_id) > 1000  # not a sequence


def test_cancelled_attach_leaves_no_client(sidecar: Sidecar, stub: Any) -> None:
    for i in range(200):
        stream = stub.Attach(
            local_pb2.AttachRequest(client_name=f"flash-{i}"),
            timeout=0.002 if i % 2 else None,
        )
        if i % 2 == 0:
            stream.cancel()
    time.sleep(2)  # a cancelled Attach that registered its callback is gone by now
    ghosts = [n for n in client_names(sidecar) if n.startswith("flash-")]
    assert not ghosts, f"{len(ghosts)} cancelled attaches still attached"
