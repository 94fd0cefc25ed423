"""The simulator's HTTP API: the parts of ``vllm serve`` a router and its clients touch.

Routes and shapes follow vLLM's OpenAI server, so a router, benchmark or proxy written for
vLLM works against the simulator unchanged: ``/v1/completions`` and ``/v1/chat/completions``
(JSON and SSE), ``/v1/models``, ``/tokenize``, ``/health``, ``/metrics`` (vLLM's metric names)
and the dev endpoint ``/reset_prefix_cache``. Errors are vLLM's ``{"error": {message, type,
param, code}}``.

Disaggregation follows vLLM's NIXL connector as the upstream proxy drives it (WIRE.md §f):
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
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .scheduler import EngineError, EngineLoop, EngineRequest, RequestStream
from .tokenizer import Tokenizer

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 16
MAX_BODY_BYTES = 64 * 1024 * 1024  # a 128k-token prompt as a JSON id list is ~1 MB
RELEASE_TIMEOUT_SECONDS = 2.0
TTFT_BUCKETS = (  # vLLM's
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    409: "ConflictError",
    503: "ServiceUnavailableError",
}


@dataclass(frozen=True, slots=True)
class ServerSettings:
    served_model_names: tuple[str, ...]
    max_model_len: int
    instance_id: str  # also the ``remote_engine_id`` of prefills
    remote_host: str  # where decode simulators reach this one's HTTP API to release blocks
    remote_port: int
    data_parallel_rank: int = 0


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
    """vLLM NIXL connector's fields (WIRE.md §f); the simulator reads only a few of them."""

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

    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        return [stop for stop in stops if stop]


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
        param = str(location[0]) if location else None  # the field, not the union branch
        raise ApiError(400, message, param) from None


# -- response shapes ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Shape:
    """Where completions and chat completions differ: ids, object names, the choice."""

    id_prefix: str
    object: str
    chunk_object: str
    chat: bool

    def choice(self, text: str, finish: str | None, stop: str | None, chunk: bool) -> dict:
        choice: dict[str, Any] = {"index": 0}
        if not self.chat:
            choice["text"] = text
        elif chunk:
            choice["delta"] = {"content": text}
        else:
            choice["message"] = {"role": "assistant", "content": text, "tool_calls": []}
        return choice | {"logprobs": None, "finish_reason": finish, "stop_reason": stop}


COMPLETION = _Shape("cmpl-", "text_completion", "text_completion", chat=False)
CHAT = _Shape("chatcmpl-", "chat.completion", "chat.completion.chunk", chat=True)


def _usage(request: EngineRequest, completion_tokens: int) -> dict[str, Any]:
    prompt_tokens = len(request.prompt_token_ids)
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": {"cached_tokens": request.num_cached_tokens},
    }


def _ttft_header(request: EngineRequest) -> dict[str, str]:
    ttft = request.ttft
    return {} if ttft is None else {"x-engine-ttft-ms": f"{ttft * 1000:.3f}"}


def _sse(payload: object) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


class _Generation:
    """A request's text, token by token, cut at the first stop string."""

    def __init__(self, stream: RequestStream, tokenizer: Tokenizer, stops: list[str]) -> None:
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


# -- metrics ------------------------------------------------------------------------------


class _EngineCollector(Collector):
    """Engine state read at scrape time, under vLLM's names where vLLM has the metric."""

    def __init__(self, engine: EngineLoop, labels: dict[str, str]) -> None:
        self._engine = engine
        self._labels = labels

    def collect(self) -> Iterable[Metric]:
        scheduler = self._engine.scheduler
        blocks = scheduler.blocks
        stats = blocks.stats
        engine = self._engine
        gauges = (
            ("vllm:num_requests_running", "Requests in the batch", len(scheduler.running)),
            ("vllm:num_requests_waiting", "Requests queued", len(scheduler.waiting)),
            ("vllm:kv_cache_usage_perc", "KV-cache usage, 1 = full", blocks.usage),
            ("vllm:gpu_cache_usage_perc", "KV-cache usage (old name)", blocks.usage),
            ("sim_kv_cache_free_blocks", "GPU blocks free or evictable", blocks.num_free_blocks),
            ("sim_kv_cache_total_blocks", "GPU blocks in the pool", blocks.num_gpu_blocks),
            ("sim_kv_transfer_held_requests", "Prefills awaiting a pull", len(scheduler.held)),
            ("sim_model_clock_seconds", "Simulated GPU time elapsed", scheduler.clock),
        )
        counters = (
            ("vllm:prefix_cache_queries", "Prompt tokens looked up", stats.query_tokens),
            ("vllm:prefix_cache_hits", "Prompt tokens hit on the GPU", stats.gpu_hit_tokens),
            ("vllm:num_preemptions", "Preemptions", scheduler.num_preemptions),
            ("vllm:generation_tokens", "Generated tokens", scheduler.num_generated_tokens),
            ("sim_cpu_prefix_cache_hits", "Prompt tokens hit on the CPU", stats.cpu_hit_tokens),
            ("sim_kv_event_batches", "KV-event batches published", engine.num_batches_published),
        )
        names, values = list(self._labels), list(self._labels.values())
        for family, rows in ((GaugeMetricFamily, gauges), (CounterMetricFamily, counters)):
            for name, documentation, value in rows:
                metric = family(name, documentation, labels=names)
                metric.add_metric(values, value)
                yield metric


# -- handlers -----------------------------------------------------------------------------


class EngineApi:
    def __init__(self, engine: EngineLoop, tokenizer: Tokenizer, settings: ServerSettings) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.settings = settings
        self.client: aiohttp.ClientSession | None = None  # for release calls, set at startup
        self._background: set[asyncio.Task[None]] = set()
        self.registry = CollectorRegistry(auto_describe=True)
        labels = {
            "model_name": settings.served_model_names[0],
            "engine": str(settings.data_parallel_rank),  # vLLM: the engine (DP) index
        }
        self.registry.register(_EngineCollector(engine, labels))
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time to first token on the model clock",
            list(labels),
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        ).labels(**labels)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await _parse(request, CompletionBody)
        prompt = body.prompt
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
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
            tokens = self.tokenizer.encode(body.prompt)
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
            }
            for name in self.settings.served_model_names
        ]
        return web.json_response({"object": "list", "data": data})

    async def health(self, request: web.Request) -> web.Response:
        return web.Response()

    async def metrics(self, request: web.Request) -> web.Response:
        body = generate_latest(self.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        if not self.engine.reset_prefix_cache():
            raise ApiError(409, "cannot reset the prefix cache while requests hold KV blocks")
        return web.Response()

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
            answer = header | {
                "object": shape.object,
                "choices": [choice],
                "usage": _usage(request, generation.num_tokens),
                "kv_transfer_params": self._transfer_answer(request),
            }
            return web.json_response(answer, headers=_ttft_header(request))
        except EngineError as error:  # before any byte was sent: rejected, or shutting down
            raise ApiError(400 if request.finish_reason == "error" else 503, str(error)) from None
        finally:
            self.engine.abort(request)  # a no-op once finished; frees blocks of a dropped client

    def _first_token(self, request: EngineRequest, transfer: KVTransferParams) -> None:
        """Account for the TTFT; a decode has its KV now, so its prefill side may free it."""
        assert request.ttft is not None
        self.ttft.observe(request.ttft)
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

        async def send(text: str, finish: str | None, role: bool = False) -> None:
            choice = shape.choice(text, finish, generation.stop_reason, chunk=True)
            if role:
                choice["delta"] = {"role": "assistant", "content": text}
            await response.write(_sse(header | {"choices": [choice]}))

        if shape.chat:
            await send("", None, role=True)
        await send(first, generation.finish_reason)
        try:
            async for text in deltas:
                await send(text, generation.finish_reason)
        except EngineError as error:  # shutdown mid-stream: say so, then end the stream
            await response.write(_sse({"error": {"message": str(error), "code": 503}}))
        if include_usage:
            usage = _usage(request, generation.num_tokens)
            await response.write(_sse(header | {"choices": [], "usage": usage}))
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
            text = self.tokenizer.apply_chat_template(
                [message.model_dump() for message in messages], add_generation_prompt
            )
        except ValueError as error:
            raise ApiError(400, str(error), "messages") from None
        return self.tokenizer.encode(text)

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
            log.warning("kv release failed url=%s error=%r", url, error)

    async def start(self, app: web.Application) -> None:
        timeout = aiohttp.ClientTimeout(total=RELEASE_TIMEOUT_SECONDS)
        self.client = aiohttp.ClientSession(timeout=timeout)

    async def stop(self, app: web.Application) -> None:
        for task in self._background:
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        if self.client is not None:
            await self.client.close()


@web.middleware
async def _errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as error:
        return error.response()


def create_app(
    engine: EngineLoop, tokenizer: Tokenizer, settings: ServerSettings
) -> web.Application:
    """The aiohttp app; the engine loop is started and closed by the caller."""
    api = EngineApi(engine, tokenizer, settings)
    app = web.Application(middlewares=[_errors], client_max_size=MAX_BODY_BYTES)

    async def identify(request: web.Request, response: web.StreamResponse) -> None:
        response.headers["x-engine-instance-id"] = settings.instance_id

    app.on_response_prepare.append(identify)
    app.on_startup.append(api.start)
    app.on_cleanup.append(api.stop)
    app.router.add_post("/v1/completions", api.completions)
    app.router.add_post("/v1/chat/completions", api.chat_completions)
    app.router.add_get("/v1/models", api.models)
    app.router.add_post("/tokenize", api.tokenize)
    app.router.add_get("/health", api.health)
    app.router.add_get("/metrics", api.metrics)
    app.router.add_post("/reset_prefix_cache", api.reset_prefix_cache)
    app.router.add_post("/sim/kv_transfer/release", api.release_kv)
    return app
