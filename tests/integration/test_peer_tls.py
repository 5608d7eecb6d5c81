"""Peers over mTLS: the gRPC port and the data channel both speak TLS, and a
caller without a certificate signed by the group's CA is refused. One sidecar
listens on every interface: with TLS that is fine, so it does not warn, and
both report peer_tls."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from harness.sidecar import start_sidecar
from tierstore.cli.ports import free_port
from tierstore.client import StoreClient
from tierstore.keys import chain_keys
from tierstore.v1 import peer_pb2, peer_pb2_grpc

from ..conftest import SMALL_LAYOUT

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _certs(root: Path) -> dict[str, Path]:
    root.mkdir()
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out",
             "ca.pem", "-days", "2", "-subj", "/CN=tierstore-test-ca", cwd=root)  # fmt: skip
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "node.key", "-out", "node.csr",
             "-subj", "/CN=tierstore", cwd=root)  # fmt: skip
    (root / "ext").write_text("subjectAltName=DNS:tierstore,IP:127.0.0.1\n")
    _openssl("x509", "-req", "-in", "node.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
             "-CAcreateserial", "-out", "node.pem", "-days", "2", "-extfile", "ext",
             cwd=root)  # fmt: skip
    return {"ca": root / "ca.pem", "cert": root / "node.pem", "key": root / "node.key"}


def test_pull_and_push_over_mtls_and_refusals(tmp_path: Path) -> None:
    certs = _certs(tmp_path / "certs")
    pa, pb = free_port(), free_port()
    tls = ["--set", f"tls_cert_file={certs['cert']}", "--set", f"tls_key_file={certs['key']}",
           "--set", f"tls_ca_file={certs['ca']}", "--set", "peer_token=t0k3n",
           "--set", "min_tokens=64"]  # fmt: skip
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = start_sidecar(tmp_path / "a", "--set", f"peer_port={pa}", "--set",
                       f"peers=127.0.0.1:{pb}", "--set", "peer_host=0.0.0.0",
                       "--set", f"advertise=127.0.0.1:{pa}", *tls)  # fmt: skip
    b = start_sidecar(tmp_path / "b", "--set", f"peer_port={pb}", "--set",
                       f"peers=127.0.0.1:{pa}", *tls)  # fmt: skip
    try:
        keys = chain_keys(SMALL_LAYOUT, np.arange(8 * 24))
        data = torch.randint(0, 256, (24, SMALL_LAYOUT.block_bytes), dtype=torch.uint8)
        with StoreClient(str(a.socket)) as ca, StoreClient(str(b.socket)) as cb:
            ca.store(SMALL_LAYOUT, keys[:12], data[:12])
            assert ca.end_turn("s", SMALL_LAYOUT, keys[:12], 96, wait=True).pushed == 12
            ca.store(SMALL_LAYOUT, keys[12:], data[12:])
            res = cb.load(SMALL_LAYOUT, keys, include_peers=True)
            assert res.num_blocks == 24 and torch.equal(res.blocks, data)
            assert cb.stat().counters["peer_fetched_blocks"] == 24
            assert ca.stat().counters["peer_tls"] == cb.stat().counters["peer_tls"] == 1
        assert "without TLS" not in a.output() + b.output()

        req = peer_pb2.PeerStatRequest()
        meta = (("authorization", "Bearer t0k3n"),)
        with grpc.insecure_channel(f"127.0.0.1:{pa}") as plain:  # no TLS at all
            with pytest.raises(grpc.RpcError) as err:
                peer_pb2_grpc.PeerServiceStub(plain).PeerStat(req, timeout=5, metadata=meta)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        # TLS that trusts the CA but presents no client certificate: mTLS refuses.
        creds = grpc.ssl_channel_credentials(root_certificates=certs["ca"].read_bytes())
        opts = [("grpc.ssl_target_name_override", "tierstore")]
        with grpc.secure_channel(f"127.0.0.1:{pa}", creds, options=opts) as no_cert:
            with pytest.raises(grpc.RpcError) as err:
                peer_pb2_grpc.PeerServiceStub(no_cert).PeerStat(req, timeout=5, metadata=meta)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        # With the client certificate and the token it answers.
        full = grpc.ssl_channel_credentials(
            root_certificates=certs["ca"].read_bytes(),
            private_key=certs["key"].read_bytes(),
            certificate_chain=certs["cert"].read_bytes(),
        )
        with grpc.secure_channel(f"127.0.0.1:{pa}", full, options=opts) as ok:
            assert peer_pb2_grpc.PeerServiceStub(ok).PeerStat(req, timeout=5, metadata=meta).group
    finally:
        a.stop()
        b.stop()
