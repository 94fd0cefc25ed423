"""Operator mistakes are errors naming what is wrong; precedence flag > env > file > default;
SIGINT stops the service within 2 s even with streams and slow clients open."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conductor.__main__ import parse_settings
from conductor.config import settings_model
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


PROFILE = {
    "strategy": "vllm_v1",
    "algorithm": "sha256_cbor",
    "python_hash_seed": "0",
    "index_projection": "low64_be",
}
ENTRY = {"endpoint": "tcp://127.0.0.1:5701", "type": "vLLM", "modelname": "m", "block_size": 16}


def entries(**named: dict[str, object]) -> str:
    """A config file whose ``kvevent_instance`` holds these entries, ENTRY's fields first."""
    return json.dumps({"kvevent_instance": {name: {**ENTRY, **e} for name, e in named.items()}})


@pytest.mark.parametrize(
    ("config", "args", "reason"),
    [
        ('{"http_server_prot": 1}', (), "http_server_prot: unknown key"),
        ('{"rpc_server_port": 70000}', (), "rpc_server_port: Input should be less than or"),
        ("{}", ("--rpc-server-port", "x"), "--rpc-server-port: rpc_server_port: Input should"),
        (
            entries(a={"hash_profile": {**PROFILE, "root_digest": "ab"}}),
            (),
            "kvevent_instance.a.hash_profile.root_digest: unknown key",
        ),
        (entries(a={"cache_group": 2}), (), "cache_group: only cache group zero is supported"),
        (
            entries(
                a={"hash_profile": PROFILE},
                b={
                    "endpoint": "tcp://127.0.0.1:5702",
                    "hash_profile": {**PROFILE, "algorithm": "sha256"},
                },
            ),
            (),
            'b|default|0 has hash profile vllm_v1/sha256 seed="0" low64_be, but its context',
        ),
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
    """The router words it the same way."""
    for given, env in (
        (["--config", "nope.json"], {}),
        ([], {"CONDUCTOR_CONFIG_PATH": "nope.json"}),
    ):
        result = subprocess.run(
            [sys.executable, "-m", "conductor", *given],
            cwd=tmp_path,
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            timeout=20,
        )
        assert (result.returncode, result.stderr) == (
            1,
            "mooncake-conductor: invalid configuration: config file nope.json does not exist\n",
        )


def test_a_port_in_use_is_one_line_and_nothing_is_registered_first(tmp_path):
    """The config file's streams were registered (and logged) before the bind failed."""
    entries = {
        name: {"endpoint": f"tcp://127.0.0.1:{5557 + n}", "type": "vLLM", "modelname": "m"}
        for n, name in enumerate(("engine-a", "engine-b"))
    }
    config = {"kvevent_instance": {n: {**e, "block_size": 16} for n, e in entries.items()}}
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_conductor(
            "--port", str(port), "--state-file", "", config_dir=tmp_path, config=json.dumps(config)
        )
    assert (result.returncode, result.stderr) == (
        1,
        f"mooncake-conductor: cannot listen on 127.0.0.1:{port}: address already in use\n",
    )


def test_every_option_says_what_it_does():
    """Nine stream limits were described as "stream limit" and nothing else."""
    descriptions = {key: spec.description for key, spec in settings_model().model_fields.items()}
    terse = {key: text for key, text in descriptions.items() if len(str(text).split()) < 5}
    assert not terse
    assert len(set(descriptions.values())) == len(descriptions)
    result = subprocess.run(
        [sys.executable, "-m", "conductor", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=20,
    )
    shown = " ".join(result.stdout.split())
    assert result.returncode == 0
    missing = [
        key for key, text in descriptions.items() if " ".join(str(text).split()) not in shown
    ]
    assert missing == ["log_level"]  # --log-level is every command's, with its own help


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
