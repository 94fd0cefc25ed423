"""The engine as the registrar sees it over HTTP: healthy yet, and what it serves.

Flags win over the engine's answers; what no flag gives is asked: the model from
``/v1/models``, the block size from ``vllm:cache_config_info`` on ``/metrics`` (vLLM and
the simulator report it; no vLLM route answers it otherwise), the streams from
``/kv_event_sources`` (vLLM 0.32 on, the simulator) unless ``--kv-events-config`` or
``--endpoint`` names them, and the DP ranks from the same answers unless ``--dp-size``
does."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import aiohttp

from conductor.failures import describe

from .settings import Settings
from .streams import (
    EngineFacts,
    KVEventsConfig,
    StreamEndpoints,
    StreamError,
    block_size_from_metrics,
    ranks_from_config,
    ranks_from_metrics,
    ranks_from_sources,
    served_model,
)

log = logging.getLogger("fleet.registrar")

HEALTH_POLL_S = 1.0
WAIT_LOG_EVERY_S = 30.0


class EngineNotHealthy(Exception):
    """The engine did not answer ``/health`` with 200 in time."""


async def wait_healthy(
    session: aiohttp.ClientSession, url: str, timeout_s: float, poll_s: float = HEALTH_POLL_S
) -> float:
    """Polls ``GET {url}/health`` until 200; returns the seconds waited. Says every
    ``WAIT_LOG_EVERY_S`` what it last saw, and raises ``EngineNotHealthy`` with it."""
    started = time.monotonic()
    next_log = started + WAIT_LOG_EVERY_S
    last = "no answer yet"
    while True:
        try:
            async with session.get(f"{url}/health") as response:
                if response.status == 200:
                    return time.monotonic() - started
                last = f"status {response.status}"
        except (aiohttp.ClientError, TimeoutError) as error:
            last = describe(error)
        now = time.monotonic()
        if now - started >= timeout_s:
            raise EngineNotHealthy(f"engine {url} not healthy after {timeout_s:g} s (last: {last})")
        if now >= next_log:
            log.info("waiting for engine url=%s waited_s=%.0f last=%r", url, now - started, last)
            next_log = now + WAIT_LOG_EVERY_S
        await asyncio.sleep(min(poll_s, max(0.0, started + timeout_s - now)))


async def _get(session: aiohttp.ClientSession, url: str, *, json: bool) -> Any:
    """The answer of a GET, None when the route is missing (404) or fails."""
    try:
        async with session.get(url) as response:
            if response.status != 200:
                log.debug("engine answer url=%s status=%d", url, response.status)
                return None
            return await response.json(content_type=None) if json else await response.text()
    except (aiohttp.ClientError, TimeoutError, ValueError) as error:
        log.debug("engine answer url=%s error=%s", url, describe(error))
        return None


def _ranks(settings: Settings, learnt: list[int]) -> list[int]:
    if settings.dp_size is not None:
        start = settings.dp_start_rank
        return list(range(start, start + settings.dp_size))
    return learnt or [settings.dp_start_rank]


async def learn(session: aiohttp.ClientSession, settings: Settings) -> EngineFacts:
    """The engine's model, block size and streams; raises ``StreamError`` naming what could
    not be learnt and the flag that gives it."""
    url = settings.engine_url
    model = settings.model_name
    if model is None:
        answer = await _get(session, f"{url}/v1/models", json=True)
        if answer is None:
            raise StreamError(f"{url}/v1/models did not answer: give --model-name")
        model = served_model(answer)
    metrics = await _get(session, f"{url}/metrics", json=False)
    block_size = settings.block_size
    if block_size is None:
        block_size = block_size_from_metrics(metrics) if metrics else None
        if block_size is None:
            raise StreamError(
                f"{url}/metrics reports no block size (vllm:cache_config_info): give --block-size"
            )
    streams = await _streams(session, settings, ranks_from_metrics(metrics or ""))
    if not streams:
        raise StreamError("the engine publishes no KV events (no stream to register)")
    return EngineFacts(model, block_size, streams)


async def _streams(
    session: aiohttp.ClientSession, settings: Settings, metric_ranks: list[int]
) -> list[StreamEndpoints]:
    if settings.explicit_events:
        config = settings.kv_events_config or KVEventsConfig()
        if settings.endpoint is not None:
            config = config.model_copy(update={"endpoint": settings.endpoint})
        return ranks_from_config(config, _ranks(settings, metric_ranks), settings.replay_endpoint)
    answer = await _get(session, f"{settings.engine_url}/kv_event_sources", json=True)
    if answer is None:
        raise StreamError(
            f"{settings.engine_url}/kv_event_sources did not answer (vLLM before 0.32?): "
            "give --kv-events-config (the engine's own JSON) or --endpoint"
        )
    streams = ranks_from_sources(answer)
    if settings.dp_size is not None:
        wanted = set(_ranks(settings, []))
        missing = wanted - {stream.rank for stream in streams}
        if missing:
            raise StreamError(
                f"/kv_event_sources lists no stream for DP rank(s) {sorted(missing)} of "
                f"--dp-size {settings.dp_size}"
            )
        streams = [stream for stream in streams if stream.rank in wanted]
    return streams
