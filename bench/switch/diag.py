"""Why a host switch of the real switch benchmark (``bench/switch/run.py``) was
not warm: a session's last replica push as its engine saw it, and the rule
that names the first reason the serving host held less than the last turn
left; and a replay of a run's turns with a perfect sender (``oracle_switches``,
``peak_offered_load``): what any order or pacing of the link could have held
at each switch, which tells a sender that fell behind from a link that could
not carry the turns; and the same replay in the sidecars' own order (oldest
first) and shortest first, which tells what the order loses from what the
sending costs. Pure (no I/O); the driver's session and pusher threads
fill the records.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any

from bench.switch.workload import classify


@dataclass(slots=True)
class PushRecord:
    """A session's last replica push (times: the driver's time.monotonic)."""

    blocks: int  # keys offered: the session's full blocks after the turn
    tokens: int  # the session's context after the turn
    started: float
    finished: float | None = None  # end_turn(wait=True) returned
    replicating: bool | None = None  # None: end_turn has not answered yet
    pushed: int = 0  # blocks the target imported
    target_held: int | None = None  # prefix blocks the target held right after the push
    error: bool = False
    log: dict[str, Any] | None = None  # the turn's entry in RunStats.turn_log


def switch_cause(
    push: PushRecord | None,
    held_blocks: int,
    prompt_tokens: int,
    prompt_blocks: int,
    turn_started: float,
    block_tokens: int,
    min_tokens: int,
) -> str:
    """``warm``, or why not: the first of these that holds.

    ``prompt_grew``: the target held all the last turn left, and the new
    input alone is more than 10% of the prompt (no store can do better);
    ``push_late``: the last turn's push had not finished when this turn
    began; ``push_error``; ``not_replicated_short``: the last turn was under
    ``min_tokens`` (kv_share's rule); ``not_pushed``: the sidecar did not
    queue it (queue full, or replication off); ``push_incomplete``: right
    after the push the target held less than offered (budget, fetch error,
    deadline), or the switch came before that check; ``evicted``: it held
    it all after the push, not at the switch."""
    ideal = min(push.blocks, prompt_blocks) if push is not None else 0
    if classify(held_blocks * block_tokens / prompt_tokens) == "warm":
        return "warm"
    if push is None:
        return "no_push_record"
    if held_blocks >= ideal:
        return "prompt_grew"
    if push.finished is None or push.finished > turn_started:
        return "push_late"
    if push.error:
        return "push_error"
    if not push.replicating:
        return "not_replicated_short" if push.tokens < min_tokens else "not_pushed"
    if (push.target_held or 0) < ideal:
        return "push_incomplete"
    return "evicted"


# -- what a perfect sender could have done: the hindsight oracle ------------------------------


@dataclass(slots=True)
class ReplicaJob:
    """Blocks ``[lo, hi)`` of ``session`` that one host's uplink must carry
    to the other host, ready at ``release`` and due at ``deadline`` (the
    session's next turn on that host; inf: none in the run)."""

    session: str
    lo: int
    hi: int
    release: float
    deadline: float
    nbytes: int
    served: list[tuple[float, float, float]]  # (from, to, bytes sent before `from`)


def replica_jobs(turns: list[dict[str, Any]], block_bytes: int) -> dict[str, list[ReplicaJob]]:
    """What each host of a two-host run (``RunStats.turn_log``) had to send
    the other, by sending host in release order: a turn's prompt blocks the
    peer lacks once they were stored, the output's at the turn's end."""
    hosts = sorted({t["host"] for t in turns})
    if len(hosts) > 2:
        raise ValueError("the replay is of two hosts (each the other's only target)")
    other = {h: next((o for o in hosts if o != h), h) for h in hosts}
    pieces = []  # (time, host that now holds them, session, blocks, due on the peer)
    for s, ts in _by_session(turns).items():
        for i, t in enumerate(ts):
            peer = other[t["host"]]
            due = next((u["t_start"] for u in ts[i + 1 :] if u["host"] == peer), math.inf)
            pieces.append((t["t_prompt"], t["host"], s, t["prompt_blocks"], due))
            pieces.append((t["t_end"], t["host"], s, t["blocks"], due))
    pieces.sort()
    known: dict[tuple[str, str], int] = {}  # (host, session) -> blocks it has or is sent
    jobs: dict[str, list[ReplicaJob]] = {h: [] for h in hosts}
    for at, host, s, blocks, due in pieces:
        known[(host, s)] = max(known.get((host, s), 0), blocks)
        peer = other[host]
        have = known.get((peer, s), 0)
        if peer != host and blocks > have:
            nbytes = (blocks - have) * block_bytes
            jobs[host].append(ReplicaJob(s, have, blocks, at, due, nbytes, []))
            known[(peer, s)] = blocks
    return jobs


# The orders a replay's uplink can send in: ``deadline`` knows when each
# session comes back (hindsight: the bound); ``oldest`` is the sidecars' own
# order (tierstore.peer.pushq, tierstore.peer.stream), and ``shortest``
# (fewest bytes left first) another order a real sender could run.
ORDERS = ("deadline", "oldest", "shortest")


def serve_in_order(jobs: list[ReplicaJob], link_bytes_per_s: float, order: str) -> None:
    """One uplink at ``link_bytes_per_s``, preemptive, no per-push cost,
    always sending the ready job first in ``order`` (``ORDERS``): fills each
    job's ``served``."""
    if order not in ORDERS:
        raise ValueError(f"order {order!r}: want one of {ORDERS}")
    pending = sorted(jobs, key=lambda j: j.release)
    left = [float(j.nbytes) for j in pending]
    keys = {
        "deadline": lambda i: (pending[i].deadline, i),
        "oldest": lambda i: (pending[i].release, i),
        "shortest": lambda i: (left[i], i),
    }[order]
    ready: list[int] = []
    now, nxt = 0.0, 0
    while nxt < len(pending) or ready:
        if not ready:
            now = max(now, pending[nxt].release)
        while nxt < len(pending) and pending[nxt].release <= now:
            ready.append(nxt)
            nxt += 1
        i = min(ready, key=keys)  # a few hundred jobs a run: a scan is enough
        job = pending[i]
        until = pending[nxt].release if nxt < len(pending) else math.inf
        end = min(until, now + left[i] / link_bytes_per_s)
        job.served.append((now, end, job.nbytes - left[i]))
        left[i] -= (end - now) * link_bytes_per_s
        now = end
        if left[i] <= 1e-6 * job.nbytes:
            ready.remove(i)


def delivered_blocks(job: ReplicaJob, at: float, link_bytes_per_s: float, block_bytes: int) -> int:
    """How far into ``[lo, hi)`` the job's blocks had arrived at ``at``."""
    sent = 0.0
    for a, b, before in job.served:
        if at > a:
            sent = before + (min(at, b) - a) * link_bytes_per_s
    return job.lo + min(job.hi - job.lo, int(sent / block_bytes + 1e-9))


def oracle_switches(
    turns: list[dict[str, Any]], link_bytes_per_s: float, block_bytes: int, order: str = "deadline"
) -> list[dict[str, Any]]:
    """Replay a two-host run's turns with a perfect sender: each host's
    uplink carries the jobs of ``replica_jobs`` in ``order``; by default
    earliest deadline first, knowing every deadline (hindsight: no real
    sender does better). One entry per host switch: the blocks the serving
    host would have held at the turn's start against what the last turn left.

    The replay ignores the CPU, the receiver and every per-push cost: a
    switch that is not warm with ``deadline`` could not be warm with any
    order or pacing of this link for these turns; one not warm with
    ``oldest`` is lost by the sidecars' order itself, however fast they send."""
    jobs = replica_jobs(turns, block_bytes)
    for js in jobs.values():
        serve_in_order(js, link_bytes_per_s, order)
    out = []
    for s, ts in _by_session(turns).items():
        for i, (prev, t) in enumerate(itertools.pairwise(ts)):
            if prev["host"] == t["host"]:
                continue
            ideal = min(prev["blocks"], t["prompt_blocks"])
            at = t["t_start"]
            held = max((u["blocks"] for u in ts[: i + 1] if u["host"] == t["host"]), default=0)
            for job in jobs[prev["host"]]:  # in release order: each starts where one ended
                if job.session == s and job.release <= at and job.lo <= held:
                    held = max(held, delivered_blocks(job, at, link_bytes_per_s, block_bytes))
            held = min(held, ideal)
            out.append(
                {
                    "t_s": at,
                    "session": s,
                    "last_turn_blocks": ideal,
                    "oracle_held": held,
                    "oracle_class_of_cached": classify(held / ideal) if ideal else "warm",
                }
            )
    return out


def peak_offered_load(jobs: list[ReplicaJob], window_s: float, link_bytes_per_s: float) -> float:
    """The most bytes released in any ``window_s`` of one uplink's jobs
    over what the link carries in it: above 1, no sender keeps up through
    that window however it orders the link."""
    peak = 0.0
    rel = sorted((j.release, j.nbytes) for j in jobs)
    total, lo = 0, 0
    for at, nbytes in rel:
        total += nbytes
        while rel[lo][0] < at - window_s:
            total -= rel[lo][1]
            lo += 1
        peak = max(peak, total / (link_bytes_per_s * window_s))
    return peak


def _by_session(turns: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for t in sorted(turns, key=lambda t: t["t_start"]):
        out.setdefault(t["session"], []).append(t)
    return out
