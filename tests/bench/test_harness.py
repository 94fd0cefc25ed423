"""The benchmarks' HTTP client keeps its queries where a router keeps them."""

from __future__ import annotations

import json

from bench.harness import JSON_TYPE, running_service


def test_queries_stay_in_the_query_lane_after_other_requests() -> None:
    """``/health`` and ``/metrics`` go on one connection; ``/query`` on another, which
    the conductor answers in its query lane (``conductor.query_lane``), the path a
    router's queries take. aiohttp names itself in a ``Server`` header; the lane does not,
    and would no more once anything else had been asked on that connection."""
    body = json.dumps({"model": "m", "block_size": 16, "token_ids": list(range(16))}).encode()
    with running_service() as (_, client):
        client.json("GET", "/health")
        client.metrics()
        for _ in range(2):
            status, _ = client.raw("POST", "/query", body)
            assert status == 200
        assert client.queries.sock is not None  # raw sent its queries on this connection
        client.queries.request("POST", "/query", body, {"Content-Type": JSON_TYPE})
        answer = client.queries.getresponse()
        answer.read()
        assert answer.status == 200 and answer.getheader("Server") is None
        client.others.request("GET", "/health")
        health = client.others.getresponse()
        health.read()
        assert health.getheader("Server", "").startswith("Python")
