"""``mooncake-register`` over real processes: the engine simulator, conductors and the
registrar, each its own process on loopback, as a pod's containers would run."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.registrar.registrar_process import RegistrarProcess
from tests.support.api import eventually, get, post
from tests.support.processes import ConductorProcess, EngineSim, free_port

MODEL, BLOCK = "m", 4
PROMPT = "A registrar keeps the engine registered while the conductor restarts. " * 4
INTERVAL_S = 1.0


def events_config(port: int, replay: int) -> str:
    """The engine's --kv-events-config (vLLM's JSON); the simulator binds it on loopback."""
    return json.dumps(
        {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://127.0.0.1:{port}",
            "replay_endpoint": f"tcp://127.0.0.1:{replay}",
            "topic": "kv-events",
        }
    )


def rank_ports() -> int:
    """A free port whose next one is free too: rank 0's and rank 1's."""
    while True:
        port = free_port()
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port


def start_engine(tmp_path: Path, name: str, config: str, *args: str) -> EngineSim:
    engine = EngineSim(
        tmp_path, name, "--kv-events-config", config, "--sim-kv-bind", *args, block_size=BLOCK
    )
    engine.wait_ready()
    return engine


def start_conductor(tmp_path: Path, port: int | None = None) -> ConductorProcess:
    """A conductor that forgets its registrations when it stops (no state file)."""
    directory = tmp_path / f"conductor-{port or free_port()}"
    directory.mkdir(exist_ok=True)
    conductor = ConductorProcess(directory, "--state-file", "", port=port)
    conductor.wait_ready()
    return conductor


@pytest.fixture
async def http() -> Any:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        yield session


async def services(http: aiohttp.ClientSession, conductor: ConductorProcess) -> list[dict]:
    status, answer = await get(http, f"{conductor.url}/services")
    assert status == 200, answer
    return answer["services"]


async def gpu_hit(
    http: aiohttp.ClientSession, conductor: ConductorProcess, instance: str, tokens: list[int]
) -> int:
    body = {"model": MODEL, "block_size": BLOCK, "token_ids": tokens, "instance_id": instance}
    status, answer = await post(http, f"{conductor.url}/query", body)
    assert status == 200, answer
    return int(answer.get("default", {}).get(instance, {}).get("GPU", 0))


async def complete(http: aiohttp.ClientSession, engine: EngineSim) -> list[int]:
    """One request to the engine; the prompt's token ids."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1}
    status, answer = await post(http, f"{engine.url}/v1/completions", body)
    assert status == 200, answer
    status, tokens = await post(http, f"{engine.url}/tokenize", {"model": MODEL, "prompt": PROMPT})
    assert status == 200, tokens
    return list(tokens["tokens"])


async def test_registers_what_the_engine_serves_and_keeps_it_through_a_conductor_restart(
    tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    port, replay = free_port(), free_port()
    engine = start_engine(tmp_path, "e0", events_config(port, replay))
    first, second = start_conductor(tmp_path), start_conductor(tmp_path)
    registrar = RegistrarProcess(
        tmp_path,
        "--engine-url", engine.url,
        "--interval-s", str(INTERVAL_S),
        env={"REGISTRAR_CONDUCTOR": f"{first.url},{second.url}", "REGISTRAR_INSTANCE_ID": "e0"},
    )  # fmt: skip
    try:
        # learnt from the engine alone: model, block size, endpoints (/kv_event_sources);
        # ready (200) once one conductor holds it, then both do
        status, view = await eventually(
            lambda: registrar.health(http),
            lambda answer: (
                answer[0] == 200
                and all(state["registered"] for state in answer[1]["conductors"].values())
            ),
            timeout=20,
        )
        assert view["model"] == MODEL and view["block_size"] == BLOCK
        for conductor in (first, second):
            [service] = await services(http, conductor)
            assert service["Endpoint"] == f"tcp://127.0.0.1:{port}"
            assert service["ReplayEndpoint"] == f"tcp://127.0.0.1:{replay}"
            assert (service["InstanceID"], service["ModelName"]) == ("e0", MODEL)
            assert service["BlockSize"] == BLOCK
        tokens = await complete(http, engine)
        full = len(tokens) // BLOCK * BLOCK
        for conductor in (first, second):
            await eventually(lambda c=conductor: gpu_hit(http, c, "e0", tokens), full.__eq__)

        # a conductor restarted without its state relearns the engine at the registrar's
        # next round (and its blocks from the publisher's replay buffer)
        first.kill()
        first = start_conductor(tmp_path, port=first.port)
        assert await services(http, first) == []
        await eventually(lambda: services(http, first), bool, timeout=INTERVAL_S + 2)
        await eventually(lambda: gpu_hit(http, first, "e0", tokens), full.__eq__)

        # SIGTERM: unregistered from every conductor, then exit 0
        assert registrar.terminate() == 0, registrar.log_tail()
        for conductor in (first, second):
            assert await services(http, conductor) == []
            assert await gpu_hit(http, conductor, "e0", tokens) == 0
        assert registrar.log().count("unregistered conductor=") == 2
        assert "unregistered from 2 of 2 conductors" in registrar.log()
    finally:
        registrar.terminate()
        engine.stop()
        first.stop()
        second.stop()


async def test_a_conductor_that_starts_later_is_registered_and_health_says_where(
    tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    engine = start_engine(tmp_path, "e1", events_config(free_port(), free_port()))
    up, later_port = start_conductor(tmp_path), free_port()
    later_url = f"http://127.0.0.1:{later_port}"
    registrar = RegistrarProcess(
        tmp_path,
        "--conductor", up.url, "--conductor", later_url,
        "--engine-url", engine.url, "--instance-id", "e1", "--interval-s", "30",
    )  # fmt: skip
    later = None
    try:
        # ready with one conductor of two: every stream is held somewhere
        status, view = await eventually(
            lambda: registrar.health(http), lambda answer: answer[0] == 200, timeout=20
        )
        assert view["conductors"][up.url]["registered"]
        assert not view["conductors"][later_url]["registered"]
        assert "cannot connect" in view["conductors"][later_url]["error"]
        # a conductor down is retried with a backoff well under the 30 s interval
        later = start_conductor(tmp_path, port=later_port)
        await eventually(lambda: services(http, later), bool, timeout=10)
    finally:
        registrar.terminate()
        engine.stop()
        up.stop()
        if later is not None:
            later.stop()


async def test_dp_ranks_from_the_kv_events_config_follow_vllms_port_rule(
    tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    """Rank r publishes on the config's ports plus r (two simulators, ranks 0 and 1)."""
    port, replay = rank_ports(), rank_ports()
    config = events_config(port, replay)
    ranks = [
        start_engine(tmp_path, f"dp{r}", config, "--data-parallel-rank", str(r)) for r in (0, 1)
    ]
    conductor = start_conductor(tmp_path)
    registrar = RegistrarProcess(
        tmp_path,
        "--conductor", conductor.url, "--engine-url", ranks[0].url, "--instance-id", "dp",
        "--kv-events-config", config, "--dp-size", "2",
    )  # fmt: skip
    try:
        await eventually(lambda: registrar.health(http), lambda a: a[0] == 200, timeout=20)
        listed = sorted(await services(http, conductor), key=lambda s: s["DPRank"])
        assert [(s["DPRank"], s["Endpoint"]) for s in listed] == [
            (0, f"tcp://127.0.0.1:{port}"),
            (1, f"tcp://127.0.0.1:{port + 1}"),
        ]
        assert listed[1]["ReplayEndpoint"] == f"tcp://127.0.0.1:{replay + 1}"
        tokens = await complete(http, ranks[1])  # rank 1's blocks, on rank 1's stream
        full = len(tokens) // BLOCK * BLOCK
        body = {"model": MODEL, "block_size": BLOCK, "token_ids": tokens, "instance_id": "dp"}
        answer = await eventually(
            lambda: post(http, f"{conductor.url}/query", body),
            lambda a: a[1]["default"]["dp"]["GPU"] == full,
        )
        assert answer[1]["default"]["dp"]["DP"] == {"0": 0, "1": full}
    finally:
        registrar.terminate()
        for engine in ranks:
            engine.stop()
        conductor.stop()


async def test_a_stale_registration_under_its_instance_id_is_replaced(
    tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    """A pod restarted with a new IP finds its old registration persisted (409)."""
    port = free_port()
    engine = start_engine(tmp_path, "e2", events_config(port, free_port()))
    conductor = start_conductor(tmp_path)
    stale = {
        "endpoint": f"tcp://127.0.0.1:{free_port()}",
        "type": "vLLM",
        "modelname": MODEL,
        "instance_id": "e2",
        "block_size": BLOCK,
    }
    assert (await post(http, f"{conductor.url}/register", stale))[0] == 200
    registrar = RegistrarProcess(
        tmp_path, "--conductor", conductor.url, "--engine-url", engine.url, "--instance-id", "e2"
    )  # fmt: skip
    try:
        await eventually(lambda: registrar.health(http), lambda a: a[0] == 200, timeout=20)
        [service] = await services(http, conductor)
        assert service["Endpoint"] == f"tcp://127.0.0.1:{port}"
        assert "replacing it" in registrar.log()
    finally:
        registrar.terminate()
        engine.stop()
        conductor.stop()


async def test_a_token_goes_along_and_a_refusal_shows_in_health(
    tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    engine = start_engine(tmp_path, "e3", events_config(free_port(), free_port()))
    directory = tmp_path / "secured"
    directory.mkdir()
    conductor = ConductorProcess(directory, "--state-file", "", "--auth-token", "s3cret")
    conductor.wait_ready()
    common = ("--conductor", conductor.url, "--engine-url", engine.url, "--instance-id", "e3")
    refused = RegistrarProcess(tmp_path, *common, "--auth-token", "wrong")
    try:
        status, view = await eventually(
            lambda: refused.health(http),
            lambda a: a[1].get("conductors", {}).get(conductor.url, {}).get("error"),
            timeout=20,
        )
        assert status == 503 and view["conductors"][conductor.url]["streams"] == {"0": "refused"}
        assert "status 401" in view["conductors"][conductor.url]["error"]
        assert "registration refused" in refused.log()
    finally:
        assert refused.terminate() == 0
    accepted = RegistrarProcess(tmp_path, *common, env={"REGISTRAR_AUTH_TOKEN": "s3cret"})
    try:
        await eventually(lambda: accepted.health(http), lambda a: a[0] == 200, timeout=20)
        assert accepted.terminate() == 0
        assert await services(http, conductor) == []  # unregistered with the token, too
        assert "s3cret" not in accepted.log()
    finally:
        accepted.terminate()
        engine.stop()
        conductor.stop()


async def test_a_conductor_that_hangs_cannot_hold_up_the_shutdown(
    tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    """SIGTERM unregisters from the conductors that answer and exits within the bound,
    whatever a conductor that accepts connections and never answers does."""
    engine = start_engine(tmp_path, "e4", events_config(free_port(), free_port()))
    conductor = start_conductor(tmp_path)
    with socket.socket() as hung:
        hung.bind(("127.0.0.1", 0))
        hung.listen(16)  # connections complete in the kernel; nothing ever reads them
        hung_url = f"http://127.0.0.1:{hung.getsockname()[1]}"
        registrar = RegistrarProcess(
            tmp_path,
            "--conductor", f"{conductor.url},{hung_url}",
            "--engine-url", engine.url, "--instance-id", "e4",
            "--request-timeout-s", "2", "--unregister-timeout-s", "1",
        )  # fmt: skip
        try:
            _, view = await eventually(
                lambda: registrar.health(http),
                lambda a: a[0] == 200 and a[1]["conductors"][hung_url]["error"],
                timeout=20,
            )
            assert view["conductors"][hung_url]["streams"] == {"0": "unreachable"}
            started = time.monotonic()
            assert registrar.terminate() == 0, registrar.log_tail()
            assert time.monotonic() - started < 1 + 1.0
            assert await services(http, conductor) == []
            assert f"unregistering took over 1 s: gave up on {hung_url}" in registrar.log()
            assert "unregistered from 1 of 2 conductors" in registrar.log()
        finally:
            registrar.terminate()
            engine.stop()
            conductor.stop()


def test_bad_flags_and_env_vars_exit_2_naming_them(tmp_path: Path) -> None:
    cases = [
        ((), {}, "no conductor: give --conductor URL or REGISTRAR_CONDUCTOR"),
        (("--conductor", "localhost:13333"), {}, "--conductor: must be an http(s)://host:port"),
        (
            ("--conductor", "http://127.0.0.1:1"),
            {"REGISTRAR_BLOCK_SIZE": "sixteen"},
            "REGISTRAR_BLOCK_SIZE: Input should be a valid integer",
        ),
        (
            ("--conductor", "http://127.0.0.1:1", "--kv-events-config", '{"endpoint": 5}'),
            {},
            "--kv-events-config: not a KV-events config: endpoint: Input should be a valid string",
        ),
        (
            ("--conductor", "http://127.0.0.1:1", "--replay-endpoint", "tcp://127.0.0.1:2"),
            {},
            "a replay endpoint needs --endpoint or --kv-events-config",
        ),
    ]
    for args, env, expected in cases:
        registrar = RegistrarProcess(tmp_path, *args, env=env)
        assert registrar.wait_exit(20) == 2, registrar.log()
        assert expected in registrar.log(), registrar.log()


def test_an_engine_that_never_becomes_healthy_ends_the_wait_with_exit_1(tmp_path: Path) -> None:
    registrar = RegistrarProcess(
        tmp_path,
        "--conductor", "http://127.0.0.1:1",
        "--engine-url", f"http://127.0.0.1:{free_port()}",  # nothing listens
        "--engine-timeout-s", "1.5",
    )  # fmt: skip
    assert registrar.wait_exit(20) == 1
    log = registrar.log()
    assert "mooncake-register: engine http://127.0.0.1:" in log
    assert "not healthy after 1.5 s (last: ClientConnectorError: cannot connect to" in log


def test_sigterm_while_waiting_for_the_engine_exits_0_at_once(tmp_path: Path) -> None:
    registrar = RegistrarProcess(
        tmp_path,
        "--conductor", "http://127.0.0.1:1",
        "--engine-url", f"http://127.0.0.1:{free_port()}",
    )  # fmt: skip
    deadline = time.monotonic() + 20
    while "waiting for engine" not in registrar.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    started = time.monotonic()
    assert registrar.terminate() == 0, registrar.log_tail()
    assert time.monotonic() - started < 2
    assert "nothing to unregister" in registrar.log()
