"""What the section modules share: bound checks that raise a ``ConfigError``
naming the field, the ``host:port`` check, and the default directories.

Provides ``at_least``, ``positive``, ``check_address``,
``default_cache_dir`` (``$XDG_CACHE_HOME/tierstore``) and
``default_runtime_dir`` (``$XDG_RUNTIME_DIR/tierstore``, else under the
cache directory). Pure: runs wherever a config is built.
"""

from __future__ import annotations

import os
from pathlib import Path

from tierstore.errors import ConfigError


def at_least(cfg: object, bound: int, *names: str) -> None:
    """ConfigError naming the first of ``names`` whose value is not >= ``bound``
    (NaN included)."""
    for name in names:
        value = getattr(cfg, name)
        if not value >= bound:
            raise ConfigError(f"{name} must be >= {bound}, got {value}")


def positive(cfg: object, *names: str) -> None:
    """ConfigError naming the first of ``names`` whose value is not > 0 (NaN included)."""
    for name in names:
        value = getattr(cfg, name)
        if not value > 0:
            raise ConfigError(f"{name} must be > 0, got {value}")


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tierstore"


def default_runtime_dir() -> Path:
    base = os.environ.get("XDG_RUNTIME_DIR")
    if base and os.path.isdir(base):
        return Path(base) / "tierstore"
    return default_cache_dir() / "run"


def check_address(addr: str, name: str) -> None:
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{name}: {addr!r} is not host:port")
