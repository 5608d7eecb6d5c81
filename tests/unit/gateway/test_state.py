"""The gateway's small state: sessions found by prefix, the in-flight ledger
and its queue estimate, engines' /metrics scraped, backends parsed."""

from __future__ import annotations

import numpy as np
import pytest

from tierstore.errors import ConfigError
from tierstore.gateway.backends import (
    Backend,
    MemberBackends,
    StaticBackends,
    backend_of,
    parse_backend,
)
from tierstore.gateway.load import EngineCounts, Ledger, host_load, scrape_counts
from tierstore.gateway.sessions import Sessions
from tierstore.keys import chain_keys
from tierstore.membership.members import Member

from ...conftest import SMALL_LAYOUT as L


def test_the_next_turn_of_a_chat_finds_its_session_by_prefix() -> None:
    s = Sessions(16)
    turn1 = np.arange(5 * L.block_tokens + 3)
    k1 = chain_keys(L, turn1)
    first = s.find(k1)
    assert first.host == "" and first.session
    s.ran(first.session, "a", k1)
    turn2 = np.concatenate([turn1, np.arange(100, 100 + 4 * L.block_tokens)])
    again = s.find(chain_keys(L, turn2))
    assert again.session == first.session and again.host == "a"
    other = s.find(chain_keys(L, np.arange(50, 50 + 6 * L.block_tokens)))
    assert other.session != first.session and other.host == ""


def test_a_session_header_names_the_session() -> None:
    s = Sessions(16)
    k = chain_keys(L, np.arange(3 * L.block_tokens))
    assert s.find(k, "chat-7").session == "chat-7"
    s.ran("chat-7", "b", k, "chat-7")
    assert s.find([], "chat-7").host == "b"


def test_sessions_are_bounded() -> None:
    s = Sessions(2)
    chains = [chain_keys(L, np.arange(i, i + L.block_tokens)) for i in range(3)]
    for i, k in enumerate(chains):
        s.ran(f"s{i}", "a", k)
    assert s.find(chains[0]).host == ""  # forgotten: the oldest of three past the bound
    assert s.find(chains[2]).host == "a"


VLLM_METRICS = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
vllm:num_requests_waiting{engine="1",model_name="m"} 1.0
vllm:num_requests_waiting_by_reason{reason="capacity"} 9.0
vllm:e2e_request_latency_seconds_bucket{le="0.3"} 7.0
vllm:request_prefill_time_seconds_sum{engine="0",model_name="m"} 2.5
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_compute"} 5000.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_cache_hit"} 900.0
"""


def test_scrape_counts_sums_the_engines_and_ignores_look_alikes() -> None:
    c = scrape_counts(VLLM_METRICS)
    assert (c.running, c.waiting) == (3.0, 3.0)
    c = scrape_counts("sglang:num_running_reqs 4\nsglang:num_queue_reqs 1\n")
    assert (c.running, c.waiting) == (4.0, 1.0)
    c = scrape_counts("garbage\nvllm:num_requests_running{x} not-a-number\n")
    assert (c.running, c.waiting) == (0.0, 0.0)


def test_the_ledger_queue_is_the_prefills_ahead_less_what_the_oldest_has_run() -> None:
    led = Ledger()
    a = led.sent("h", prefill_s=2.0, prefill_tokens=1000)
    led.sent("h", prefill_s=3.0, prefill_tokens=1000)
    sent_at = led._hosts["h"].flights[a].sent_at
    assert led.pending_prefill_s("h", now=sent_at) == pytest.approx(5.0)
    assert led.pending_prefill_s("h", now=sent_at + 1.5) == pytest.approx(3.5)
    assert led.in_flight("h") == (2, 0)
    led.first_byte(a)
    assert led.in_flight("h") == (1, 1)
    led.done(a)
    assert led.in_flight("h") == (1, 0) and led.in_flight("other") == (0, 0)


def test_host_load_counts_other_clients_waiting_requests() -> None:
    idle = host_load(0.0, 0, EngineCounts(1, 0, 0), 2.0)
    assert idle.busy_slots == 0
    own = host_load(4.0, 2, EngineCounts(1, 2, 0), 2.0)
    assert own.wait_s == 4.0  # the engine's two waiting are the gateway's own
    foreign = host_load(4.0, 2, EngineCounts(1, 5, 0), 2.0)
    assert foreign.wait_s == 4.0 + 3 * 2.0


def test_backends_parse_and_refuse_with_the_reason() -> None:
    b = parse_backend("http://10.0.0.1:8000/;peer=10.0.0.1:7700;events=tcp://10.0.0.1:5557")
    assert b == Backend("http://10.0.0.1:8000", "10.0.0.1:7700", "tcp://10.0.0.1:5557")
    assert b.name == "10.0.0.1:7700" and parse_backend("http://e:1").name == "http://e:1"
    bad_items = [("e:8000", "http"), ("http://e:1;peer=e", "host:port"),
                 ("http://e:1;port=2", "expected"), ("http://e:1;events=e:2", "ZMQ")]  # fmt: skip
    for bad, why in bad_items:
        with pytest.raises(ConfigError, match=why):
            parse_backend(bad)
    with pytest.raises(ConfigError, match="twice"):
        StaticBackends([parse_backend("http://e:1"), parse_backend("http://e:1")])


def test_member_records_name_their_engines() -> None:
    class Records:
        version = 3

        def records(self) -> dict[str, Member]:
            return {
                "h1:7700": Member("h1:7700", "g", engine_url="http://h1:8000"),
                "h2:7700": Member("h2:7700", "g"),  # a sidecar with no engine named
                "h3:7700": Member("h3:7700", "g", engine_url="not a url"),
            }

    got = MemberBackends(Records()).backends()
    assert got == [Backend("http://h1:8000", "h1:7700")]
    assert backend_of(Member("x:1", "g", engine_url="http://x:2", engine_events="tcp://x:3")) == (
        Backend("http://x:2", "x:1", "tcp://x:3")
    )


def test_the_ttft_factor_learns_how_late_a_host_answers_against_the_estimate() -> None:
    led = Ledger()
    assert led.ttft_factor("h") == 1.0
    for _ in range(20):  # 0.5 s before the correction, answered in 1.5 s
        t = led.sent("h", 0.4, 1000, predicted_s=0.5 * led.ttft_factor("h"))
        led._hosts["h"].flights[t].sent_at -= 1.5
        led.first_byte(t)
        led.done(t)
    # Each estimate is made with the factor learned so far: it converges on
    # the correction the estimate needs, not on the raw ratio of the last one.
    assert led.ttft_factor("h") == pytest.approx(3.0, rel=0.05)
    assert led.ttft_factor("other") == led.ttft_factor("h")  # unmeasured: the others'
    t = led.sent("h", 0.0, 10, predicted_s=0.01)  # too short to say anything
    led._hosts["h"].flights[t].sent_at -= 5.0
    before = led.ttft_factor("h")
    led.first_byte(t)
    assert led.ttft_factor("h") == before


def test_the_step_time_is_the_streamed_gap_and_counts_only_while_streaming() -> None:
    led = Ledger()
    t = led.sent("h", 0.1, 100)
    led.first_byte(t)
    assert led.step_s("h") == 0.0  # one chunk: no gap yet
    for _ in range(3):
        led._hosts["h"].flights[t].last_at -= 0.2  # the next chunk 0.2 s later
        led.chunk(t)
    assert led.step_s("h") == pytest.approx(0.2, rel=0.05)
    led.done(t)
    assert led.step_s("h") == 0.0  # nothing streams there now: a new prefill starts at once
    assert host_load(1.0, 0, None, 0.0, step_s=0.2).wait_s == pytest.approx(1.2)
