"""The pure parts of group membership: the etcd:// URL, member records and
their strict decoding, join/leave diffs, etcd's prefix ranges, and the
config checks."""

from __future__ import annotations

import json

import pytest

from tierstore.config.peer import PeerConfig, parse_membership
from tierstore.config.router import RouterConfig
from tierstore.errors import ConfigError
from tierstore.membership.etcd_client import EtcdAuth, prefix_end
from tierstore.membership.members import Member, StaticMembers, decode_member, diff

PREFIX = b"/tierstore/groups/default/members/"


def test_url_with_several_endpoints_and_a_prefix() -> None:
    u = parse_membership("etcd://10.0.0.1:2379,10.0.0.2:2379/fleet/a")
    assert u.scheme == "etcd" and u.endpoints == ("10.0.0.1:2379", "10.0.0.2:2379")
    assert u.prefix == "/fleet/a"
    assert u.member_key("g", "h:1") == b"/fleet/a/groups/g/members/h:1"


def test_url_defaults_and_tls_scheme() -> None:
    u = parse_membership("etcds://etcd.local:2379")
    assert u.scheme == "etcds" and u.prefix == "/tierstore"


@pytest.mark.parametrize(
    "url",
    [
        "http://h:2379/p",  # not etcd
        "etcd:///p",  # no endpoint
        "etcd://h/p",  # no port
        "etcd://h:0/p",
        "etcd://user:pw@h:2379/p",  # credentials belong in a file, not the URL
        "etcd://h:2379/p?x=1",
    ],
)
def test_bad_urls_are_refused(url: str) -> None:
    with pytest.raises(ConfigError):
        parse_membership(url)


def test_config_checks() -> None:
    ok = PeerConfig(membership="etcd://h:2379/p", membership_ttl_s=5)
    assert ok.membership_url() is not None and PeerConfig().membership_url() is None
    with pytest.raises(ConfigError, match="whole number"):
        PeerConfig(membership="etcd://h:2379/p", membership_ttl_s=4.5)
    with pytest.raises(ConfigError, match=">= 2"):
        PeerConfig(membership_ttl_s=1)
    with pytest.raises(ConfigError, match="not both"):
        PeerConfig(membership="etcd://h:2379/p", peers=("h:1",))
    with pytest.raises(ConfigError, match="without '/'"):
        PeerConfig(membership="etcd://h:2379/p", group="a/b")
    with pytest.raises(ConfigError, match="under half"):
        PeerConfig(membership_ttl_s=2, membership_timeout_s=1)
    with pytest.raises(ConfigError, match="set together"):
        PeerConfig(membership_tls_cert_file="c.pem")


def test_router_needs_hosts_or_membership() -> None:
    from tierstore.router.router import Router

    with pytest.raises(ConfigError, match="membership"):
        Router(RouterConfig(), PeerConfig(peer_token="t"))
    with pytest.raises(ConfigError, match="not both"):
        Router(
            RouterConfig(router_hosts=("h:1",)),
            PeerConfig(peer_token="t", membership="etcd://h:2379/p"),
        )


def member(address: str = "10.0.0.5:7700") -> Member:
    return Member(address, "default", ("dram", "nvme"), 1 << 30, 16 << 30, 4 << 30,
                  {"busy_slots": 1, "slots": 4, "queue_len": 0}, "0.1.0", 42)  # fmt: skip


def test_record_round_trip() -> None:
    m = member()
    assert decode_member(PREFIX + m.address.encode(), m.encode(), PREFIX) == m


@pytest.mark.parametrize(
    "change",
    [
        lambda d: d.update(address="10.0.0.6:7700"),  # does not match its key
        lambda d: d.update(v=2),  # another record version
        lambda d: d.pop("group"),
        lambda d: d.update(dram_bytes="lots"),
    ],
)
def test_malformed_records_are_none(change: object) -> None:
    m = member()
    d = json.loads(m.encode())
    change(d)  # type: ignore[operator]
    value = json.dumps(d).encode()
    assert decode_member(PREFIX + m.address.encode(), value, PREFIX) is None


def test_a_load_that_is_not_a_mapping_is_dropped_not_trusted() -> None:
    m = member()
    d = json.loads(m.encode())
    d["load"] = [1, 2]
    got = decode_member(PREFIX + m.address.encode(), json.dumps(d).encode(), PREFIX)
    assert got is not None and got.load == {} and got.address == m.address


def test_records_that_are_not_records() -> None:
    key = PREFIX + b"10.0.0.5:7700"
    assert decode_member(key, b"not json", PREFIX) is None
    assert decode_member(key, b"[1]", PREFIX) is None
    assert decode_member(key, b"x" * 10_000, PREFIX) is None
    assert decode_member(b"/other/" + b"10.0.0.5:7700", member().encode(), PREFIX) is None
    bad = member("nohost")
    assert decode_member(PREFIX + b"nohost", bad.encode(), PREFIX) is None


def test_diff() -> None:
    assert diff(["a", "b", "c"], ["b", "c", "d"]) == (["d"], ["a"])
    assert diff([], []) == ([], [])


def test_prefix_end() -> None:
    assert prefix_end(b"/a/") == b"/a0"
    assert prefix_end(b"a\xff") == b"b"
    assert prefix_end(b"\xff\xff") == b"\0"


def test_static_members() -> None:
    s = StaticMembers(["a:1", "b:1", "a:1"])
    assert s.addresses() == ["a:1", "b:1"] and s.version == 0


def test_credentials_file(tmp_path: object) -> None:
    from pathlib import Path

    p = Path(str(tmp_path)) / "cred"
    p.write_text("tierstore:s3cret:with:colons\n")
    assert EtcdAuth(("h:1",), credentials_file=str(p)).credentials() == (
        "tierstore",
        "s3cret:with:colons",
    )
    p.write_text("nocolon\n")
    with pytest.raises(ConfigError, match="user:password"):
        EtcdAuth(("h:1",), credentials_file=str(p)).credentials()
    with pytest.raises(ConfigError, match="cannot read"):
        EtcdAuth(("h:1",), credentials_file=str(p) + ".missing").credentials()
    assert EtcdAuth(("h:1",)).credentials() is None
