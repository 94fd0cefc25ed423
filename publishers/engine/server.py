"""The simulator's HTTP API: the parts of ``vllm serve`` a router and its clients touch.

Routes and shapes follow vLLM's OpenAI server, so a router, benchmark or proxy written for
vLLM works against the simulator unchanged: ``/v1/completions`` and ``/v1/chat/completions``
(JSON and SSE), their scale-out ``/render`` twins (403 without ``--enable-scale-out``, as
vLLM), ``/v1/models``, ``/tokenize``, ``/detokenize``, ``/health``, ``/ping``, ``/version``,
``/load``, ``/kv_event_sources``, ``/metrics`` (``metrics.py``) and the dev endpoint
``/reset_prefix_cache``. Errors are vLLM's ``{"error": {message, type, param, code}}``; an
unknown route or a wrong method gets FastAPI's ``{"detail": ...}`` 404 or 405. Every shape
is pinned against a real vLLM 0.32's answer to the same request. Imitating SGLang
(``ServerSettings.engine``), the cache is flushed by SGLang's ``/flush_cache`` instead, and
the usage report is SGLang's (with ``reasoning_tokens``), pinned against SGLang 0.5.23.

Disaggregation follows vLLM's NIXL connector as the upstream proxy drives it:
``kv_transfer_params.do_remote_decode`` makes a request a prefill — one token, blocks kept,
and the answer carries the ``kv_transfer_params`` the decode instance needs;
``do_remote_prefill`` makes it a decode that loads the prompt's KV instead of computing it.
Where NIXL's decode side reads the blocks and notifies the prefill side over its side
channel, the simulator's decode side POSTs ``/sim/kv_transfer/release`` to ``remote_host``:
``remote_port`` (the prefill simulator's HTTP address), which frees the held blocks.

Each response carries ``x-engine-instance-id`` and, once the first token exists,
``x-engine-ttft-ms``: the request's TTFT on the engine's *model clock* (queueing included,
not scaled by ``--sim-time-scale``) — what the modeled GPU would have taken.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp
import xxhash
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from conductor.failures import describe

from .block_hash import Engine
from .loop import EngineError, EngineLoop, RequestStream
from .metrics import EngineMetrics
from .scheduler import EngineRequest
from .tokenizer import EngineTokenizer

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 16
MAX_BODY_BYTES = 64 * 1024 * 1024  # a 128k-token prompt as a JSON id list is ~1 MB
RELEASE_TIMEOUT_SECONDS = 2.0
VLLM_VERSION = "0.32.0"  # the vLLM whose answers the simulator's are pinned against
ERROR_TYPES = {
    400: "BadRequestError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    409: "ConflictError",
    503: "ServiceUnavailableError",
}
SGLANG_FLUSHED = (  # SGLang's answers to /flush_cache
    "Cache flushed.\nPlease check backend logs for more details. (When there are running or "
    "waiting requests, the operation will not be performed.)\n"
)
SGLANG_NOT_FLUSHED = "Flush cache failed.\n"
SCALE_OUT_DISABLED = (
    "Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out to enable them."
)


@dataclass(frozen=True, slots=True)
class ServerSettings:
    served_model_names: tuple[str, ...]
    max_model_len: int
    instance_id: str  # also the ``remote_engine_id`` of prefills
    remote_host: str  # where decode simulators reach this one's HTTP API to release blocks
    remote_port: int
    data_parallel_rank: int = 0
    enable_scale_out: bool = False  # serve the render endpoints (vLLM's flag)
    kv_events_config: dict[str, Any] | None = None  # as bound; None without events
    engine: Engine = "vllm"  # whose cache flush and usage report the API has
    system_fingerprint: str = field(init=False)

    def __post_init__(self) -> None:
        """vLLM's ``vllm-<version>-<config hash>``: stable for one configuration."""
        digest = xxhash.xxh32_hexdigest(
            repr((self.served_model_names, self.max_model_len)).encode()
        )
        object.__setattr__(self, "system_fingerprint", f"vllm-{VLLM_VERSION}-{digest}")


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def response(self) -> web.Response:
        error = {
            "message": self.message,
            "type": ERROR_TYPES.get(self.status, "InternalServerError"),
            "param": self.param,
            "code": self.status,
        }
        return web.json_response({"error": error}, status=self.status)


# -- request bodies -----------------------------------------------------------------------


class _Body(BaseModel):
    """Wrong JSON types are 400s; unknown fields (temperature, seed, ...) are ignored."""

    model_config = ConfigDict(strict=True, extra="ignore")


class KVTransferParams(_Body):
    """vLLM NIXL connector's fields; the simulator reads only a few of them."""

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_engine_id: str | None = None
    remote_request_id: str | None = None
    remote_block_ids: list[int] | None = None
    remote_host: str | None = None
    remote_port: int | None = None
    tp_size: int = 1

    @model_validator(mode="after")
    def _one_side(self) -> KVTransferParams:
        if self.do_remote_decode and self.do_remote_prefill:
            raise ValueError("do_remote_decode and do_remote_prefill exclude each other")
        return self


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class ChatMessage(_Body):
    model_config = ConfigDict(extra="allow")  # name, tool_calls...: ignored by the template
    role: str
    content: str | list[dict[str, Any]] | None = None


class _GenerationBody(_Body):
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    n: int = Field(default=1, ge=1, le=1)  # one choice only: refuse rather than ignore n > 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    cache_salt: str | None = None
    kv_transfer_params: KVTransferParams | None = None
    # sampling: the simulator samples greedily whatever they say; render echoes them
    temperature: float = 1.0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        return [stop for stop in stops if stop]

    def sampling_params(self, max_tokens: int | None) -> dict[str, Any]:
        """vLLM's SamplingParams as render serializes them: greedy drops top_p and min_p,
        unset seed and max_tokens are left out, streaming asks for deltas."""
        params: dict[str, Any] = {
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
            "temperature": self.temperature,
        }
        if self.temperature != 0:
            params |= {"top_p": self.top_p, "min_p": self.min_p}
        if self.seed is not None:
            params["seed"] = self.seed
        params |= {"stop": self.stops(), "stop_token_ids": []}
        if max_tokens is not None:
            params["max_tokens"] = max_tokens
        params |= {"output_kind": 1 if self.stream else 2, "skip_clone": True}
        if self.kv_transfer_params is not None:
            transfer = self.kv_transfer_params.model_dump(exclude_unset=True)
            params["extra_args"] = {"kv_transfer_params": transfer}
        return params | {"bad_words": [], "skip_reading_prefix_cache": False}


class CompletionBody(_GenerationBody):
    prompt: str | list[int]


class ChatCompletionBody(_GenerationBody):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    add_generation_prompt: bool = True


class TokenizeBody(_Body):
    """vLLM's TokenizeCompletionRequest or TokenizeChatRequest (one of prompt, messages)."""

    model: str | None = None
    prompt: str | list[int] | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeBody:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' and 'messages'")
        return self


class DetokenizeBody(_Body):
    model: str | None = None
    tokens: list[int]


class ReleaseBody(_Body):
    remote_request_id: str
    remote_engine_id: str | None = None


B = TypeVar("B", bound=BaseModel)


async def _parse(request: web.Request, model: type[B]) -> B:
    try:
        return model.model_validate_json(await request.read())
    except ValidationError as error:
        problems = error.errors(include_url=False)
        message = "; ".join(
            f"{'.'.join(map(str, p['loc'])) or 'body'}: {p['msg']}" for p in problems
        )
        location = problems[0]["loc"]
        param = str(location[0]) if location else "body"  # the field, not the union branch
        raise ApiError(400, message, param) from None


async def _parse_render(request: web.Request, settings: ServerSettings, model: type[B]) -> B:
    """vLLM registers the render routes either way; without scale-out they answer 403."""
    if not settings.enable_scale_out:
        raise ApiError(403, SCALE_OUT_DISABLED)
    return await _parse(request, model)


# -- response shapes ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Shape:
    """Where completions and chat completions differ: ids, object names, the choice and the
    fields vLLM 0.32 adds (null unless asked for: token ids, logprobs, reasoning ...)."""

    id_prefix: str
    object: str
    chunk_object: str
    chat: bool

    def choice(self, text: str, finish: str | None, stop: str | None, chunk: bool) -> dict:
        common = {"index": 0}
        tail = {"logprobs": None, "finish_reason": finish, "stop_reason": stop}
        if not self.chat:
            extra = ("prompt_token_ids", "token_ids") if chunk else _COMPLETION_CHOICE_NULLS
            return common | {"text": text} | tail | dict.fromkeys(extra)
        if chunk:
            if finish is None:  # vLLM names the stop reason in the last chunk only
                del tail["stop_reason"]
            return common | {"delta": {"content": text}} | tail | {"token_ids": None}
        message = {"role": "assistant", "content": text} | dict.fromkeys(_MESSAGE_NULLS)
        return common | {"message": message} | tail | dict.fromkeys(_CHAT_CHOICE_NULLS)

    def answer_nulls(self) -> dict[str, None]:
        """Top-level fields of a whole answer that the simulator always leaves null."""
        return dict.fromkeys(_CHAT_ANSWER_NULLS if self.chat else ()) | dict.fromkeys(
            ("service_tier", "ec_transfer_params", "metrics")
        )


_COMPLETION_CHOICE_NULLS = ("token_ids", "prompt_logprobs", "prompt_token_ids", "routed_experts")
_CHAT_CHOICE_NULLS = ("token_ids", "routed_experts")
_MESSAGE_NULLS = ("refusal", "annotations", "audio", "function_call", "reasoning")
_CHAT_ANSWER_NULLS = ("prompt_logprobs", "prompt_token_ids", "prompt_text")
COMPLETION = _Shape("cmpl-", "text_completion", "text_completion", chat=False)
CHAT = _Shape("chatcmpl-", "chat.completion", "chat.completion.chunk", chat=True)


def _usage(
    request: EngineRequest, completion_tokens: int, chunk: bool, engine: Engine
) -> dict[str, Any]:
    """Token counts; cached tokens always, as vLLM with ``--enable-prompt-tokens-details``
    and SGLang with ``--enable-cache-report`` (whose ``UsageInfo`` has every field)."""
    prompt_tokens = len(request.prompt_token_ids)
    usage: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": {"cached_tokens": request.num_cached_tokens},
    }
    if engine == "sglang":
        return usage | {"reasoning_tokens": 0, "completion_tokens_details": None}
    return usage if chunk else usage | {"completion_tokens_details": None}


def _model_permission(created: int) -> dict[str, Any]:
    """vLLM's (OpenAI's legacy) permission entry of ``/v1/models``: everything but fine-tuning."""
    return {
        "id": f"modelperm-{uuid.uuid4().hex[:16]}",
        "object": "model_permission",
        "created": created,
        "allow_create_engine": False,
        "allow_sampling": True,
        "allow_logprobs": True,
        "allow_search_indices": False,
        "allow_view": True,
        "allow_fine_tuning": False,
        "organization": "*",
        "group": None,
        "is_blocking": False,
    }


def _ttft_header(request: EngineRequest) -> dict[str, str]:
    ttft = request.ttft
    return {} if ttft is None else {"x-engine-ttft-ms": f"{ttft * 1000:.3f}"}


def _sse(payload: object) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


class _Generation:
    """A request's text, token by token, cut at the first stop string."""

    def __init__(self, stream: RequestStream, tokenizer: EngineTokenizer, stops: list[str]) -> None:
        self.stream = stream
        self.request = stream.request
        self.text = ""
        self.num_tokens = 0
        self.finish_reason: str | None = None
        self.stop_reason: str | None = None
        self._tokenizer = tokenizer
        self._stops = stops

    async def deltas(self) -> AsyncIterator[str]:
        """The text each token adds; ``finish_reason`` is set when the last one is yielded."""
        async for token in self.stream:
            self.num_tokens += 1
            start = len(self.text)
            self.text += self._tokenizer.decode([token])
            cut = self._first_stop(start)
            if cut is not None:
                self.text = self.text[:cut]
                self.finish_reason = "stop"
                yield self.text[start:]
                return
            if self.stream.drained:
                self.finish_reason = self.request.finish_reason
            yield self.text[start:]

    def _first_stop(self, start: int) -> int | None:
        """Where the earliest stop string that ends in the new text begins."""
        found = []
        for stop in self._stops:
            at = self.text.find(stop, max(0, start - len(stop) + 1))
            if at >= 0:
                found.append((at, stop))
        if not found:
            return None
        at, self.stop_reason = min(found)
        return at


# -- handlers -----------------------------------------------------------------------------


class EngineApi:
    def __init__(
        self,
        engine: EngineLoop,
        tokenizer: EngineTokenizer,
        settings: ServerSettings,
        metrics: EngineMetrics,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.settings = settings
        self.engine_metrics = metrics
        self.client: aiohttp.ClientSession | None = None  # for release calls, set at startup
        self._background: set[asyncio.Task[None]] = set()

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await _parse(request, CompletionBody)
        prompt = body.prompt
        token_ids = self.tokenizer.encode_prompt(prompt) if isinstance(prompt, str) else prompt
        return await self._generate(request, body, token_ids, body.max_tokens, COMPLETION)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = await _parse(request, ChatCompletionBody)
        token_ids = self._chat_tokens(body.messages, body.add_generation_prompt)
        max_tokens = body.max_completion_tokens or body.max_tokens
        return await self._generate(request, body, token_ids, max_tokens, CHAT)

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await _parse(request, TokenizeBody)
        self._check_model(body.model)
        if body.messages is not None:
            tokens = self._chat_tokens(body.messages, body.add_generation_prompt)
        elif isinstance(body.prompt, str):
            tokens = self.tokenizer.encode_prompt(body.prompt)
        else:
            tokens = list(body.prompt or [])
        return web.json_response(
            {
                "count": len(tokens),
                "max_model_len": self.settings.max_model_len,
                "tokens": tokens,
                "token_strs": None,
            }
        )

    async def models(self, request: web.Request) -> web.Response:
        created = int(time.time())
        data = [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "vllm",
                "root": name,
                "parent": None,
                "max_model_len": self.settings.max_model_len,
                "permission": [_model_permission(created)],
            }
            for name in self.settings.served_model_names
        ]
        return web.json_response({"object": "list", "data": data})

    async def health(self, request: web.Request) -> web.Response:
        return web.Response()

    async def metrics(self, request: web.Request) -> web.Response:
        body = generate_latest(self.engine_metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": VLLM_VERSION})

    async def load(self, request: web.Request) -> web.Response:
        """Requests in the engine: what vLLM counts with ``--enable-server-load-tracking``."""
        scheduler = self.engine.scheduler
        return web.json_response({"server_load": len(scheduler.running) + len(scheduler.waiting)})

    async def kv_event_sources(self, request: web.Request) -> web.Response:
        """Where this engine publishes KV events, by DP rank: how a consumer finds them."""
        config = self.settings.kv_events_config
        rank = str(self.settings.data_parallel_rank)
        return web.json_response({} if config is None else {rank: config})

    async def detokenize(self, request: web.Request) -> web.Response:
        body = await _parse(request, DetokenizeBody)
        self._check_model(body.model)
        out_of_vocabulary = [t for t in body.tokens if not 0 <= t < self.tokenizer.vocab_size]
        if out_of_vocabulary:
            raise ApiError(400, f"Token id {out_of_vocabulary[0]} is out of vocabulary", "tokens")
        return web.json_response({"prompt": self.tokenizer.decode(body.tokens)})

    async def render_completion(self, request: web.Request) -> web.Response:
        """vLLM's scale-out render: the token-in request a ``/generate`` server would take."""
        body = await _parse_render(request, self.settings, CompletionBody)
        prompt = body.prompt
        token_ids = self.tokenizer.encode_prompt(prompt) if isinstance(prompt, str) else prompt
        if not token_ids:
            raise ApiError(400, "Either prompt or prompt_embeds must be provided and non-empty.",
                           "prompt")  # fmt: skip
        return web.json_response([self._rendered(body, token_ids, body.max_tokens, COMPLETION)])

    async def render_chat(self, request: web.Request) -> web.Response:
        body = await _parse_render(request, self.settings, ChatCompletionBody)
        token_ids = self._chat_tokens(body.messages, body.add_generation_prompt)
        max_tokens = body.max_completion_tokens or body.max_tokens
        return web.json_response(self._rendered(body, token_ids, max_tokens, CHAT))

    def _rendered(
        self, body: _GenerationBody, token_ids: list[int], max_tokens: int | None, shape: _Shape
    ) -> dict[str, Any]:
        """vLLM's ``GenerateRequest``; what the simulator cannot have (features) is null, and
        ``model`` is the request's, null when it named none."""
        self._check_model(body.model)
        options = body.stream_options
        nulls = ("token_offsets", "features", "content_parts")
        late_nulls = ("reasoning_ended", "reasoning_parser_kwargs", "return_token_ids")
        return (
            {"request_id": shape.id_prefix + uuid.uuid4().hex[:16], "token_ids": token_ids}
            | dict.fromkeys(nulls)
            | {"sampling_params": body.sampling_params(max_tokens), "model": body.model}
            | dict.fromkeys(late_nulls)
            | {
                "output_mode": "tokens",
                "stream": body.stream,
                "stream_options": None if options is None else options.model_dump(),
                "cache_salt": body.cache_salt,
                "priority": 0,
                "kv_transfer_params": None,  # vLLM carries them in sampling_params.extra_args
                "ec_transfer_params": None,
            }
        )

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        if not self.engine.reset_prefix_cache():
            raise ApiError(409, "cannot reset the prefix cache while requests hold KV blocks")
        return web.Response()

    async def flush_cache(self, request: web.Request) -> web.Response:
        """SGLang's: an idle engine drops its cache (AllBlocksCleared); a busy one refuses."""
        if self.engine.reset_prefix_cache():
            return web.Response(text=SGLANG_FLUSHED)
        return web.Response(text=SGLANG_NOT_FLUSHED, status=400)

    async def release_kv(self, request: web.Request) -> web.Response:
        """The decode side has the prefill's KV (NIXL's notification): free the blocks."""
        body = await _parse(request, ReleaseBody)
        engine_id = body.remote_engine_id
        if engine_id not in (None, self.settings.instance_id) or not self.engine.release(
            body.remote_request_id
        ):
            raise ApiError(404, f"no KV held for request {body.remote_request_id!r}")
        return web.json_response({"released": True})

    # -- generation -----------------------------------------------------------------------

    async def _generate(
        self,
        http_request: web.Request,
        body: _GenerationBody,
        token_ids: list[int],
        max_tokens: int | None,
        shape: _Shape,
    ) -> web.StreamResponse:
        model = self._check_model(body.model)
        transfer = body.kv_transfer_params or KVTransferParams()
        if transfer.do_remote_decode and body.stream:  # its answer carries the transfer params
            raise ApiError(400, "kv_transfer_params.do_remote_decode needs stream=false", "stream")
        max_tokens = 1 if transfer.do_remote_decode else max_tokens or DEFAULT_MAX_TOKENS
        self._check_prompt(token_ids, max_tokens)
        request = EngineRequest(
            request_id=uuid.uuid4().hex,
            prompt_token_ids=token_ids,
            max_tokens=max_tokens,
            cache_salt=body.cache_salt or None,
            remote_prefill=transfer.do_remote_prefill,
            keep_blocks=transfer.do_remote_decode,
        )
        generation = _Generation(self.engine.submit(request), self.tokenizer, body.stops())
        header = {
            "id": shape.id_prefix + request.request_id,
            "created": int(time.time()),
            "model": model,
        }
        try:
            deltas = generation.deltas()
            first = await anext(deltas)  # nothing is sent before it: errors stay clean
            self._first_token(request, transfer)
            if body.stream:
                options = body.stream_options
                usage = options is not None and options.include_usage
                return await self._stream(
                    http_request, generation, deltas, first, header, shape, usage
                )
            async for _ in deltas:
                pass
            choice = shape.choice(
                generation.text, generation.finish_reason, generation.stop_reason, chunk=False
            )
            answer = (
                header
                | shape.answer_nulls()
                | {
                    "object": shape.object,
                    "choices": [choice],
                    "system_fingerprint": self.settings.system_fingerprint,
                    "usage": _usage(request, generation.num_tokens, False, self.settings.engine),
                    "kv_transfer_params": self._transfer_answer(request),
                }
            )
            return web.json_response(answer, headers=_ttft_header(request))
        except EngineError as error:  # before any byte was sent: rejected, or shutting down
            raise ApiError(400 if request.finish_reason == "error" else 503, str(error)) from None
        finally:  # a no-op once finished; frees blocks of a stopped or dropped request
            self.engine.abort(request, "stop" if generation.finish_reason == "stop" else "abort")

    def _first_token(self, request: EngineRequest, transfer: KVTransferParams) -> None:
        """A decode has its KV now, so its prefill side may free it."""
        if transfer.do_remote_prefill:
            self._release_remote(transfer)

    async def _stream(
        self,
        http_request: web.Request,
        generation: _Generation,
        deltas: AsyncIterator[str],
        first: str,
        header: dict[str, Any],
        shape: _Shape,
        include_usage: bool,
    ) -> web.StreamResponse:
        """SSE chunks as vLLM sends them; headers go out with the first token (and its TTFT)."""
        request = generation.request
        headers = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        response = web.StreamResponse(headers=headers | _ttft_header(request))
        await response.prepare(http_request)
        header = header | {"object": shape.chunk_object}

        async def send(text: str, finish: str | None) -> None:
            choice = shape.choice(text, finish, generation.stop_reason, chunk=True)
            await response.write(_sse(header | {"choices": [choice]}))

        if shape.chat:  # the role first, with the prompt fields vLLM leaves null
            role = {"index": 0, "delta": {"role": "assistant", "content": ""}}
            choice = role | {"logprobs": None, "finish_reason": None}
            prompt_nulls = dict.fromkeys(("prompt_token_ids", "prompt_text"))
            await response.write(_sse(header | {"choices": [choice]} | prompt_nulls))
        await send(first, generation.finish_reason)
        try:
            async for text in deltas:
                await send(text, generation.finish_reason)
        except EngineError as error:  # shutdown mid-stream: say so, then end the stream
            await response.write(_sse({"error": {"message": str(error), "code": 503}}))
        if include_usage:
            usage = _usage(request, generation.num_tokens, True, self.settings.engine)
            fingerprint = self.settings.system_fingerprint
            last = {"choices": [], "usage": usage, "system_fingerprint": fingerprint}
            await response.write(_sse(header | last))
        await response.write(_sse("[DONE]"))
        await response.write_eof()
        return response

    def _check_model(self, model: str | None) -> str:
        names = self.settings.served_model_names
        if model is None:
            return names[0]
        if model not in names:
            raise ApiError(404, f"The model `{model}` does not exist.", "model")
        return model

    def _check_prompt(self, token_ids: list[int], max_tokens: int) -> None:
        if not token_ids:
            raise ApiError(400, "The decoder prompt cannot be empty", "prompt")
        out_of_vocabulary = [t for t in token_ids if not 0 <= t < self.tokenizer.vocab_size]
        if out_of_vocabulary:
            raise ApiError(400, f"Token id {out_of_vocabulary[0]} is out of vocabulary", "prompt")
        total = len(token_ids) + max_tokens
        limit = self.settings.max_model_len
        if total > limit:
            raise ApiError(
                400,
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {total} tokens ({len(token_ids)} in the messages, {max_tokens} "
                "in the completion). Please reduce the length of the messages or completion.",
                "max_tokens",
            )
        problem = self.engine.scheduler.capacity_problem(len(token_ids), max_tokens)
        if problem is not None:
            raise ApiError(400, f"{problem}: the request could never run", "max_tokens")

    def _chat_tokens(self, messages: list[ChatMessage], add_generation_prompt: bool) -> list[int]:
        try:
            return self.tokenizer.chat_prompt(
                [message.model_dump() for message in messages], add_generation_prompt
            )
        except ValueError as error:
            raise ApiError(400, str(error), "messages") from None

    def _transfer_answer(self, request: EngineRequest) -> dict[str, Any] | None:
        """What the decode instance needs (vLLM NIXL's names), for a remote-decode prefill.

        ``remote_block_ids`` are the prompt's block hashes: the block manager does not
        expose its GPU block ids, and no simulator reads them.
        """
        if not request.keep_blocks:
            return None
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.settings.instance_id,
            "remote_request_id": request.request_id,
            "remote_block_ids": list(request.block_hashes),
            "remote_host": self.settings.remote_host,
            "remote_port": self.settings.remote_port,
            "tp_size": 1,
        }

    def _release_remote(self, transfer: KVTransferParams) -> None:
        """Tell the prefill simulator its KV arrived (fire and forget, as a notification)."""
        if not (transfer.remote_host and transfer.remote_port and transfer.remote_request_id):
            return
        host = transfer.remote_host
        host = f"[{host}]" if ":" in host else host
        url = f"http://{host}:{transfer.remote_port}/sim/kv_transfer/release"
        body = {
            "remote_request_id": transfer.remote_request_id,
            "remote_engine_id": transfer.remote_engine_id,
        }
        task = asyncio.create_task(self._post_release(url, body))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _post_release(self, url: str, body: dict[str, Any]) -> None:
        assert self.client is not None
        try:
            async with self.client.post(url, json=body) as response:
                if response.status != 200:
                    log.warning("kv release refused url=%s status=%d", url, response.status)
        except (aiohttp.ClientError, TimeoutError) as error:
            log.warning("kv release failed url=%s error=%s", url, describe(error))

    async def release_client(self, app: web.Application) -> AsyncIterator[None]:
        """``cleanup_ctx``: the session for release calls, open while the app runs; at the
        end, calls still under way are cancelled."""
        self.client = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=RELEASE_TIMEOUT_SECONDS)
        )
        yield
        for task in self._background:
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        await self.client.close()


@web.middleware
async def _errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as error:
        return error.response()
    except web.HTTPNotFound:
        return web.json_response({"detail": "Not Found"}, status=404)  # FastAPI's
    except web.HTTPMethodNotAllowed as error:
        headers = {"Allow": error.headers["Allow"]}
        return web.json_response({"detail": "Method Not Allowed"}, status=405, headers=headers)


def create_app(
    engine: EngineLoop, tokenizer: EngineTokenizer, settings: ServerSettings, metrics: EngineMetrics
) -> web.Application:
    """The aiohttp app; the engine loop's lifecycle is the caller's (``__main__``)."""
    api = EngineApi(engine, tokenizer, settings, metrics)
    app = web.Application(middlewares=[_errors], client_max_size=MAX_BODY_BYTES)

    async def identify(request: web.Request, response: web.StreamResponse) -> None:
        response.headers["x-engine-instance-id"] = settings.instance_id

    app.on_response_prepare.append(identify)
    app.cleanup_ctx.append(api.release_client)
    app.router.add_post("/v1/completions", api.completions)
    app.router.add_post("/v1/chat/completions", api.chat_completions)
    app.router.add_get("/v1/models", api.models)
    app.router.add_post("/v1/completions/render", api.render_completion)
    app.router.add_post("/v1/chat/completions/render", api.render_chat)
    app.router.add_post("/tokenize", api.tokenize)
    app.router.add_post("/detokenize", api.detokenize)
    app.router.add_get("/health", api.health)
    app.router.add_route("GET", "/ping", api.health)
    app.router.add_route("POST", "/ping", api.health)
    app.router.add_route("*", "/metrics", api.metrics)  # vLLM mounts an app: any method
    app.router.add_get("/version", api.version)
    app.router.add_get("/load", api.load)
    app.router.add_get("/kv_event_sources", api.kv_event_sources)
    if settings.engine == "sglang":
        app.router.add_route("GET", "/flush_cache", api.flush_cache)
        app.router.add_route("POST", "/flush_cache", api.flush_cache)
    else:
        app.router.add_post("/reset_prefix_cache", api.reset_prefix_cache)
    app.router.add_post("/sim/kv_transfer/release", api.release_kv)
    return app
