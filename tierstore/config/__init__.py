"""Configuration: frozen dataclasses with units in every name, one per
section, and a loader that layers embedded defaults < TOML file <
``TIERSTORE_*`` environment variables < explicit overrides (CLI flags).

Provides ``Config`` (one field per section), ``SECTIONS`` (section name ->
its class, from ``Config``'s fields), ``load_config``, ``config_to_dict``,
``ALIASES`` (other names of settings) and ``ENV_PREFIX``. Each section is a
module: ``store``, ``server``, ``peer`` (with the ``membership`` URL),
``router``, ``remote``, ``gateway``; ``parse`` reads raw values, ``common``
holds the checks and default directories the sections share. A new section
is one module and one field of ``Config``, and its table in
docs/configuration.md (tests/unit/test_config_doc.py holds the two together).

TOML may be flat or grouped in tables (``[store]``, ``[server]``, ...); the
table names are only for reading: every field name is unique across the
sections. Sizes accept integers or strings such as ``"8GiB"`` or ``"512MB"``;
durations accept numbers of seconds.

Loaded once at the start of every process (sidecar, engine client, router,
gateway, CLI); the result is frozen, so any thread may read it.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import typing
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from tierstore.config.gateway import GatewayConfig
from tierstore.config.parse import coerce, gib_to_bytes
from tierstore.config.peer import PeerConfig
from tierstore.config.remote import RemoteConfig
from tierstore.config.router import RouterConfig
from tierstore.config.server import ServerConfig
from tierstore.config.store import StoreConfig
from tierstore.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

ENV_PREFIX = "TIERSTORE_"


@dataclass(frozen=True)
class Config:
    """The effective configuration: one field per section (a module each).
    A new section is one module and one field here; ``SECTIONS`` follows."""

    store: StoreConfig = field(default_factory=StoreConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    peer: PeerConfig = field(default_factory=PeerConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    remote: RemoteConfig = field(default_factory=RemoteConfig)
    gateway: GatewayConfig = field(default_factory=GatewayConfig)


_HINTS = typing.get_type_hints(Config)
SECTIONS: dict[str, type] = {f.name: _HINTS[f.name] for f in fields(Config)}


# Other names of settings, as the design names them: alias -> (setting, the
# alias's value in the setting's unit). kv_share's replica budget is
# ``max_gib`` in the design and ``replica_bytes`` here (units in names).
ALIASES: dict[str, tuple[str, Callable[[str, Any], Any]]] = {
    "max_gib": ("replica_bytes", gib_to_bytes),
}


def _field_index() -> dict[str, tuple[str, str]]:
    index: dict[str, tuple[str, str]] = {}
    for section, cls in SECTIONS.items():
        for f in fields(cls):
            index[f.name] = (section, str(f.type))
    return index


def load_config(
    path: str | Path | None = None,
    env: dict[str, str] | None = None,
    overrides: dict[str, Any] | None = None,
) -> Config:
    """Build the effective Config. Unknown keys are errors, not ignored.
    Without ``path``, the file named by TIERSTORE_CONFIG is read, if set."""
    environ = os.environ if env is None else env
    if path is None and environ.get(ENV_PREFIX + "CONFIG"):
        path = environ[ENV_PREFIX + "CONFIG"]
    index = _field_index()
    values: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
    given: dict[str, str] = {}  # setting -> the name that set it, in the layer being read

    def put(name: str, value: Any, origin: str) -> None:
        if name in ALIASES:
            target, convert = ALIASES[name]
            value = convert(name, value)
        else:
            target = name
        if target not in index:
            known = sorted([*index, *ALIASES])
            raise ConfigError(f"{origin}: unknown setting {name!r}; known: {known}")
        if given.setdefault(target, name) != name:
            raise ConfigError(f"{origin}: {given[target]} and {name} both set {target}; keep one")
        section, annotation = index[target]
        values[section][target] = coerce(target, annotation, value)

    if path is not None:
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except OSError as e:
            raise ConfigError(f"cannot read config file {path}: {e}") from e
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {path} is not valid TOML: {e}") from e
        for key, value in data.items():
            if isinstance(value, dict):
                if key not in SECTIONS:
                    raise ConfigError(f"{path}: unknown table [{key}]; known: {sorted(SECTIONS)}")
                for name, inner in value.items():
                    put(name, inner, f"{path} [{key}]")
            else:
                put(key, value, str(path))
    given.clear()  # a later layer overrides an earlier one under either name
    for var, value in environ.items():
        if var.startswith(ENV_PREFIX) and var != ENV_PREFIX + "CONFIG":
            put(var[len(ENV_PREFIX) :].lower(), value, f"environment variable {var}")
    given.clear()
    for name, value in (overrides or {}).items():
        if value is not None:
            put(name, value, "command line")
    return Config(**{s: SECTIONS[s](**values[s]) for s in SECTIONS})


def config_to_dict(config: Config) -> dict[str, dict[str, Any]]:
    return {s: dataclasses.asdict(getattr(config, s)) for s in SECTIONS}
