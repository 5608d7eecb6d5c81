"""deploy/ is checked, not just shipped: the Kubernetes manifest against the
Kubernetes API's schemas (kubernetes-validate, strict), its TOML and flags
against tierstore's own config and CLI, its engine's connector settings
against the connector's; the systemd units with ``systemd-analyze verify``.
Each check is shown to fail once on a broken copy."""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tierstore.cli.main import build_parser
from tierstore.config import load_config
from tierstore.engines.vllm.driver import kv_transfer_config
from tierstore.memory.arena import Arena

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
MANIFEST = DEPLOY / "kubernetes" / "tierstore.yaml"
UNITS = sorted((DEPLOY / "systemd").glob("*.service"))
ARENA_MOUNT = DEPLOY / "systemd" / "run-tierstore_arena.mount"


def docs() -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]


def by_kind(kind: str, name: str) -> dict[str, Any]:
    (doc,) = [d for d in docs() if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def container(doc: dict[str, Any], name: str) -> dict[str, Any]:
    (c,) = [c for c in doc["spec"]["template"]["spec"]["containers"] if c["name"] == name]
    return c


def test_every_resource_passes_the_kubernetes_schemas_strictly() -> None:
    version = kubernetes_validate.latest_version()
    kinds = []
    for doc in docs():
        kubernetes_validate.validate(doc, version, strict=True)
        kinds.append(doc["kind"])
    assert {"StatefulSet", "Deployment", "Service", "ConfigMap"} <= set(kinds)
    broken = copy.deepcopy(by_kind("Deployment", "tierstore-gateway"))
    broken["spec"]["template"]["spec"]["containers"][0]["portz"] = []  # a typo'd field
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, version, strict=True)


def test_the_pod_shares_the_socket_and_shm_on_memory_backed_volumes() -> None:
    llm = by_kind("StatefulSet", "llm")
    volumes = {v["name"]: v for v in llm["spec"]["template"]["spec"]["volumes"]}
    for name in ("run", "shm"):
        assert volumes[name]["emptyDir"]["medium"] == "Memory"
    for c in ("tierstore", "engine"):
        mounts = {m["name"]: m["mountPath"] for m in container(llm, c)["volumeMounts"]}
        assert mounts["run"] == "/run/tierstore" and mounts["shm"] == "/dev/shm"


def test_the_configs_and_flags_are_tierstores_own(tmp_path: Path) -> None:
    cm = by_kind("ConfigMap", "tierstore-config")["data"]
    files = {}
    for name, text in cm.items():
        files[name] = tmp_path / name
        files[name].write_text(text)
    sidecar = container(by_kind("StatefulSet", "llm"), "tierstore")
    env = {e["name"]: e["value"] for e in sidecar["env"] if "value" in e}
    env = {k: v.replace("$(POD_IP)", "10.1.2.3") for k, v in env.items()}
    cfg = load_config(files["sidecar.toml"], env=env)
    assert cfg.peer.membership and cfg.peer.engine_url == "http://10.1.2.3:8000"
    assert cfg.peer.advertise == "10.1.2.3:7700" and cfg.peer.engine_events.startswith("tcp://")
    gw = load_config(files["gateway.toml"], env={})
    assert gw.gateway.gateway_policy == "tierstore" and gw.peer.membership == cfg.peer.membership
    parser = build_parser()
    assert parser.parse_args(sidecar["args"]).command == "serve"
    gateway = container(by_kind("Deployment", "tierstore-gateway"), "gateway")
    assert parser.parse_args(gateway["args"]).command == "gateway"
    # The engine's connector settings are the connector's own, on the sidecar's socket.
    engine = container(by_kind("StatefulSet", "llm"), "engine")
    (arg,) = [a for a in engine["args"] if a.startswith("--kv-transfer-config=")]
    transfer = json.loads(arg.split("=", 1)[1])
    assert transfer == kv_transfer_config(cfg.server.socket_path, include_peers=True)
    (arg,) = [a for a in engine["args"] if a.startswith("--kv-events-config=")]
    port = cfg.peer.engine_events.rsplit(":", 1)[1]
    assert json.loads(arg.split("=", 1)[1])["endpoint"] == f"tcp://*:{port}"
    (bad,) = [f for f in files.values() if f.name == "gateway.toml"]
    bad.write_text(bad.read_text().replace("gateway_policy", "gateway_polcy"))
    with pytest.raises(Exception, match="unknown setting"):
        load_config(bad, env={})


def verify_unit(unit: Path, tmp_path: Path, edit: str = "") -> str:
    """``systemd-analyze verify`` of ``unit`` with ExecStart on this install's
    ``tierstore``; what it complains of (empty: nothing)."""
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is not installed (the systemd package)")
    entry = Path(sys.executable).parent / "tierstore"
    text = unit.read_text().replace("/opt/tierstore/bin/tierstore", str(entry)) + edit
    copy_ = tmp_path / unit.name
    copy_.write_text(text)
    out = subprocess.run([tool, "verify", str(copy_)], capture_output=True, text=True,
                         timeout=60)  # fmt: skip
    return (out.stdout + out.stderr).strip() + (
        f" (exit {out.returncode})" if out.returncode else ""
    )


@pytest.mark.parametrize("unit", UNITS, ids=lambda p: p.name)
def test_systemd_units_verify(unit: Path, tmp_path: Path) -> None:
    assert verify_unit(unit, tmp_path) == ""
    text = unit.read_text()
    assert "Restart=on-failure" in text and "Type=notify" in text
    assert verify_unit(unit, tmp_path, "\n[Service]\nRestart=sometimes\n") != ""


def test_the_sidecar_unit_lets_the_arena_be_locked() -> None:
    (unit,) = [u for u in UNITS if u.name == "tierstore.service"]
    assert "LimitMEMLOCK=infinity" in unit.read_text()


def unit_values(unit: Path, key: str) -> list[str]:
    """The values of ``key=`` lines in ``unit`` (comments skipped)."""
    return [
        line.split("=", 1)[1]
        for line in unit.read_text().splitlines()
        if line.startswith(f"{key}=")
    ]


def test_the_arena_mount_unit_verifies_and_is_the_sidecars_shm_dir(tmp_path: Path) -> None:
    assert verify_unit(ARENA_MOUNT, tmp_path) == ""
    (where,) = unit_values(ARENA_MOUNT, "Where")
    # systemd names a mount unit after its path: one that does not match is refused.
    assert verify_unit(ARENA_MOUNT, tmp_path, "\n[Mount]\nWhere=/run/elsewhere\n") != ""
    (service,) = [u for u in UNITS if u.name == "tierstore.service"]
    assert where in unit_values(service, "RequiresMountsFor")
    env = dict(v.split("=", 1) for v in unit_values(service, "Environment"))
    assert load_config(None, env=env).store.shm_dir == where


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs")
def test_the_arena_mount_units_options_give_the_arena_huge_pages(tmp_path: Path) -> None:
    """The unit's own Options= (its size cut to 64 MiB) on a tmpfs here: an
    arena there is mapped with 2 MiB pages; the same options without huge=
    (the control) give base pages, as /dev/shm does."""
    (options,) = unit_values(ARENA_MOUNT, "Options")
    opts = [o for o in options.split(",") if not o.startswith("size=")] + ["size=64m"]
    assert "huge=within_size" in opts
    for label, mount_opts in (("unit", opts), ("control", [o for o in opts if "huge" not in o])):
        where = tmp_path / label
        where.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join(mount_opts), "tmpfs", str(where)],
                       check=True, capture_output=True, timeout=30)  # fmt: skip
        try:
            arena = Arena.create(32 << 20, where)  # populated upfront
            try:
                huge = arena.huge_bytes()
                if label == "unit":
                    assert arena.page_kind == "thp (tmpfs huge=within_size)", arena.page_kind
                    assert huge > 0 and huge % (2 << 20) == 0, huge
                else:
                    assert arena.page_kind.startswith("base"), arena.page_kind
                    assert huge == 0, huge
            finally:
                arena.close()
        finally:
            subprocess.run(["umount", str(where)], check=True, timeout=30)
