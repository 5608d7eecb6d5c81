"""Admission policies: whether a block evicted from DRAM is written to NVMe at all.

Provides the ``AdmissionPolicy`` protocol with ``AlwaysAdmit`` (the default)
and ``SeenTwiceAdmit`` (admit only keys offered at least twice, so one-hit
blocks never cost a disk write), and ``make_admission_policy`` by config
name (``nvme_admission``).

Pure: no I/O, no locks, no torch. The sidecar's demoter asks, under the
store's lock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

from tierstore.errors import ConfigError
from tierstore.keys import BlockKey


class AdmissionPolicy(Protocol):
    """Decides whether a block is written to a slower tier at all."""

    def admit(self, key: BlockKey) -> bool: ...


class AlwaysAdmit:
    def admit(self, key: BlockKey) -> bool:
        return True


class SeenTwiceAdmit:
    """Admit a key the second time it is offered within the last
    ``history_keys`` offers; one-hit blocks never cost a disk write."""

    def __init__(self, history_keys: int = 65536) -> None:
        self._seen: OrderedDict[BlockKey, None] = OrderedDict()
        self._history_keys = history_keys

    def admit(self, key: BlockKey) -> bool:
        if self._seen.pop(key, False) is None:
            return True
        self._seen[key] = None
        while len(self._seen) > self._history_keys:
            self._seen.popitem(last=False)
        return False


ADMISSION_POLICIES: dict[str, Callable[[], AdmissionPolicy]] = {
    "always": AlwaysAdmit,
    "seen_twice": SeenTwiceAdmit,
}


def make_admission_policy(name: str) -> AdmissionPolicy:
    try:
        return ADMISSION_POLICIES[name]()
    except KeyError:
        raise ConfigError(
            f"unknown admission policy {name!r}; choose one of {sorted(ADMISSION_POLICIES)}"
        ) from None
