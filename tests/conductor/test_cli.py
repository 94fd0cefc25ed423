"""Operator mistakes are errors naming what is wrong; precedence flag > env > file > default;
SIGINT stops the service within 2 s even with streams and slow clients open."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conductor.__main__ import parse_settings
from tests.conftest import REPO
from tests.support.api import get, register_and_connect


def run_conductor(*args: str, config_dir: Path, config: str = "{}", env=None):
    """The conductor with a config file in ``config_dir``; expected to exit at start-up."""
    path = config_dir / "conductor_config.json"
    path.write_text(config)
    return subprocess.run(
        [sys.executable, "-m", "conductor", "--host", "127.0.0.1", "--config", str(path), *args],
        cwd=REPO,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=20,
    )


@pytest.mark.parametrize(
    ("config", "args", "reason"),
    [
        ('{"http_server_prot": 1}', (), "http_server_prot: unknown key"),
        ('{"kvevent_instance": {"a": {"endpiont": "tcp://h:1"}}}', (), "unknown key 'endpiont'"),
        ('{"max_connections": "9"}', (), "max_connections"),
        ('{"max_dp_ranks": 0}', (), "max_dp_ranks"),
        ("{}", ("--port", "70000"), "1..65535"),
        ("{}", ("--log-level", "verbose"), "verbose"),
    ],
)
def test_mistakes_are_one_line_errors(tmp_path, config, args, reason):
    result = run_conductor(*args, config_dir=tmp_path, config=config)
    assert result.returncode != 0 and reason in result.stderr, result.stderr


def test_an_explicit_missing_config_is_an_error(tmp_path):
    for given in (("--config", str(tmp_path / "nope.json")),):
        result = subprocess.run(
            [sys.executable, "-m", "conductor", *given],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=20,
        )
        assert result.returncode != 0 and "nope.json does not exist" in result.stderr
    env = {**os.environ, "CONDUCTOR_CONFIG_PATH": str(tmp_path / "nope.json")}
    result = subprocess.run(
        [sys.executable, "-m", "conductor"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=20,
    )
    assert result.returncode != 0 and "does not exist" in result.stderr


def test_version():
    result = subprocess.run(
        [sys.executable, "-m", "conductor", "--version"], cwd=REPO, capture_output=True, text=True
    )
    assert result.returncode == 0 and result.stdout.startswith("mooncake-conductor ")


def test_precedence_flag_over_env_over_file_over_default(tmp_path, monkeypatch):
    path = tmp_path / "c.json"
    path.write_text(
        json.dumps({"max_connections": 7, "body_timeout_s": 3, "http_server_port": 1234})
    )
    monkeypatch.setenv("CONDUCTOR_BODY_TIMEOUT_S", "4")
    monkeypatch.setenv("CONDUCTOR_MAX_CONNECTIONS", "8")
    monkeypatch.setenv("CONDUCTOR_REGISTER_ALLOW", "10.0.0.0/8,host-a")
    monkeypatch.delenv("CONDUCTOR_LOG_LEVEL", raising=False)
    settings, limits, _, config_path = parse_settings(
        ["--config", str(path), "--max-connections", "9", "--replay-timeout", "5"]
    )
    assert config_path == str(path)
    assert settings.max_connections == 9  # flag
    assert settings.body_timeout_s == 4  # env
    assert settings.http_server_port == 1234  # file
    assert settings.keepalive_timeout_s == 75  # default
    assert settings.register_allow == ["10.0.0.0/8", "host-a"]
    assert limits.replay_timeout_s == 5 and settings.log_level == "INFO"


async def test_sigint_stops_within_two_seconds_with_streams_and_slow_clients(
    conductor, http, publisher_factory
):
    await register_and_connect(http, conductor.url, publisher_factory(), "engine-a")
    port = int(conductor.url.rsplit(":", 1)[1])
    slow = [await asyncio.open_connection("127.0.0.1", port) for _ in range(5)]
    for _, writer in slow:
        writer.write(b"POST /query HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
    assert (await get(http, f"{conductor.url}/health"))[0] == 200
    started = time.monotonic()
    conductor.process.send_signal(signal.SIGINT)
    await asyncio.to_thread(conductor.process.wait, 5)
    assert time.monotonic() - started < 2.0 and conductor.process.returncode == 0, conductor.log()
    for _, writer in slow:
        writer.close()
