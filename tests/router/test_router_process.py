"""The router process as a newcomer meets it (issue 23): it listens at once and says so,
whatever the conductors do, and is degraded (with the reason) until one answers; a taken
port, a config mistake and every flag explain themselves in one line; its log lines carry no
exception reprs, and at DEBUG one line per routing decision says where and why."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from router.__main__ import build_parser
from router.__main__ import main as router_main
from tests.router.inprocess import MODEL, layout
from tests.support.api import eventually, get
from tests.support.processes import REPO, ConductorProcess, EngineSim, RouterProcess, free_port

# what an exception's repr looks like in a line: ClientConnectorError(…, ConnectionKey(…
REPR = re.compile(r"\b[A-Z]\w*(?:Error|Exception|Key)\(|<\w")


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[EngineSim]:
    process = EngineSim(tmp_path, "e0", model=MODEL)
    process.wait_ready()
    yield process
    process.stop()


async def complete(http: aiohttp.ClientSession, url: str) -> tuple[int, dict[str, str]]:
    request = {"model": MODEL, "prompt": "Hello there, how are you?", "max_tokens": 2}
    async with http.post(f"{url}/v1/completions", json=request) as response:
        await response.read()
        return response.status, dict(response.headers)


def decision_lines(router: RouterProcess) -> list[str]:
    return [
        line for line in router.log().splitlines() if "level=DEBUG" in line and " route " in line
    ]


def run_router(*argv: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "router", *argv]
    return subprocess.run(command, capture_output=True, text=True, timeout=30, cwd=REPO)


# -- start-up ---------------------------------------------------------------------------------
async def test_it_listens_at_once_and_is_degraded_until_a_conductor_answers(
    tmp_path, engine, routers, http
):
    conductor_port = free_port()
    conductor_url = f"http://127.0.0.1:{conductor_port}"
    conductor = {"address": conductor_url, "registration_timeout_seconds": 30}
    config = layout([engine.url], conductor=conductor, routing={"policy": "ttft"})
    stream = {"endpoint": f"tcp://127.0.0.1:{free_port()}"}  # a KV-event stream to register
    config["prefill"]["instances"][0]["registrations"] = [stream]
    started = time.monotonic()
    router = routers(config, "--log-level", "DEBUG")
    router.wait_ready(timeout=3.0)  # not after the 30 s the registration may retry for
    assert time.monotonic() - started < 3.0

    async def log() -> str:
        return router.log()

    # the line follows the socket's listening by a moment (on a loaded machine, more)
    listening = f"level=INFO logger=router listening on {router.url}"
    await eventually(log, lambda text: listening in text)

    refused = (
        f"conductor {conductor_url} has not accepted the registrations (ClientConnectorError: "
        f"cannot connect to 127.0.0.1:{conductor_port}: connection refused)"
    )
    status, health = await eventually(
        lambda: get(http, f"{router.url}/health"), lambda answer: answer[1]["reasons"] == [refused]
    )
    assert (status, health["status"], health["conductors"]) == (
        200,  # requests are served meanwhile: only nothing to serve them with is a 503
        "degraded",
        {conductor_url: "down"},
    )
    status, headers = await complete(http, router.url)
    assert (status, headers["x-conductor-fallback"]) == (200, "conductor_unavailable")
    assert decision_lines(router)[-1].endswith(
        "route prefill=e0 decode=- cached_tokens=0 policy=least_loaded "
        "fallback=conductor_unavailable candidates=e0:gpu=0,load=0,queued=0"
    )

    conductor_process = ConductorProcess(tmp_path, port=conductor_port)
    try:
        conductor_process.wait_ready()
        _, health = await eventually(
            lambda: get(http, f"{router.url}/health"), lambda answer: answer[1]["status"] == "ok"
        )
        assert (health["reasons"], health["conductors"]) == ([], {conductor_url: "up"})
        status, headers = await complete(http, router.url)
        assert status == 200 and "x-conductor-fallback" not in headers
    finally:
        conductor_process.stop()
    # the policy's own decision, with each candidate's score (the first prompt, still in
    # flight for the router, is a hit)
    decision = decision_lines(router)[-1]
    assert re.search(
        r"route prefill=e0 decode=- cached_tokens=(\d+) policy=ttft fallback=- "
        r"candidates=e0:gpu=\1,load=0,queued=0,score=[0-9.e-]+$",
        decision,
    ), decision
    log = router.log()
    assert f"conductor {conductor_url} answers again" in log
    assert not REPR.search(log), log


def test_a_port_in_use_is_one_line_and_exit_1(tmp_path):
    config = tmp_path / "router.json"
    config.write_text(json.dumps(layout(["http://127.0.0.1:9"])))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_router("--config", str(config), "--host", "127.0.0.1", "--port", str(port))
    assert result.returncode == 1
    assert result.stderr == PORT_IN_USE.format(port=port) + "\n"


async def test_warnings_name_the_failure_without_its_repr(tmp_path, engine, routers, http):
    """A refused engine and a refused conductor: each a short sentence in the log."""
    dead_port = free_port()
    config = layout([f"http://127.0.0.1:{dead_port}", engine.url])
    config["prefill"]["instances"][0]["registrations"] = [
        {"endpoint": f"tcp://127.0.0.1:{free_port()}"}
    ]
    router = routers(config)
    router.wait_ready()
    status, headers = await complete(http, router.url)  # e0 refuses its /tokenize first
    assert (status, headers["x-conductor-prefill-instance"]) == (200, "e1")
    log = router.log()
    warning = (
        r"level=WARNING logger=router.app upstream instance=e0 out of rotation: (/\w+: )?"
        rf"ClientConnectorError: cannot connect to 127.0.0.1:{dead_port}: connection refused\n"
    )
    assert re.search(warning, log), log
    assert "unavailable (registration: ClientConnectorError: cannot connect to" in log
    assert not REPR.search(log), log
    assert "Traceback" not in log


# -- configuration ----------------------------------------------------------------------------
# each writes router.json in the working directory and gives the argv and the error line
def write(text: str) -> str:
    Path("router.json").write_text(text)
    return "router.json"


def unknown_key() -> tuple[list[str], str]:
    config = layout(["http://127.0.0.1:9"])
    config["prefill"]["config"]["block_sise"] = 16
    reason = "router.json: prefill.config.block_sise: unknown key"
    return ["--config", write(json.dumps(config))], reason


def not_json() -> tuple[list[str], str]:
    reason = "router.json: not valid JSON: Expecting value at line 1 column 13"
    return ["--config", write('{"prefill": }')], reason


def not_an_object() -> tuple[list[str], str]:
    return ["--config", write("[]")], "router.json: the config must be a JSON object"


def bad_value() -> tuple[list[str], str]:
    config = layout(["http://127.0.0.1:9"], upstream={"first_byte_timeout_seconds": 0})
    reason = "upstream.first_byte_timeout_seconds: Input should be greater than 0"
    return ["--config", write(json.dumps(config))], f"router.json: {reason}"


def bad_flag() -> tuple[list[str], str]:
    argv = ["--config", write(json.dumps(layout(["http://127.0.0.1:9"]))), "--block-size", "0"]
    return argv, "--block-size: prefill.config.block_size: Input should be greater than 0"


def missing_file() -> tuple[list[str], str]:
    return ["--config", "nope.json"], "config file nope.json does not exist"


MISTAKES = [unknown_key, not_json, not_an_object, bad_value, bad_flag, missing_file]
PORT_IN_USE = "mooncake-router: cannot listen on 127.0.0.1:{port}: address already in use"


@pytest.mark.parametrize("mistake", MISTAKES)
def test_a_config_error_names_where_the_bad_value_is(tmp_path, monkeypatch, mistake):
    monkeypatch.chdir(tmp_path)
    argv, reason = mistake()
    with pytest.raises(SystemExit) as exit_:
        router_main(argv)
    assert exit_.value.code == f"mooncake-router: invalid configuration: {reason}"


def test_a_missing_config_file_is_one_line_and_exit_1():
    result = run_router("--config", "nope.json")
    assert result.returncode == 1
    expected = "mooncake-router: invalid configuration: config file nope.json does not exist\n"
    assert result.stderr == expected


def test_the_docs_quote_only_messages_pinned_here(tmp_path, monkeypatch):
    """Every ``mooncake-router: ...`` line docs/router.md quotes is one a test here pins."""
    monkeypatch.chdir(tmp_path)
    pinned = {f"mooncake-router: invalid configuration: {m()[1]}" for m in MISTAKES}
    pinned.add(PORT_IN_USE.format(port="PORT"))
    docs = (REPO / "docs/router.md").read_text()
    quoted = re.findall(r"^mooncake-router: .*$", docs, re.MULTILINE)
    assert quoted and {re.sub(r"127\.0\.0\.1:\d+", "127.0.0.1:PORT", q) for q in quoted} <= pinned


def test_every_option_says_what_it_does():
    generic = {"", "help", "option", "flag", "the value"}
    for action in build_parser()._actions:
        help_text = (action.help or "").strip().lower()
        assert help_text not in generic and len(help_text) >= 20, action.option_strings
    result = run_router("--help")
    assert result.returncode == 0 and "--stream-headers-timeout-seconds" in result.stdout


def test_the_listen_address_comes_from_the_environment_unless_a_flag_names_it(monkeypatch):
    monkeypatch.setenv("ROUTER_HOST", "127.0.0.1")
    monkeypatch.setenv("ROUTER_PORT", "8123")
    parsed = build_parser().parse_args([])
    assert (parsed.host, parsed.port) == ("127.0.0.1", 8123)
    parsed = build_parser().parse_args(["--host", "::1", "--port", "9000"])
    assert (parsed.host, parsed.port) == ("::1", 9000)
    monkeypatch.setenv("ROUTER_PORT", "80000")
    with pytest.raises(SystemExit):
        build_parser().parse_args([])
