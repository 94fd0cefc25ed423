"""The answers of the simulator's generation routes, shaped as vLLM 0.32 shapes them.

A request becomes one engine request per prompt and sample: a ``Sequence`` each, in vLLM's
choice order (prompt by prompt, a prompt's ``n`` samples in turn: choice ``index`` is
``prompt * n + sample``). ``Answer`` turns them into the whole JSON answer or, streaming,
into SSE chunks: one choice per chunk, as each sequence's tokens come (``merged``).

What vLLM reports that depends on which sequence came first or last, the simulator takes
from the same sequence: the usage's ``cached_tokens`` are the last prompt's (of its samples,
the last to finish) in a whole answer and the first sequence to produce a token's in a
stream; ``prompt_tokens`` count each prompt once, ``completion_tokens`` every sample's.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from .block_hash import Engine
from .logprobs import (
    Position,
    chat_logprobs,
    completion_logprobs,
    positions,
    prompt_logprobs,
)
from .loop import EngineError, RequestStream
from .scheduler import EngineRequest
from .tokenizer import EngineTokenizer

_CHAT_CHOICE_NULLS = ("token_ids", "routed_experts")
_MESSAGE_NULLS = ("refusal", "annotations", "audio", "function_call", "reasoning")


@dataclass(frozen=True, slots=True)
class Shape:
    """Where completions and chat completions differ: ids and object names."""

    id_prefix: str
    object: str
    chunk_object: str
    chat: bool


COMPLETION = Shape("cmpl-", "text_completion", "text_completion", chat=False)
CHAT = Shape("chatcmpl-", "chat.completion", "chat.completion.chunk", chat=True)


@dataclass(frozen=True, slots=True)
class Prompt:
    token_ids: list[int]
    echo: str = ""  # what an echoing answer repeats: the prompt's text (chat: last message)


@dataclass(frozen=True, slots=True)
class Options:
    """The request's options that shape its choices."""

    n: int = 1
    echo: bool = False
    echo_only: bool = False  # completions' echo with max_tokens 0: the prompt is the answer
    num_logprobs: int | None = None  # candidates per generated token; None: no logprobs
    num_prompt_logprobs: int | None = None  # per prompt token (asked for, or by echo)
    role: str = "assistant"  # chat: the answer's role


class Delta(NamedTuple):
    text: str
    token_id: int
    position: int  # of the token among the sequence's generated ones
    finish_reason: str | None  # set on the sequence's last delta


class SequenceText:
    """One choice: an engine request's tokens as text, cut at the first stop string, where
    ``end`` ends its engine request (vLLM stops a sequence as its stop string appears)."""

    def __init__(
        self,
        index: int,
        prompt: Prompt,
        stream: RequestStream,
        tokenizer: EngineTokenizer,
        stops: list[str],
        end: Callable[[EngineRequest, str], None],
    ) -> None:
        self.index = index
        self.prompt = prompt
        self.stream = stream
        self.request = stream.request
        self.text = ""
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.stop_reason: str | None = None
        self.echoed = False  # streaming: the prompt went out with the first chunk
        self.text_offset = 0  # streaming: where the next chunk's logprobs start
        self._tokenizer = tokenizer
        self._stops = stops
        self._end = end

    async def deltas(self) -> AsyncIterator[Delta]:
        """The text each token adds; the last one carries the finish reason."""
        async for token in self.stream:
            self.token_ids.append(token)
            start = len(self.text)
            self.text += self._tokenizer.decode([token])
            cut = self._first_stop(start)
            if cut is not None:
                self.text = self.text[:cut]
                self.finish_reason = "stop"
                self._end(self.request, "stop")
            elif self.stream.drained:
                self.finish_reason = self.request.finish_reason
            yield Delta(self.text[start:], token, len(self.token_ids) - 1, self.finish_reason)
            if cut is not None:
                return

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


def _stop_reason(sequence: SequenceText, delta: Delta) -> str | None:
    """The stop string a chunk names: its sequence's, on its last chunk only (the sequence
    may have run ahead of the chunk being sent)."""
    return None if delta.finish_reason is None else sequence.stop_reason


async def merged(
    sequences: Sequence[SequenceText],
) -> AsyncGenerator[tuple[SequenceText, Delta]]:
    """Every sequence's deltas as they come (vLLM's ``merge_async_iterators``); raises the
    first EngineError any of them meets."""
    if len(sequences) == 1:
        (only,) = sequences
        async for delta in only.deltas():
            yield only, delta
        return
    queue: asyncio.Queue[tuple[SequenceText, Delta | EngineError | None]] = asyncio.Queue()

    async def pump(sequence: SequenceText) -> None:
        try:
            async for delta in sequence.deltas():
                queue.put_nowait((sequence, delta))
        except EngineError as error:
            queue.put_nowait((sequence, error))
        finally:
            queue.put_nowait((sequence, None))

    tasks = [asyncio.create_task(pump(sequence)) for sequence in sequences]
    try:
        running = len(tasks)
        while running:
            sequence, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, EngineError):
                raise item
            else:
                yield sequence, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def usage(
    prompt_tokens: int, completion_tokens: int, cached_tokens: int, chunk: bool, engine: Engine
) -> dict[str, Any]:
    """Token counts; cached tokens always, as vLLM with ``--enable-prompt-tokens-details``
    and SGLang with ``--enable-cache-report`` (whose ``UsageInfo`` has every field)."""
    counts: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
    if engine == "sglang":
        return counts | {"reasoning_tokens": 0, "completion_tokens_details": None}
    return counts if chunk else counts | {"completion_tokens_details": None}


@dataclass(slots=True)
class Answer:
    """One request's choices, as a whole answer or as a stream's chunks."""

    shape: Shape
    options: Options
    prompts: list[Prompt]
    sequences: list[SequenceText]
    header: dict[str, Any]  # id, object, created, model
    tokenizer: EngineTokenizer
    system_fingerprint: str
    engine: Engine
    include_usage: bool = False  # streaming: a last chunk with the usage
    first: SequenceText | None = None  # streaming: the first to produce

    # -- log-probabilities -------------------------------------------------------------

    def _decode(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _prompt_positions(self, sequence: SequenceText) -> list[Position]:
        """The prompt's tokens and candidates, the same for all of the prompt's samples."""
        k = self.options.num_prompt_logprobs
        assert k is not None
        first = self.sequences[sequence.index - sequence.index % self.options.n]
        seed, num_ordinary = first.request.seed, self.tokenizer.num_ordinary
        return positions(seed, sequence.prompt.token_ids, 0, k, num_ordinary)

    def _output_positions(
        self, sequence: SequenceText, token_ids: list[int], start: int
    ) -> list[Position]:
        k = self.options.num_logprobs
        assert k is not None
        at = len(sequence.prompt.token_ids) + start
        return positions(sequence.request.seed, token_ids, at, k, self.tokenizer.num_ordinary)

    def _echo_entries(
        self, sequence: SequenceText, token_ids: list[int], start: int
    ) -> list[Position]:
        """Completions' logprobs of the echoed prompt and then of the given outputs."""
        prompt = self._prompt_positions(sequence)
        if self.options.echo_only:
            return prompt
        return prompt + self._output_positions(sequence, token_ids, start)

    # -- whole answers -----------------------------------------------------------------

    def whole(self, kv_transfer_params: dict[str, Any] | None) -> dict[str, Any]:
        choices = [self._whole_choice(sequence) for sequence in self.sequences]
        last_prompt = self.sequences[-self.options.n :]
        reported = max(last_prompt, key=lambda s: (s.request.finish_time or 0.0, s.index))
        answer = self.header | {"choices": choices}
        answer |= {"service_tier": None, "system_fingerprint": self.system_fingerprint}
        answer["usage"] = self._usage(reported, chunk=False)
        if self.shape.chat:
            answer["prompt_logprobs"] = self._chat_prompt_logprobs()
            answer |= dict.fromkeys(("prompt_token_ids", "prompt_text"))
        return answer | {
            "kv_transfer_params": kv_transfer_params,
            "ec_transfer_params": None,
            "metrics": None,
        }

    def _usage(self, reported: SequenceText, chunk: bool) -> dict[str, Any]:
        prompt_tokens = sum(len(prompt.token_ids) for prompt in self.prompts)
        completion_tokens = sum(len(sequence.token_ids) for sequence in self.sequences)
        cached = reported.request.num_cached_tokens
        return usage(prompt_tokens, completion_tokens, cached, chunk, self.engine)

    def _whole_choice(self, sequence: SequenceText) -> dict[str, Any]:
        index = {"index": sequence.index}
        ends = {"finish_reason": sequence.finish_reason, "stop_reason": sequence.stop_reason}
        if self.shape.chat:
            content = (sequence.prompt.echo if self.options.echo else "") + sequence.text
            message: dict[str, str | None] = {"role": self.options.role, "content": content}
            message |= dict.fromkeys(_MESSAGE_NULLS)
            logprobs = self._chat_choice_logprobs(sequence, sequence.token_ids, 0)
            choice = index | {"message": message, "logprobs": logprobs} | ends
            return choice | dict.fromkeys(_CHAT_CHOICE_NULLS)
        text = sequence.text
        if self.options.echo:
            text = sequence.prompt.echo + ("" if self.options.echo_only else text)
        logprobs = None
        k = self.options.num_logprobs
        if k is not None:
            logprobs = completion_logprobs(self._completion_entries(sequence), k, self._decode)
        prompt = None
        if self.options.num_prompt_logprobs is not None:
            prompt = prompt_logprobs(self._prompt_positions(sequence), self._decode)
        choice = index | {"text": text, "logprobs": logprobs} | ends | {"token_ids": None}
        return choice | {
            "prompt_logprobs": prompt,
            "prompt_token_ids": None,
            "routed_experts": None,
        }

    def _completion_entries(self, sequence: SequenceText) -> list[Position]:
        if self.options.echo:
            return self._echo_entries(sequence, sequence.token_ids, 0)
        return self._output_positions(sequence, sequence.token_ids, 0)

    def _chat_choice_logprobs(
        self, sequence: SequenceText, token_ids: list[int], start: int
    ) -> dict[str, Any] | None:
        k = self.options.num_logprobs
        if k is None:
            return None
        entries = self._output_positions(sequence, token_ids, start)
        return chat_logprobs(entries, k, self._decode)

    def _chat_prompt_logprobs(self) -> list[Any] | None:
        """Chat's top-level ``prompt_logprobs``: asked for, or implied by echo."""
        if self.options.num_prompt_logprobs is None:
            return None
        return prompt_logprobs(self._prompt_positions(self.sequences[0]), self._decode)

    # -- streams -----------------------------------------------------------------------

    def opening_chunks(self, first: SequenceText) -> list[dict[str, Any]]:
        """What goes out before the first token's chunk: chat's role for each choice, then
        the echoed last message for each (completions: nothing)."""
        self.first = first
        if not self.shape.chat:
            return []
        head = self.header | {"object": self.shape.chunk_object}
        chunks = []
        for index in range(self.options.n):
            role = {"index": index, "delta": {"role": self.options.role, "content": ""}}
            choice = role | {"logprobs": None, "finish_reason": None}
            prompt_nulls = dict.fromkeys(("prompt_token_ids", "prompt_text"))
            chunks.append(head | {"choices": [choice]} | prompt_nulls)
        echo = self.prompts[0].echo if self.options.echo else ""
        for index in range(self.options.n if echo else 0):
            delta = {"index": index, "delta": {"content": echo}}
            chunks.append(head | {"choices": [delta | {"logprobs": None, "finish_reason": None}]})
        return chunks

    def delta_chunk(self, sequence: SequenceText, delta: Delta) -> dict[str, Any]:
        """One token's chunk; its choice's finish reason with the last one."""
        choice = (
            self._chat_delta(sequence, delta)
            if self.shape.chat
            else self._text_delta(sequence, delta)
        )
        chunk = self.header | {"object": self.shape.chunk_object, "choices": [choice]}
        if delta.finish_reason is not None and not self.include_usage:
            chunk["system_fingerprint"] = self.system_fingerprint  # vLLM's terminal chunk
        return chunk

    def _chat_delta(self, sequence: SequenceText, delta: Delta) -> dict[str, Any]:
        logprobs = self._chat_choice_logprobs(sequence, [delta.token_id], delta.position)
        choice = {"index": sequence.index, "delta": {"content": delta.text}, "logprobs": logprobs}
        choice["finish_reason"] = delta.finish_reason
        if delta.finish_reason is not None:  # vLLM names the stop reason in the last chunk only
            choice["stop_reason"] = _stop_reason(sequence, delta)
        return choice | {"token_ids": None}

    def _text_delta(self, sequence: SequenceText, delta: Delta) -> dict[str, Any]:
        """Completions: the first chunk of an echoing choice carries the prompt (its text,
        ids and, with logprobs, their candidates); offsets continue from chunk to chunk."""
        text, prompt_ids = delta.text, None
        echo = self.options.echo and not sequence.echoed
        if echo:
            sequence.echoed = True
            prompt_ids = sequence.prompt.token_ids
            text = sequence.prompt.echo + ("" if self.options.echo_only else delta.text)
        logprobs = None
        k = self.options.num_logprobs
        if k is not None:
            if echo:
                entries = self._echo_entries(sequence, [delta.token_id], delta.position)
            else:
                entries = self._output_positions(sequence, [delta.token_id], delta.position)
            logprobs = completion_logprobs(entries, k, self._decode, sequence.text_offset)
            sequence.text_offset = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
        choice = {"index": sequence.index, "text": text, "logprobs": logprobs}
        choice |= {
            "finish_reason": delta.finish_reason,
            "stop_reason": _stop_reason(sequence, delta),
        }
        return choice | {"prompt_token_ids": prompt_ids, "token_ids": None}

    def usage_chunk(self) -> dict[str, Any]:
        """The stream's last chunk: the usage of every choice, cached tokens as the first
        sequence to produce a token reported them."""
        assert self.first is not None, "opening_chunks names the first sequence"
        counts = self._usage(self.first, chunk=True)
        last = {"choices": [], "usage": counts, "system_fingerprint": self.system_fingerprint}
        return self.header | {"object": self.shape.chunk_object} | last
