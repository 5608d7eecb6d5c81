"""The simulated engines of bench/switch/run.py's two hosts.

Provides ``Driver``: one thread per agent session; each turn takes a slot
(affinity with a spill, or the router's placement), looks up what the host
holds, imports it at a switch (through the host's ``EngineImports``), stores
the prefill and the output through the host's sidecar, holds the slot for
the modelled prefill and decode time at scale, and ends the turn with a
replica push on a background thread. ``RunStats`` is what a run collected.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from fractions import Fraction
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import torch

from bench.switch.diag import PushRecord, switch_cause
from bench.switch.hosts import SLOTS_PER_HOST, EngineImports
from bench.switch.sim import RoutedPlacement, SimConfig
from bench.switch.workload import Workload, choose_host, classify, session_name
from tierstore.client import StoreClient
from tierstore.keys import KVLayout, chain_keys
from tierstore.tiers import TIER_CODES


def scaled_layout(scale: Fraction, wl: Workload) -> KVLayout:
    """bf16 K and V, one KV head of dim 80; layers chosen so a token is
    ``wl.bytes_per_token * scale`` bytes (80 KiB x scale: 4 layers at 1/64)."""
    per_layer_token = 2 * 1 * 80 * 2
    layers = Fraction(wl.bytes_per_token) * scale / per_layer_token
    if layers.denominator != 1 or layers < 1:
        raise SystemExit(f"--scale {scale}: use 1/2**k with k <= 8 (whole layers)")
    return KVLayout("switch-bench", int(layers), 1, 80, "bfloat16", wl.block_tokens)


@dataclass
class RunStats:
    outcomes: list[str] = field(default_factory=list)
    switch_log: list[dict[str, Any]] = field(default_factory=list)
    pushes_unfinished_at_next_turn: int = 0
    push_slack_s: list[float] = field(default_factory=list)  # next turn start - push end
    slot_excess_s: list[float] = field(default_factory=list)  # slot held beyond the model
    cached_outcomes: list[str] = field(default_factory=list)
    reuse: list[float] = field(default_factory=list)
    engine_import_s: list[float] = field(default_factory=list)
    engine_import_bytes: list[int] = field(default_factory=list)
    engine_import_from_dram: list[bool] = field(default_factory=list)  # every block in DRAM
    engine_import_memcpy_s: list[float] = field(default_factory=list)  # same bytes, around it
    engine_import_cpu_s: list[float] = field(default_factory=list)  # the loading thread on a CPU
    send_s: list[float] = field(default_factory=list)
    import_s: list[float] = field(default_factory=list)
    tail_s: list[float] = field(default_factory=list)  # receiver: last byte -> resident
    push_bytes: list[int] = field(default_factory=list)
    pushed_blocks: int = 0
    pushes: int = 0
    turns: int = 0
    same_host_misses: int = 0
    ttft_s: list[float] = field(default_factory=list)  # wait for a slot + import + prefill
    wait_s: list[float] = field(default_factory=list)  # arrival -> slot
    lookup_s: list[float] = field(default_factory=list)  # router: its lookups on both hosts
    # One entry per turn (times from the run's start): when its blocks were
    # stored and its push ended; switchdiag.oracle_switches replays it.
    turn_log: list[dict[str, Any]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


class Driver:
    """The simulated engines of both hosts: one thread per session."""

    def __init__(
        self,
        clients: dict[str, StoreClient],
        layout: KVLayout,
        wl: Workload,
        scale: float,
        sessions: int,
        duration_s: float,
        min_tokens: int,
        engines: dict[str, EngineImports],
        policy: str = "affinity",
        stream: bool = False,
    ) -> None:
        self.clients, self.layout, self.wl = clients, layout, wl
        self.stream = stream  # store with the session id: the sidecar streams its replica
        self.min_tokens = min_tokens  # kv_share's rule (also when replication is off)
        self.scale, self.sessions, self.duration_s = scale, sessions, duration_s
        self.members = list(clients)
        self.free = dict.fromkeys(self.members, SLOTS_PER_HOST)
        self.cond = threading.Condition()
        self.queue: list[int] = []
        self.stats = RunStats()
        self.pushers: list[threading.Thread] = []
        self.last_push: dict[str, PushRecord] = {}  # session name -> its last push
        self.t0 = 0.0
        max_blocks = wl.max_context_tokens // wl.block_tokens + 64
        gen = np.random.default_rng(0)
        self.data = torch.from_numpy(
            gen.integers(0, 256, size=(max_blocks, layout.block_bytes), dtype=np.uint8)
        )
        self.slot_conns = {m: list(e.conns) for m, e in engines.items()}
        self.stop_at = 0.0
        self.busy_s = dict.fromkeys(self.members, 0.0)  # slot-seconds served per host
        # policy "router": tierstore's cost model places each turn and picks
        # each replica's target (bench.switch.sim.RoutedPlacement, as in the
        # simulation), on the hosts' real lookups and this gateway's slots.
        self.placement = (
            RoutedPlacement(
                self.members,
                SLOTS_PER_HOST,
                wl,
                SimConfig(),
                block_bytes=layout.block_bytes,
                time_scale=scale,
            )
            if policy == "router"
            else None
        )
        self.wants: dict[int, str] = {}  # router: waiting session -> the host it waits for

    def run(self) -> RunStats:
        self.t0 = time.monotonic()
        self.stop_at = self.t0 + self.duration_s
        threads = [
            threading.Thread(target=self._session, args=(i,), name=f"session-{i}", daemon=True)
            for i in range(self.sessions)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for t in list(self.pushers):
            t.join(timeout=30)
        return self.stats

    def _sleep_until(self, t: float) -> bool:
        delay = t - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        return time.monotonic() < self.stop_at

    def _prefixes(self, keys: list[Any]) -> dict[str, bytes]:
        """Tier codes of the prefix of ``keys`` each host holds (real lookups)."""
        out = {}
        for m, c in self.clients.items():
            res = c.lookup(self.layout, keys, include_peers=False)
            out[m] = bytes(TIER_CODES[t] for t in res.tiers[: res.num_hits])
        return out

    def _load(self, before: int | None = None) -> tuple[dict[str, int], dict[str, int]]:
        """Busy slots per host, and sessions waiting for each host (ahead of
        queue position ``before``). Holds cond."""
        ahead = self.queue if before is None else self.queue[:before]
        queued = Counter(self.wants[j] for j in ahead if j in self.wants)
        busy = {m: SLOTS_PER_HOST - self.free[m] for m in self.members}
        return busy, {m: queued.get(m, 0) for m in self.members}

    def _take_slot(
        self, index: int, name: str, last: str | None, prompt: int, keys: list[Any]
    ) -> str | None:
        prefixes = {}
        if self.placement is not None:  # part of the wait: a router's decision costs time
            t0 = time.monotonic()
            prefixes = self._prefixes(keys)
            self.stats.lookup_s.append(time.monotonic() - t0)
        with self.cond:
            self.queue.append(index)
            while True:
                if time.monotonic() >= self.stop_at:
                    self.queue.remove(index)
                    self.wants.pop(index, None)
                    self.cond.notify_all()
                    return None
                host = self._choose(index, name, last, prompt, prefixes)
                if host is not None:
                    self.free[host] -= 1
                    self.queue.remove(index)
                    self.wants.pop(index, None)
                    self.cond.notify_all()
                    return host
                self.cond.wait(timeout=0.05)

    def _choose(
        self, index: int, name: str, last: str | None, prompt: int, prefixes: dict[str, bytes]
    ) -> str | None:
        """The host to start on now, or None to keep waiting. Holds cond.
        Affinity: the head of the queue takes its affinity host or a spill.
        Router: each session waits for the host of its least estimated TTFT
        (which may be a busy host holding its prefix), first come first served
        per host."""
        if self.placement is None:
            if self.queue[0] != index:
                return None
            return choose_host(name, last, self.free, self.members)
        pos = self.queue.index(index)
        best = self.placement.plan(name, prompt, last, prefixes, *self._load(pos)).best
        assert best is not None
        self.wants[index] = best.host
        ahead = any(self.wants.get(j) == best.host for j in self.queue[:pos])
        return best.host if self.free[best.host] > 0 and not ahead else None

    def _give_slot(self, host: str) -> None:
        with self.cond:
            self.free[host] += 1
            self.cond.notify_all()

    def _session(self, index: int) -> None:
        wl, s = self.wl, self.scale
        rng = wl.rng(index)
        conversation, context, last = 0, 0, None
        if not self._sleep_until(time.monotonic() + rng.uniform(0, wl.think_mean_s) * s):
            return
        while True:
            name = session_name(index, conversation)
            prompt = context + wl.new_input(rng) if context else wl.first_prompt(rng)
            arrived = time.monotonic()
            keys = chain_keys(self.layout, self._tokens(index, conversation, prompt))
            host = self._take_slot(index, name, last, prompt, keys)
            if host is None:
                return
            got_slot = time.monotonic()
            self.stats.wait_s.append(got_slot - arrived)
            with self.cond:
                slot = self.slot_conns[host].pop()
            try:
                context = self._turn(
                    index, name, conversation, prompt, host, last, rng, slot, got_slot - arrived
                )
            except Exception as e:
                self.stats.errors.append(f"{name} on {host}: {e!r}")
                context = prompt
            finally:
                with self.cond:
                    self.slot_conns[host].append(slot)
                    self.busy_s[host] += time.monotonic() - got_slot
                if self.placement is not None:
                    self.placement.observe(time.monotonic() - got_slot)
                self._give_slot(host)
            last = host
            if context >= wl.max_context_tokens:
                conversation, context, last = conversation + 1, 0, None
            if not self._sleep_until(time.monotonic() + wl.think(rng) * s):
                return

    def _turn(
        self,
        index: int,
        name: str,
        conv: int,
        prompt: int,
        host: str,
        last: str | None,
        rng: Any,
        slot: Connection,
        waited_s: float,
    ) -> int:
        wl, layout, client = self.wl, self.layout, self.clients[host]
        started = time.monotonic()
        keys = chain_keys(layout, self._tokens(index, conv, prompt))
        hits = client.lookup(layout, keys, include_peers=False).num_hits
        reused = hits * wl.block_tokens
        self.stats.turns += 1
        record = self.last_push.get(name)
        if record is not None and record.replicating is not False:
            if record.finished is None:
                self.stats.pushes_unfinished_at_next_turn += 1
            else:
                self.stats.push_slack_s.append(started - record.finished)
        if last is not None and host != last:
            self.stats.outcomes.append(classify(reused / prompt))
            self.stats.reuse.append(reused / prompt)
            self.stats.switch_log.append(
                self._explain_switch(name, prompt, len(keys), hits, record, started)
            )
            if hits:
                # The engine imports what its host holds into its slot's memory.
                slot.send(keys[:hits])
                loaded, load_s, from_dram, memcpy_s, cpu_s = slot.recv()
                self.stats.engine_import_cpu_s.append(cpu_s)
                self.stats.engine_import_s.append(load_s)
                self.stats.engine_import_bytes.append(loaded * layout.block_bytes)
                self.stats.engine_import_from_dram.append(from_dram == loaded)
                self.stats.engine_import_memcpy_s.append(memcpy_s)
                waited_s += load_s
        elif last is not None and hits < len(keys) - wl.input_max_tokens // wl.block_tokens - 1:
            self.stats.same_host_misses += 1
        new = len(keys) - hits
        if new:
            session = name if self.stream else ""
            client.store(layout, keys[hits:], self.data[:new], session=session)  # prefill
        entry: dict[str, Any] = {
            "session": name,
            "host": host,
            "t_start": started - self.t0,
            "prompt_blocks": len(keys),
            "t_prompt": time.monotonic() - self.t0,  # the prompt's blocks are stored
        }
        decode_s = wl.decode(rng)
        context = prompt + wl.output(rng)
        self.stats.ttft_s.append(waited_s + wl.prefill_s(prompt - reused) * self.scale)
        hold_until = started + (wl.prefill_s(prompt - reused) + decode_s) * self.scale
        self._sleep_until(hold_until)
        all_keys = chain_keys(layout, self._tokens(index, conv, context))
        out = len(all_keys) - len(keys)
        if out:
            session = name if self.stream else ""
            client.store(layout, all_keys[len(keys) :], self.data[:out], session=session)
        if len(all_keys) > len(keys) and all_keys[len(keys) - 1] != keys[-1]:
            raise RuntimeError("chain keys of the prompt changed with the output")
        self.stats.slot_excess_s.append(max(0.0, time.monotonic() - hold_until))
        record = PushRecord(len(all_keys), context, time.monotonic())
        self.last_push[name] = record
        entry.update(t_end=record.started - self.t0, blocks=len(all_keys), tokens=context)
        self.stats.turn_log.append(entry)
        record.log = entry
        pusher = threading.Thread(
            target=self._push, args=(host, name, all_keys, context, record), daemon=True
        )
        self.pushers.append(pusher)
        pusher.start()
        return context

    @staticmethod
    def _tokens(index: int, conv: int, n: int) -> np.ndarray:
        base = (index * 64 + conv) * 1_000_000  # token ids of this conversation
        return np.arange(base, base + n, dtype=np.int64)

    def _push(self, host: str, name: str, keys: list[Any], tokens: int, record: PushRecord) -> None:
        client = self.clients[host]
        spill = ""
        if self.placement is not None:  # the router's spill host, from the same estimates
            prefixes = self._prefixes(keys)
            with self.cond:
                load = self._load()
            spill = self.placement.plan(name, tokens, host, prefixes, *load).spill_host
        t0 = time.perf_counter()
        try:
            reply = client.end_turn(
                name, self.layout, keys, tokens, wait=True, replica_target=spill
            )
        except Exception as e:
            record.error, record.finished = True, time.monotonic()
            self.stats.errors.append(f"end_turn {name}: {e!r}")
            return
        wall = time.perf_counter() - t0
        record.pushed = reply.pushed
        record.replicating = reply.replicating
        record.finished = time.monotonic()  # before the check below: it is not the push
        if record.log is not None:
            record.log.update(
                t_done=record.finished - self.t0,
                pushed=reply.pushed,
                replicating=reply.replicating,
                target=reply.replica_target,
            )
        target = self.clients.get(reply.replica_target)
        if reply.replicating and target is not None:
            # What the target holds right after the push (before it can be
            # evicted): tells a partial push from a later eviction.
            record.target_held = target.lookup(self.layout, keys, include_peers=False).num_hits
        if reply.replicating and reply.pushed:
            self.stats.pushes += 1
            self.stats.pushed_blocks += reply.pushed
            self.stats.send_s.append(wall)
            self.stats.import_s.append(reply.push_s)
            self.stats.tail_s.append(reply.push_tail_s)
            self.stats.push_bytes.append(reply.pushed * self.layout.block_bytes)

    def _explain_switch(
        self,
        name: str,
        prompt: int,
        prompt_blocks: int,
        hits: int,
        record: PushRecord | None,
        started: float,
    ) -> dict[str, Any]:
        """One host switch: what the target held at the lookup against what
        the last turn left, and the first reason it held less."""
        ideal = min(record.blocks, prompt_blocks) if record is not None else 0
        cause = switch_cause(
            record, hits, prompt, prompt_blocks, started, self.wl.block_tokens, self.min_tokens
        )
        return {
            "t_s": round(started - self.t0, 3),
            "session": name,
            "prompt_blocks": prompt_blocks,
            "last_turn_blocks": ideal,
            "held_before_lookup": hits,
            "target_held_after_push": None if record is None else record.target_held,
            "push_started_before_s": None if record is None else round(started - record.started, 3),
            "push_done_before_s": None
            if record is None or record.finished is None
            else round(started - record.finished, 3),
            "class": classify(hits * self.wl.block_tokens / prompt),
            # Warmth against what the last turn left (the store's share; the
            # simulation's *_of_cached): the prompt's new input not counted.
            "class_of_cached": classify(hits / ideal) if ideal else "warm",
            "cause": cause,
        }
