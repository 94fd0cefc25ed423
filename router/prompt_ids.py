"""Stage 2 of a request: the prompt's token ids, and where they came from.

Ids given in the request are taken as they are. Otherwise the router's own tokenizer
(``tokenizer.LocalTokenizer``, the model directory's HF tokenizer and chat template) encodes
the prompt, on each endpoint once an engine's ``/tokenize`` agreed with it on probe prompts
(``verify``, run by the background upkeep); else an engine's ``/tokenize`` is asked (a slow
one is a timeout and the next engine is asked, never taken for a dead engine). A completion
whose text the router tokenized goes to the engine as those ids, so it does not tokenize the
prompt a second time. A batch of prompts (a list of texts or of id lists) is routed by its
first and goes to the engine as sent. A prompt the engines' ``/tokenize`` refuses (a 4xx:
an empty chat, a malformed prompt) is routed by load, so the engine's own answer to the
request tells the client what is wrong, as vLLM words it.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import aiohttp
import msgspec

from conductor.failures import describe
from tokenization.tokenizer import (
    InvalidPrompt,
    LocalTokenizer,
    TokenizerUnavailable,
    Unsupported,
    probes,
)

from .client_request import ClientRequest, Endpoint
from .config import LimitsSection, ModelSection, UpstreamSection
from .errors import ApiError, upstream_message
from .index_client import MAX_TOKENS
from .metrics import RouterMetrics
from .pool import InstancePool, Upstream
from .rotation import Rotation
from .sessions import UpstreamSessions

log = logging.getLogger("router.app")  # the router's lines keep their logger (docs/router.md)

TOKENIZED_BY = "x-conductor-tokenized-by"  # the answer's header: given, local, engine, none
TOKENIZE_ATTEMPTS = 3  # engines asked for a prompt's tokens before routing without them
# a body past this many bytes is tokenized in a worker thread (HF tokenizers release the
# GIL): about 5k tokens, a few ms of encoding. A smaller one is encoded on the loop when it
# is the only request being routed (no thread hop); in a burst every one goes to a thread,
# so the encodings run on every core and the loop keeps reading the conductor's answers
INLINE_TOKENIZE_BYTES = 16 * 1024
TOKENIZER_HINT = (
    "set the model's tokenizer.path (models[].tokenizer.path, or --tokenizer) to a directory "
    "holding its tokenizer.json"
)


class _TokenizeAnswer(msgspec.Struct):
    """An engine's ``/tokenize`` answer: the ids (its other fields are not read)."""

    tokens: list[Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKENS)]]


_TOKENIZE_ANSWER = msgspec.json.Decoder(_TokenizeAnswer)


@dataclass(frozen=True, slots=True)
class Tokenized:
    """A request's prompt ids (None: no engine could say), where they came from, and the
    request as the engine gets it (a completion's text as the router's ids)."""

    request: ClientRequest
    tokens: list[int] | None
    by: str  # given, local, engine or none (router_tokenize_total's path)

    @property
    def count(self) -> int:
        return len(self.tokens or ())


class PromptTokenizer:
    """One model's prompts' ids, from its engines (``base``'s instances in the pool)."""

    def __init__(
        self,
        model: ModelSection,
        limits: LimitsSection,
        timeouts: UpstreamSection,
        metrics: RouterMetrics,
        pool: InstancePool,
        sessions: UpstreamSessions,
        rotation: Rotation,
    ) -> None:
        self._settings = model.tokenizer
        self._modelname = model.modelname
        self._max_tokens = limits.max_json_items
        self._timeout_s = timeouts.tokenize_timeout_seconds
        self._metrics = metrics
        self._pool = pool
        self._sessions = sessions
        self._rotation = rotation
        self._tokenizing = 0  # prompts being tokenized by the local tokenizer
        self._turn = itertools.count()  # spreads /tokenize calls over the engines
        self.local: LocalTokenizer | None = None
        self.directory = self._settings.directory(self._modelname)
        # the endpoints whose prompts the local tokenizer encodes: once an engine agreed
        self.trusted: set[Endpoint] = set()
        self._unverified: set[Endpoint] = set()
        self._unloadable: set[Path] = set()  # engines' directories tried in vain, once each
        if self.directory is not None:
            # raises TokenizerUnavailable (a ValueError) for a directory it cannot read
            self._adopt(LocalTokenizer.load(self.directory, self._settings.chunk_cache_tokens))

    def _adopt(self, local: LocalTokenizer) -> None:
        """Tokenize with ``local``: on every endpoint it can render, once verified."""
        self.local = local
        if local.encoder is not None:
            self._metrics.watch_encoder(self._modelname, local.encoder)
        if local.chat_unsupported:
            log.info("chat prompts go to the engines' /tokenize: %s", local.chat_unsupported)
        if not self._settings.verify:
            self.trusted, self._unverified = set(Endpoint), set()
            return
        self._unverified = {Endpoint.COMPLETIONS}
        if not local.chat_unsupported:
            self._unverified.add(Endpoint.CHAT)

    async def find_local(self) -> bool:
        """Without a tokenizer yet: load the one in the model directory an engine of the
        model names (vLLM's ``/v1/models`` card ``root``) when this host can read it. True
        once there is a local tokenizer."""
        if self.local is not None:
            return True
        for root in self._pool.roots(self._modelname):
            directory = Path(root).expanduser()
            if directory in self._unloadable or not (directory / "tokenizer.json").is_file():
                continue
            try:
                local = await asyncio.to_thread(
                    LocalTokenizer.load, directory, self._settings.chunk_cache_tokens
                )
            except TokenizerUnavailable as error:  # said once, not at every round
                self._unloadable.add(directory)
                log.warning("model=%s: cannot load the tokenizer in %s", self._modelname, error)
                continue
            self.directory = directory
            self._adopt(local)
            log.info("model=%s: tokenizer loaded from %s (its engines' model directory)",
                     self._modelname, directory)  # fmt: skip
            self.publish()
            return True
        return False

    def health(self) -> dict[str, Any]:
        """Where this model's prompts' ids come from, for ``/health``; with the setting to
        change when every prompt costs an engine's round trip."""
        answer: dict[str, Any] = {
            "directory": None if self.directory is None else str(self.directory),
            "local": sorted(e.value for e in self.trusted) if self.local is not None else [],
        }
        if self.local is None:
            answer["note"] = f"every prompt is tokenized by an engine; {TOKENIZER_HINT}"
        return answer

    def announce(self) -> None:
        """At start: a model without a tokenizer of its own costs a round trip per prompt."""
        if self.local is None:
            log.warning(
                "model=%s: no tokenizer files found, so every prompt is tokenized by an "
                "engine's /tokenize (a round trip per request) until the engines name a "
                "model directory this host can read; %s",
                self._modelname, TOKENIZER_HINT,
            )  # fmt: skip
        self.publish()

    def publish(self) -> None:
        """``router_local_tokenizer_active``: which endpoints the router tokenizes itself."""
        for endpoint in Endpoint:
            active = self.local is not None and endpoint in self.trusted
            self._metrics.local_tokenizer.labels(endpoint.value, self._modelname).set(active)

    # -- a request's prompt --------------------------------------------------------------
    async def tokenize(self, request: ClientRequest) -> Tokenized:
        """The prompt's token ids and where they came from: given in the request, the
        router's own tokenizer, else a prefill instance's ``/tokenize``; None when no
        instance could say. Counted in ``router_tokenize_total`` and the prompt tokens."""
        tokens, by = await self._ids(request)
        self._metrics.tokenized.labels(by).inc()
        self._metrics.prompt_tokens.inc(len(tokens or ()))
        if tokens is not None and self._forwards_ids(request, by):
            request = request.with_prompt_ids(tokens)
        return Tokenized(request, tokens, by)

    async def _ids(self, request: ClientRequest) -> tuple[list[int] | None, str]:
        """The ids of the prompt the request is routed by: a batch's first (the engine
        gets the batch as sent), or the one prompt."""
        endpoint, body = request.endpoint, request.body
        prompt = request.prompts[0]
        if not endpoint.chat and isinstance(prompt, list) and prompt:
            try:  # checks every id in C: several times faster than a Python loop
                return msgspec.convert(prompt, list[int], strict=True), "given"
            except msgspec.ValidationError:  # not ids, or one past 64 bits (still ids)
                if all(type(t) is int for t in prompt):
                    return prompt, "given"
        if prompt is not body.get("prompt"):  # a batch's first text
            body = {**body, "prompt": prompt}
        if self.local is not None and endpoint in self.trusted:
            try:
                tokens = await self._encode(endpoint, body, len(request.raw))
            except Unsupported as unsupported:
                self._metrics.local_skipped.labels(unsupported.reason).inc()
            except InvalidPrompt as invalid:
                raise ApiError(400, str(invalid), param=_prompt_field(endpoint)) from None
            else:
                self._check_prompt_length(len(tokens))
                return tokens, "local"
        engines_ids = await self._ask_engines(endpoint, body)
        return engines_ids, "none" if engines_ids is None else "engine"

    def _forwards_ids(self, request: ClientRequest, by: str) -> bool:
        """Whether the engine gets the router's ids instead of the prompt's text: saves it
        tokenizing the prompt again (CPU per token on the engine's cores; bench.router_compare
        measured what it costs the engines) where the ids are surely its own. Only for one
        text prompt: vLLM's chat takes no ids, and a batch keeps its other prompts' text."""
        return (
            by == "local"
            and self._settings.forward_token_ids
            and not request.endpoint.chat
            and isinstance(request.body.get("prompt"), str)
            and not request.body.get("echo")
        )

    async def _encode(self, endpoint: Endpoint, body: dict[str, Any], size: int) -> list[int]:
        assert self.local is not None
        self._tokenizing += 1
        try:
            if size <= INLINE_TOKENIZE_BYTES and self._tokenizing == 1:
                return self.local.prompt_ids(endpoint.chat, body)
            return await asyncio.to_thread(self.local.prompt_ids, endpoint.chat, body)
        finally:
            self._tokenizing -= 1

    def _check_prompt_length(self, tokens: int) -> None:
        limit = self._max_tokens
        if tokens >= limit:
            raise ApiError(400, f"the prompt is over the router's limit of {limit} tokens")

    async def _ask_engines(self, endpoint: Endpoint, body: dict[str, Any]) -> list[int] | None:
        """An engine's ids for the prompt; None when none could say, or the engine refused
        it (a 4xx: the request goes on, and the engine's own answer tells the client why)."""
        request: dict[str, Any] = {"model": body.get("model")}
        field = _prompt_field(endpoint)
        request[field] = body.get(field)
        async for _, status, raw in self.engines_tokenize(json.dumps(request).encode(), {}):
            if 400 <= status < 500:
                return None
            tokens = self._ids_in(status, raw)
            if tokens is not None:
                return tokens
        return None

    # -- vLLM's /tokenize ----------------------------------------------------------------
    async def local_answer(self, request: ClientRequest) -> dict[str, Any] | None:
        """vLLM's ``/tokenize`` answer from the local tokenizer; None when it cannot give
        the engines' answer (not trusted on this endpoint, a request it leaves to them, the
        model's ``max_model_len`` unknown)."""
        max_model_len = self._pool.max_model_len(
            request.model or self._modelname
        ) or self._pool.max_model_len(self._modelname)  # an adapter's card may not say
        want_strs = request.body.get("return_token_strs")
        if (
            self.local is None
            or request.endpoint not in self.trusted
            or max_model_len is None
            or not (want_strs is None or type(want_strs) is bool)
        ):
            return None
        try:
            tokens = await self._encode(request.endpoint, request.body, len(request.raw))
        except Unsupported as unsupported:
            self._metrics.local_skipped.labels(unsupported.reason).inc()
            return None
        except InvalidPrompt as invalid:
            raise ApiError(400, str(invalid), param=_prompt_field(request.endpoint)) from None
        return {
            "count": len(tokens),
            "max_model_len": max_model_len,
            "tokens": tokens,
            "token_strs": self.local.token_strs(tokens) if want_strs else None,
        }

    async def engines_tokenize(
        self, payload: bytes, headers: dict[str, str]
    ) -> AsyncIterator[tuple[Upstream, int, bytes]]:
        """Healthy prefill instances' ``/tokenize`` answers (status, body), one at a time,
        at most ``TOKENIZE_ATTEMPTS`` asked. A slow one is counted and skipped, never taken
        for dead; one that refuses the connection is out of rotation until probed."""
        for upstream in self._in_turn()[:TOKENIZE_ATTEMPTS]:
            try:
                status, raw = await self._engine_tokenize(upstream, payload, headers)
            except TimeoutError:
                self._metrics.timeouts.labels(upstream.instance_id, "tokenize").inc()
                continue
            except aiohttp.ClientConnectionError as error:
                self._rotation.take_out(upstream, f"/tokenize: {describe(error)}")
                continue
            except aiohttp.ClientError:
                continue
            yield upstream, status, raw

    async def _engine_tokenize(
        self, upstream: Upstream, payload: bytes, headers: dict[str, str]
    ) -> tuple[int, bytes]:
        """One engine's ``/tokenize`` answer, within the tokenize timeout however the
        engine trickles it."""
        async with asyncio.timeout(self._timeout_s):
            async with self._sessions.to(upstream).post(
                "/tokenize", data=payload, headers={**headers, "Content-Type": "application/json"}
            ) as response:
                return response.status, await response.read()

    def _ids_in(self, status: int, raw: bytes) -> list[int] | None:
        """The token ids of an engine's ``/tokenize`` answer; None for another status or
        an answer of another shape (counted)."""
        if status != 200:
            return None
        self._check_prompt_length(raw.count(b","))
        try:  # parsed and every id checked in C
            return _TOKENIZE_ANSWER.decode(raw).tokens
        except msgspec.MsgspecError:
            self._metrics.rejected("tokenize_answer")
            return None

    def _in_turn(self) -> list[Upstream]:
        """The model's prefill instances in rotation, starting at the next one in turn."""
        base = self._modelname
        healthy = [u for u in self._pool.prefill.values() if u.healthy and u.model == base]
        if not healthy:
            return []
        start = next(self._turn) % len(healthy)
        return healthy[start:] + healthy[:start]

    # -- trusting the local tokenizer ----------------------------------------------------
    async def verify(self) -> bool:
        """One round: an engine's ``/tokenize`` against the local ids on every probe of each
        endpoint not settled yet. Trusted where they all agree; a mismatch (or an engine that
        cannot tokenize chat) leaves that endpoint with the engines for good. True once
        every endpoint is settled."""
        for upstream in self._in_turn()[:1]:
            for endpoint in [e for e in Endpoint if e in self._unverified]:
                verdict = await self._agrees(upstream, endpoint)
                if verdict is not None:
                    self._unverified.discard(endpoint)
                if verdict:
                    self.trusted.add(endpoint)
                    log.info("tokenizing %s prompts in the router", endpoint)
            self.publish()
        return not self._unverified

    async def _agrees(self, upstream: Upstream, endpoint: Endpoint) -> bool | None:
        """Whether ``upstream``'s /tokenize gives the local ids for every probe of the
        endpoint; None when it did not answer (asked again later)."""
        assert self.local is not None
        for chat, body in probes(self.local, self._modelname):
            if chat != endpoint.chat:
                continue
            try:
                engine: Any = await self._tokenize_on(upstream, body)
            except ApiError as error:  # the engine refuses it: so must the router
                engine = error.message
            except (aiohttp.ClientError, TimeoutError, ValueError):
                return None
            if engine is None:
                return None
            try:
                local: Any = self.local.prompt_ids(chat, body)
            except Unsupported as unsupported:
                local = f"unsupported: {unsupported.reason}"
            if engine != local:
                log.warning(
                    "the router's tokenizer disagrees with instance=%s on a %s probe (%s): "
                    "those prompts keep going to the engines' /tokenize",
                    upstream.instance_id, endpoint, _difference(local, engine),
                )  # fmt: skip
                return False
        return True

    async def _tokenize_on(self, upstream: Upstream, request: dict[str, Any]) -> list[int] | None:
        """One engine's ``/tokenize`` ids (``_ids_in``); a refusal (4xx) is an ApiError
        with the engine's message."""
        status, raw = await self._engine_tokenize(upstream, json.dumps(request).encode(), {})
        if 400 <= status < 500:
            raise ApiError(status, upstream_message(raw.decode(errors="replace")))
        return self._ids_in(status, raw)


def _prompt_field(endpoint: Endpoint) -> str:
    """The body field that holds an endpoint's prompt."""
    return "messages" if endpoint.chat else "prompt"


def _difference(local: Any, engine: Any) -> str:
    """Where the router's ids first differ from an engine's answer, for the log."""
    if not isinstance(engine, list) or not isinstance(local, list):
        return f"the router has {local!r:.100}, the engine answered {engine!r:.200}"
    at = next((i for i, (a, b) in enumerate(zip(local, engine, strict=False)) if a != b), None)
    at = min(len(local), len(engine)) if at is None else at
    return (
        f"first difference at token {at}: router {local[at : at + 5]} engine {engine[at : at + 5]}"
    )
