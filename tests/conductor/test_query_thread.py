"""The query thread (``_native.QueryThread``, ``conductor.query_thread``).

In-process first: the thread serves a real loopback socket, with the plans of random
fleets (test_plain_query's); each answer it writes must be the handler's, byte for byte,
and each request it declines must reach the loop whole, with its socket. Then a conductor
process with ``--query-thread``: its answers are a conductor's without the thread, over
connections the kernel spreads over the thread and the loop; pipelines cut by another
route, requests split across writes, slots coming and going, routed prompts, the token,
the connection limit, keep-alive and shutdown.
"""

from __future__ import annotations

import asyncio
import random
import select
import signal
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from conductor import _native
from conductor.api import MSGPACK, PLAIN_HEADS, ConductorApi
from conductor.index import ContextKey
from conductor.loads import REPLICA_HEADER
from tests.conductor.test_plain_query import (
    HITS_ONLY,
    MODEL,
    both_ways,
    random_fleet,
    random_query,
    raw_query,
)
from tests.conductor.test_query_lane import QUERY, TOKENS, as_json, as_msgpack, read_answer
from tests.support.api import metric, post, register_and_connect, registration
from tests.support.wire_publisher import stored

BLOCK = 4
PACKED_QUERY = {**QUERY, "token_ids": b"".join(t.to_bytes(4, "little") for t in TOKENS)}


# -- in-process: the thread's own answers ------------------------------------------------------
@contextmanager
def serving(api: ConductorApi) -> Iterator[tuple[_native.QueryThread, int]]:
    """A query thread of ``api``'s on a loopback socket of its own, and its port; stopped
    and closed after."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        listener.setblocking(False)
        limits = api.options.limits
        thread = _native.QueryThread(
            PLAIN_HEADS, (listener,), api.thread_heads(), MSGPACK.encode(), None,
            limits.body_bytes("/query"), limits.max_query_tokens, 5.0, (0.001, 0.01), 64,
        )  # fmt: skip
        thread.start()
        try:
            yield thread, listener.getsockname()[1]
        finally:
            thread.stop()


def ask(thread: _native.QueryThread, port: int, raw: bytes) -> bytes | None:
    """The thread's answer to ``raw`` on a new connection; None if it handed it to the loop
    (then it must have given the request whole)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as client:
        client.sendall(raw)
        readable, _, _ = select.select([client, thread.handover_fd], [], [], 5)
        assert readable, "neither answered nor handed over"
        if client not in readable:
            [(fd, pending)] = thread.handovers()
            socket.socket(fileno=fd).close()
            assert pending == raw
            return None
        answer = b""
        while b"\r\n\r\n" not in answer or len(answer) < body_end(answer):
            chunk = client.recv(65536)
            assert chunk, "closed before the whole answer"
            answer += chunk
        return answer


def body_end(answer: bytes) -> int:
    head, _, _ = answer.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1])
        for line in head.split(b"\r\n")
        if line.startswith(b"Content-Length")
    )
    return len(head) + 4 + length


@pytest.mark.parametrize("seed", range(4))
async def test_the_threads_answers_are_the_handlers(seed: int) -> None:
    rng = random.Random(seed)
    answered = must = 0
    for _ in range(8):
        fleet = random_fleet(rng)
        api = fleet.api
        key = ContextKey("default", MODEL, "", fleet.block_size)
        plans = api.thread_plans(key)
        with serving(api) as (thread, port):
            thread.publish(("default", MODEL, "", fleet.block_size), *plans)
            thread.set_routed(api.routed.holds_any())
            for _ in range(15):
                payload, packed, own = random_query(rng, fleet)
                extra = HITS_ONLY if rng.random() < 0.5 else ""
                if rng.random() < 0.1:  # a replica's: the loop's (it may have to wait)
                    extra += f"{REPLICA_HEADER}: replica-a\r\n"
                    own = False
                raw = raw_query(payload, packed, extra)
                answer = ask(thread, port, raw)
                _, handler = await both_ways(api, raw)
                if answer is not None:
                    assert answer == handler, payload
                    answered += 1
                salted = "cache_salt" in payload and plans[2] is not None  # the loop's
                if own and plans[0] is not None and not api.routed.holds_any() and not salted:
                    must += 1
                    assert answer is not None, payload
    print(f"{answered} answered by the thread, {must} of them had to be")
    assert answered >= must > 0


async def test_a_held_context_waits_for_its_plans() -> None:
    fleet = random_fleet(random.Random(3))
    key = ("default", MODEL, "", fleet.block_size)
    with serving(fleet.api) as (thread, port):
        thread.hold(key)
        raw = raw_query({"model": MODEL, "block_size": fleet.block_size, "token_ids": [1]}, False)
        answer = asyncio.get_running_loop().run_in_executor(None, ask, thread, port, raw)
        await asyncio.sleep(0.3)
        assert not answer.done()  # waiting, not handed over
        thread.publish(key, *fleet.api.thread_plans(ContextKey(*key)))
        assert await asyncio.wait_for(answer, 5) == (await both_ways(fleet.api, raw))[1]
        assert 0 < time.monotonic() - thread.last_request < 5  # the loop's steps stay short
        thread.hold(key)  # never published again: the loop's after a second
        started = time.monotonic()
        assert (
            await asyncio.wait_for(
                asyncio.get_running_loop().run_in_executor(None, ask, thread, port, raw), 5
            )
            is None
        )
        assert 0.9 < time.monotonic() - started < 3


def test_a_query_thread_is_made_with_what_it_needs() -> None:
    with pytest.raises(ValueError, match="head reader"):
        _native.QueryThread(
            _native.HeadReader(b"/query", (), ()), (), (b"", b""), b"m", None, 1, 1, 1.0, (), 1
        )
    with pytest.raises(ValueError, match="keep-alive"):
        _native.QueryThread(PLAIN_HEADS, (), (b"", b""), b"m", None, 1, 1, 0.0, (), 1)
    thread = _native.QueryThread(PLAIN_HEADS, (), (b"", b""), b"m", None, 1, 1, 1.0, (), 1)
    with pytest.raises(TypeError, match="QueryPlan"):
        thread.publish(("t", "m", "", 4), object(), None, None)
    with pytest.raises(TypeError, match="ProfileChain"):
        thread.publish(("t", "m", "", 4), None, None, b"")
    thread.stop()  # never started: nothing to stop
    unmade = _native.QueryThread.__new__(_native.QueryThread)
    with pytest.raises(RuntimeError, match="not made"):
        unmade.hold(("t", "m", "", 4))
    with pytest.raises(RuntimeError, match="not made"):
        unmade.start()


# -- a conductor process with the thread ---------------------------------------------------------
def port_of(conductor) -> int:
    return int(conductor.url.rsplit(":", 1)[1])


async def until_indexed(http, conductor, matched: int = 8) -> None:
    for _ in range(200):
        _, answer = await post(http, f"{conductor.url}/query", QUERY)
        if answer.get("default", {}).get("engine-a", {}).get("longest_matched") == matched:
            return
        await asyncio.sleep(0.05)
    pytest.fail("blocks never indexed")


@pytest.fixture
async def pair(conductor_factory, http, publisher_factory):
    """A conductor with the thread and one without, each holding TOKENS' two blocks."""
    threaded = conductor_factory("--query-thread")
    plain = conductor_factory()
    publisher = publisher_factory()
    for conductor in (threaded, plain):
        await register_and_connect(http, conductor.url, publisher, "engine-a", block_size=BLOCK)
    await publisher.publish([stored([11, 12], TOKENS, block_size=BLOCK)])
    for conductor in (threaded, plain):
        await until_indexed(http, conductor)
    return threaded, plain


async def on_connections(port: int, raw: bytes, count: int = 24) -> list[tuple[int, str, bytes]]:
    """``raw`` sent on ``count`` connections at once: each (status, content type, body)."""

    async def one() -> tuple[int, str, bytes]:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(raw)
            status, headers, body = await read_answer(reader)
            return status, headers.get("content-type", ""), body
        finally:
            writer.close()

    return await asyncio.gather(*(one() for _ in range(count)))


CASES = {
    "JSON": as_json(QUERY),
    "msgpack, packed": as_msgpack(PACKED_QUERY),
    "msgpack, an array": as_msgpack(QUERY),  # the loop's: C reads packed token ids only
    "hits only": as_json(QUERY, extra="X-Conductor-Hits-Only: 1\r\n"),
    "salted": as_json({**QUERY, "cache_salt": "s"}),
    "HTTP/1.0": as_json(QUERY, version="HTTP/1.0"),
    "a replica's": as_msgpack(PACKED_QUERY, extra="X-Conductor-Replica: r1\r\n"),
    "one instance": as_json({**QUERY, "instance_id": "engine-a"}),
    "no context": as_json({**QUERY, "block_size": 16}),
    "bad JSON": as_json({"model": "m"})[:-3] + b"{{{",
    "tiers": as_json(QUERY, extra="X-Conductor-Tiers: gpu\r\n"),
}


async def test_the_thread_answers_as_a_conductor_without_it(pair, http):
    threaded, plain = pair
    thread_queries = "conductor_query_thread_queries_total"
    before = await metric(http, threaded.url, thread_queries)
    for case, raw in CASES.items():
        [expected] = await on_connections(port_of(plain), raw, 1)
        assert set(await on_connections(port_of(threaded), raw)) == {expected}, case
    assert await metric(http, threaded.url, thread_queries) > before
    assert await metric(http, threaded.url, "conductor_query_thread_handovers_total") > 0


async def test_a_pipeline_cut_by_another_route_goes_on_in_the_loop(pair):
    threaded, _ = pair
    one, other = as_json(QUERY), as_json({**QUERY, "token_ids": TOKENS[:4]})
    health = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"

    async def pipeline() -> list[int]:
        reader, writer = await asyncio.open_connection("127.0.0.1", port_of(threaded))
        writer.write((one + other) * 20 + health + one)
        answers = [await read_answer(reader) for _ in range(42)]
        writer.close()
        assert answers[40][0] == 200 and b'"status"' in answers[40][2]
        return [body.count(b'"longest_matched":8') for _, _, body in answers[:40] + answers[41:]]

    for matched in await asyncio.gather(*(pipeline() for _ in range(12))):
        assert matched == [1, 0] * 20 + [1]


async def test_a_request_split_across_writes_is_answered(pair):
    threaded, _ = pair
    raw = as_json(QUERY)

    async def split(pause: float) -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", port_of(threaded))
        for piece in (raw[:10], raw[10:-3], raw[-3:]):
            writer.write(piece)
            await writer.drain()
            await asyncio.sleep(pause)
        _, _, body = await read_answer(reader)
        writer.close()
        return body

    bodies = await asyncio.gather(*(split(0.05) for _ in range(8)), *(split(0.7) for _ in range(8)))
    assert all(b'"longest_matched":8' in body for body in bodies)


async def test_a_client_that_ends_its_side_gets_its_answers(pair):
    threaded, _ = pair

    async def ended() -> list[int]:
        reader, writer = await asyncio.open_connection("127.0.0.1", port_of(threaded))
        writer.write(as_json(QUERY) * 2)
        writer.write_eof()
        statuses = [(await read_answer(reader))[0] for _ in range(2)]
        assert await asyncio.wait_for(reader.read(), 3) == b""  # then closed
        writer.close()
        return statuses

    assert await asyncio.gather(*(ended() for _ in range(12))) == [[200, 200]] * 12


async def test_slots_coming_and_going_are_seen_at_once(pair, http, publisher_factory):
    threaded, plain = pair
    newcomer = publisher_factory()
    for conductor in (threaded, plain):
        await register_and_connect(http, conductor.url, newcomer, "engine-b", block_size=BLOCK)
    raw = as_json(QUERY)
    [expected] = await on_connections(port_of(plain), raw, 1)
    assert b"engine-b" in expected[2]
    assert set(await on_connections(port_of(threaded), raw)) == {expected}
    for conductor in (threaded, plain):
        status, _ = await post(http, f"{conductor.url}/unregister", {"instance_id": "engine-a"})
        assert status == 200
    [expected] = await on_connections(port_of(plain), raw, 1)
    assert b"engine-a" not in expected[2]
    assert set(await on_connections(port_of(threaded), raw)) == {expected}


async def test_a_routed_prompt_is_counted_at_once(pair, http):
    threaded, plain = pair
    routed = {"model": "m", "block_size": BLOCK, "token_ids": TOKENS + [9, 9, 9, 9]}
    for conductor in (threaded, plain):
        status, _ = await post(http, f"{conductor.url}/routed", {**routed, "instance_id": "b"})
        assert status == 200
    raw = as_json({**QUERY, "token_ids": routed["token_ids"]})
    [expected] = await on_connections(port_of(plain), raw, 1)
    assert set(await on_connections(port_of(threaded), raw)) == {expected}


async def test_the_token_is_checked_on_the_thread(conductor_factory, http, publisher_factory):
    conductor = conductor_factory("--query-thread", "--auth-token", "t0k", "--auth-all")
    token = {"Authorization": "Bearer t0k"}
    body = registration(publisher_factory(), "engine-a", block_size=BLOCK)
    status, _ = await post(http, f"{conductor.url}/register", body, token)
    assert status == 200
    port = port_of(conductor)
    refused = await on_connections(port, as_json(QUERY))
    assert {status for status, _, _ in refused} == {401}
    wrong = await on_connections(port, as_json(QUERY, extra="Authorization: Bearer nope\r\n"))
    assert {status for status, _, _ in wrong} == {401}
    answered = "conductor_query_thread_queries_total"
    async with http.get(f"{conductor.url}/metrics", headers=token) as response:
        assert f"{answered} 0.0" in await response.text()
    passed = await on_connections(port, as_json(QUERY, extra="Authorization: bearer  t0k \r\n"))
    assert {status for status, _, _ in passed} == {200}
    async with http.get(f"{conductor.url}/metrics", headers=token) as response:
        assert f"{answered} 0.0" not in await response.text()  # the thread let some through


async def test_one_connection_limit_for_the_thread_and_the_loop(conductor_factory):
    """Connections opened one after the other (both sides accept at once otherwise, each
    before it hears of the other's newest)."""
    conductor = conductor_factory("--query-thread", "--max-connections", "4")
    opened, served = [], 0
    for _ in range(10):
        reader, writer = await asyncio.open_connection("127.0.0.1", port_of(conductor))
        opened.append(writer)
        writer.write(as_json(QUERY))
        try:
            await read_answer(reader)
            served += 1
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
    for writer in opened:
        writer.close()
    assert served == 4


async def test_idle_connections_are_closed_after_keep_alive(conductor_factory):
    conductor = conductor_factory("--query-thread", "--keepalive-timeout-s", "0.3")
    opened = [await asyncio.open_connection("127.0.0.1", port_of(conductor)) for _ in range(8)]
    for reader, writer in opened:
        writer.write(as_json(QUERY))
        await read_answer(reader)
    for reader, writer in opened:
        assert await asyncio.wait_for(reader.read(), 3) == b""  # closed by the service
        writer.close()


async def test_it_stops_with_connections_open(conductor_factory):
    conductor = conductor_factory("--query-thread")
    opened = [await asyncio.open_connection("127.0.0.1", port_of(conductor)) for _ in range(8)]
    for reader, writer in opened:
        writer.write(as_json(QUERY))
        await read_answer(reader)
    conductor.process.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(conductor.process.wait, 10) == 0
    for _, writer in opened:
        writer.close()
