"""The query lane (conductor.query_lane) answers as aiohttp does, over real sockets.

Two conductor processes hold the same blocks, one with the lane (the default) and one
with ``--no-query-lane``; the same raw requests must get the same statuses, content types,
our headers and bodies from both. Then the connection handling only the lane has: keep-alive
and pipelined requests, a connection handed to aiohttp at its first other request (and
served there to the end), heads and bodies split across reads, ``Connection: close``,
HTTP/1.0, heads the lane declines.
"""

from __future__ import annotations

import asyncio
import json

import msgpack
import pytest

from conductor.lane_http import parse_head
from tests.support.api import metric, post, register_and_connect
from tests.support.wire_publisher import stored

BLOCK = 4
TOKENS = list(range(1, 9))  # two blocks
QUERY = {"model": "m", "block_size": BLOCK, "token_ids": TOKENS}
PACKED = b"".join(token.to_bytes(4, "little") for token in TOKENS)  # as the router sends them


def request(
    body: bytes,
    path: str = "/query",
    content_type: str = "application/json",
    extra: str = "",
    version: str = "HTTP/1.1",
) -> bytes:
    head = (
        f"POST {path} {version}\r\nHost: 127.0.0.1\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\n{extra}\r\n"
    )
    return head.encode() + body


def as_json(payload: object, **options: str) -> bytes:
    return request(json.dumps(payload).encode(), **options)


def as_msgpack(payload: object, **options: str) -> bytes:
    return request(msgpack.packb(payload), content_type="application/msgpack", **options)


async def read_answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    status_line, *lines = head.decode("latin-1").rstrip("\r\n").split("\r\n")
    headers = {}
    for line in lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    length = int(headers.get("content-length", "0"))
    body = await asyncio.wait_for(reader.readexactly(length), 10)
    return int(status_line.split(" ")[1]), headers, body


async def exchange(port: int, *requests: bytes) -> list[tuple[int, dict[str, str], bytes]]:
    """Each request on one connection, answered before the next is sent."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        answers = []
        for raw in requests:
            writer.write(raw)
            answers.append(await read_answer(reader))
        return answers
    finally:
        writer.close()


def port_of(conductor) -> int:
    return int(conductor.url.rsplit(":", 1)[1])


@pytest.fixture
async def pair(conductor_factory, http, publisher_factory):
    """A conductor with the lane and one without, each holding TOKENS' two blocks."""
    with_lane = conductor_factory()
    without = conductor_factory("--no-query-lane")
    publisher = publisher_factory()
    for conductor in (with_lane, without):
        await register_and_connect(http, conductor.url, publisher, "engine-a", block_size=BLOCK)
    await publisher.publish([stored([11, 12], TOKENS, block_size=BLOCK)])
    for conductor in (with_lane, without):
        for _ in range(200):
            status, answer = await post(http, f"{conductor.url}/query", QUERY)
            if answer.get("default", {}).get("engine-a", {}).get("longest_matched") == 8:
                break
            await asyncio.sleep(0.05)
        else:
            pytest.fail(f"blocks never indexed: {answer}")
    return with_lane, without


SAME_ANSWERS = {
    "a hit, JSON": as_json(QUERY),
    "a hit, msgpack": as_msgpack(QUERY),
    "a hit, msgpack, tokens packed": as_msgpack({**QUERY, "token_ids": PACKED}),
    "only hits, msgpack": as_msgpack(
        {**QUERY, "token_ids": PACKED}, extra="X-Conductor-Hits-Only: 1\r\n"
    ),
    "as our router asks": as_msgpack(
        {**QUERY, "token_ids": PACKED, "tenant_id": "default", "lora_name": ""},
        extra="X-Conductor-Hits-Only: 1\r\nX-Conductor-Replica: r1\r\n"
        "X-Conductor-Replica-Lease: 7\r\n"
        'X-Conductor-Progress: ["engine-a"]\r\n',
    ),
    "only hits": as_json(QUERY, extra="X-Conductor-Hits-Only: 1\r\n"),
    "one instance": as_json({**QUERY, "instance_id": "engine-a"}),
    "no context": as_json({**QUERY, "block_size": 16}),
    "by hash": as_json(
        {"model": "m", "block_size": BLOCK, "seq_hashes": [11]}, path="/query_by_hash"
    ),
    "bad JSON": request(b"{not json"),
    "a field missing": as_json({"model": "m", "token_ids": TOKENS}),
    "a bad token": as_json({**QUERY, "token_ids": [1, "x"]}),
    "an unknown msgpack field": as_msgpack({**QUERY, "colour": 1}),
    "not msgpack": request(b"\xc1", content_type="application/msgpack"),
    "bad tiers": as_json(QUERY, extra="X-Conductor-Tiers: nope\r\n"),
    "charset parameter": as_json(QUERY, content_type="application/json; charset=utf-8"),
}


@pytest.mark.parametrize("case", SAME_ANSWERS)
async def test_the_lane_answers_as_aiohttp_does(pair, case):
    with_lane, without = pair
    raw = SAME_ANSWERS[case]
    [(status, headers, body)] = await exchange(port_of(with_lane), raw)
    [(status_aiohttp, headers_aiohttp, body_aiohttp)] = await exchange(port_of(without), raw)
    assert (status, body) == (status_aiohttp, body_aiohttp)
    assert "server" not in headers and "server" in headers_aiohttp  # each way was taken
    ours = ("no-context", "replica-loads", "other-replicas", "indexed-until")
    for name in ("content-type", *(f"x-conductor-{header}" for header in ours)):
        assert headers.get(name) == headers_aiohttp.get(name), name


async def test_keep_alive_then_another_route_hands_the_connection_to_aiohttp(pair, http):
    with_lane, _ = pair
    queries = 'conductor_http_requests_total{route="/query",status="200"}'
    before = await metric(http, with_lane.url, queries)
    health = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    answers = await exchange(
        port_of(with_lane), as_json(QUERY), as_json(QUERY), health, as_json(QUERY)
    )
    assert [status for status, _, _ in answers] == [200, 200, 200, 200]
    assert ["server" in headers for _, headers, _ in answers] == [False, False, True, True]
    assert json.loads(answers[3][2]) == json.loads(answers[0][2])
    assert await metric(http, with_lane.url, queries) == before + 3  # both ways counted


async def test_pipelined_and_split_requests_are_answered_in_order(pair):
    with_lane, _ = pair
    one, other = as_json(QUERY), as_json({**QUERY, "token_ids": TOKENS[:4]})
    reader, writer = await asyncio.open_connection("127.0.0.1", port_of(with_lane))
    writer.write(one + other)  # pipelined: both at once
    first, second = await read_answer(reader), await read_answer(reader)
    for piece in (other[:10], other[10:-3], other[-3:]):  # head and body in pieces
        writer.write(piece)
        await writer.drain()
        await asyncio.sleep(0.05)
    third = await read_answer(reader)
    writer.close()
    matched = [
        json.loads(body)["default"]["engine-a"]["longest_matched"]
        for _, _, body in (first, second, third)
    ]
    assert matched == [8, 4, 4]


async def test_many_pipelined_plain_queries_are_answered_in_order_and_counted(pair, http):
    """Plain queries are answered at once, in a loop over the buffer: a thousand in one
    write must neither recurse nor reorder."""
    with_lane, _ = pair
    plain = "conductor_plain_queries_total"
    before = await metric(http, with_lane.url, plain)
    one, other = as_json(QUERY), as_json({**QUERY, "token_ids": TOKENS[:4]})
    reader, writer = await asyncio.open_connection("127.0.0.1", port_of(with_lane))
    writer.write((one + other) * 500)
    matched = []
    for _ in range(1000):
        _, headers, body = await read_answer(reader)
        matched.append(json.loads(body)["default"]["engine-a"]["longest_matched"])
    writer.close()
    assert matched == [8, 4] * 500
    assert await metric(http, with_lane.url, plain) == before + 1000


@pytest.mark.parametrize(
    ("extra", "version"),
    [("Connection: close\r\n", "HTTP/1.1"), ("", "HTTP/1.0")],
    ids=["connection close", "HTTP/1.0"],
)
async def test_a_connection_not_kept_alive_is_closed_after_its_answer(pair, extra, version):
    with_lane, _ = pair
    reader, writer = await asyncio.open_connection("127.0.0.1", port_of(with_lane))
    writer.write(as_json(QUERY, extra=extra, version=version))
    status, headers, _ = await read_answer(reader)
    assert status == 200 and headers["connection"] == "close"
    assert await asyncio.wait_for(reader.read(), 5) == b""
    writer.close()


async def test_a_chunked_query_goes_to_aiohttp_and_is_answered(pair):
    with_lane, _ = pair
    body = json.dumps(QUERY).encode()
    chunked = (
        b"POST /query HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n"
        + f"{len(body):x}\r\n".encode()
        + body
        + b"\r\n0\r\n\r\n"
    )
    [(status, headers, answer)] = await exchange(port_of(with_lane), chunked)
    assert status == 200 and "server" in headers
    assert json.loads(answer)["default"]["engine-a"]["longest_matched"] == 8


async def test_the_token_is_checked_on_the_lane(conductor_factory):
    conductor = conductor_factory("--auth-token", "s3cret", "--auth-all")
    [(status, headers, _)] = await exchange(port_of(conductor), as_json(QUERY))
    assert status == 401 and headers["www-authenticate"] == "Bearer"
    assert "server" not in headers  # the lane refused it, not aiohttp
    [(status, headers, _)] = await exchange(
        port_of(conductor), as_json(QUERY, extra="Authorization: Bearer s3cret\r\n")
    )
    assert status == 200 and "server" not in headers


@pytest.mark.parametrize(
    "head",
    [
        b"GET /query HTTP/1.1\r\nContent-Length: 0",  # another method
        b"POST /query?x=1 HTTP/1.1\r\nContent-Length: 0",  # a query string
        b"POST /health HTTP/1.1\r\nContent-Length: 0",  # another route
        b"POST /query HTTP/2.0\r\nContent-Length: 0",  # another version
        b"POST /query HTTP/1.1",  # no length
        b"POST /query HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 1",  # two
        b"POST /query HTTP/1.1\r\nContent-Length: +1",  # not digits
        b"POST /query HTTP/1.1\r\nContent-Length: 1\r\nTransfer-Encoding: chunked",
        b"POST /query HTTP/1.1\r\nContent-Length: 1\r\nExpect: 100-continue",
        b"POST /query HTTP/1.1\r\nContent-Length: 1\r\nBad Name: x",  # not a token
        b"POST /query HTTP/1.1\r\nContent-Length: 1\r\n folded: x",  # obsolete folding
        b"POST  /query HTTP/1.1\r\nContent-Length: 1",  # two spaces
        b"POST /query HTTP/1.1\r\nContent-Length: 1\r\nX: a\nb",  # a bare line feed
    ],
)
def test_heads_the_lane_leaves_to_aiohttp(head):
    assert parse_head(head) is None


def test_a_plain_head_is_read():
    head = parse_head(
        b"POST /query_by_hash HTTP/1.0\r\nContent-Type: Application/Msgpack; x=y\r\n"
        b"content-length:  12 \r\nConnection: Keep-Alive\r\nX-Conductor-Hits-Only: 1"
    )
    assert head is not None
    assert (head.path, head.length, head.keep_alive) == ("/query_by_hash", 12, True)
    assert head.content_type == "application/msgpack"
    assert head.headers["x-conductor-hits-only"] == "1"
