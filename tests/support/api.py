"""Small async helpers for talking to a conductor under test; every wait is bounded."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import aiohttp

from tests.support.wire_publisher import WirePublisher

T = TypeVar("T")


async def eventually(
    probe: Callable[[], Awaitable[T]],
    accept: Callable[[T], bool],
    timeout: float = 10.0,
    interval: float = 0.05,
) -> T:
    """Poll ``probe`` until ``accept`` holds; fail with the last value after ``timeout``."""
    deadline = time.monotonic() + timeout
    value = await probe()
    while not accept(value):
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s; last value: {value!r}")
        await asyncio.sleep(interval)
        value = await probe()
    return value


async def post(
    http: aiohttp.ClientSession, url: str, body: Any, headers: dict[str, str] | None = None
) -> tuple[int, Any]:
    async with http.post(url, json=body, headers=headers) as response:
        return response.status, await response.json(content_type=None)


async def get(http: aiohttp.ClientSession, url: str) -> tuple[int, Any]:
    async with http.get(url) as response:
        return response.status, await response.json(content_type=None)


def registration(publisher: WirePublisher, instance_id: str, **fields: Any) -> dict[str, Any]:
    body = {
        "endpoint": publisher.endpoint,
        "replay_endpoint": publisher.replay_endpoint,
        "type": "vLLM",
        "modelname": "m",
        "instance_id": instance_id,
        "block_size": 4,
        "dp_rank": 0,
    }
    return {**body, **fields}


async def register_and_connect(
    http: aiohttp.ClientSession, base: str, publisher: WirePublisher, instance_id: str, **fields
) -> dict[str, Any]:
    """Register a publisher and wait until the SUB socket is connected (no slow-joiner loss)."""
    body = registration(publisher, instance_id, **fields)
    status, answer = await post(http, f"{base}/register", body)
    assert status == 200, answer

    async def state() -> str:
        _, services = await get(http, f"{base}/services")
        return next(s["State"] for s in services["services"] if s["Endpoint"] == body["endpoint"])

    await eventually(state, lambda s: s == "connected")
    await asyncio.sleep(0.1)  # the subscription itself travels after the TCP connect
    return body


async def query(
    http: aiohttp.ClientSession, base: str, tokens: list[int], **fields: Any
) -> dict[str, Any]:
    body = {"model": "m", "block_size": 4, "token_ids": tokens, **fields}
    status, answer = await post(http, f"{base}/query", body)
    assert status == 200, answer
    return answer


async def matched(
    http: aiohttp.ClientSession, base: str, tokens: list[int], instance_id: str, **fields: Any
) -> int:
    answer = await query(http, base, tokens, **fields)
    tenant = fields.get("tenant_id") or "default"
    return answer.get(tenant, {}).get(instance_id, {}).get("longest_matched", 0)


async def metric(http: aiohttp.ClientSession, base: str, name: str) -> float:
    """Sum of every sample of a Prometheus metric (0 when absent). ``name`` may name some
    of its labels (``m{a="x"}``): the samples that have those, whatever their others."""
    async with http.get(f"{base}/metrics") as response:
        text = await response.text()
    family, _, wanted = name.partition("{")
    labels = set(re.findall(r'\w+="[^"]*"', wanted))
    pattern = re.compile(rf"^{re.escape(family)}(?:{{([^}}]*)}})? (\S+)$", re.MULTILINE)
    return sum(
        float(value)
        for found, value in pattern.findall(text)
        if labels <= set(re.findall(r'\w+="[^"]*"', found))
    )
