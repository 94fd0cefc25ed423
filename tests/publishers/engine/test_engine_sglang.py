"""The simulator's SGLang mode against what real SGLang 0.5.23 published.

``tests/fixtures/sglang_frames.json`` (``scripts/capture-sglang-frames.py``) holds a real
SGLang's KV-event frames, usage reports and replay for a scripted sequence of token-id
prompts sent one at a time: a prompt, its repeat and extension, a distinct prompt, a partial
match, a salted prompt, ``/flush_cache``, then prompts until its 32-page pool evicts. The
simulator started with ``--sim-engine sglang`` and the same pool gets the same sequence and
must publish the same frames: topic, sequence numbers and payload bytes (all but the
timestamp), answer the same replay and report the same cached tokens.

Compared in full: everything the sequence exercises, evictions included. Those are
deterministic here because requests run one at a time, so the least recently used radix
leaf is the oldest prompt's in both. Not exercised by the capture, and so pinned only
against SGLang's source by the block-manager tests below: output pages (their tokens are
the model's, which the simulator cannot know), concurrent duplicates and preemption.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import msgpack
import pytest

from conductor.wire.events import MASK64, AllBlocksCleared, BlockStored
from publishers.encoding import WireEvent
from publishers.engine.block_hash import SGLangBlockHasher
from publishers.engine.block_manager import BlockManager
from tests.publishers.engine.test_engine_server import parse, wait_subscribed
from tests.publishers.test_publisher import receive, replay, subscriber
from tests.support.api import eventually, matched, post
from tests.support.processes import ConductorProcess, EngineSim, free_port

FIXTURE = json.loads(
    (Path(__file__).resolve().parents[2] / "fixtures" / "sglang_frames.json").read_text()
)
STEPS: list[dict[str, Any]] = FIXTURE["steps"]
PAGE = FIXTURE["page_size"]
POOL_PAGES = FIXTURE["max_total_tokens"] // PAGE
MODEL = "tiny"
TS = slice(2, 10)  # a batch is fixarray(3), float64 marker, then the timestamp's 8 bytes
HASHER = SGLangBlockHasher()


def chain(tokens: list[int], page: int = PAGE, salt: str | None = None) -> list[int]:
    """The event hashes (unsigned) of the prompt's complete pages."""
    return [HASHER.event_hash(d) for d in HASHER.block_digests(tokens, page, cache_salt=salt)]


def events_config(events: int, replay_port: int) -> str:
    """SGLang's own --kv-events-config, bound on loopback as the capture ran it."""
    return json.dumps(
        {
            "publisher": "zmq",
            "endpoint": f"tcp://127.0.0.1:{events}",
            "bind": True,
            "replay_endpoint": f"tcp://127.0.0.1:{replay_port}",
            "topic": "kv-events",
        }
    )


def start_sim(log_dir: Path, instance_id: str, *args: str) -> EngineSim:
    engine = EngineSim(
        log_dir,
        instance_id,
        "--sim-engine",
        "sglang",
        "--num-gpu-blocks-override",
        str(POOL_PAGES),
        *args,
        model=MODEL,
        block_size=PAGE,
    )
    engine.wait_ready()
    return engine


@pytest.fixture
def sim(tmp_path: Path) -> Iterator[tuple[EngineSim, str, str]]:
    """A simulated SGLang with its event and replay endpoints."""
    events, replay_port = free_port(), free_port()
    engine = start_sim(
        tmp_path, "sglang-sim", "--kv-events-config", events_config(events, replay_port)
    )
    yield engine, f"tcp://127.0.0.1:{events}", f"tcp://127.0.0.1:{replay_port}"
    engine.stop()


async def run_step(
    http: aiohttp.ClientSession, engine: EngineSim, step: dict[str, Any]
) -> tuple[int, Any]:
    """The captured step against the simulator: its usage report, or the flush's answer."""
    if "flush_cache" in step:
        async with http.post(f"{engine.url}/flush_cache") as response:
            return response.status, await response.text()
    body = {"model": MODEL, "prompt": step["prompt"], "max_tokens": 1, "temperature": 0}
    if "cache_salt" in step:
        body["cache_salt"] = step["cache_salt"]
    status, answer = await post(http, f"{engine.url}/v1/completions", body)
    return status, answer["usage"] if status == 200 else answer


def expected_answer(step: dict[str, Any]) -> tuple[int, Any]:
    flush = step.get("flush_cache")
    return (flush["status"], flush["body"]) if flush else (200, step["usage"])


def assert_same_batch(payload: bytes, captured_hex: str) -> None:
    """Byte-equal but for the timestamp; decoded too, for a readable difference."""
    captured = bytes.fromhex(captured_hex)
    assert msgpack.unpackb(payload)[1:] == msgpack.unpackb(captured)[1:]
    assert payload[: TS.start] == captured[: TS.start] == b"\x93\xcb"
    assert payload[TS.stop :] == captured[TS.stop :]


# -- the sequence, frame by frame ---------------------------------------------------------


async def test_the_frames_replay_and_cached_tokens_are_sglangs(
    sim: tuple[EngineSim, str, str], http: aiohttp.ClientSession
) -> None:
    engine, events, replay_endpoint = sim
    with subscriber(events) as sub:  # after the start, as the capture: seq 0 is replay's
        for number, step in enumerate(STEPS):
            assert await run_step(http, engine, step) == expected_answer(step), number
            for captured in step["frames"]:
                topic, seq, payload = receive(sub)
                assert (topic.decode(), int.from_bytes(seq, "big")) == (
                    captured["topic"],
                    captured["seq"],
                ), number
                assert_same_batch(payload, captured["payload"])
        assert not sub.poll(200), "a frame SGLang did not publish"

    replies = replay(replay_endpoint, FIXTURE["replay"]["start_seq"])
    captured_replies = [[bytes.fromhex(f) for f in r] for r in FIXTURE["replay"]["replies"]]
    assert len(replies) == len(captured_replies)
    for reply, captured in zip(replies[:-1], captured_replies[:-1], strict=True):
        assert reply[:3] == captured[:3]  # delimiter, topic, seq
        assert_same_batch(reply[3], captured[3].hex())
    assert replies[-1] == captured_replies[-1] == [b"", b"", b"\xff" * 8, b""]


def test_page_hashes_are_sglangs() -> None:
    """Every captured BlockStored is a run of the prompt's page chain, parent included."""
    stored = 0
    for step in STEPS:
        for frame in step["frames"]:
            for event in frame["decoded"][1]:
                if event["type"] != "BlockStored":
                    continue
                pages = chain(step["prompt"], salt=step.get("cache_salt"))
                hashes = [value & MASK64 for value in event["block_hashes"]]
                first = pages.index(hashes[0])
                assert pages[first : first + len(hashes)] == hashes
                parent = event["parent_block_hash"]
                assert (parent & MASK64 if parent is not None else None) == (
                    pages[first - 1] if first else None
                )
                assert (
                    event["token_ids"]
                    == step["prompt"][first * PAGE : (first + len(hashes)) * PAGE]
                )
                stored += 1
    assert stored >= 10


async def test_a_busy_engine_refuses_to_flush_as_sglang(
    tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    """SGLang flushes only when idle (400 otherwise); vLLM's route is not there."""
    engine = start_sim(tmp_path, "sglang-busy", "--sim-time-scale", "1")
    flush = f"{engine.url}/flush_cache"
    try:
        body = {"model": MODEL, "prompt": list(range(100, 200)), "max_tokens": 300, "stream": True}
        async with http.post(f"{engine.url}/v1/completions", json=body) as streaming:
            assert streaming.status == 200
            await streaming.content.readline()  # its first token: it runs
            async with http.post(flush) as refused:
                assert (refused.status, await refused.text()) == (400, "Flush cache failed.\n")
        # the client went away: the request ends and the engine is idle again

        async def status() -> int:
            async with http.get(flush) as answer:
                return answer.status

        await eventually(status, lambda code: code == 200)
        async with http.post(f"{engine.url}/reset_prefix_cache") as response:
            assert response.status == 404
    finally:
        engine.stop()


def test_the_sglang_mode_takes_sglangs_events_config_and_refuses_vllm_only_flags() -> None:
    sglang = ("--sim-engine", "sglang")
    config = parse(*sglang, "--kv-events-config", events_config(5557, 5558)).kv_events_config
    assert config.enabled and config.bind and config.topic == "kv-events"
    assert not parse(*sglang).kv_events_config.enabled
    register = ("--sim-register-with", "http://127.0.0.1:13333")
    parse(*sglang, *register, "--kv-events-config", events_config(5557, 5558))  # it binds
    for refused in (
        (*sglang, "--kv-events-config", '{"enable_kv_cache_events": true}'),  # vLLM's key
        ("--kv-events-config", '{"publisher": "zmq", "bind": true}'),  # SGLang's, for vLLM
        (*sglang, "--sim-cpu-offload-blocks", "8"),
        (*sglang, "--prefix-caching-hash-algo", "sha256"),
    ):
        with pytest.raises(SystemExit):
            parse(*refused)


# -- SGLang's radix cache where the capture does not reach -------------------------------

SMALL_PAGE = 4


def radix(num_pages: int) -> BlockManager:
    """An SGLang cache of 4-token pages, its start-up AllBlocksCleared taken."""
    blocks = BlockManager(num_pages, SMALL_PAGE, engine="sglang")
    assert [type(wire.event) for wire in blocks.take_events()] == [AllBlocksCleared]
    return blocks


def page_hashes(tokens: list[int]) -> list[int]:
    return chain(tokens, SMALL_PAGE)


def summary(events: list[WireEvent]) -> list[tuple[str, list[int], int | None]]:
    """(type, hashes, parent) of each event."""
    return [
        (
            type(wire.event).__name__,
            getattr(wire.event, "block_hashes", []),
            wire.event.parent_hash if isinstance(wire.event, BlockStored) else None,
        )
        for wire in events
    ]


def test_pages_computed_twice_are_cached_and_announced_once() -> None:
    """Two requests for one prompt in one step both compute it (neither page is cached
    before its prefill is); the second's insert adopts the first's pages and frees its own."""
    blocks, prompt = radix(16), list(range(100, 110))  # 2 pages and 2 tokens
    first, second = blocks.allocate("a", prompt), blocks.allocate("b", prompt)
    assert first is not None and second is not None and second.num_cached_tokens == 0
    blocks.checkpoint("a")
    blocks.checkpoint("b")
    assert summary(blocks.take_events()) == [("BlockStored", page_hashes(prompt), None)]
    assert blocks.num_free_blocks == 16 - 3 - 1  # "b" keeps only its last, partial page
    blocks.free("a")
    blocks.free("b")
    assert blocks.take_events() == [] and blocks.num_free_blocks == 16
    again = blocks.allocate("c", prompt)
    assert again is not None and again.num_cached_tokens == 8


def test_output_pages_are_cached_when_the_request_finishes_not_when_preempted() -> None:
    blocks, prompt = radix(16), list(range(100, 106))  # 1 page and 2 tokens
    pages = page_hashes([*prompt, 7, 8])
    for request_id, finished in (("done", True), ("preempted", False)):
        blocks.allocate(request_id, prompt)
        blocks.checkpoint(request_id)
        for token in (7, 8, 9):  # the decode steps complete page 2: no event yet
            blocks.append_tokens(request_id, [token])
        stored = [("BlockStored", pages[:1], None)] if finished else []
        assert summary(blocks.take_events()) == stored
        blocks.free(request_id, finished=finished)
        outputs = [("BlockStored", pages[1:], pages[0])] if finished else []
        assert summary(blocks.take_events()) == outputs


def test_eviction_takes_free_pages_first_then_whole_leaves_oldest_first() -> None:
    """A 4-page prompt, then one sharing its first 2 pages (its match splits A's node):
    filling the pool evicts A's split-off tail, B's page, then the shared head, each node
    whole, in one BlockRemoved, as SGLang evicts leaves."""
    blocks = radix(8)
    a = list(range(100, 117))  # 4 pages and 1 token
    b = a[:8] + list(range(200, 205))  # A's first 2 pages, 1 page of its own and 1 token
    for request_id, prompt in (("a", a), ("b", b)):
        blocks.allocate(request_id, prompt)
        blocks.checkpoint(request_id)
        blocks.free(request_id)
    blocks.take_events()
    small = blocks.allocate("free pages only", list(range(300, 309)))  # 3 of the 4 free
    assert small is not None and blocks.take_events() == []
    blocks.free("free pages only", finished=False)
    blocks.allocate("c", list(range(400, 432)))  # 8 pages: every page
    blocks.checkpoint("c")
    removed = [*page_hashes(a)[2:], page_hashes(b)[2], *page_hashes(a)[:2]]
    assert summary(blocks.take_events()) == [
        ("BlockRemoved", removed, None),
        ("BlockStored", page_hashes(list(range(400, 432))), None),
    ]


# -- the conductor reads the simulated SGLang ------------------------------------------


def held_pages(steps: list[dict[str, Any]]) -> set[int]:
    """The page hashes SGLang held after ``steps``, from its own events."""
    held: set[int] = set()
    for step in steps:
        for frame in step["frames"]:
            for event in frame["decoded"][1]:
                hashes = {value & MASK64 for value in event.get("block_hashes", [])}
                if event["type"] == "BlockStored":
                    held |= hashes
                elif event["type"] == "BlockRemoved":
                    held -= hashes
                else:
                    held.clear()
    return held


def held_prefix(step: dict[str, Any], held: set[int]) -> int:
    """Tokens of the step's prompt in leading pages that are held."""
    pages = chain(step["prompt"], salt=step.get("cache_salt"))
    count = 0
    while count < len(pages) and pages[count] in held:
        count += 1
    return count * PAGE


async def test_the_conductor_indexes_the_simulated_sglang(
    tmp_path: Path, conductor: ConductorProcess, http: aiohttp.ClientSession
) -> None:
    """Before each request /query says what the simulator then reports cached (SGLang's
    own numbers); at the end it holds what SGLang held, evictions and flush applied."""
    engine = start_sim(
        tmp_path,
        "sglang-indexed",
        "--kv-events-config",
        events_config(0, 0),  # ports the OS picks; the registration names them
        "--sim-register-with",
        conductor.url,
    )
    try:
        await wait_subscribed(http, conductor, "sglang-indexed")
        requests = [step for step in STEPS if "prompt" in step]

        def indexed(step: dict[str, Any]) -> Callable[[], Awaitable[int]]:
            """The prompt's longest match on the engine (in its salt's namespace)."""
            salt = {"cache_salt": step["cache_salt"]} if "cache_salt" in step else {}
            fields = {"model": MODEL, "block_size": PAGE, **salt}
            return lambda: matched(http, conductor.url, step["prompt"], "sglang-indexed", **fields)

        for number, step in enumerate(STEPS):
            if "prompt" in step:
                cached = step["usage"]["prompt_tokens_details"]["cached_tokens"]
                await eventually(indexed(step), lambda tokens, c=cached: tokens == c)
            assert await run_step(http, engine, step) == expected_answer(step), number
        held = held_pages(STEPS)
        for step in requests:
            await eventually(indexed(step), lambda tokens, s=step: tokens == held_prefix(s, held))
    finally:
        engine.stop()
