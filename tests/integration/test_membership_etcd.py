"""``EtcdMembers`` against a real etcd: TLS with client certificates (mTLS),
user/password authentication with the credentials in a file, a list of
endpoints whose first one is dead, and a record deleted behind a member's
back (put back under the same lease); and `tierstore route` with no etcd.

``EtcdMembers`` runs in this process (a registering member and a watching
router-like one); the sidecar wiring is tested in test_membership.py.
Skipped when etcd (or, for auth, etcdctl; for TLS, openssl) is missing.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from harness import REPO
from harness.etcd import MISSING, EtcdProcess, etcd_binary
from tierstore.cli.ports import free_port
from tierstore.config.peer import PeerConfig
from tierstore.membership.etcd import EtcdMembers, describe_host

from ..conftest import SMALL_LAYOUT
from .test_peer_tls import _certs

pytestmark = pytest.mark.skipif(etcd_binary() is None, reason=MISSING)

WAIT_S = 20.0
SECRET = "s3cret-etcd-password"


def wait_for(what: str, cond: Callable[[], bool], timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        time.sleep(0.05)


@contextmanager
def members(url: str, register: bool, **settings: object) -> Iterator[EtcdMembers]:
    values: dict[str, object] = {"membership_ttl_s": 2, "membership_timeout_s": 0.5, **settings}
    cfg = PeerConfig(
        peer_port=free_port(), peer_token="t", membership=url, **values,  # type: ignore[arg-type]
    )  # fmt: skip
    describe = (
        describe_host(cfg.address(), cfg.group, ("dram",), 1 << 20, 0, 0, dict, "test")
        if register
        else None
    )
    m = EtcdMembers(cfg, describe=describe)
    m.start()
    try:
        yield m
    finally:
        m.close()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")
def test_mtls_to_etcd(tmp_path: Path) -> None:
    certs = _certs(tmp_path / "certs")
    (tmp_path / "etcd").mkdir()
    etcd = EtcdProcess(tmp_path / "etcd", tls=certs)
    try:
        url = f"etcds://{etcd.endpoint}/mtls"
        tls = {"membership_tls_ca_file": str(certs["ca"]),
               "membership_tls_cert_file": str(certs["cert"]),
               "membership_tls_key_file": str(certs["key"])}  # fmt: skip
        with members(url, True, **tls) as a, members(url, False, **tls) as watcher:
            wait_for("the watcher sees the member", lambda: len(watcher.addresses()) == 1)
            assert watcher.addresses() == [a.cfg.address()]
            assert a.counters.registered == 1
        # Without a client certificate etcd refuses the handshake: nothing joins.
        only_ca = {"membership_tls_ca_file": str(certs["ca"])}
        with members(url, False, **only_ca) as stranger:
            wait_for("the refusal is counted", lambda: stranger.counters.etcd_errors > 0)
            assert not stranger.wait_synced(0) and stranger.addresses() == []
            assert stranger.counters.etcd_up == 0
    finally:
        etcd.stop()


@pytest.mark.skipif(shutil.which("etcdctl") is None, reason="needs etcdctl (etcd-client)")
def test_credentials_from_a_file(etcd: EtcdProcess, tmp_path: Path) -> None:
    etcd.etcdctl("user", "add", "root:rootpw", "--interactive=false")
    etcd.etcdctl("user", "add", f"tierstore:{SECRET}", "--interactive=false")
    etcd.etcdctl("role", "add", "tierstore")
    etcd.etcdctl("role", "grant-permission", "tierstore", "readwrite", "/auth/", "--prefix=true")
    etcd.etcdctl("user", "grant-role", "tierstore", "tierstore")
    etcd.etcdctl("auth", "enable")
    cred = tmp_path / "etcd-credentials"
    cred.write_text(f"tierstore:{SECRET}\n")
    cred.chmod(0o600)
    url = f"etcd://{etcd.endpoint}/auth"
    # etcd checks a password with bcrypt (~0.1 s of CPU a call): give each
    # call time for that on a busy 2-core machine.
    auth = {
        "membership_credentials_file": str(cred),
        "membership_ttl_s": 8,
        "membership_timeout_s": 3.0,
    }
    with members(url, True, **auth) as a, members(url, False, **auth) as watcher:
        wait_for("the watcher sees the member", lambda: len(watcher.addresses()) == 1)
        assert a.counters.registered == 1 and a.counters.etcd_errors == 0
        values = etcd.etcdctl("--user", "root:rootpw", "get", "--prefix", "/auth/")
        assert watcher.addresses()[0] in values
        assert SECRET not in values and "rootpw" not in values  # nothing secret stored
    with members(url, False) as anonymous:  # no credentials: refused, counted
        wait_for("the refusal is counted", lambda: anonymous.counters.etcd_errors > 0)
        assert anonymous.addresses() == [] and anonymous.counters.etcd_up == 0


def test_a_dead_first_endpoint_is_skipped(etcd: EtcdProcess) -> None:
    url = f"etcd://127.0.0.1:{free_port()},{etcd.endpoint}/failover"
    with members(url, True) as a, members(url, False) as watcher:
        wait_for("the watcher sees the member", lambda: len(watcher.addresses()) == 1)
        wait_for("the member registered", lambda: a.counters.registered == 1)
        assert a.etcd.endpoint == etcd.endpoint


def test_a_deleted_record_is_put_back(etcd: EtcdProcess) -> None:
    url = f"etcd://{etcd.endpoint}/deleted"
    with members(url, True) as a, members(url, False) as watcher:
        wait_for("the watcher sees the member", lambda: len(watcher.addresses()) == 1)
        key = a.url.member_key(a.cfg.group, a.cfg.address())
        leases = a.counters.registrations
        a.etcd.delete(key)  # an operator's `etcdctl del`, say
        wait_for("the record is back", lambda: len(a.etcd.range_prefix(key).kvs) == 1)
        wait_for("the watcher sees it again", lambda: len(watcher.addresses()) == 1)
        assert a.counters.registrations == leases  # the same lease: no rejoin needed
        assert watcher.counters.leaves >= 1 and watcher.counters.joins >= 2


def test_route_with_no_reachable_etcd_says_so() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "tierstore.cli", "route", "--layout",
         json.dumps(SMALL_LAYOUT.to_dict()), "--random-tokens", "64",
         "--membership", f"etcd://127.0.0.1:{free_port()}/nobody", "--set", "peer_token=t",
         "--set", "membership_timeout_s=0.5"],
        capture_output=True, text=True, timeout=60, env=dict(os.environ, PYTHONPATH=str(REPO)),
    )  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert "no candidate hosts" in out.stderr and "Traceback" not in out.stderr
