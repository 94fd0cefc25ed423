"""Start-up from the config file and env, fast failure on bad config, clean shutdown."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from aiohttp.test_utils import TestServer

from conductor.__main__ import parse_settings
from conductor.service import MANAGER, create_app
from conductor.states import SubscriberState
from tests.conftest import REPO
from tests.support.api import eventually, get, matched
from tests.support.wire_publisher import stored


def run_conductor(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "conductor", "--host", "127.0.0.1", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=20,
    )


async def test_config_file_registrations_are_indexed(conductor_factory, http, publisher_factory):
    publisher = publisher_factory()
    config = {
        "kvevent_instance": {
            "engine-a": {
                "endpoint": publisher.endpoint,
                "replay_endpoint": publisher.replay_endpoint,
                "type": "vLLM",
                "modelname": "m",
                "block_size": 4,
            }
        },
        "http_server_port": 1,  # overridden by --port
    }
    conductor = conductor_factory(config=config)
    status, services = await get(http, f"{conductor.url}/services")
    assert status == 200 and services["count"] == 1
    service = services["services"][0]
    assert (service["InstanceID"], service["TenantID"]) == ("engine-a", "default")

    async def connected() -> str:
        return (await get(http, f"{conductor.url}/services"))[1]["services"][0]["State"]

    await eventually(connected, lambda state: state == "connected")
    await publisher.publish([stored([1], [1, 2, 3, 4])], send=False)
    await publisher.publish([stored([2], [5, 6, 7, 8], parent=1)])
    tokens = list(range(1, 9))
    await eventually(lambda: matched(http, conductor.url, tokens, "engine-a"), lambda n: n == 8)


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        ("{not json", "invalid configuration"),
        ('{"kvevent_instance": {"a": {"endpoint": "tcp://h:1", "type": "TGI"}}}', "type"),
        ('{"http_server_port": "13333"}', "http_server_port"),
        (
            '{"kvevent_instance": {"a": {"endpoint": "tcp://h:1", "type": "vLLM", '
            '"modelname": "m", "block_size": 0}}}',
            "block_size",
        ),
        ('{"kv_store_admin_urls": {"10.0.0.9:50051": "10.0.0.9:9003"}}', "kv_store_admin_urls"),
        ('{"kv_store_check_interval_s": 0}', "kv_store_check_interval_s"),
        (
            '{"kvevent_instance": {"a": {"endpoint": "tcp://127.0.0.1:00", "type": "vLLM", '
            '"modelname": "m", "block_size": 16}}}',
            'kvevent_instance.a.endpoint: port must be a number 1..65535, got "00"',
        ),
        (
            '{"kvevent_instance": {"a": {"endpoint": "tcp://[127.0.0.1]:5557", "type": "vLLM", '
            '"modelname": "m", "block_size": 16}}}',
            "kvevent_instance.a.endpoint: brackets hold an IPv6 address only",
        ),
        ('{"receive_buffer_bytes": 1024}', "receive_buffer_bytes must hold one message"),
        ('{"max_dp_ranks": 0}', "max_dp_ranks: Input should be greater than 0"),
        (
            json.dumps(
                {
                    "kvevent_instance": {
                        name: {"endpoint": "tcp://127.0.0.1:5557", "type": "vLLM"}
                        | {"modelname": "m", "block_size": 16}
                        for name in ("a", "b")
                    }
                }
            ),
            "kvevent_instance.b: endpoint tcp://127.0.0.1:5557 is kvevent_instance.a's",
        ),
    ],
)
def test_invalid_config_exits_with_one_line_reason(tmp_path, content, reason):
    path = tmp_path / "conductor_config.json"
    path.write_text(content)
    result = run_conductor("--config", str(path))
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and reason in lines[0], result.stderr
    assert lines[0].startswith(f"mooncake-conductor: invalid configuration: {path}: "), lines


async def test_the_app_runs_everything_behind_its_routes_and_stops_it(
    tmp_path, http, publisher_factory
):
    """``create_app`` is the whole service: its cleanup_ctx subscribes the config file's
    streams before the first request and stops them when the app is cleaned up."""
    publisher = publisher_factory()
    endpoint = {"endpoint": publisher.endpoint, "type": "vLLM", "modelname": "m", "block_size": 4}
    config = tmp_path / "conductor_config.json"
    config.write_text(json.dumps({"kvevent_instance": {"engine-a": endpoint}}))
    settings, limits, parsed, _ = parse_settings(["--config", str(config)])
    app = create_app(settings, limits, parsed, state=None)
    manager = app[MANAGER]
    assert manager.state_of("engine-a|default|0") is SubscriberState.STOPPED  # not started
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        base = f"http://127.0.0.1:{server.port}"
        services = await eventually(
            lambda: get(http, f"{base}/services"),
            lambda answer: answer[1]["services"][0]["State"] == "connected",
        )
        assert services[1]["count"] == 1
    finally:
        await server.close()
    assert manager.state_of("engine-a|default|0") is SubscriberState.STOPPED


async def test_an_empty_config_starts_an_empty_service(conductor, http):
    status, health = await get(http, f"{conductor.url}/health")
    assert status == 200 and health["services"] == 0


def test_invalid_log_level_is_rejected(tmp_path):
    config = tmp_path / "conductor_config.json"
    config.write_text("{}")
    result = run_conductor("--config", str(config), "--log-level", "LOUD")
    assert result.returncode != 0 and "--log-level" in result.stderr and "LOUD" in result.stderr


async def test_sigterm_shuts_down_within_two_seconds(conductor, http, publisher_factory):
    from tests.support.api import register_and_connect

    await register_and_connect(http, conductor.url, publisher_factory(), "engine-a")
    elapsed = conductor.stop()
    assert conductor.process.returncode == 0, conductor.log()
    assert elapsed < 2.0
