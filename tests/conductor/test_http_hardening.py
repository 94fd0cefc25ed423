"""One request can neither hold the event loop nor a socket: item and body limits, head and
body timeouts with real slow clients, a connection cap, Go integer widths. Limits and widths
are checked in-process; slow clients, the connection cap and the loop lag against a
conductor process (its guarded socket). Requests hold ingest turns back on the guarded
socket, served in-process."""

from __future__ import annotations

import asyncio
import json
import re
import time
from array import array

import msgpack
import pytest
from aiohttp import web

from conductor.__main__ import parse_settings
from conductor.api import MSGPACK
from conductor.http_guard import GuardedSite
from conductor.service import GUARD, MANAGER, create_app
from tests.support.api import eventually, get, metric, post, register_and_connect
from tests.support.wire_publisher import stored

QUERY = {"model": "m", "block_size": 4, "token_ids": [1, 2, 3, 4]}
REGISTRATION = {"endpoint": "tcp://127.0.0.1:1", "type": "vLLM", "modelname": "m", "block_size": 4}
INT64_MAX = 2**63 - 1


def port_of(conductor) -> int:
    return int(conductor.url.rsplit(":", 1)[1])


async def closed_within(reader: asyncio.StreamReader, timeout: float) -> float:
    """Seconds until the server closed the connection (EOF or reset); bounded."""
    started = time.monotonic()
    try:
        async with asyncio.timeout(timeout):
            while await reader.read(1024):
                pass
    except ConnectionError:
        pass
    return time.monotonic() - started


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/register", {**REGISTRATION, "block_size": 2**63}, "block_size"),
        ("/register", {**REGISTRATION, "block_size": 2**64}, "block_size"),
        ("/register", {**REGISTRATION, "dp_rank": 2**64}, "dp_rank"),
        ("/unregister", {"instance_id": "a", "dp_rank": 2**63}, "dp_rank"),
        ("/query", {**QUERY, "block_size": 2**63}, "block_size"),
        ("/query", {**QUERY, "lora_id": 2**63}, "lora_id"),
        ("/query", {**QUERY, "lora_id": -(2**63) - 1}, "lora_id"),
        ("/register", {**REGISTRATION, "endpoint": "tcp://127.0.0.1:x"}, "endpoint"),
    ],
)
async def test_numbers_beyond_go_int64_are_400_naming_the_field(served, http, path, body, field):
    status, answer = await post(http, served.url + path, body)
    assert (status, answer["field"]) == (400, field), answer


async def test_the_largest_go_int_is_accepted_and_views_stay_msgpack_safe(
    served, http, publisher_factory
):
    base = served.url
    publisher = publisher_factory()
    await register_and_connect(http, base, publisher, "a", dp_rank=INT64_MAX)
    headers = {"Accept": "application/msgpack"}
    for path in ("/services", "/global_view", "/health"):
        async with http.get(base + path, headers=headers) as response:
            assert response.status == 200, path


async def test_item_limits_are_413_naming_the_field(serve_conductor, http):
    conductor = await serve_conductor("--max-query-tokens", "64", "--max-query-hashes", "8")
    base = conductor.url
    status, answer = await post(http, f"{base}/query", {**QUERY, "token_ids": [1] * 65})
    assert (status, answer["field"]) == (413, "token_ids") and "at most 64" in answer["error"]
    body = {**QUERY, "seq_hashes": list(range(9))}
    status, answer = await post(http, f"{base}/query_by_hash", body)
    assert (status, answer["field"]) == (413, "seq_hashes")
    assert (await post(http, f"{base}/query", {**QUERY, "token_ids": [1] * 64}))[0] == 200


async def test_small_routes_have_a_small_body_limit(served, http):
    body = {**REGISTRATION, "modelname": "m" * 100_000}
    status, answer = await post(http, f"{served.url}/register", body)
    assert status == 413 and "limit 65536" in answer["error"]


async def test_a_head_sent_byte_by_byte_is_cut_off(conductor_factory, http):
    conductor = conductor_factory("--header-timeout-s", "0.5")
    reader, writer = await asyncio.open_connection("127.0.0.1", port_of(conductor))
    head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 1000

    async def trickle() -> None:
        for byte in head:
            writer.write(bytes([byte]))
            await writer.drain()
            await asyncio.sleep(0.02)

    sender = asyncio.create_task(trickle())
    elapsed = await closed_within(reader, timeout=5)
    sender.cancel()
    await asyncio.gather(sender, return_exceptions=True)
    writer.close()
    assert elapsed < 5  # closed by the server well before the head was complete
    assert (await get(http, f"{conductor.url}/health"))[0] == 200
    closed = 'conductor_http_connections_closed_total{reason="header_timeout"}'
    assert await metric(http, conductor.url, closed) == 1


async def test_a_silent_connection_is_cut_off_and_keepalive_requests_are_not(
    conductor_factory, http
):
    conductor = conductor_factory("--header-timeout-s", "0.5")
    silent_reader, silent = await asyncio.open_connection("127.0.0.1", port_of(conductor))
    reader, writer = await asyncio.open_connection("127.0.0.1", port_of(conductor))
    for _ in range(3):  # each head arrives at once: 3 requests over 1 s on one connection
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert b"200 OK" in await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        length = await asyncio.wait_for(reader.readuntil(b"}"), 5)
        assert length
        await asyncio.sleep(0.4)
    assert await closed_within(silent_reader, timeout=5) < 5
    silent.close()
    writer.close()


async def test_a_slow_body_is_408_and_the_service_answers(conductor_factory, http):
    conductor = conductor_factory("--body-timeout-s", "0.5")
    reader, writer = await asyncio.open_connection("127.0.0.1", port_of(conductor))
    writer.write(
        b"POST /query HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 1000\r\n\r\n{"
    )
    answer = await asyncio.wait_for(reader.read(4096), 5)
    assert answer.startswith(b"HTTP/1.1 408") and b"not received within 0.5 s" in answer
    assert await closed_within(reader, timeout=5) < 5
    writer.close()
    assert (await get(http, f"{conductor.url}/health"))[0] == 200


async def test_connections_beyond_the_limit_are_closed_and_the_others_served(
    conductor_factory, http
):
    conductor = conductor_factory("--max-connections", "3")
    port = port_of(conductor)
    held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(3)]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    assert await closed_within(reader, timeout=5) < 5  # the 4th: closed at once
    writer.close()
    first_reader, first = held[0]
    first.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert b"200 OK" in await asyncio.wait_for(first_reader.readuntil(b"\r\n\r\n"), 5)
    for _, held_writer in held:
        held_writer.close()
    closed = 'conductor_http_connections_closed_total{reason="limit"}'
    assert await eventually(lambda: metric(http, conductor.url, closed), bool) >= 1


async def test_worst_loop_lag_under_maximum_requests(conductor, http, publisher_factory):
    """64 instances with a big index; maximum-size /query and /query_by_hash (every hash a
    miss: the costly lookup) and register/unregister churn; prints the worst lag seen."""
    base = conductor.url
    publishers = [publisher_factory(with_replay=False) for _ in range(64)]
    for number, publisher in enumerate(publishers):
        status, _ = await post(
            http,
            f"{base}/register",
            {
                "endpoint": publisher.endpoint,
                "type": "vLLM",
                "modelname": "m",
                "instance_id": f"i{number}",
                "block_size": 16,
            },
        )
        assert status == 200
    await asyncio.sleep(0.5)  # subscriptions travel after the connects
    for number, publisher in enumerate(publishers):
        hashes = [number * 100_000 + block for block in range(500)]
        await publisher.publish([stored(hashes, list(range(500 * 16)), block_size=16)])
    tokens = [token % 50_000 for token in range(131_072)]
    hashes = list(range(10**12, 10**12 + 8_192))
    before = await lag_buckets(http, base)
    for _ in range(3):
        status, _ = await post(
            http, f"{base}/query", {"model": "m", "block_size": 16, "token_ids": tokens}
        )
        assert status == 200
        body = {"model": "m", "block_size": 16, "seq_hashes": hashes}
        assert (await post(http, f"{base}/query_by_hash", body))[0] == 200
    extra = publisher_factory(with_replay=False)
    churn = {
        "endpoint": extra.endpoint,
        "type": "vLLM",
        "modelname": "m",
        "instance_id": "c",
        "block_size": 16,
    }
    for _ in range(10):
        assert (await post(http, f"{base}/register", churn))[0] == 200
        assert (await post(http, f"{base}/unregister", {"instance_id": "c"}))[0] == 200
    await asyncio.sleep(0.1)
    after = await lag_buckets(http, base)
    worst = max(
        (bound for bound, count in after.items() if count > before.get(bound, 0)), default=0
    )
    print(f"worst event-loop lag bucket: <= {worst} s")
    assert worst <= 0.25  # generous for a loaded 2-core machine; the aim is < 0.05


async def lag_buckets(http, base: str) -> dict[float, float]:
    """Observations per histogram bucket (not cumulative) of the loop-lag histogram."""
    async with http.get(f"{base}/metrics") as response:
        text = await response.text()
    pattern = r'^conductor_event_loop_lag_seconds_bucket\{le="([^"]+)"\} (\S+)$'
    cumulative = [(float(le), float(n)) for le, n in re.findall(pattern, text, re.MULTILINE)]
    assert cumulative, "no loop-lag histogram on /metrics"
    counts, previous = {}, 0.0
    for bound, total in cumulative:
        counts[bound], previous = total - previous, total
    return counts


async def test_ingest_turns_wait_while_a_request_is_answered_on_the_guarded_socket(tmp_path):
    """From a request's first bytes to its answer, the index's turns wait (a query's rounds
    run without ingest steps between them); a dropped connection ends its request too."""
    config = tmp_path / "conductor_config.json"
    config.write_text("{}")
    settings, limits, parsed, _ = parse_settings(["--config", str(config), "--state-file", ""])
    app = create_app(settings, limits, parsed, None)
    share = app[MANAGER].loop_share
    share.defer_s = 10.0

    async def requests() -> int:
        return share.requests

    runner = web.AppRunner(app)
    await runner.setup()
    try:
        site = GuardedSite(runner, app[GUARD], host="127.0.0.1", port=0)
        await site.start()
        port = runner.addresses[0][1]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        body = json.dumps(QUERY).encode()
        writer.write(b"POST /query HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n")
        await eventually(requests, lambda n: n == 1)
        turn = asyncio.create_task(share.turn())
        await asyncio.sleep(0.05)
        assert not turn.done()
        writer.write(b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)).startswith(
            b"HTTP/1.1 200"
        )
        await asyncio.wait_for(turn, 5)
        assert share.requests == 0

        writer.write(b"GET /health HTTP/1.1\r\n")  # a request cut off by its client
        await eventually(requests, lambda n: n == 1)
        writer.close()
        await eventually(requests, lambda n: n == 0)
    finally:
        await runner.cleanup()


def _ones(count: int) -> bytes:
    return b",".join([b"1"] * count)


async def refused_at_once(http, url: str, body: bytes, content_type: str) -> tuple[int, str]:
    """The status and error of a body the service must refuse within a second, which it
    must answer correctly after."""
    headers = {"Content-Type": content_type, "Accept": MSGPACK}
    started = time.monotonic()
    async with http.post(url, data=body, headers=headers) as response:
        answer = msgpack.unpackb(await response.read())
    assert time.monotonic() - started < 1.0
    base = url.rsplit("/", 1)[0]
    assert (await post(http, f"{base}/query", QUERY))[0] == 200
    return response.status, answer["error"]


# each body would decode to a 400 for its block_size: a 413 means its items were counted first
PACKED_TOKENS = array("i", [1] * 400_000).tobytes()
COUNTED_BEFORE_DECODING = [
    (
        "/query",
        MSGPACK,
        msgpack.packb({"model": "m", "token_ids": [1] * 1_500_000, "block_size": "4"}),
        "token_ids: at most 131072 per request, got 1500000",
    ),
    (
        "/query",
        MSGPACK,
        msgpack.packb({"model": "m", "token_ids": PACKED_TOKENS, "block_size": "4"}),
        "token_ids: at most 131072 per request, got 400000",
    ),
    (
        "/query",
        "application/json",
        b'{"model": "m", "token\\u005fids": [' + _ones(800_000) + b'], "block_size": "4"}',
        "token_ids: at most 131072 per request, got 800000",
    ),
    (
        "/query_by_hash",
        MSGPACK,
        msgpack.packb({"model": "m", "block_hash": [1] * 100_000, "block_size": "4"}),
        "seq_hashes: at most 8192 per request, got 100000",
    ),
    (
        "/query_by_hash",
        "application/json",
        b'{"model": "m", "seq_hashes": [' + _ones(80_000) + b'], "block_size": "4"}',
        "seq_hashes: at most 8192 per request, got 80000",
    ),
]


@pytest.mark.parametrize(("path", "content_type", "body", "message"), COUNTED_BEFORE_DECODING)
async def test_items_are_counted_before_the_body_is_decoded(
    shared_conductor, http, path, content_type, body, message
):
    """A msgpack body within the route's byte cap (sized for JSON) held ~12x the token
    limit and was decoded in full before its 413; so was a JSON body whose key is escaped
    (the C token reader declines it)."""
    url = shared_conductor.url + path
    assert await refused_at_once(http, url, body, content_type) == (413, message)


NESTED = b"[" + b",".join([b"[]"] * 500_000) + b"]"
NESTED_MODEL = b'{"model": ' + NESTED + b', "block_size": 4, "token_ids": [1]}'


@pytest.mark.parametrize(
    ("content_type", "body", "status", "message"),
    [
        (
            "application/json",
            b'{"model": "m", "block_size": 4, "token_ids": ' + NESTED + b"}",
            400,
            "token_ids: must be an array of integers",
        ),
        (
            MSGPACK,
            msgpack.packb(
                {"model": "m", "block_size": 4, "token_ids": [[[[[[[[[[]]]]]]]]]] * 99_999}
            ),
            400,
            "token_ids: must be an array of integers",
        ),
        ("application/json", NESTED, 400, "request body must be an object"),
        (
            "application/json",
            NESTED_MODEL,
            413,
            f"request body too large: its fields besides token_ids take {len(NESTED_MODEL) - 3} "
            "bytes (limit 65536)",
        ),
    ],
)
async def test_nested_values_are_refused_before_decoding(
    shared_conductor, http, content_type, body, status, message
):
    """A body of nested empty arrays held the event loop before it was refused, as
    pydantic or msgpack built a Python list for each."""
    url = f"{shared_conductor.url}/query"
    assert await refused_at_once(http, url, body, content_type) == (status, message)
