"""Bearer-token auth and the /register endpoint allowlist, against the conductor app served
in-process."""

from __future__ import annotations

import logging

import pytest

from conductor.config import Registration
from conductor.security import EndpointAllowlist, EndpointRefused
from tests.support.api import get, post, register_and_connect, registration

TOKEN = "s3cret-token"
UNAUTHORIZED = {"error": "missing or invalid bearer token", "field": None}


def entry(endpoint: str, **fields: str) -> Registration:
    body = {"endpoint": endpoint, "type": "vLLM", "modelname": "m", "block_size": 4}
    return Registration.model_validate({**body, **fields})


async def test_mutating_routes_need_the_token(serve_conductor, http, publisher_factory):
    conductor = await serve_conductor("--auth-token", TOKEN)
    base = conductor.url
    body = registration(publisher_factory(), "a")
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
        async with http.post(f"{base}/register", json=body, headers=headers) as response:
            assert response.status == 401 and await response.json() == UNAUTHORIZED
            assert response.headers["WWW-Authenticate"] == "Bearer"
    async with http.post(f"{base}/unregister", json={"instance_id": "a"}) as response:
        assert response.status == 401
    routed = {"model": "m", "block_size": 4, "token_ids": [1] * 8, "instance_id": "a"}
    async with http.post(f"{base}/routed", json=routed) as response:  # it changes answers
        assert response.status == 401
    async with http.post(f"{base}/loads", json={"replica": "r"}) as response:  # so does it
        assert response.status == 401
    good = {"Authorization": f"Bearer {TOKEN}"}
    async with http.post(f"{base}/register", json=body, headers=good) as response:
        assert response.status == 200
    assert (await get(http, f"{base}/services"))[0] == 200  # reads stay open
    assert (await post(http, f"{base}/query", {"model": "m", "block_size": 4, "token_ids": [1]}))[
        0
    ] == 200


async def test_auth_all_guards_every_route_but_health(serve_conductor, http):
    conductor = await serve_conductor("--auth-all", config={"auth_token": TOKEN})
    base = conductor.url
    for path in ("/services", "/global_view", "/metrics"):
        assert await get(http, base + path) == (401, UNAUTHORIZED)
    assert (await get(http, f"{base}/health"))[0] == 200
    async with http.get(f"{base}/services", headers={"Authorization": f"Bearer {TOKEN}"}) as r:
        assert r.status == 200


async def test_unlisted_endpoints_are_403_and_never_contacted(served, http, caplog):
    """The default allowlist is loopback: /services cannot probe other hosts or sockets."""
    base = served.url
    for field, body in [
        ("endpoint", {"endpoint": "tcp://10.1.2.3:5557"}),
        ("endpoint", {"endpoint": "tcp://db.internal:5432"}),
        ("endpoint", {"endpoint": "ipc:///run/docker.sock"}),
        ("endpoint", {"endpoint": "inproc://x"}),
        (
            "replay_endpoint",
            {"endpoint": "tcp://127.0.0.1:1", "replay_endpoint": "tcp://10.0.0.1:1"},
        ),
        ("kv_store", {"endpoint": "tcp://127.0.0.1:1", "kv_store": "10.0.0.9:50051"}),
    ]:
        full = {"type": "vLLM", "modelname": "m", "block_size": 4, "instance_id": "x", **body}
        status, answer = await post(http, f"{base}/register", full)
        assert (status, answer["field"]) == (403, field), answer
        assert "register_allow" in answer["error"]
    assert (await get(http, f"{base}/services"))[1]["count"] == 0
    refusals = [r for r in caplog.records if "register refused" in r.getMessage()]
    assert refusals and all(record.levelno == logging.WARNING for record in refusals)


async def test_listed_hosts_and_star_are_allowed(serve_conductor, http, publisher_factory):
    publisher = publisher_factory()
    conductor = await serve_conductor("--register-allow", "10.0.0.0/8", "--register-allow", "*")
    await register_and_connect(http, conductor.url, publisher, "a")
    body = {
        "endpoint": "tcp://10.255.255.1:5557",
        "type": "vLLM",
        "modelname": "m",
        "block_size": 4,
    }
    assert (await post(http, f"{conductor.url}/register", {**body, "instance_id": "b"}))[0] == 200


def test_allowlist_rules() -> None:
    allowlist = EndpointAllowlist.parse(
        ["10.0.0.0/8", "Engine-1.local", "ipc:///run/engines/", "ipc:///tmp/one", "::1"]
    )
    for allowed in (
        "tcp://10.3.4.5:1",
        "tcp://engine-1.local:1",
        "ipc:///run/engines/a.sock",
        "ipc:///tmp/one",
        "tcp://[::1]:5557",
    ):
        allowlist.check(entry(allowed))
    for refused in (
        "tcp://11.0.0.1:1",
        "tcp://engine-2.local:1",
        "ipc:///run/engines/../docker.sock",
        "ipc:///tmp/one2",
        "tcp://10.0.0.1:1;192.168.0.1:2",  # the destination after ';' counts
        "inproc://x",
    ):
        with pytest.raises(EndpointRefused):
            allowlist.check(entry(refused))


def test_default_allowlist_is_loopback_and_the_config_hosts() -> None:
    allowlist = EndpointAllowlist.default([entry("tcp://10.0.0.5:5557", kv_store="store-1:50051")])
    allowlist.check(entry("tcp://10.0.0.5:6000"))
    allowlist.check(entry("tcp://localhost:1"))
    allowlist.check(entry("tcp://127.0.0.2:1", kv_store="store-1:1"))
    with pytest.raises(EndpointRefused, match="10.0.0.6"):
        allowlist.check(entry("tcp://10.0.0.6:5557"))
