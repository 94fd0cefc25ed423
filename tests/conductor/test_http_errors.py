"""Every bad request gets a precise status and a message naming the field (the app served
in-process: ``tests/conductor/conftest.py``)."""

from __future__ import annotations

import json

import msgpack
import pytest

from conductor.api import HttpLimits, _decode_msgpack, _plain_msgpack
from conductor.config import QueryRequest
from tests.support.api import get, post, register_and_connect, registration

VALID_QUERY = {"model": "m", "block_size": 4, "token_ids": [1, 2, 3, 4]}
VALID_REGISTRATION = {
    "endpoint": "tcp://127.0.0.1:1",
    "type": "vLLM",
    "modelname": "m",
    "instance_id": "a",
    "block_size": 4,
}


@pytest.mark.parametrize(
    ("path", "body", "status", "field", "message"),
    [
        ("/query", {**VALID_QUERY, "block_size": "16"}, 400, "block_size", "valid integer"),
        ("/query", {**VALID_QUERY, "block_size": -4}, 400, "block_size", "greater than 0"),
        ("/query", {**VALID_QUERY, "token_ids": [1, 2**31]}, 400, "token_ids", "element 1"),
        ("/query", {**VALID_QUERY, "token_ids": "1,2"}, 400, "token_ids", "array"),
        ("/query", {"block_size": 4, "token_ids": [1]}, 400, "model", "required"),
        ("/query", {**VALID_QUERY, "model": ""}, 400, "model", "at least 1"),
        ("/query", {**VALID_QUERY, "tenant_id": 7}, 400, "tenant_id", "valid string"),
        ("/query_by_hash", {**VALID_QUERY}, 400, "seq_hashes", "required"),
        ("/query_by_hash", {**VALID_QUERY, "seq_hashes": [2**64]}, 400, "seq_hashes.0", "less"),
        ("/register", {**VALID_REGISTRATION, "type": "TGI"}, 400, "type", "vLLM"),
        ("/register", {**VALID_REGISTRATION, "block_size": 0}, 400, "block_size", "greater"),
        ("/register", {**VALID_REGISTRATION, "dp_rank": -1}, 400, "dp_rank", "greater"),
        ("/register", {**VALID_REGISTRATION, "endpoint": ""}, 400, "endpoint", "at least 1"),
        ("/register", {**VALID_REGISTRATION, "endpoint": "http://x:1"}, 400, "endpoint", "tcp"),
        ("/register", {**VALID_REGISTRATION, "endpoint": "tcp://*:5557"}, 400, "endpoint", "bind"),
        ("/register", {**VALID_REGISTRATION, "endpoint": "tcp://nohost"}, 400, "endpoint", ""),
        *(
            ("/register", {**VALID_REGISTRATION, name: endpoint}, 400, name, message)
            for name in ("endpoint", "replay_endpoint")
            for endpoint, message in (
                ("tcp://127.0.0.1:00", 'port must be a number 1..65535, got "00"'),
                ("tcp://127.0.0.1:000", 'port must be a number 1..65535, got "000"'),
                ("tcp://127.0.0.1:0", 'port must be a number 1..65535, got "0"'),
                ("tcp://127.0.0.1:65536", 'port must be a number 1..65535, got "65536"'),
                ("tcp://127.0.0.1:+1", 'port must be a number 1..65535, got "+1"'),
                ("tcp://[127.0.0.1]:5557", "brackets hold an IPv6 address only, got [127.0.0.1]"),
                ("tcp://[::1:5557", "an IPv6 address goes in brackets on both sides, got [::1"),
            )
        ),
        ("/register", {**VALID_REGISTRATION, "kv_store": "store"}, 400, "kv_store", "host:port"),
        ("/register", {**VALID_REGISTRATION, "kv_store": ":5"}, 400, "kv_store", "host:port"),
        ("/register", {**VALID_REGISTRATION, "kv_store": "s:0"}, 400, "kv_store", "1..65535"),
        ("/register", {**VALID_REGISTRATION, "kv_store": "s:65536"}, 400, "kv_store", "host"),
        ("/register", {**VALID_REGISTRATION, "kv_store": 5}, 400, "kv_store", "valid string"),
        (
            "/register",
            {**VALID_REGISTRATION, "type": "Mooncake", "kv_store": "s:1"},
            400,
            "kv_store",
            "only engines",
        ),
        ("/unregister", {"tenant_id": "default"}, 400, "instance_id", "required"),
        ("/unregister", {"instance_id": "ghost"}, 404, "instance_id", "ghost|default|0"),
    ],
)
async def test_invalid_bodies(served, http, path, body, status, field, message):
    got_status, answer = await post(http, served.url + path, body)
    assert got_status == status, answer
    assert answer["field"] == field
    assert message in answer["error"]


@pytest.mark.parametrize("raw", [b"{bad", b"", b"[1,2]", b"null"])
async def test_malformed_json_is_400(served, http, raw):
    async with http.post(f"{served.url}/query", data=raw) as response:
        assert response.status == 400
        answer = await response.json()
    assert answer["error"] in ("Invalid JSON", "request body must be an object")


async def test_invalid_msgpack_is_400(served, http):
    headers = {"Content-Type": "application/msgpack"}
    async with http.post(f"{served.url}/query", data=b"\xc1", headers=headers) as response:
        assert response.status == 400


@pytest.mark.parametrize(
    ("method", "path"),
    [("GET", "/query"), ("GET", "/register"), ("POST", "/services"), ("PUT", "/global_view")],
)
async def test_wrong_method_is_405(served, http, method, path):
    async with http.request(method, served.url + path) as response:
        assert response.status == 405
        assert (await response.json())["error"] == "Method Not Allowed"


async def test_unknown_path_is_404(served, http):
    status, answer = await get(http, f"{served.url}/nope")
    assert status == 404 and answer["error"] == "Not Found"


async def test_oversized_body_is_413(serve_conductor, http):
    conductor = await serve_conductor("--max-body-bytes", "1024")
    body = {**VALID_QUERY, "token_ids": list(range(2000))}
    status, answer = await post(http, f"{conductor.url}/query", body)
    assert status == 413 and "too large" in answer["error"]
    status, _ = await post(http, f"{conductor.url}/query", VALID_QUERY)
    assert status == 200


async def test_reregistration_is_idempotent_and_conflicts_are_409(served, http, publisher_factory):
    publisher = publisher_factory()
    body = await register_and_connect(http, served.url, publisher, "a")
    assert await post(http, f"{served.url}/register", body) == (
        200,
        {"instance_id": "a", "status": "registered successfully"},
    )
    status, answer = await post(http, f"{served.url}/register", {**body, "block_size": 16})
    assert status == 409 and "a|default|0" in answer["error"]
    other = {**body, "instance_id": "b"}
    status, answer = await post(http, f"{served.url}/register", other)
    assert status == 409 and "already registered as a|default|0" in answer["error"]
    _, services = await get(http, f"{served.url}/services")
    assert services["count"] == 1


async def test_unknown_tenant_and_instance(served, http, publisher_factory):
    publisher = publisher_factory()
    await register_and_connect(http, served.url, publisher, "a")
    status, answer = await post(http, f"{served.url}/query", {**VALID_QUERY, "tenant_id": "x"})
    assert (status, answer) == (200, {})
    body = {**VALID_QUERY, "instance_id": "ghost"}
    status, answer = await post(http, f"{served.url}/query", body)
    zeros = {"longest_matched": 0, "DP": {}, "GPU": 0, "CPU": 0, "DISK": 0}
    assert (status, answer) == (200, {"default": {"ghost": zeros}})


async def test_service_survives_garbage(served, http):
    """After a barrage of bad requests the service still answers correctly."""
    for raw in (b"\x00" * 100, json.dumps({"token_ids": [None]}).encode(), b"[" * 10000):
        async with http.post(f"{served.url}/query", data=raw) as response:
            assert response.status == 400
    status, health = await get(http, f"{served.url}/health")
    assert status == 200 and health["status"] == "ok"


async def test_the_socket_limit_is_503_with_retry_after(serve_conductor, http, publisher_factory):
    conductor = await serve_conductor("--max-sockets", "10")
    answers = []
    for number in range(4):
        body = registration(publisher_factory(), f"engine-{number}")
        async with http.post(f"{conductor.url}/register", json=body) as response:
            answers.append((response.status, response.headers.get("Retry-After")))
            if response.status == 503:
                answer = await response.json()
    assert answers[0] == (200, None) and (503, "5") in answers, answers
    assert answer["field"] is None and answer["error"]
    _, services = await get(http, f"{conductor.url}/services")
    assert all(service["Stream"]["state"] != "failed" for service in services["services"])


async def test_endpoints_written_in_any_valid_form_register(served, http):
    endpoints = ("tcp://[::1]:5557", "tcp://127.0.0.1:05558", "tcp://127.0.0.1:0;localhost:5559")
    for number, endpoint in enumerate(endpoints):
        body = {**VALID_REGISTRATION, "endpoint": endpoint, "instance_id": f"e{number}"}
        assert (await post(http, f"{served.url}/register", body))[0] == 200, endpoint


@pytest.mark.parametrize(
    ("body", "status", "error"),
    [
        ({**VALID_QUERY, "token_ids": [1, "x"]}, 400, "token_ids: element 1 ('x') is not an int32"),
        ({**VALID_QUERY, "token_ids": [[1]]}, 400, "token_ids: element 0 ([1]) is not an int32"),
        ({**VALID_QUERY, "token_ids": b"\x01\x00\x00"}, 400, "token_ids: token bytes must be"),
        ({**VALID_QUERY, "block_size": "4"}, 400, "block_size: Input should be a valid integer"),
        ([1, 2], 400, "request body must be an object"),
        ({**VALID_QUERY, "token_ids": b"\x01\x00\x00\x00"}, 200, None),
    ],
)
async def test_msgpack_bodies_get_the_answers_json_bodies_get(served, http, body, status, error):
    headers = {"Content-Type": "application/msgpack"}
    data = msgpack.packb(body)
    async with http.post(f"{served.url}/query", data=data, headers=headers) as response:
        answer = msgpack.unpackb(await response.read())
    assert response.status == status, answer
    assert error is None or answer["error"].startswith(error), answer


PACKED = b"\x01\x00\x00\x00\x02\x00\x00\x00"


@pytest.mark.parametrize(
    "fields",
    [
        {"model": "m", "block_size": 4, "token_ids": PACKED},
        {"model": "m", "block_size": 4, "lora_name": "a", "tenant_id": "t", "token_ids": b""},
        {"token_ids": PACKED, "model": "m", "block_size": 8, "instance_id": "i", "cache_salt": "s"},
    ],
)
def test_a_plain_msgpack_query_is_read_as_the_general_way_reads_it(fields):
    """``_plain_msgpack``, the msgpack fast path, gives the model the general way gives."""
    body, items = msgpack.packb(fields), HttpLimits().item_limits["/query"]
    general = QueryRequest.model_validate(_decode_msgpack(body, items))
    assert _plain_msgpack(body, QueryRequest, items) == general


@pytest.mark.parametrize(
    "body",
    [
        msgpack.packb(VALID_QUERY),  # an item array: counted and checked the general way
        msgpack.packb({**VALID_QUERY, "token_ids": PACKED, "extra": 1}),  # an unknown key
        msgpack.packb({**VALID_QUERY, "token_ids": PACKED, "block_size": "4"}),  # invalid
        msgpack.packb({**VALID_QUERY, "token_ids": b"\x01"}),  # not whole int32s
        msgpack.packb({**VALID_QUERY, "token_ids": PACKED}).replace(b"\xa1m", b"\xa1\xff"),
        msgpack.packb({1: PACKED}),
        msgpack.packb([PACKED]),
        msgpack.packb({"model": "m", "block_size": 4}),  # no token_ids
        msgpack.packb({**VALID_QUERY, "token_ids": PACKED, "model": "m" * 70_000}),  # large
    ],
)
def test_the_msgpack_fast_path_leaves_anything_unusual_to_the_general_way(body):
    assert _plain_msgpack(body, QueryRequest, HttpLimits().item_limits["/query"]) is None


async def test_msgpack_that_cannot_be_decoded_is_400(served, http):
    undecodable = msgpack.packb(VALID_QUERY).replace(b"\xa1m", b"\xa1\xff")  # bad UTF-8
    headers = {"Content-Type": "application/msgpack"}
    for body in (undecodable, msgpack.packb({1: 2}), b"\xc1", msgpack.packb(VALID_QUERY)[:-1]):
        async with http.post(f"{served.url}/query", data=body, headers=headers) as response:
            answer = msgpack.unpackb(await response.read())
        assert (response.status, answer["error"]) == (400, "Invalid msgpack"), body


async def test_a_query_no_context_matches_says_which_contexts_the_model_has(served, http):
    """The HTTP API's example (then in the README, now docs/http-api.md) asked for block
    size 16 of a fleet running 32 and got ``{"default": {}}`` with no hint why."""
    for number, (block_size, lora) in enumerate([(32, ""), (32, "sql-adapter")]):
        body = {
            **VALID_REGISTRATION,
            "endpoint": f"tcp://127.0.0.1:{number + 1}",
            "instance_id": f"e{number}",
            "block_size": block_size,
        }
        status, _ = await post(http, f"{served.url}/register", {**body, "lora_name": lora})
        assert status == 200
    contexts = (
        'block_size=32 lora_name="" tenant_id="default", '
        'block_size=32 lora_name="sql-adapter" tenant_id="default"'
    )
    asked = [
        ("/query", {**VALID_QUERY, "block_size": 16}),
        ("/query_by_hash", {**VALID_QUERY, "block_size": 16, "seq_hashes": [1]}),
    ]
    for path, body in asked:
        async with http.post(served.url + path, json=body) as response:
            assert (response.status, await response.json()) == (200, {"default": {}})
            assert response.headers["X-Conductor-No-Context"] == (
                'no context matched model="m" block_size=16 lora_name="" tenant_id="default"; '
                f"contexts of the model: {contexts}"
            )
    other = {**VALID_QUERY, "model": "llama\n", "block_size": 32}
    async with http.post(f"{served.url}/query", json=other) as response:
        assert response.headers["X-Conductor-No-Context"] == (
            'no context matched model="llama\\n" block_size=32 lora_name="" '
            'tenant_id="default"; the model has none'
        )
    async with http.post(f"{served.url}/query", json={**VALID_QUERY, "block_size": 32}) as response:
        assert response.status == 200 and "X-Conductor-No-Context" not in response.headers
