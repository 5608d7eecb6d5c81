"""The gateway's parsing of OpenAI request bodies: what it needs to place a
turn, and the 4xx errors (OpenAI's format) for what an engine would refuse."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tierstore.gateway.requests import ApiError, parse_json, parse_request, with_transfer_params


def test_a_token_id_prompt_passes_as_it_is() -> None:
    r = parse_request("completions", {"model": "m", "prompt": [1, 2, 3], "max_tokens": 4})
    assert (r.token_ids, r.text, r.max_tokens, r.stream) == ([1, 2, 3], None, 4, False)
    assert r.add_special_tokens


def test_text_and_batches_place_by_their_first_prompt() -> None:
    assert parse_request("completions", {"model": "m", "prompt": "hi"}).text == "hi"
    assert parse_request("completions", {"model": "m", "prompt": ["a", "b"]}).text == "a"
    r = parse_request("completions", {"model": "m", "prompt": [[5, 6], [7]], "stream": True})
    assert r.token_ids == [5, 6] and r.stream


def test_chat_keeps_the_template_options_the_engine_uses() -> None:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hello"}],
        "add_generation_prompt": False,
        "chat_template_kwargs": {"enable_thinking": True},
        "max_completion_tokens": 9,
    }
    r = parse_request("chat", body)
    assert r.messages == body["messages"] and r.max_tokens == 9
    assert r.chat_kwargs == {"add_generation_prompt": False, "enable_thinking": True}
    assert not r.add_special_tokens  # vLLM's chat default


@pytest.mark.parametrize(
    ("kind", "body", "param"),
    [
        ("completions", {"prompt": [1]}, "model"),
        ("completions", {"model": "m"}, "prompt"),
        ("completions", {"model": "m", "prompt": [1, "x"]}, "prompt"),
        ("completions", {"model": "m", "prompt": [-1]}, "prompt"),
        ("completions", {"model": "m", "prompt": [1], "max_tokens": 0}, "max_tokens"),
        ("completions", {"model": "m", "prompt": [1], "max_tokens": True}, "max_tokens"),
        ("completions", {"model": "m", "prompt": [1], "stream": "yes"}, "stream"),
        ("chat", {"model": "m", "messages": []}, "messages"),
        ("chat", {"model": "m", "messages": [{"content": "no role"}]}, "messages"),
        ("chat", {"model": "m", "messages": [{"role": "user"}], "chat_template_kwargs": 3},
         "chat_template_kwargs"),
    ],
)  # fmt: skip
def test_malformed_requests_are_400_naming_the_field(
    kind: Any, body: dict[str, Any], param: str
) -> None:
    with pytest.raises(ApiError) as e:
        parse_request(kind, body)
    assert e.value.status == 400 and e.value.param == param
    err = e.value.body()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["message"]


def test_bad_json_is_400() -> None:
    for raw in (b"{not json", b"[1, 2]", b"\xff\xfe"):
        with pytest.raises(ApiError) as e:
            parse_json(raw)
        assert e.value.status == 400
    assert parse_json(b'{"a": 1}') == {"a": 1}


def test_transfer_params_merge_and_the_clients_own_win() -> None:
    body = {"model": "m", "kv_transfer_params": {"session": "mine"}}
    out = json.loads(with_transfer_params(json.dumps(body).encode(), body,
                                          {"session": "derived", "x": 1}))  # fmt: skip
    assert out == {"model": "m", "kv_transfer_params": {"session": "mine", "x": 1}}
    assert body["kv_transfer_params"] == {"session": "mine"}  # not modified in place


def test_transfer_params_go_in_front_without_writing_the_body_again() -> None:
    raw = b'  {"model": "m", "prompt": [1, 2], "stream": true}'
    out = with_transfer_params(raw, json.loads(raw), {"session": "s"})
    assert out.endswith(b'"model": "m", "prompt": [1, 2], "stream": true}')
    assert json.loads(out) == {"kv_transfer_params": {"session": "s"}, "model": "m",
                               "prompt": [1, 2], "stream": True}  # fmt: skip
