"""docs/configuration.md stays true: every setting is documented with its
default, and the sample tierstore.toml loads."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from tierstore.config import ALIASES, SECTIONS, load_config
from tierstore.config.parse import parse_bytes

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
ROW = re.compile(r"^\| `([a-z0-9_]+)` \| (.+?) \|", re.M)
FIELDS = {f.name: cls for cls in SECTIONS.values() for f in dataclasses.fields(cls)}


def _rows() -> dict[str, str]:
    return dict(ROW.findall(DOC.read_text()))


def test_every_setting_has_one_row() -> None:
    assert set(_rows()) == set(FIELDS) | set(ALIASES)


@pytest.mark.parametrize("alias", sorted(ALIASES))
def test_documented_default_of_an_alias_is_its_settings_default(alias: str) -> None:
    target, convert = ALIASES[alias]
    literal = _rows()[alias].strip("`")
    assert convert(alias, literal) == getattr(FIELDS[target](), target)


@pytest.mark.parametrize("name", sorted(FIELDS))
def test_documented_default_is_the_default(name: str) -> None:
    default = getattr(FIELDS[name](), name)
    cell = _rows()[name]
    if name in ("nvme_dir", "socket_path"):  # depend on XDG_* and $HOME
        assert cell.startswith("`$XDG_")
        return
    literal = cell.strip("`").strip('"')
    if name.endswith("_bytes"):
        assert parse_bytes(literal) == default
    elif isinstance(default, bool):
        assert literal == str(default).lower()
    elif isinstance(default, int | float):
        assert float(literal) == default
    elif isinstance(default, tuple):
        assert literal == "[]" and default == ()
    else:
        assert literal == default


def test_sample_toml_loads(tmp_path: Path) -> None:
    sample = re.search(r"```toml\n(.*?)```", DOC.read_text(), re.S)
    assert sample is not None
    path = tmp_path / "tierstore.toml"
    path.write_text(sample.group(1))
    config = load_config(path, env={})
    assert config.store.dram_bytes == 64 << 30
    assert config.store.nvme_bytes == int(1.5 * 2**40)
    assert config.peer.peers == ("10.0.0.2:9478", "10.0.0.3:9478")
