"""bench.limits.raw_read_best: the disk limit the NVMe loads are measured against."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bench.limits import raw_read_best

MIB = 1 << 20


def _file(tmp_path: Path, nbytes: int) -> Path:
    path = tmp_path / "blocks.dat"
    path.write_bytes(os.urandom(nbytes))
    return path


def test_tries_every_way_and_names_the_fastest(tmp_path: Path) -> None:
    path = _file(tmp_path, 12 * MIB)
    gbps, how = raw_read_best(path, 12 * MIB, depths=(1, 3), chunks=(MIB, 4 * MIB), rounds=1)
    assert gbps > 0
    assert how in {f"{c} MiB requests, {d} in flight" for c in (1, 4) for d in (1, 3)}


def test_a_file_shorter_than_the_load_is_refused(tmp_path: Path) -> None:
    path = _file(tmp_path, 4 * MIB)
    with pytest.raises(ValueError, match="fewer than"):
        raw_read_best(path, 8 * MIB, chunks=(MIB,), rounds=1)


def test_a_read_that_comes_back_short_fails_instead_of_timing(tmp_path: Path) -> None:
    # The size check passes on a sparse length, then the file shrinks under it:
    # a limit timed over missing bytes would be too fast.
    path = _file(tmp_path, 8 * MIB)

    class Longer:
        st_size = 16 * MIB

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "fstat", lambda fd: Longer)
        with pytest.raises(OSError, match="short read"):
            raw_read_best(path, 16 * MIB, depths=(2,), chunks=(MIB,), rounds=1)
