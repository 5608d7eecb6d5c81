"""What an OpenAI API request asks for, and the errors the gateway answers.

Provides:
- ``ApiError``: an HTTP status with an OpenAI error object
  (``{"error": {"message", "type", "param", "code"}}``), raised by the
  parsers and the gateway's handlers and answered as is;
- ``Request`` and ``parse_request(kind, body)``: the parts of a
  ``/v1/completions`` or ``/v1/chat/completions`` body the gateway needs to
  place the turn (model, prompt as token ids, text or chat messages,
  streaming, the output budget, vLLM's ``cache_salt``), checked the way the
  engines check them, so a malformed request is refused here with a 4xx
  and never costs an engine a slot;
- ``with_transfer_params(raw, body, params)``: the body with vLLM's
  ``kv_transfer_params`` merged in (the session).

Pure: no I/O. Runs on the gateway's event loop.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

RequestKind = Literal["completions", "chat"]
MAX_BATCH_PROMPTS = 1024  # prompts in one /v1/completions body


class ApiError(Exception):
    """An OpenAI-format error answer. ``status`` 4xx: the client's request;
    5xx: no engine could serve it."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


@dataclass(frozen=True, slots=True)
class Request:
    """One completion or chat request as the gateway places it."""

    kind: RequestKind
    model: str
    body: dict[str, Any]  # the parsed body, forwarded (with transfer params) as is
    stream: bool
    max_tokens: int | None  # the output budget, when the client set one
    token_ids: list[int] | None = None  # a token-id prompt (the first, for a batch)
    text: str | None = None  # a text prompt (the first, for a batch)
    messages: list[dict[str, Any]] | None = None  # chat
    chat_kwargs: dict[str, Any] = field(default_factory=dict)  # template options
    add_special_tokens: bool = True
    cache_salt: str = ""


def parse_json(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ApiError(400, f"We could not parse the JSON body of your request: {e}") from e
    if not isinstance(body, dict):
        raise ApiError(400, f"The request body must be a JSON object, got {type(body).__name__}")
    return body


def parse_request(kind: RequestKind, body: dict[str, Any]) -> Request:
    """The request in ``body`` (already a JSON object); raises ApiError(400)
    naming the field that is missing or malformed."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "you must provide a model parameter", param="model")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "stream must be true or false", param="stream")
    max_tokens = _max_tokens(body)
    salt = body.get("cache_salt") or ""
    if not isinstance(salt, str):
        raise ApiError(400, "cache_salt must be a string", param="cache_salt")
    if kind == "completions":
        token_ids, text = _prompt(body.get("prompt"))
        return Request(
            "completions", model, body, stream, max_tokens, token_ids=token_ids, text=text,
            add_special_tokens=_bool(body.get("add_special_tokens", True), "add_special_tokens"),
            cache_salt=salt,
        )  # fmt: skip
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty array", param="messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, f"messages[{i}] must be an object with a role", param="messages")
    return Request(
        "chat", model, body, stream, max_tokens, messages=messages,
        chat_kwargs=_chat_kwargs(body),
        add_special_tokens=_bool(body.get("add_special_tokens", False), "add_special_tokens"),
        cache_salt=salt,
    )  # fmt: skip


def _chat_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    """The chat template's options in a chat body, as vLLM passes them."""
    kwargs: dict[str, Any] = {}
    for name in ("add_generation_prompt", "continue_final_message"):
        if name in body:
            kwargs[name] = _bool(body[name], name)
    extra = body.get("chat_template_kwargs") or {}
    if not isinstance(extra, dict):
        raise ApiError(400, "chat_template_kwargs must be an object", param="chat_template_kwargs")
    kwargs.update(extra)
    for name in ("tools", "documents"):
        if body.get(name) is not None:
            kwargs[name] = body[name]
    if "chat_template" in body:
        kwargs["chat_template"] = body["chat_template"]
    return kwargs


def _bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise ApiError(400, f"{name} must be true or false", param=name)
    return value


def _max_tokens(body: dict[str, Any]) -> int | None:
    for name in ("max_completion_tokens", "max_tokens"):
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ApiError(400, f"{name} must be a positive integer, got {value!r}", param=name)
        return value
    return None


def _token_list(value: list[Any]) -> list[int] | None:
    if all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        if any(t < 0 or t >= 1 << 32 for t in value):
            raise ApiError(400, "token ids in prompt must be in [0, 2**32)", param="prompt")
        return value
    return None


def _prompt(prompt: Any) -> tuple[list[int] | None, str | None]:
    """(token ids, text) of the completion's prompt; for a batch, the first
    prompt's (a batch is placed as one: where its first prompt's KV is)."""
    if isinstance(prompt, str):
        return None, prompt
    if isinstance(prompt, list) and prompt:
        if len(prompt) > MAX_BATCH_PROMPTS:
            raise ApiError(400, f"at most {MAX_BATCH_PROMPTS} prompts a request", param="prompt")
        ids = _token_list(prompt)
        if ids is not None:
            return ids, None
        first = prompt[0]
        if all(isinstance(p, str) for p in prompt):
            return None, first
        if all(isinstance(p, list) and p for p in prompt):
            ids = _token_list(first)
            if ids is not None and all(_token_list(p) is not None for p in prompt[1:]):
                return ids, None
    raise ApiError(
        400,
        "prompt must be a string, an array of strings, an array of token ids, or an array "
        "of arrays of token ids",
        param="prompt",
    )


def with_transfer_params(raw: bytes, body: dict[str, Any], params: dict[str, Any]) -> bytes:
    """The request ``raw`` (parsed: ``body``) with ``params`` in its
    ``kv_transfer_params`` (the client's own entries win: it may name its
    session itself). Without such a field the body is not written again:
    the field goes in front of the others."""
    own = body.get("kv_transfer_params")
    head = raw.lstrip()
    if own is None and head.startswith(b"{") and body:
        return b'{"kv_transfer_params":' + json.dumps(params).encode() + b"," + head[1:]
    merged = dict(params)
    if isinstance(own, dict):
        merged.update(own)
    return json.dumps({**body, "kv_transfer_params": merged}).encode()
