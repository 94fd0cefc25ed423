"""Stage 5 of a request: the call to the engines, and the answer streamed back.

The request goes to the decision's prefill instance (with disaggregation: a prefill-only
call there, then the decode instance streams the answer) with timeouts on connect, a
stream's headers, the first byte and every idle gap. A refused connection, a 5xx or no
first byte in time moves it to the next-best instance and takes the failed one out of
rotation; so does an instance taken out meanwhile by anyone else, at once. The answer is
passed through chunk by chunk (SSE stays SSE; a whole answer keeps the engine's
``Content-Length``) with the decision in ``x-conductor-*`` headers; its engine-reported
cached tokens are compared with the index's prediction, and its TTFT teaches the cost model
(neither for a batch of prompts: its numbers are the batch's, not its first prompt's).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

import aiohttp
from aiohttp import hdrs, web

from conductor.failures import describe

from . import disagg
from .config import UpstreamSection
from .decision import Choice, NoCandidates, Routed
from .engine_metrics import in_range
from .errors import ApiError, upstream_message
from .in_flight import Claim, InFlight
from .index_client import MAX_TOKENS
from .metrics import RouterMetrics
from .pool import InstancePool, Ticket, Upstream
from .prompt_ids import TOKENIZED_BY
from .rotation import Rotation
from .sessions import UpstreamSessions
from .usage import UsageTap, cached_tokens

T = TypeVar("T")

HOP_BY_HOP = {"content-length", "transfer-encoding", "connection", "keep-alive", "content-encoding"}
MAX_TTFT_MS = 3_600_000.0  # an engine-reported TTFT past an hour is no measurement


class UpstreamFailed(Exception):
    """Connection refused/reset or a 5xx before anything reached the client: retry."""


class UpstreamTimeout(UpstreamFailed):
    """No first byte within the timeout: retried elsewhere; a 504 when nowhere is left."""


class Forwarder:
    def __init__(
        self,
        in_flight: InFlight,
        rotation: Rotation,
        sessions: UpstreamSessions,
        pool: InstancePool,
        metrics: RouterMetrics,
        timeouts: UpstreamSection,
    ) -> None:
        self._in_flight = in_flight
        self._rotation = rotation
        self._sessions = sessions
        self._pool = pool
        self._metrics = metrics
        self._timeouts = timeouts

    async def forward(self, request: web.Request, routed: Routed) -> web.StreamResponse:
        """Serve the request on the decider's choice, then on the next-best instance while
        one fails retryably (a 504 when the last one timed out and none is left)."""
        failed: set[str] = set()
        last: UpstreamFailed | None = None
        trace = routed.trace
        while True:  # each failed instance is excluded, so this ends
            try:
                with trace.span("decision") as span:
                    choice = routed.target.served.decider.choose(routed, failed)
                    span.set(
                        instance_id=choice.prefill.instance_id,
                        cached_tokens=choice.decision.cached_tokens,
                        policy=choice.decision.policy,
                    )
            except NoCandidates:
                if isinstance(last, UpstreamTimeout):
                    raise ApiError(504, f"no upstream answered in time: {last}") from None
                raise
            if not failed:
                self._metrics.proxy_seconds.observe(time.perf_counter() - routed.started)
            try:
                prefill = choice.prefill
                with trace.span(
                    "upstream",
                    attempt=len(failed) + 1,
                    instance_id=prefill.instance_id,
                    server_address=prefill.host,
                    server_port=prefill.port,
                ) as call:
                    if choice.decode is not None:
                        call.set(decode_instance_id=choice.decode.instance_id)
                    response = await self._serve(request, routed, choice, call.upstream_headers())
                    call.set(status_code=response.status)
                return response
            except UpstreamFailed as error:
                last = error
                failed.add(choice.prefill.instance_id)
                self._rotation.take_out(choice.prefill, str(error))
                self._metrics.retries.labels(choice.prefill.instance_id).inc()

    async def _serve(
        self, request: web.Request, routed: Routed, choice: Choice, trace_headers: dict[str, str]
    ) -> web.StreamResponse:
        decision, prefill, decode = choice.decision, choice.prefill, choice.decode
        headers = {
            **routed.trace.response_headers(),
            "x-conductor-prefill-instance": prefill.instance_id,
            "x-conductor-cached-tokens": str(decision.cached_tokens),
            "x-conductor-policy": decision.policy,
            TOKENIZED_BY: routed.tokenized.by,
            "x-conductor-overhead-ms": f"{(time.perf_counter() - routed.started) * 1000:.3f}",
        }
        if routed.lookup.fallback:
            headers["x-conductor-fallback"] = routed.lookup.fallback
        forwarded = {
            **routed.tokenized.request.forwarded,
            **trace_headers,
            "Content-Type": "application/json",
        }
        # without the index's answer there is no prediction to compare the engine's with;
        # a batch's cached tokens are the batch's, not those of the first prompt it was
        # routed by
        batch = routed.tokenized.request.batch
        predicted = None if routed.lookup.fallback or batch else decision.cached_tokens
        with self._in_flight.claim(routed, choice) as claim:
            if decode is None:
                return await self._stream(
                    request, prefill, routed, routed.tokenized.request.raw, forwarded, headers,
                    claim.ticket, learn=claim, predicted=predicted,
                )  # fmt: skip
            headers["x-conductor-decode-instance"] = decode.instance_id
            return await self._disaggregated(
                request, routed, claim, prefill, decode, forwarded, headers, predicted
            )

    async def _disaggregated(
        self,
        request: web.Request,
        routed: Routed,
        claim: Claim,
        prefill: Upstream,
        decode: Upstream,
        forwarded: dict[str, str],
        headers: dict[str, str],
        predicted: int | None,
    ) -> web.StreamResponse:
        """The prefill leg on ``prefill``, then the decode instance streams the answer; a
        decode failure is the client's 502 (504 for a timeout): the prefill is not retried."""
        body = routed.tokenized.request.body
        answer = await self._prefill_only(request.path, body, prefill, forwarded)
        if predicted is not None:
            realized = self._cached_tokens(cached_tokens(answer), routed)
            self._metrics.record_cache_use(prefill.instance_id, predicted, realized)
        params = disagg.transfer_params(answer)
        claim.ticket.first_token()
        self._observe(routed, claim, time.perf_counter() - routed.started)
        payload = json.dumps(disagg.decode_request(body, params)).encode()
        decode_ticket = self._pool.claim(decode, 0)
        try:
            return await self._stream(
                request, decode, routed, payload, forwarded, headers, decode_ticket
            )
        except UpstreamFailed as error:  # the prefill is fine: do not retry it
            self._rotation.take_out(decode, str(error))
            message = f"decode instance {decode.instance_id} failed: {error}"
            raise ApiError(504 if isinstance(error, UpstreamTimeout) else 502, message) from None
        finally:
            decode_ticket.release()

    def _observe(self, routed: Routed, claim: Claim, ttft_s: float | None) -> None:
        if ttft_s is None:
            return
        self._metrics.ttft_seconds.observe(ttft_s)
        served = routed.target.served
        # a batch's first token comes after its prompts' prefills, not only the first's
        if served.learner is not None and not routed.tokenized.request.batch:
            served.learner.observe(claim.new_tokens, claim.queued_before, ttft_s)
            self._metrics.publish_cost_model(served.name, served.learner.model)

    async def _prefill_only(
        self, path: str, body: dict[str, Any], prefill: Upstream, headers: dict[str, str]
    ) -> dict[str, Any]:
        """The prefill leg of disaggregation: its answer (kv_transfer_params and usage),
        within the first-byte timeout (one token is all it computes)."""
        deadline = asyncio.get_running_loop().time() + self._timeouts.first_byte_timeout_seconds
        call = self._prefill_answer(path, body, prefill, headers)
        try:
            answer = await self._first_byte(prefill, call, deadline, "first_byte")
        except (aiohttp.ClientError, ValueError, RecursionError) as error:
            raise UpstreamFailed(describe(error)) from None
        return answer if isinstance(answer, dict) else {}

    async def _prefill_answer(
        self, path: str, body: dict[str, Any], prefill: Upstream, headers: dict[str, str]
    ) -> Any:
        async with self._sessions.to(prefill).post(
            path, json=disagg.prefill_request(body), headers=headers
        ) as response:
            if response.status >= 500:
                raise UpstreamFailed(f"prefill answered {response.status}")
            answer = await response.json(content_type=None)
            if response.status != 200:
                raise ApiError(response.status, upstream_message(answer), "UpstreamError")
            return answer

    async def _stream(
        self,
        request: web.Request,
        upstream: Upstream,
        routed: Routed,
        payload: bytes,
        forwarded: dict[str, str],
        headers: dict[str, str],
        ticket: Ticket,
        learn: Claim | None = None,
        predicted: int | None = None,
    ) -> web.StreamResponse:
        """Forward and pass the answer through chunk by chunk (SSE stays SSE). Failing
        before the first byte is retryable; after it, the client sees the transfer cut.
        With ``predicted`` (the index's hit on the prefill instance), a complete 200
        answer's cached tokens are compared with it."""
        now = asyncio.get_running_loop().time()
        deadline = now + self._timeouts.first_byte_timeout_seconds
        headers_by, stage = deadline, "first_byte"
        if routed.tokenized.request.streams:  # vLLM sends a stream's headers at once
            stream_headers_by = now + self._timeouts.stream_headers_timeout_seconds
            if stream_headers_by < deadline:
                headers_by, stage = stream_headers_by, "stream_headers"
        post = self._sessions.to(upstream).post(request.path, data=payload, headers=forwarded)
        try:
            upstream_response = await self._first_byte(upstream, post, headers_by, stage)
        except aiohttp.ClientConnectionError as error:
            raise UpstreamFailed(describe(error)) from None
        async with upstream_response:
            if upstream_response.status >= 500:
                raise UpstreamFailed(f"answered {upstream_response.status}")
            response = web.StreamResponse(status=upstream_response.status)
            for name, value in upstream_response.headers.items():
                if name.lower() not in HOP_BY_HOP:
                    response.headers[name] = value
            response.headers.update(headers)
            response.content_length = _passed_length(upstream_response)
            streaming = upstream_response.content_type == "text/event-stream"
            tap = UsageTap(streaming) if predicted is not None else None
            first = True
            try:
                async for chunk in self._chunks(upstream, upstream_response.content, deadline):
                    if first:
                        first = False
                        ticket.first_token()
                        if learn is not None:
                            self._observe(routed, learn, self._ttft(upstream_response, routed))
                        await response.prepare(request)
                    await response.write(chunk)
                    if tap is not None:
                        tap.feed(chunk)
            except (aiohttp.ClientPayloadError, TimeoutError) as error:
                if first:  # a cut (no first byte in time is an UpstreamTimeout)
                    raise UpstreamFailed(f"answer cut before any byte: {describe(error)}") from None
                if isinstance(error, TimeoutError):
                    self._metrics.timeouts.labels(upstream.instance_id, "idle").inc()
                self._rotation.take_out(upstream, f"answer cut short: {describe(error)}")
                assert request.transport is not None
                request.transport.close()  # the client must see a truncated answer, not EOF
                return response
            if first:
                await response.prepare(request)
            await response.write_eof()
            if tap is not None and predicted is not None and upstream_response.status == 200:
                realized = self._cached_tokens(tap.cached_tokens(), routed)
                self._metrics.record_cache_use(upstream.instance_id, predicted, realized)
            return response

    async def _first_byte(
        self, upstream: Upstream, call: Awaitable[T], deadline: float, stage: str
    ) -> T:
        """``call`` (an answer's headers, its first chunk, a prefill's whole answer) by
        ``deadline`` (loop time), else UpstreamTimeout of ``stage``; UpstreamFailed at once
        when the upstream is taken out of rotation meanwhile (a failed probe or scrape,
        another request's failure): nobody waits out a timeout on an engine known dead."""
        work = asyncio.ensure_future(call)
        taken_out = self._rotation.taken_out_signal(upstream)
        try:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout_at(deadline):
                    await asyncio.wait((work, taken_out), return_when=asyncio.FIRST_COMPLETED)
            if work.done():
                return work.result()
        finally:
            work.cancel()  # nothing when it is done; else it is abandoned
        if taken_out.done():
            raise UpstreamFailed(
                f"instance {upstream.instance_id} was taken out of rotation before its first byte"
            )
        raise self._timed_out(upstream, stage)

    async def _chunks(
        self, upstream: Upstream, content: aiohttp.StreamReader, deadline: float
    ) -> AsyncIterator[bytes]:
        """The answer's chunks as they come: the first by ``deadline`` (the first-byte
        timeout, as ``_first_byte`` waits), each next one within the idle timeout (else
        TimeoutError)."""
        chunk = await self._first_byte(upstream, content.readany(), deadline, "first_byte")
        while chunk:
            yield chunk
            async with asyncio.timeout(self._timeouts.idle_timeout_seconds):
                chunk = await content.readany()

    def _timed_out(self, upstream: Upstream, stage: str) -> UpstreamTimeout:
        self._metrics.timeouts.labels(upstream.instance_id, stage).inc()
        if stage == "stream_headers":
            timeout = self._timeouts.stream_headers_timeout_seconds
            return UpstreamTimeout(
                f"instance {upstream.instance_id} sent no stream headers within {timeout}s"
            )
        timeout = self._timeouts.first_byte_timeout_seconds
        return UpstreamTimeout(f"instance {upstream.instance_id} sent nothing within {timeout}s")

    def _ttft(self, response: aiohttp.ClientResponse, routed: Routed) -> float | None:
        """The engine's own TTFT when it reports a sane one (a finite number of ms within an
        hour; else it is ignored and counted); else, for a stream, the first byte's time
        (a whole non-streamed answer says nothing about its first token)."""
        now = time.perf_counter()
        reported = response.headers.get("x-engine-ttft-ms")
        if reported is not None:
            try:
                ttft_ms = float(reported)
            except ValueError:
                ttft_ms = float("nan")
            if in_range(ttft_ms, MAX_TTFT_MS):
                return ttft_ms / 1000
            self._metrics.rejected("ttft_header")
        return now - routed.started if routed.tokenized.request.streams else None

    def _cached_tokens(self, reported: int | None, routed: Routed) -> int | None:
        """An engine's cached-token count when it is one (0..the prompt's tokens); else
        None (counted): the answer counts as unverified."""
        if reported is None:
            return None
        if in_range(reported, routed.tokenized.count or MAX_TOKENS):
            return reported
        self._metrics.rejected("cached_tokens")
        return None


def _passed_length(response: aiohttp.ClientResponse) -> int | None:
    """The engine's ``Content-Length`` when its body passes through byte for byte (not
    decompressed by aiohttp): a whole answer keeps the engine's framing, so a client sees
    its length up front and a cut answer as short; None (chunked) for a stream."""
    if response.headers.get(hdrs.CONTENT_ENCODING):
        return None
    return response.content_length
