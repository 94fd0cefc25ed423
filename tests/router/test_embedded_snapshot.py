"""The router's embedded index restarted from a snapshot, over real processes: from its
own file or a peer's ``/snapshot`` (a conductor's, or another router's) it routes as
before after its engines' replay buffers rolled over; a corrupt file is refused with a
clear message and the previous one used; a gap the replay cannot fill is shown."""

from __future__ import annotations

import argparse
import json
from typing import Any

import aiohttp
import pytest

from conductor.snapshot import parse, read_file
from router import config as router_config
from router.conductor_client import registration_bodies
from router.config import RouterConfig
from tests.router.inprocess import layout
from tests.support.api import eventually, get, metric, post, query
from tests.support.wire_publisher import WirePublisher, removed, stored

PROMPT = list(range(1, 13))  # three blocks of four
OTHER = list(range(100, 108))
LATER = list(range(200, 208))
NEW = list(range(300, 308))  # published after the restart
PROMPTS = (PROMPT, OTHER, LATER, OTHER[:4] + [99, 99, 99, 99])
ENGINES = ("engine-a", "engine-b")
STREAMS = [f"{name}|default|0" for name in ENGINES]
TOKEN = "peer-secret"


def embedded_config(
    engines: dict[str, str], publishers: dict[str, WirePublisher], **conductor: Any
) -> dict[str, Any]:
    """One model, ``engines`` (name → URL) serving it, each publishing its KV events on
    ``publishers[name]``; the index in the router, with ``conductor``'s settings."""
    return {
        "conductor": {"embedded": True, "reregister_interval_seconds": 0.5, **conductor},
        "prefill": {
            "config": {"modelname": "m", "block_size": 4},
            "instances": [
                {
                    "instance_id": name,
                    "http_endpoint": url,
                    "registrations": [
                        {
                            "endpoint": publishers[name].endpoint,
                            "replay_endpoint": publishers[name].replay_endpoint,
                            "dp_rank": 0,
                        }
                    ],
                }
                for name, url in engines.items()
            ],
        },
        "routing": {"in_flight_prefixes": False},  # the index alone
    }


async def routed(http: aiohttp.ClientSession, url: str, prompt: list[int]) -> tuple[str, int]:
    """Where the router sends the prompt, and the cached tokens it counts there (one more
    token after it: the engine computes at least one, so every block it holds counts)."""
    request = {"model": "m", "prompt": [*prompt, 77], "max_tokens": 1}
    async with http.post(f"{url}/v1/completions", json=request) as response:
        assert response.status == 200, await response.text()
        headers = response.headers
        return headers["x-conductor-prefill-instance"], int(headers["x-conductor-cached-tokens"])


async def answers(http: aiohttp.ClientSession, url: str) -> list[tuple[str, int]]:
    return [await routed(http, url, prompt) for prompt in PROMPTS]


# engine-a holds PROMPT (3 blocks), engine-b PROMPT's first two and OTHER's first (its
# second removed): the prompts go by their hits, whatever the load
EXPECTED = [("engine-a", 12), ("engine-b", 4), None, ("engine-b", 4)]


def as_expected(found: list[tuple[str, int]]) -> bool:
    return all(want is None or got == want for got, want in zip(found, EXPECTED, strict=True))


async def streams_connected(http: aiohttp.ClientSession, url: str) -> None:
    """Until the router's index has subscribed to every stream (/health ``streams``)."""

    async def streams() -> dict[str, Any]:
        return (await get(http, f"{url}/health"))[1].get("streams", {})

    await eventually(
        streams, lambda found: all(found.get(k, {}).get("state") == "connected" for k in STREAMS)
    )


async def index_the_fleet(
    http: aiohttp.ClientSession, url: str, publishers: dict[str, WirePublisher]
) -> list[tuple[str, int]]:
    """Blocks on two tiers, one removal; the router (or conductor at ``url``) routes by
    them. One batch per publisher before the removal's: seq 0 and 1 each."""
    first, second = publishers["engine-a"], publishers["engine-b"]
    await first.publish([stored([11, 12, 13], PROMPT)])
    await first.publish([stored([21, 22], LATER[:8], medium="CPU")])
    await second.publish([stored([11, 12], PROMPT[:8]), stored([31, 32], OTHER)])
    await second.publish([removed([32])])
    return await eventually(lambda: answers(http, url), as_expected)


def fleet(engine_sims, publisher_factory) -> tuple[dict[str, str], dict[str, WirePublisher]]:
    engines = {name: engine_sims(name).url for name in ENGINES}
    return engines, {name: publisher_factory() for name in ENGINES}


def recycle(publishers: dict[str, WirePublisher]) -> None:
    """The replay buffers rolled over: every block must come from the snapshot."""
    for publisher in publishers.values():
        publisher.buffer.clear()


async def test_a_router_restarted_from_its_snapshot_file_routes_as_before(
    routers, engine_sims, publisher_factory, http, tmp_path
):
    path = tmp_path / "router.snapshot"
    engines, publishers = fleet(engine_sims, publisher_factory)
    config = embedded_config(engines, publishers, snapshot_path=str(path))
    first = routers(config)
    first.wait_ready()
    await streams_connected(http, first.url)
    before = await index_the_fleet(http, first.url, publishers)
    first.stop()  # SIGTERM: the last snapshot is written
    assert read_file(path).sequences == dict.fromkeys(STREAMS, 1)
    recycle(publishers)

    second = routers(config)
    second.wait_ready()
    assert await eventually(lambda: answers(http, second.url), lambda a: a == before) == before
    assert "snapshot restored" in second.log()
    assert await metric(http, second.url, "conductor_snapshot_restored_blocks") == 8
    await publishers["engine-b"].publish([stored([41, 42], NEW)])  # seq 2 follows
    await eventually(lambda: routed(http, second.url, NEW), lambda r: r == ("engine-b", 8))
    assert await metric(http, second.url, "conductor_sequence_gaps_unrepaired_total") == 0
    _, health = await get(http, f"{second.url}/health")
    assert not any("resume_gap" in stream for stream in health["streams"].values())


async def test_a_router_takes_a_peer_conductors_snapshot(
    routers, conductor_factory, engine_sims, publisher_factory, http
):
    """The conductor indexed the router's very streams (as a router without the embedded
    index registers them): the embedded index resumes them from its snapshot."""
    engines, publishers = fleet(engine_sims, publisher_factory)
    peer = conductor_factory("--state-file", "")
    config = embedded_config(engines, publishers)
    served = RouterConfig.model_validate(config).served_models()
    for body in (body for model in served for body in registration_bodies(model)):
        status, answer = await post(http, f"{peer.url}/register", body)
        assert status == 200, answer

    async def connected() -> list[str]:
        _, found = await get(http, f"{peer.url}/services")
        return [s["State"] for s in found["services"]]

    await eventually(connected, lambda states: states == ["connected"] * 2)
    first, second = publishers["engine-a"], publishers["engine-b"]
    await first.publish([stored([11, 12, 13], PROMPT)])
    await second.publish([stored([11, 12], PROMPT[:8]), stored([31, 32], OTHER)])
    await second.publish([removed([32])])
    await eventually(  # distinct blocks: 3 of PROMPT and 2 of OTHER, then one removed
        lambda: get(http, f"{peer.url}/health"), lambda answer: answer[1]["blocks"] == 4
    )
    recycle(publishers)

    config["conductor"] |= {"peers": ["http://127.0.0.1:1", peer.url], "peer_timeout_s": 2}
    router = routers(config)
    router.wait_ready()
    assert await eventually(lambda: answers(http, router.url), as_expected)
    assert "unreachable" in router.log()  # the dead peer: a warning, not a failed start
    assert await metric(http, router.url, "conductor_snapshot_restored_blocks") == 6
    await second.publish([stored([51, 52], NEW)])  # seq 2 follows the snapshot's
    await eventually(lambda: routed(http, router.url, NEW), lambda r: r == ("engine-b", 8))


async def test_a_router_takes_another_routers_snapshot(
    routers, engine_sims, publisher_factory, http
):
    """``GET /snapshot`` of an embedded index: what a router (or conductor) with ``peers``
    restores from, behind ``conductor.auth_token`` when one is set."""
    engines, publishers = fleet(engine_sims, publisher_factory)
    config = embedded_config(engines, publishers, auth_token=TOKEN)
    first = routers(config)
    first.wait_ready()
    await streams_connected(http, first.url)
    before = await index_the_fleet(http, first.url, publishers)
    async with http.get(f"{first.url}/snapshot") as response:
        assert response.status == 401
    recycle(publishers)

    config["conductor"] |= {"peers": [first.url]}
    second = routers(config)
    second.wait_ready()
    assert await eventually(lambda: answers(http, second.url), lambda a: a == before) == before
    assert f"snapshot chosen source={first.url}/snapshot" in second.log()


async def test_a_corrupt_snapshot_is_refused_and_the_previous_one_used(
    routers, engine_sims, publisher_factory, http, tmp_path
):
    path = tmp_path / "router.snapshot"
    engines, publishers = fleet(engine_sims, publisher_factory)
    config = embedded_config(engines, publishers, snapshot_path=str(path), snapshot_interval_s=0.1)
    first = routers(config)
    first.wait_ready()
    await streams_connected(http, first.url)
    before = await index_the_fleet(http, first.url, publishers)
    written = await metric(http, first.url, "conductor_snapshot_written_timestamp_seconds")
    await eventually(  # two writes after the blocks: the previous file has them too
        lambda: metric(http, first.url, "conductor_snapshot_written_timestamp_seconds"),
        lambda at: at > written + 0.15,
    )
    first.stop()
    previous = path.with_name(path.name + ".previous")
    assert read_file(previous).sequences == dict.fromkeys(STREAMS, 1)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    recycle(publishers)

    second = routers(config)
    second.wait_ready()
    assert await eventually(lambda: answers(http, second.url), lambda a: a == before) == before
    log = second.log()
    assert f"snapshot skipped source={path}" in log
    assert "checksum mismatch" in log and "truncated or corrupt" in log
    assert f"snapshot chosen source={previous}" in log


async def test_a_gap_the_replay_cannot_fill_is_shown_per_stream(
    routers, engine_sims, publisher_factory, http, tmp_path
):
    path = tmp_path / "router.snapshot"
    engines, publishers = fleet(engine_sims, publisher_factory)
    config = embedded_config(engines, publishers, snapshot_path=str(path))
    first = routers(config)
    first.wait_ready()
    await streams_connected(http, first.url)
    publisher = publishers["engine-a"]
    await publisher.publish([stored([11, 12, 13], PROMPT)])  # seq 0: in the snapshot
    await eventually(lambda: routed(http, first.url, PROMPT), lambda r: r == ("engine-a", 12))
    first.stop()
    await publisher.publish([stored([21, 22], OTHER)])  # seq 1: lost with the buffer
    await publisher.publish([stored([41, 42], LATER)])  # seq 2: still buffered
    publisher.buffer = publisher.buffer[2:]

    second = routers(config)
    second.wait_ready()
    await eventually(lambda: routed(http, second.url, LATER), lambda r: r == ("engine-a", 8))
    assert await routed(http, second.url, PROMPT) == ("engine-a", 12)  # from the snapshot
    assert (await routed(http, second.url, OTHER))[1] == 0  # never seen
    _, health = await get(http, f"{second.url}/health")
    gap = health["streams"][STREAMS[0]]["resume_gap"]
    assert "resumed at seq 1 but the publisher's buffer starts at 2" in gap
    assert "resume_gap" not in health["streams"][STREAMS[1]]
    assert await metric(http, second.url, "conductor_sequence_gaps_unrepaired_total") == 1


@pytest.mark.parametrize(
    ("conductor", "reason"),
    [
        ({"snapshot_path": "/tmp/x"}, "are the embedded index's (conductor.embedded: true)"),
        ({"peers": ["http://127.0.0.1:1"]}, "are the embedded index's"),
        ({"embedded": True, "peers": "ftp://host:1"}, "a peer is another conductor's"),
        ({"embedded": True, "peers": "http://a:1?x=1"}, "conductor.peers.0"),
        ({"embedded": True, "snapshot_interval_s": 0}, "conductor.snapshot_interval_s"),
        ({"embedded": True, "peer_timeout_s": 601}, "conductor.peer_timeout_s"),
    ],
)
def test_snapshot_settings_are_checked(tmp_path, conductor, reason):
    config = embedded_config({}, {})
    config["conductor"] = conductor
    config["prefill"]["instances"] = [{"instance_id": "a", "http_endpoint": "http://h:1"}]
    path = tmp_path / "router.json"
    path.write_text(json.dumps(config))
    with pytest.raises(router_config.ConfigError) as error:
        parser = argparse.ArgumentParser()
        router_config.add_cli_flags(parser)
        router_config.load(parser.parse_args(["--config", str(path)]))
    assert reason in str(error.value)


async def test_the_snapshot_route_is_the_embedded_index_s(serve, http):
    """A router asking a conductor service has no index to serve; an embedded one without
    a token serves its own (``GET /snapshot``, as a conductor does)."""
    config = layout(["http://127.0.0.1:1"])
    served = await serve(config)
    async with http.get(f"{served.url}/snapshot") as response:
        assert response.status == 404
        assert "the conductors serve /snapshot" in await response.text()
    config["conductor"] = {"embedded": True}
    served = await serve(config)
    async with http.get(f"{served.url}/snapshot") as response:
        assert response.status == 200
        assert parse(await response.read(), "route").registrations == []


async def test_a_router_with_keys_serves_its_snapshot_only_behind_a_token(serve, http, tmp_path):
    """The snapshot holds every client's prompts' block hashes: with a keys file it is
    refused until ``conductor.auth_token`` is set, then needs that token."""
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"keys": [{"id": "k1", "key": "sk-client-key-0123456789"}]}))
    config = layout(["http://127.0.0.1:1"], keys={"file": str(keys)})
    config["conductor"] = {"embedded": True}
    served = await serve(config)
    async with http.get(f"{served.url}/snapshot") as response:
        assert response.status == 403
        assert "set conductor.auth_token" in await response.text()
    config["conductor"] = {"embedded": True, "auth_token": TOKEN}
    served = await serve(config)
    client = {"Authorization": "Bearer sk-client-key-0123456789"}
    for headers, status in ((client, 401), ({"Authorization": f"Bearer {TOKEN}"}, 200)):
        async with http.get(f"{served.url}/snapshot", headers=headers) as response:
            assert response.status == status


async def test_a_conductor_takes_a_routers_snapshot(
    routers, conductor_factory, engine_sims, publisher_factory, http
):
    """A router's embedded index as a conductor's peer: the conductor adopts its streams
    and answers from its blocks, its engines' buffers rolled over."""
    engines, publishers = fleet(engine_sims, publisher_factory)
    router = routers(embedded_config(engines, publishers))
    router.wait_ready()
    await streams_connected(http, router.url)
    await index_the_fleet(http, router.url, publishers)
    recycle(publishers)

    conductor = conductor_factory("--state-file", "", "--peers", router.url)
    answer = await query(http, conductor.url, [*PROMPT, 77])
    assert answer["default"]["engine-a"]["longest_matched"] == 12
    assert answer["default"]["engine-b"]["longest_matched"] == 8
    await publishers["engine-a"].publish([stored([61, 62], NEW)])  # seq 2 follows
    await eventually(
        lambda: query(http, conductor.url, NEW),
        lambda a: a["default"]["engine-a"]["longest_matched"] == 8,
    )
