"""How busy each engine is: its own /metrics, and the gateway's own ledger.

Provides:
- ``scrape_counts(text)``: running and waiting requests from an engine's
  Prometheus page (vLLM's ``vllm:num_requests_running`` /
  ``vllm:num_requests_waiting``, SGLang's ``sglang:num_running_reqs`` /
  ``sglang:num_queue_reqs``), summed over their labels; a line scan, not a
  full parse (vLLM's page is tens of KB of histograms, scraped every
  ``gateway_load_poll_s``);
- ``Ledger``: the requests this gateway has in flight on each engine, each
  with the prefill time the cost model expected for it; what is still
  waiting for its first token is the queue a new request would join
  (``pending_prefill_s``). It also learns how far each engine's first tokens
  come later than the cost model said (``ttft_factor``: the engine's real
  speed against the configured one, its decodes and its batching, which the
  model does not see), which calibrates the model per engine;
- ``host_load(...)``: the two views as the cost model's ``HostLoadView``.

Pure apart from the ledger's lock. The ledger is updated from the event
loop and read by placement (on a worker thread).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from tierstore.load import HostLoadView

RUNNING = ("vllm:num_requests_running", "sglang:num_running_reqs")
WAITING = ("vllm:num_requests_waiting", "sglang:num_queue_reqs")
RATE_WEIGHT = 0.3  # weight of the newest TTFT-factor sample
FACTOR_MIN_PREDICTED_S = 0.05  # shorter estimates are mostly fixed costs: not a factor sample
FACTOR_MIN, FACTOR_MAX = 0.25, 8.0  # one outlier moves the factor at most this far


@dataclass(frozen=True, slots=True)
class EngineCounts:
    running: float = 0.0
    waiting: float = 0.0
    at: float = 0.0  # time.monotonic() of the scrape


def scrape_counts(text: str) -> EngineCounts:
    """Running and waiting requests on an engine's /metrics page."""
    running = waiting = 0.0
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name not in RUNNING and name not in WAITING:
            continue
        try:
            value = float(line.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            continue
        if name in RUNNING:
            running += value
        else:
            waiting += value
    return EngineCounts(running, waiting, time.monotonic())


@dataclass(slots=True)
class _Flight:
    host: str
    prefill_s: float  # the cost model's estimate when it was placed
    prefill_tokens: int
    sent_at: float
    predicted_s: float = 0.0  # the cost model's whole TTFT estimate (0: none)
    factor: float = 1.0  # the host's TTFT factor the estimate was made with
    first_at: float = 0.0  # first byte of the answer (0: not yet)
    last_at: float = 0.0  # the answer's latest chunk


@dataclass(slots=True)
class _Host:
    flights: dict[int, _Flight] = field(default_factory=dict)
    ttft_factor: float = 0.0  # observed TTFT over the estimate; 0: no sample yet
    step_s: float = 0.0  # gap between streamed chunks: the engine's step while it decodes


class Ledger:
    """The gateway's requests in flight, per host. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._hosts: dict[str, _Host] = {}
        self._where: dict[int, str] = {}  # ticket -> host
        self._next = 0

    def sent(
        self, host: str, prefill_s: float, prefill_tokens: int, predicted_s: float = 0.0
    ) -> int:
        """A request was sent to ``host`` (``predicted_s``: the TTFT the cost
        model expected, made with ``ttft_factor(host)``); returns its ticket."""
        with self._lock:
            h = self._hosts.setdefault(host, _Host())
            self._next += 1
            self._where[self._next] = host
            h.flights[self._next] = _Flight(
                host, prefill_s, prefill_tokens, time.monotonic(), predicted_s=predicted_s,
                factor=h.ttft_factor or 1.0,
            )  # fmt: skip
            return self._next

    def first_byte(self, ticket: int) -> float:
        """The answer's first byte arrived; returns the time since it was sent."""
        now = time.monotonic()
        with self._lock:
            f = self._find(ticket)
            if f is None or f.first_at:
                return 0.0
            f.first_at = f.last_at = now
            ttft = now - f.sent_at
            h = self._hosts[f.host]
            if f.predicted_s >= FACTOR_MIN_PREDICTED_S:
                sample = min(max(f.factor * ttft / f.predicted_s, FACTOR_MIN), FACTOR_MAX)
                h.ttft_factor = _ewma(h.ttft_factor, sample)
            return ttft

    def chunk(self, ticket: int) -> None:
        """A chunk of a streamed answer arrived: its gap from the last one is
        a sample of the engine's step time (one token per running request)."""
        now = time.monotonic()
        with self._lock:
            f = self._find(ticket)
            if f is None or not f.first_at:
                return
            if f.last_at:
                h = self._hosts[f.host]
                h.step_s = _ewma(h.step_s, now - f.last_at)
            f.last_at = now

    def step_s(self, host: str) -> float:
        """How long ``host``'s engine takes a step now: the streamed gaps of
        its answers, while any of this gateway's answers is streaming there
        (an idle engine takes a new request's prefill at once)."""
        with self._lock:
            h = self._hosts.get(host)
            if h is None or not any(f.first_at for f in h.flights.values()):
                return 0.0
            return h.step_s

    def done(self, ticket: int) -> None:
        with self._lock:
            host = self._where.pop(ticket, None)
            if host is not None:
                self._hosts[host].flights.pop(ticket, None)

    def _find(self, ticket: int) -> _Flight | None:
        host = self._where.get(ticket)
        return self._hosts[host].flights.get(ticket) if host is not None else None

    def in_flight(self, host: str) -> tuple[int, int]:
        """(requests waiting for their first byte, requests streaming) on ``host``."""
        with self._lock:
            h = self._hosts.get(host)
            if h is None:
                return 0, 0
            waiting = sum(1 for f in h.flights.values() if not f.first_at)
            return waiting, len(h.flights) - waiting

    def pending_prefill_s(self, host: str, now: float | None = None) -> float:
        """The prefill work queued on ``host`` by this gateway: the estimates
        of its requests still waiting for a first byte, less the time the
        oldest of them has already run (an engine takes prefills in order)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            h = self._hosts.get(host)
            waiting = [f for f in h.flights.values() if not f.first_at] if h else []
            if not waiting:
                return 0.0
            total = sum(f.prefill_s for f in waiting)
            oldest = min(waiting, key=lambda f: f.sent_at)
            return max(total - min(now - oldest.sent_at, oldest.prefill_s), 0.0)

    def ttft_factor(self, host: str) -> float:
        """How much longer ``host``'s first tokens took than the cost model
        said (its decodes, its batching, what the model does not see): the
        weighted mean of observed over estimated TTFT; a host with no sample
        yet, the others' mean; 1.0 with none anywhere."""
        with self._lock:
            h = self._hosts.get(host)
            if h is not None and h.ttft_factor:
                return h.ttft_factor
            known = [x.ttft_factor for x in self._hosts.values() if x.ttft_factor]
            return sum(known) / len(known) if known else 1.0


def host_load(
    pending_s: float, own_waiting: int, counts: EngineCounts | None, foreign_request_s: float,
    step_s: float = 0.0,
) -> HostLoadView:  # fmt: skip
    """The cost model's view of one engine: the wait for a new request is the
    prefill queued by this gateway, plus the requests the engine says are
    waiting beyond this gateway's own (other gateways', direct clients'),
    each at ``foreign_request_s``, plus one step of the decodes it runs now
    (``step_s``: a new prefill shares its step with them). ``HostLoadView``'s
    slot terms are unused: an engine batches every running request, and what
    a new one waits for is the work ahead of it."""
    foreign = 0.0
    if counts is not None:
        foreign = max(counts.waiting - own_waiting, 0.0) * foreign_request_s
    wait_s = pending_s + foreign + step_s
    if wait_s <= 0:
        return HostLoadView(reported=True, busy_slots=0, slots=1)
    return HostLoadView(reported=True, busy_slots=1, slots=1, queue_len=0, wait_s=wait_s)


def _ewma(old: float, sample: float) -> float:
    """The running estimate with ``sample`` in (``old`` 0: the first sample)."""
    return sample if not old else (1 - RATE_WEIGHT) * old + RATE_WEIGHT * sample
