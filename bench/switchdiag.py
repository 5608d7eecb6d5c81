"""Why a host switch of the real switch benchmark (``bench/switch.py``) was
not warm: a session's last replica push as its engine saw it, and the rule
that names the first reason the serving host held less than the last turn
left. Pure (no I/O); the driver's session and pusher threads fill the records.
"""

from __future__ import annotations

from dataclasses import dataclass

from switchsim import classify


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
