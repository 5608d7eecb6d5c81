"""Reading raw setting values (TOML, environment strings, CLI flags) as their types.

Provides ``parse_bytes`` (``1073741824``, ``"1GiB"``, ``"1.5 GB"``),
``coerce`` (a value as the field's annotated type: sizes for ``*_bytes``,
booleans from ``true``/``yes``/``1``..., comma-separated tuples) and
``gib_to_bytes`` (an alias's GiB). Pure: runs wherever a config is loaded.
"""

from __future__ import annotations

import re
from typing import Any

from tierstore.errors import ConfigError

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: Any, name: str = "size") -> int:
    """``1073741824``, ``"1GiB"``, ``"1.5 GB"`` -> bytes."""
    if isinstance(value, bool):
        raise ConfigError(f"{name}: expected a size, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        if m and m.group(2).lower() in _SIZE_UNITS:
            return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])
    raise ConfigError(f"{name}: cannot read {value!r} as a size (e.g. 4096, '512MiB', '8GB')")


def coerce(name: str, annotation: str, value: Any) -> Any:
    try:
        if name.endswith("_bytes"):
            return parse_bytes(value, name)
        if annotation == "bool":
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on"):
                return True
            if isinstance(value, str) and value.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        if annotation == "int":
            if isinstance(value, bool):
                raise ValueError(value)
            return int(value)
        if annotation == "float":
            return float(value)
        if annotation.startswith("tuple"):
            if isinstance(value, str):
                return tuple(v.strip() for v in value.split(",") if v.strip())
            return tuple(value)
        if annotation == "str":
            if not isinstance(value, str | int | float) or isinstance(value, bool):
                raise ValueError(value)
            return str(value)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{name}: cannot read {value!r} as {annotation}") from e
    return value


def gib_to_bytes(name: str, value: Any) -> int:
    """``max_gib = 1.5`` -> 1.5 GiB in bytes."""
    try:
        if isinstance(value, bool):
            raise ValueError(value)
        gib = float(value)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{name}: cannot read {value!r} as GiB (a number, e.g. 4 or 0.5)") from e
    if not 0 <= gib < 2**33:  # also refuses nan and inf
        raise ConfigError(f"{name} must be a number of GiB >= 0, got {value!r}")
    return int(gib * 2**30)
