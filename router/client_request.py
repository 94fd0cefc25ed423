"""Stage 1 of a request: read the client's JSON body within the limits, check the fields the
router reads, and say which endpoint's prompt it holds (a completion's or a chat's).

A body is bounded before it is parsed (bytes, then JSON values counted by their commas) and
its depth after, so no request holds the event loop longer than parsing ``max_json_items``
values takes; errors are vLLM's (a 400 naming the field, ``body`` for the body itself).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any

import msgspec
from aiohttp import web

from .config import LimitsSection
from .errors import ApiError

FORWARDED_HEADERS = ("X-Request-Id",)  # the client's, passed to the engine


class Endpoint(StrEnum):
    """Which kind of prompt a request holds: a completion's ``prompt`` or a chat's
    ``messages`` (the value names it in metrics and logs)."""

    COMPLETIONS = "completions"
    CHAT = "chat"

    @property
    def chat(self) -> bool:
        return self is Endpoint.CHAT

    @classmethod
    def of_path(cls, path: str) -> Endpoint:
        return cls.CHAT if path.endswith("chat/completions") else cls.COMPLETIONS


@dataclass(frozen=True, slots=True)
class ClientRequest:
    """A client's request as read: its JSON object, its bytes (forwarded as received when
    nothing needs changing) and the headers the engine gets too."""

    endpoint: Endpoint
    body: dict[str, Any]
    raw: bytes
    forwarded: dict[str, str]

    @property
    def model(self) -> Any:
        return self.body.get("model")

    @property
    def cache_salt(self) -> str:
        return self.body.get("cache_salt") or ""

    @property
    def streams(self) -> bool:
        return self.body.get("stream") is True

    @property
    def prompts(self) -> list[Any]:
        """A completion's prompts: a list of texts or of id lists is several (vLLM serves
        each, and answers them as one response's choices); any other ``prompt`` is one."""
        prompt = self.body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            return prompt
        return [prompt]

    @property
    def batch(self) -> bool:
        """Several prompts: routed by the first, though the engine serves them all."""
        return len(self.prompts) > 1

    def with_cache_salt(self, salt: str) -> ClientRequest:
        """This request with ``cache_salt`` set: the engine then keys its cache blocks by it
        (vLLM hashes it into the first block), as the index's chain root does."""
        body = {**self.body, "cache_salt": salt}
        return replace(self, body=body, raw=json.dumps(body, separators=(",", ":")).encode())

    def with_prompt_ids(self, tokens: list[int]) -> ClientRequest:
        """This request with ``prompt`` replaced by ``tokens``: the ids through msgspec (far
        faster than json on a long prompt's ids; bench.router_overhead times the router), the
        other fields as ``json`` writes them (a NaN the client sent stays a NaN, where msgspec
        would write null)."""
        rest = json.dumps(
            {k: v for k, v in self.body.items() if k != "prompt"}, separators=(",", ":")
        )
        ids = b'{"prompt":' + msgspec.json.encode(tokens)
        raw = ids + b"}" if rest == "{}" else ids + b"," + rest[1:].encode()
        return replace(self, body={**self.body, "prompt": tokens}, raw=raw)


async def read_completion(
    request: web.Request, limits: LimitsSection, authorization: str | None
) -> ClientRequest:
    """A completion or chat request: a JSON object (``read_json_object``) with the fields
    the router reads of the right types (400 naming the field). Without a ``model`` it is
    the default model's, as vLLM serves it. ``authorization``: the header the engine gets
    (None: none)."""
    body, raw = await read_json_object(request, limits)
    _check_types(body, (("model", str), ("stream", bool), ("max_tokens", int), ("cache_salt", str)))
    if not _utf8(body.get("cache_salt") or ""):  # the salt is hashed as UTF-8
        raise ApiError(400, "`cache_salt` must be valid Unicode text", param="cache_salt")
    return _client_request(request, Endpoint.of_path(request.path), body, raw, authorization)


async def read_tokenize(
    request: web.Request, limits: LimitsSection, authorization: str | None
) -> ClientRequest:
    """vLLM's ``/tokenize`` request: a chat's (``messages``) or a ``prompt``; a 400 unless it
    gives exactly one of them. ``authorization``: the header the engine gets."""
    body, raw = await read_json_object(request, limits)
    _check_types(body, (("model", str),))
    has_prompt, has_messages = body.get("prompt") is not None, body.get("messages") is not None
    if has_prompt == has_messages:
        param = "messages" if has_prompt else "prompt"
        raise ApiError(400, "give exactly one of `prompt` and `messages`", param=param)
    endpoint = Endpoint.CHAT if has_messages else Endpoint.COMPLETIONS
    return _client_request(request, endpoint, body, raw, authorization)


def _client_request(
    request: web.Request,
    endpoint: Endpoint,
    body: dict[str, Any],
    raw: bytes,
    authorization: str | None,
) -> ClientRequest:
    forwarded = {k: v for k in FORWARDED_HEADERS if (v := request.headers.get(k))}
    if authorization:
        forwarded["Authorization"] = authorization
    return ClientRequest(endpoint, body, raw, forwarded)


async def read_json_object(
    request: web.Request, limits: LimitsSection
) -> tuple[dict[str, Any], bytes]:
    """The request's JSON object, within the limits: bytes (413), values and depth (400,
    ``param`` "body" as vLLM names a body's errors), read time (408). Values are counted
    before parsing, so no body holds the event loop longer than parsing ``max_json_items``
    values takes."""
    max_bytes = limits.max_body_bytes
    if request.content_length is not None and request.content_length > max_bytes:
        raise ApiError(413, f"request body over {max_bytes} bytes")
    try:
        async with asyncio.timeout(limits.body_read_timeout_seconds):
            raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise ApiError(413, f"request body over {max_bytes} bytes") from None
    except TimeoutError:
        message = f"request body not received within {limits.body_read_timeout_seconds}s"
        raise ApiError(408, message) from None
    if raw.count(b",") >= limits.max_json_items:
        raise ApiError(
            400, f"request body has over {limits.max_json_items} JSON values", param="body"
        )
    too_deep = ApiError(
        400, f"request body is nested deeper than {limits.max_json_depth} levels", param="body"
    )
    try:
        body = _loads(raw)
    except RecursionError:  # nested past the interpreter's limit: over ours too
        raise too_deep from None
    except ValueError:
        raise ApiError(400, "request body is not valid JSON", param="body") from None
    brackets = raw.count(b"[") + raw.count(b"{")  # a body with few cannot nest deeply
    if brackets > limits.max_json_depth and _deeper_than(body, limits.max_json_depth):
        raise too_deep
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object", param="body")
    return body, raw


def _check_types(body: dict[str, Any], fields: Iterable[tuple[str, type]]) -> None:
    """Each of ``fields`` the body sets (not null) is of its type; else a 400 naming it."""
    for key, kind in fields:
        if key in body and body[key] is not None and not isinstance(body[key], kind):
            raise ApiError(400, f"`{key}` must be a {kind.__name__}", param=key)


def _utf8(text: str) -> bool:
    """Whether ``text`` encodes as UTF-8 (JSON escapes allow lone surrogates; UTF-8 does not)."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def _loads(raw: bytes) -> Any:
    """``json.loads``, through msgspec (several times faster on token lists) when it can:
    what msgspec refuses (NaN, huge numbers, lone surrogates, deep nesting) takes the
    standard parser, so every body means what it meant."""
    try:
        return msgspec.json.decode(raw)
    except (msgspec.MsgspecError, RecursionError):
        return json.loads(raw)


def _deeper_than(value: Any, limit: int) -> bool:
    """Whether JSON ``value`` nests more than ``limit`` levels (iteratively: no recursion)."""
    stack: list[tuple[Iterable[Any], int]] = [([value], 0)]
    while stack:
        children, depth = stack.pop()
        for child in children:
            if isinstance(child, dict | list):
                if depth + 1 > limit:
                    return True
                stack.append((child.values() if isinstance(child, dict) else child, depth + 1))
    return False
