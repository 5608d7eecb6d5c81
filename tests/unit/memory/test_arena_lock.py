"""The arena locked in memory (``dram_lock``): locked as its pages are faulted
in when the host allows it; when it does not (a user without CAP_IPC_LOCK
and a low memory-lock limit), "auto" says so at start-up with the fix,
"require" refuses to start, and stat never claims a lock it does not hold."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from harness import REPO, child_env
from tierstore.config.store import StoreConfig
from tierstore.errors import ConfigError
from tierstore.memory.arena import Arena, locked_bytes

ARENA = 4 << 20

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="locks memory and drops to nobody")

# Locked as nobody with a 64 KiB memory-lock limit: no CAP_IPC_LOCK, so the limit holds.
UNPRIVILEGED = (
    f"ARENA_BYTES = {ARENA}\n"
    + """
import json, logging, os, resource, sys
from tierstore.errors import ArenaError  # imported first: nobody cannot read root's Python
from tierstore.memory.arena import Arena, locked_bytes
from tierstore.store.build import lock_arena
warned = []
logging.getLogger("tierstore.store.build").addHandler(
    type("H", (logging.Handler,), {"emit": lambda self, r: warned.append(r.getMessage())})())
d = sys.argv[1]  # the test removes it
arena = Arena.create(ARENA_BYTES, d)  # made and mapped as root; locked, or not, as nobody
resource.setrlimit(resource.RLIMIT_MEMLOCK, (64 << 10, 64 << 10))
os.setgid(65534); os.setuid(65534)
why = arena.lock()
lock_arena(arena, "auto")
try:
    lock_arena(arena, "require")
    refused = ""
except ArenaError as e:
    refused = str(e)
print(json.dumps({"why": why, "locked": arena.locked, "vmlck": locked_bytes(),
                  "warned": warned, "refused": refused}))
"""
)


@needs_root
def test_the_arena_is_locked_as_it_is_faulted_in() -> None:
    before = locked_bytes()
    arena = Arena.create(ARENA, upfront=False)
    try:
        assert arena.lock() == "" and arena.locked
        assert locked_bytes() - before >= ARENA
        arena.ensure_ready(0, ARENA)  # faulted in: the pages are locked as they come
        arena.view(0, ARENA)[:8] = b"x" * 8
    finally:
        arena.close()
    assert locked_bytes() == before


def test_control_an_arena_not_locked_adds_no_locked_memory() -> None:
    before = locked_bytes()
    arena = Arena.create(ARENA)
    try:
        assert not arena.locked and locked_bytes() == before
    finally:
        arena.close()


@needs_root
def test_a_low_memory_lock_limit_is_said_at_start_and_require_refuses() -> None:
    shm = tempfile.mkdtemp(dir="/dev/shm")
    try:
        out = subprocess.run(
            [sys.executable, "-c", UNPRIVILEGED, shm], cwd=REPO, env=child_env(),
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.splitlines()[-1])
    assert not got["locked"] and got["vmlck"] == 0
    assert "the memory-lock limit is 64 KiB" in got["why"]
    assert len(got["warned"]) == 1
    for said in (got["warned"][0], got["refused"]):
        assert "NOT locked in memory" in said and "64 KiB" in said
        assert "LimitMEMLOCK" in said and "ulimit -l" in said


def test_dram_lock_takes_only_its_three_values() -> None:
    assert StoreConfig(dram_lock="off").dram_lock == "off"
    with pytest.raises(ConfigError, match="dram_lock must be auto, require or off"):
        StoreConfig(dram_lock="yes")
