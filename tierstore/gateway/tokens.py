"""A request's prompt as the token ids its engine will see.

Block keys are chained over token ids, so the gateway must tokenize a text
or chat prompt exactly as the engine does. Provides:
- ``prompt_tokens(request, local, remote)``: token-id prompts as they are;
  text and chat through the local tokenizer when there is one and it can
  (string message contents), else through an engine's ``/tokenize``;
- ``HfTokenizer``: the model's own tokenizer and chat template
  (``transformers``, local files only), doing what vLLM's OpenAI server
  does: a chat is rendered to text by the template
  (``add_generation_prompt`` on unless the request says otherwise), then
  encoded with ``add_special_tokens`` off (on for completions), the part
  an earlier turn already had taken from ``prefix_tokens.PrefixTokens``;
- ``EngineTokenizer``: the same through the engine's ``/tokenize`` endpoint
  (vLLM's), for deployments that give the gateway no tokenizer files.

The local tokenizer runs on a worker thread (``asyncio.to_thread``): a long
prompt takes milliseconds to encode and must not hold up the event loop; a
chat whose earlier turns are cached leaves only its new part to encode
(tens of microseconds), which is done on the loop.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from tierstore.gateway.prefix_tokens import PrefixTokens
from tierstore.gateway.requests import ApiError, Request

QUICK_TAIL_CHARS = 4096  # a chat's new part this short is encoded on the event loop


class RemoteTokenize(Protocol):
    async def __call__(self, body: dict[str, Any]) -> list[int]:
        """POST ``body`` to an engine's ``/tokenize``; its ``tokens``."""
        ...


class HfTokenizer:
    """The model's tokenizer from a local directory (``tokenizer.json`` and
    ``tokenizer_config.json`` with its chat template)."""

    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer

        try:
            self.tok: Any = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as e:
            raise ValueError(
                f"gateway_tokenizer: cannot load a tokenizer from {path!r}: {e}"
            ) from e
        self.path = path
        # Chat prompts grow turn by turn: their prefix's ids come from a cache.
        self.prefixes = (
            PrefixTokens(self.tok.backend_tokenizer, self.tok.added_tokens_decoder)
            if getattr(self.tok, "is_fast", False)
            else None
        )

    def can_encode(self, request: Request) -> bool:
        """Whether this tokenizer gives the engine's ids for this request: chat
        messages whose contents are plain strings (content parts, images and
        tool calls are normalised by the engine in ways of its own)."""
        if request.messages is None:
            return True
        return all(
            isinstance(m.get("content"), str) and set(m) <= {"role", "content", "name"}
            for m in request.messages
        )

    def render(self, request: Request) -> str:
        """A chat's prompt text, rendered by the model's chat template."""
        kwargs = dict(request.chat_kwargs)
        kwargs.setdefault("add_generation_prompt", True)
        try:
            text: str = self.tok.apply_chat_template(request.messages, tokenize=False, **kwargs)
        except Exception as e:  # jinja2's errors: the template refused these messages
            raise ApiError(400, f"the chat template failed on these messages: {e}") from e
        return text

    def encode(self, request: Request) -> list[int]:
        """The request's ids (a worker thread's call: a long prompt takes milliseconds)."""
        if request.messages is None:
            assert request.text is not None
            return self.encode_text(request.text, request.add_special_tokens)
        return self.encode_text(self.render(request), request.add_special_tokens)

    def encode_text(self, text: str, add_special_tokens: bool) -> list[int]:
        if self.prefixes is not None and not add_special_tokens:
            ids = self.prefixes.encode(text)
            assert ids is not None
            return ids
        return list(self.tok(text, add_special_tokens=add_special_tokens)["input_ids"])


def tokenize_body(request: Request) -> dict[str, Any]:
    """The ``/tokenize`` body for a text or chat request (vLLM's schema)."""
    if request.messages is None:
        return {
            "model": request.model,
            "prompt": request.text,
            "add_special_tokens": request.add_special_tokens,
        }
    body: dict[str, Any] = {
        "model": request.model,
        "messages": request.messages,
        "add_special_tokens": request.add_special_tokens,
    }
    kwargs = dict(request.chat_kwargs)
    for name in ("add_generation_prompt", "continue_final_message", "tools", "chat_template"):
        if name in kwargs:
            body[name] = kwargs.pop(name)
    if kwargs:
        body["chat_template_kwargs"] = kwargs
    return body


async def prompt_tokens(
    request: Request, local: HfTokenizer | None, remote: RemoteTokenize | None
) -> list[int] | None:
    """The prompt's token ids, or None when nothing here can tell them
    (no tokenizer given and no engine answered: the turn is then placed by
    load alone)."""
    if request.token_ids is not None:
        return request.token_ids
    if local is not None and local.can_encode(request):
        if request.messages is None or local.prefixes is None or request.add_special_tokens:
            return await asyncio.to_thread(local.encode, request)
        # A chat whose earlier turns are cached leaves only its new part to
        # encode: done here; a first turn goes to a worker thread.
        text = local.render(request)
        ids = local.prefixes.encode(text, QUICK_TAIL_CHARS)
        if ids is not None:
            return ids
        return await asyncio.to_thread(local.encode_text, text, False)
    if remote is not None:
        return await remote(tokenize_body(request))
    return None
