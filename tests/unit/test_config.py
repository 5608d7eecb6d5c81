"""Config: defaults, TOML < env < overrides, sizes, clear errors."""

from __future__ import annotations

import pytest

from tierstore.config import load_config
from tierstore.config.parse import parse_bytes
from tierstore.errors import ConfigError


def test_defaults_need_no_file() -> None:
    cfg = load_config(env={})
    assert cfg.store.dram_bytes == 1 << 30 and cfg.server.socket_path.endswith("tierstore.sock")
    assert cfg.store.nvme_dir.endswith("nvme")


def test_precedence_toml_env_overrides(tmp_path) -> None:
    path = tmp_path / "t.toml"
    path.write_text('dram_bytes = "2GiB"\n[server]\nmetrics_port = 1234\nkeepalive_s = 3\n')
    cfg = load_config(path, env={})
    assert cfg.store.dram_bytes == 2 << 30 and cfg.server.metrics_port == 1234
    cfg = load_config(path, env={"TIERSTORE_METRICS_PORT": "4321", "OTHER": "x"})
    assert cfg.server.metrics_port == 4321 and cfg.server.keepalive_s == 3.0
    cfg = load_config(path, env={"TIERSTORE_METRICS_PORT": "4321"}, overrides={"metrics_port": 0})
    assert cfg.server.metrics_port == 0


@pytest.mark.parametrize(
    "value, expected",
    [(4096, 4096), ("4096", 4096), ("1KiB", 1024), ("1.5 GB", 1_500_000_000), ("8gib", 8 << 30)],
)
def test_sizes(value, expected) -> None:
    assert parse_bytes(value) == expected


@pytest.mark.parametrize(
    "setup, needle",
    [
        ({"overrides": {"dram_bytes": "lots"}}, "dram_bytes"),
        ({"overrides": {"no_such": 1}}, "unknown setting 'no_such'"),
        ({"env": {"TIERSTORE_NVME_DIRECT_IO": "maybe"}}, "nvme_direct_io"),
        ({"overrides": {"dram_low_watermark": 0.95}}, "watermarks"),
        ({"overrides": {"metrics_port": 70000}}, "metrics_port"),
        ({"overrides": {"socket_path": "/tmp/" + "x" * 120}}, "socket_path"),
    ],
)
def test_bad_values_name_the_setting(setup, needle) -> None:
    with pytest.raises(ConfigError, match=needle):
        load_config(env=setup.get("env", {}), overrides=setup.get("overrides"))


def test_bad_files(tmp_path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "missing.toml", env={})
    bad = tmp_path / "bad.toml"
    bad.write_text("dram_bytes = = 3")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad, env={})
    table = tmp_path / "table.toml"
    table.write_text("[nope]\nx = 1\n")
    with pytest.raises(ConfigError, match=r"unknown table \[nope\]"):
        load_config(table, env={})


def test_config_file_from_environment(tmp_path) -> None:
    path = tmp_path / "t.toml"
    path.write_text("[server]\nmetrics_port = 1111\n")
    assert load_config(env={"TIERSTORE_CONFIG": str(path)}).server.metrics_port == 1111


def test_log_level_is_checked() -> None:
    with pytest.raises(ConfigError, match="log_level"):
        load_config(env={}, overrides={"log_level": "loud"})


def test_max_gib_is_the_replica_budget_in_gib(tmp_path) -> None:
    """The design's kv_share name: in the [peer] table, flat, env and --set."""
    table = tmp_path / "t.toml"
    table.write_text("[peer]\nmax_gib = 1.5\n")
    assert load_config(table, env={}).peer.replica_bytes == 3 << 29
    flat = tmp_path / "flat.toml"
    flat.write_text("max_gib = 2\n")
    assert load_config(flat, env={}).peer.replica_bytes == 2 << 30
    assert load_config(env={"TIERSTORE_MAX_GIB": "0.25"}).peer.replica_bytes == 1 << 28
    assert load_config(env={}, overrides={"max_gib": "0"}).peer.replica_bytes == 0
    # A later layer wins under either name.
    cfg = load_config(table, env={"TIERSTORE_REPLICA_BYTES": "1GiB"})
    assert cfg.peer.replica_bytes == 1 << 30
    cfg = load_config(env={"TIERSTORE_REPLICA_BYTES": "1GiB"}, overrides={"max_gib": 3})
    assert cfg.peer.replica_bytes == 3 << 30


@pytest.mark.parametrize("value", ["lots", -1, True, "nan", "inf"])
def test_bad_max_gib_names_the_setting(value) -> None:
    with pytest.raises(ConfigError, match="max_gib"):
        load_config(env={}, overrides={"max_gib": value})


def test_max_gib_and_replica_bytes_in_one_layer_is_an_error(tmp_path) -> None:
    path = tmp_path / "t.toml"
    path.write_text('[peer]\nreplica_bytes = "1GiB"\nmax_gib = 2\n')
    with pytest.raises(ConfigError, match="replica_bytes and max_gib both set replica_bytes"):
        load_config(path, env={})
    with pytest.raises(ConfigError, match="both set replica_bytes"):
        load_config(env={"TIERSTORE_MAX_GIB": "1", "TIERSTORE_REPLICA_BYTES": "1GiB"})


def test_negative_replica_budget_is_refused() -> None:
    with pytest.raises(ConfigError, match="replica_bytes"):
        load_config(env={}, overrides={"replica_bytes": -1})


def test_gateway_settings_are_checked() -> None:
    from tierstore.config.gateway import GatewayConfig

    assert GatewayConfig().gateway_policy == "tierstore"
    with pytest.raises(ConfigError, match="gateway_policy must be one of"):
        GatewayConfig(gateway_policy="random")
    with pytest.raises(ConfigError, match="gateway_port"):
        GatewayConfig(gateway_port=0)
    with pytest.raises(ConfigError, match="gateway_load_poll_s"):
        GatewayConfig(gateway_load_poll_s=0)
    cfg = load_config(env={"TIERSTORE_GATEWAY_BACKENDS": "http://a:1;peer=a:2, http://b:1"})
    assert cfg.gateway.gateway_backends == ("http://a:1;peer=a:2", "http://b:1")


def test_engine_url_and_events_are_checked() -> None:
    from tierstore.config.peer import PeerConfig

    with pytest.raises(ConfigError, match="engine_url"):
        PeerConfig(engine_url="10.0.0.1:8000")
    with pytest.raises(ConfigError, match="engine_events"):
        PeerConfig(engine_events="10.0.0.1:5557")
    ok = PeerConfig(engine_url="http://10.0.0.1:8000", engine_events="tcp://10.0.0.1:5557")
    assert ok.engine_url.startswith("http")
