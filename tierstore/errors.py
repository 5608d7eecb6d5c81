"""Exceptions that tierstore raises for caller errors and unusable environments.

Expected outcomes (a tier is full, a block is missing or failed verification)
are return values, never exceptions; these classes are for bad input and for
resources the store cannot get. Every message names the offending value.
"""

from __future__ import annotations


class TierstoreError(Exception):
    """Base class of every error tierstore raises on purpose."""


class LayoutError(TierstoreError, ValueError):
    """A KVLayout is invalid, unknown to the store, or does not match the data."""


class KeyFormatError(TierstoreError, ValueError):
    """A block key is not 32 bytes, or token ids are not valid uint32 values."""


class BlockSizeError(TierstoreError, ValueError):
    """Block bytes do not match the layout's block size."""


class ArenaError(TierstoreError, OSError):
    """The shared-memory arena cannot be created or attached."""


class StorageError(TierstoreError, OSError):
    """The NVMe directory or its index cannot be used."""


class ConfigError(TierstoreError, ValueError):
    """A configuration value is out of range or of the wrong type."""
