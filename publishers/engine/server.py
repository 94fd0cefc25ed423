"""The simulator's HTTP API: the parts of ``vllm serve`` a router and its clients touch.

Routes and shapes follow vLLM's OpenAI server, so a router, benchmark or proxy written for
vLLM works against the simulator unchanged: ``/v1/completions`` and ``/v1/chat/completions``
(JSON and SSE), their scale-out ``/render`` twins (403 without ``--enable-scale-out``, as
vLLM), ``/v1/models``, ``/tokenize``, ``/detokenize``, ``/health``, ``/ping``, ``/version``,
``/load``, ``/kv_event_sources``, ``/metrics`` (``metrics.py``) and the dev endpoint
``/reset_prefix_cache``. ``model`` names the base model (any served name, or none) or a
LoRA adapter (``models.py``), whose requests are cached under the adapter's block hashes.
Completions take a list of prompts (strings or token-id lists), ``n``, ``echo`` and
``logprobs``, chat ``n``, ``echo``, ``logprobs`` and ``top_logprobs``, streaming or not,
answered as vLLM answers them (``answers.py``; the log-probabilities are made up,
``logprobs.py``). Errors are vLLM's ``{"error": {message, type, param, code}}``; an
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
from abc import abstractmethod
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp
import xxhash
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from conductor.failures import describe

from .answers import CHAT, COMPLETION, Answer, Delta, Options, Prompt, SequenceText, Shape, merged
from .block_hash import Engine
from .logprobs import MAX_LOGPROBS
from .loop import EngineError, EngineLoop
from .metrics import EngineMetrics
from .models import Served, ServedModels
from .scheduler import EngineRequest, SampleGroup
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
EMPTY_CONVERSATION = (
    "Cannot apply chat template to an empty conversation. Provide at least one message."
)
MAX_N_SEQUENCES = 16_384  # vLLM's VLLM_MAX_N_SEQUENCES
MAX_COMPLETION_PROMPTS = 1_024  # vLLM's VLLM_MAX_COMPLETION_PROMPTS
SAMPLING_EPS = 1e-5  # a lower temperature is greedy sampling, as in vLLM


@dataclass(frozen=True, slots=True)
class ServerSettings:
    models: ServedModels  # the base model's names and the LoRA adapters
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
        digest = xxhash.xxh32_hexdigest(repr((self.models.names, self.max_model_len)).encode())
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
    max_tokens: int | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    cache_salt: str | None = None
    kv_transfer_params: KVTransferParams | None = None
    echo: bool = False
    prompt_logprobs: int | None = None
    # sampling: the simulator samples its own way whatever they say; render echoes them
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

    @abstractmethod
    def num_logprobs(self) -> int | None:
        """Candidates per generated token vLLM's sampler is asked for (None: none)."""

    @abstractmethod
    def echo_logprobs(self) -> int | None:
        """Candidates per prompt token that ``echo`` asks for (None: none)."""

    def num_prompt_logprobs(self) -> int | None:
        """Candidates per prompt token: asked for, or implied by echo; vLLM reads no cache
        for a request that wants them."""
        if self.prompt_logprobs is not None:
            return self.prompt_logprobs
        return self.echo_logprobs() if self.echo else None

    def check(self) -> None:
        """What vLLM's request model refuses before it looks at anything else."""
        wanted = self.prompt_logprobs
        if wanted is None:
            return
        if self.stream and (wanted > 0 or wanted == -1):
            message = "`prompt_logprobs` are not available when `stream=True`."
            raise ApiError(400, _invalid(message, "prompt_logprobs"), "prompt_logprobs")
        if wanted < -1:
            message = "`prompt_logprobs` must be a positive value or -1."
            raise ApiError(400, _invalid(message, "prompt_logprobs", wanted), "prompt_logprobs")

    def sampling_params(self, max_tokens: int | None) -> dict[str, Any]:
        """vLLM's SamplingParams as render serializes them: greedy drops top_p and min_p,
        unset seed and max_tokens are left out, streaming asks for deltas."""
        params: dict[str, Any] = {"n": self.n} if self.n != 1 else {}
        params |= {
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
        logprobs = {"logprobs": self.num_logprobs(), "prompt_logprobs": self.num_prompt_logprobs()}
        params |= {key: value for key, value in logprobs.items() if value is not None}
        params |= {"output_kind": 1 if self.stream else 2, "skip_clone": True}
        if self.kv_transfer_params is not None:
            transfer = self.kv_transfer_params.model_dump(exclude_unset=True)
            params["extra_args"] = {"kv_transfer_params": transfer}
        skip = self.num_prompt_logprobs() is not None
        return params | {"bad_words": [], "skip_reading_prefix_cache": skip}


class CompletionBody(_GenerationBody):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def echo_logprobs(self) -> int | None:
        return self.logprobs

    def check(self) -> None:
        super().check()
        if self.logprobs is not None and self.logprobs < -1:
            raise ApiError(400, _invalid("`logprobs` must be a positive value or -1.",
                                         "logprobs", self.logprobs), "logprobs")  # fmt: skip
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) > MAX_COMPLETION_PROMPTS:
                raise ApiError(
                    400,
                    f"prompt list length {len(prompt)} exceeds the maximum allowed count of "
                    f"{MAX_COMPLETION_PROMPTS}. To increase this limit, set the "
                    "VLLM_MAX_COMPLETION_PROMPTS environment variable. (parameter=prompt)",
                    "prompt",
                )

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: its text or its token ids."""
        prompt = self.prompt
        if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
            return [prompt]  # type: ignore[list-item]  # a str or a list[int]
        return list(prompt)  # a list[str] or a list[list[int]]


class ChatCompletionBody(_GenerationBody):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True
    logprobs: bool = False
    top_logprobs: int | None = 0  # None is 0, as vLLM reads it

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def echo_logprobs(self) -> int | None:
        return self.top_logprobs or 0

    def check(self) -> None:
        super().check()
        top = self.top_logprobs or 0
        if top < -1:
            raise ApiError(400, _invalid("`top_logprobs` must be a positive value or -1.",
                                         "top_logprobs", top), "top_logprobs")  # fmt: skip
        if top != 0 and not self.logprobs:
            message = "when using `top_logprobs`, `logprobs` must be set to true."
            raise ApiError(400, _invalid(message, "top_logprobs"), "top_logprobs")

    def role(self) -> str:
        """vLLM's answer role: the assistant's, or without a generation prompt the last
        message's (the answer continues it)."""
        if self.add_generation_prompt or not self.messages:
            return "assistant"
        return self.messages[-1].role

    def echoed(self) -> str:
        """What echo repeats: the last message's content if it is the answer's role's."""
        if not self.messages or self.messages[-1].role != self.role():
            return ""
        content = self.messages[-1].content
        if isinstance(content, list):
            return "\n".join(str(part.get("text", "")) for part in content)
        return content or ""


def _chat_max_tokens(body: ChatCompletionBody) -> int | None:
    """``max_completion_tokens``, or the deprecated ``max_tokens`` without it."""
    if body.max_completion_tokens is not None:
        return body.max_completion_tokens
    return body.max_tokens


def _invalid(message: str, parameter: str, value: object = None) -> str:
    """A VLLMValidationError's text: the message, then what it is about."""
    about = f"parameter={parameter}" + ("" if value is None else f", value={value}")
    return f"{message} ({about})"


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


# -- response helpers ---------------------------------------------------------------------


def _ttft_header(request: EngineRequest) -> dict[str, str]:
    ttft = request.ttft
    return {} if ttft is None else {"x-engine-ttft-ms": f"{ttft * 1000:.3f}"}


def _sse(payload: object) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


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
        """One choice per prompt and sample; ``echo`` with ``max_tokens`` 0 answers with the
        prompt alone (vLLM generates one token for it, and counts it)."""
        body = await _parse(request, CompletionBody)
        body.check()
        served = self._served(body.model)
        texts = body.prompts()
        token_ids = [self._prompt_tokens(text) for text in texts]
        echo_only = body.echo and body.max_tokens == 0
        max_tokens = self._checked_max_tokens(body, 1 if echo_only else body.max_tokens, token_ids)
        prompts = [
            Prompt(ids, self._echo_text(text) if body.echo else "")
            for ids, text in zip(token_ids, texts, strict=True)
        ]
        options = Options(
            n=body.n,
            echo=body.echo,
            echo_only=echo_only,
            num_logprobs=body.logprobs,
            num_prompt_logprobs=body.num_prompt_logprobs(),
        )
        return await self._generate(request, body, served, prompts, max_tokens, COMPLETION, options)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        """``n`` choices for the one prompt; ``echo`` asks vLLM for the prompt's logprobs."""
        body = await _parse(request, ChatCompletionBody)
        body.check()
        served = self._served(body.model)
        token_ids = self._chat_tokens(body.messages, body.add_generation_prompt)
        max_tokens = self._checked_max_tokens(body, _chat_max_tokens(body), [token_ids])
        options = Options(
            n=body.n,
            echo=body.echo,
            num_logprobs=body.num_logprobs(),
            num_prompt_logprobs=body.num_prompt_logprobs(),
            role=body.role(),
        )
        prompt = Prompt(token_ids, body.echoed() if body.echo else "")
        return await self._generate(request, body, served, [prompt], max_tokens, CHAT, options)

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await _parse(request, TokenizeBody)
        self._served(body.model)
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
        data = self.settings.models.cards(self.settings.max_model_len)
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
        self._served(body.model)
        out_of_vocabulary = [t for t in body.tokens if not 0 <= t < self.tokenizer.vocab_size]
        if out_of_vocabulary:
            raise ApiError(400, f"Token id {out_of_vocabulary[0]} is out of vocabulary", "tokens")
        return web.json_response({"prompt": self.tokenizer.decode(body.tokens)})

    async def render_completion(self, request: web.Request) -> web.Response:
        """vLLM's scale-out render: the token-in request a ``/generate`` server would take."""
        body = await _parse_render(request, self.settings, CompletionBody)
        body.check()
        rendered = []
        for prompt in body.prompts():
            token_ids = self._prompt_tokens(prompt)
            if not token_ids:
                raise ApiError(400, "Either prompt or prompt_embeds must be provided and "
                               "non-empty.", "prompt")  # fmt: skip
            rendered.append(self._rendered(body, token_ids, body.max_tokens, COMPLETION))
        return web.json_response(rendered)

    async def render_chat(self, request: web.Request) -> web.Response:
        body = await _parse_render(request, self.settings, ChatCompletionBody)
        body.check()
        token_ids = self._chat_tokens(body.messages, body.add_generation_prompt)
        return web.json_response(self._rendered(body, token_ids, _chat_max_tokens(body), CHAT))

    def _rendered(
        self, body: _GenerationBody, token_ids: list[int], max_tokens: int | None, shape: Shape
    ) -> dict[str, Any]:
        """vLLM's ``GenerateRequest``; what the simulator cannot have (features) is null, and
        ``model`` is the request's, null when it named none."""
        self._served(body.model)
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
        served: Served,
        prompts: list[Prompt],
        max_tokens: int,
        shape: Shape,
        options: Options,
    ) -> web.StreamResponse:
        transfer = body.kv_transfer_params or KVTransferParams()
        sequences = self._submit(body, served, prompts, max_tokens, options, transfer)
        header = {
            "id": shape.id_prefix + sequences[0].request.request_id,
            "object": shape.object,
            "created": int(time.time()),
            "model": served.name,
        }
        options_ = body.stream_options
        answer = Answer(
            shape,
            options,
            prompts,
            sequences,
            header,
            self.tokenizer,
            self.settings.system_fingerprint,
            self.settings.engine,
            include_usage=options_ is not None and options_.include_usage,
        )
        deltas = merged(sequences)
        try:
            first, delta = await anext(deltas)  # nothing is sent before it: errors stay clean
            if transfer.do_remote_prefill:  # a decode has its KV now: its prefill may free it
                self._release_remote(transfer)
            if body.stream:
                return await self._stream(http_request, answer, deltas, first, delta)
            async for _ in deltas:
                pass
            whole = answer.whole(self._transfer_answer(sequences[0].request))
            return web.json_response(whole, headers=_ttft_header(first.request))
        except EngineError as error:  # before any byte was sent: rejected, or shutting down
            rejected = any(s.request.finish_reason == "error" for s in sequences)
            raise ApiError(400 if rejected else 503, str(error)) from None
        finally:  # a no-op once finished; frees the blocks of dropped requests
            await deltas.aclose()
            for sequence in sequences:
                self.engine.abort(sequence.request)

    def _submit(
        self,
        body: _GenerationBody,
        served: Served,
        prompts: list[Prompt],
        max_tokens: int,
        options: Options,
        transfer: KVTransferParams,
    ) -> list[SequenceText]:
        """One engine request per prompt and sample, queued in vLLM's order."""
        sequences: list[SequenceText] = []
        for prompt in prompts:
            group = SampleGroup(options.n) if options.n > 1 else None
            for sample in range(options.n):
                request = EngineRequest(
                    request_id=uuid.uuid4().hex,
                    prompt_token_ids=prompt.token_ids,
                    max_tokens=max_tokens,
                    cache_salt=body.cache_salt or None,
                    remote_prefill=transfer.do_remote_prefill,
                    keep_blocks=transfer.do_remote_decode,
                    lora=served.lora,
                    read_cache=options.num_prompt_logprobs is None,
                    sample_index=sample,
                    group=group,
                )
                stream = self.engine.submit(request)
                index = len(sequences)
                sequences.append(
                    SequenceText(
                        index, prompt, stream, self.tokenizer, body.stops(), self.engine.abort
                    )
                )
        return sequences

    async def _stream(
        self,
        http_request: web.Request,
        answer: Answer,
        deltas: AsyncGenerator[tuple[SequenceText, Delta]],
        first: SequenceText,
        delta: Delta,
    ) -> web.StreamResponse:
        """SSE chunks as vLLM sends them; headers go out with the first token (and its TTFT)."""
        headers = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        response = web.StreamResponse(headers=headers | _ttft_header(first.request))
        await response.prepare(http_request)
        for chunk in answer.opening_chunks(first):
            await response.write(_sse(chunk))
        await response.write(_sse(answer.delta_chunk(first, delta)))
        try:
            async for sequence, delta in deltas:
                await response.write(_sse(answer.delta_chunk(sequence, delta)))
        except EngineError as error:  # shutdown mid-stream: say so, then end the stream
            await response.write(_sse({"error": {"message": str(error), "code": 503}}))
        if answer.include_usage:
            await response.write(_sse(answer.usage_chunk()))
        await response.write(_sse("[DONE]"))
        await response.write_eof()
        return response

    def _served(self, model: str | None) -> Served:
        """The base model or the adapter ``model`` names; 404 as vLLM for anything else."""
        served = self.settings.models.resolve(model)
        if served is None:
            assert model is not None
            raise ApiError(404, self.settings.models.unknown(model), "model")
        return served

    def _prompt_tokens(self, prompt: str | list[int]) -> list[int]:
        return self.tokenizer.encode_prompt(prompt) if isinstance(prompt, str) else prompt

    def _echo_text(self, prompt: str | list[int]) -> str:
        """What echo repeats of a prompt: its text, or its token ids decoded."""
        return prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt)

    def _checked_max_tokens(
        self, body: _GenerationBody, requested: int | None, prompts: list[list[int]]
    ) -> int:
        """The engine requests' ``max_tokens``, once vLLM's checks of the sampling
        parameters and of each prompt passed; what the simulator cannot do is refused."""
        transfer = body.kv_transfer_params or KVTransferParams()
        if transfer.do_remote_decode and body.stream:  # its answer carries the transfer params
            raise ApiError(400, "kv_transfer_params.do_remote_decode needs stream=false", "stream")
        if (transfer.do_remote_decode or transfer.do_remote_prefill) and (
            body.n > 1 or len(prompts) > 1
        ):
            raise ApiError(
                400,
                "the simulator does not support kv_transfer_params with n > 1 or several prompts",
                "kv_transfer_params",
            )
        self._check_sampling(body, requested)
        max_tokens = 1 if transfer.do_remote_decode else requested or DEFAULT_MAX_TOKENS
        for token_ids in prompts:
            self._check_prompt(token_ids, max_tokens)
        return max_tokens

    def _check_sampling(self, body: _GenerationBody, max_tokens: int | None) -> None:
        """vLLM's SamplingParams checks, in its order and its words."""
        n = body.n
        if n < 1:
            raise ApiError(400, f"n must be at least 1, got {n}.")
        if n > MAX_N_SEQUENCES:
            raise ApiError(
                400,
                f"n must be at most {MAX_N_SEQUENCES}, got {n}. To increase this limit, set "
                "the VLLM_MAX_N_SEQUENCES environment variable.",
            )
        if max_tokens is not None and max_tokens < 1:
            message = f"max_tokens must be at least 1, got {max_tokens}."
            raise ApiError(400, _invalid(message, "max_tokens", max_tokens), "max_tokens")
        if body.temperature < SAMPLING_EPS and n > 1:
            raise ApiError(400, f"n must be 1 when using greedy sampling, got {n}.")
        wanted = (("sample", "logprobs", body.num_logprobs()),
                  ("prompt", "prompt_logprobs", body.num_prompt_logprobs()))  # fmt: skip
        for kind, parameter, k in wanted:
            requested = self.tokenizer.vocab_size if k == -1 else k
            if requested is not None and requested > MAX_LOGPROBS:
                message = (
                    f"Requested {kind} logprobs of {requested}, which is greater than max "
                    f"allowed: {MAX_LOGPROBS}"
                )
                raise ApiError(400, _invalid(message, parameter, requested), parameter)

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
        if not messages:
            raise ApiError(400, EMPTY_CONVERSATION)
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
