"""The Docker image itself, built from the Dockerfile unchanged (scripts/container/prepare.sh)
and run with podman: the conductor it starts by default answers its own HEALTHCHECK, the
router and the engine simulator run from it too and serve a request end to end, it runs as
uid 10001, and each command stops cleanly on SIGTERM (what `docker stop` sends) in time."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from publishers.local import HOST, free_port
from tests.container.podman import REPO, Containers, podman

pytestmark = pytest.mark.needs("podman")

STOP_BOUND_S = 5.0  # from SIGTERM to the container's exit, podman's own overhead included
MODEL = "demo-model"
EVENTS = {
    "enable_kv_cache_events": True,
    "publisher": "zmq",
    "endpoint": f"tcp://{HOST}:0",
    "replay_endpoint": f"tcp://{HOST}:0",
    "topic": "",
}


@pytest.fixture
def containers() -> Iterator[Containers]:
    made = Containers()
    yield made
    made.remove_all()


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status, response.read()
    except OSError:
        return 0, b""


def _mounted(tmp_path: Path, files: dict[str, str]) -> str:
    """A directory readable by the image's user (pytest's are root's alone), as a -v option."""
    folder = tmp_path / "mounted"
    folder.mkdir(mode=0o755)
    folder.chmod(0o755)
    for name, text in files.items():
        (folder / name).write_text(text)
        (folder / name).chmod(0o644)
    return f"{folder}:/etc/mooncake:ro"


def _health_env(port: int) -> str:
    return f"HEALTHCHECK_URL=http://{HOST}:{port}/health"


def _conductor(containers: Containers, tmp_path: Path) -> tuple[str, int]:
    port = free_port()
    name = containers.run(
        "--network", "host", "-v", _mounted(tmp_path, {"conductor_config.json": "{}"}),
        "-e", _health_env(port),
        args=("--host", HOST, "--port", str(port)),
    )  # fmt: skip
    containers.wait_until(name, lambda: containers.healthy(name))
    return name, port


def _engine_sim(containers: Containers, conductor_port: int) -> tuple[str, int]:
    port = free_port()
    name = containers.run(
        "--network", "host", "--entrypoint", "mooncake-engine-sim", "-e", _health_env(port),
        args=(
            "--host", HOST, "--port", str(port), "--served-model-name", MODEL,
            "--block-size", "16", "--kv-events-config", json.dumps(EVENTS), "--sim-kv-bind",
            "--sim-instance-id", "engine-0",
            "--sim-register-with", f"http://{HOST}:{conductor_port}",
        ),
    )  # fmt: skip
    containers.wait_until(name, lambda: containers.healthy(name))
    return name, port


def _router(containers: Containers, conductor_port: int, engine_port: int) -> tuple[str, int]:
    port = free_port()
    name = containers.run(
        "--network", "host", "--entrypoint", "mooncake-router", "-e", _health_env(port),
        args=(
            "--host", HOST, "--port", str(port), "--modelname", MODEL, "--block-size", "16",
            "--prefiller-hosts", HOST, "--prefiller-ports", str(engine_port),
            "--prefiller-instance-ids", "engine-0",
            "--conductor-address", f"http://{HOST}:{conductor_port}",
        ),
    )  # fmt: skip
    containers.wait_until(name, lambda: containers.healthy(name))
    return name, port


def _stop_time(containers: Containers, name: str) -> tuple[float, int]:
    """SIGTERM, as `docker stop` sends it; the seconds until the container exited, and its
    exit code."""
    started = time.monotonic()
    podman("kill", "--signal", "TERM", name)
    try:
        code = podman("wait", name, timeout=STOP_BOUND_S * 3).stdout.strip()
    except subprocess.TimeoutExpired:
        pytest.fail(f"{name} still running {STOP_BOUND_S * 3} s after SIGTERM")
    return time.monotonic() - started, int(code)


def test_the_image_as_shipped_is_healthy_and_runs_as_its_user(containers: Containers) -> None:
    """The default entrypoint (all interfaces, port 13333) and the default HEALTHCHECK_URL,
    with the README's config mount, in a network namespace of the container's own: nothing
    is bound outside it, and the healthcheck runs inside it."""
    name = containers.run("--network", "none", "-v", f"{REPO / 'config'}:/etc/mooncake:ro")
    containers.wait_until(name, lambda: containers.healthy(name))
    assert containers.health_status(name) == "healthy"
    assert podman("exec", name, "id", "-un").stdout.strip() == "conductor"
    status = podman("exec", name, "cat", "/proc/1/status").stdout
    uids = next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1:]
    assert uids == ["10001"] * 4, status  # the command itself is PID 1, as that user
    services = podman(
        "exec", name, "python", "-c",
        "import urllib.request; print(urllib.request.urlopen("
        "'http://127.0.0.1:13333/services', timeout=2).read().decode())",
    ).stdout  # fmt: skip
    assert {s["InstanceID"] for s in json.loads(services)["services"]} == {"engine-0", "engine-1"}


def test_the_healthcheck_says_unhealthy_when_the_service_is_not_there(
    containers: Containers,
) -> None:
    """A healthcheck that always passed would prove nothing: pointed at a port nothing
    listens on, it fails."""
    name = containers.run(
        "--network", "none", "-v", f"{REPO / 'config'}:/etc/mooncake:ro",
        "-e", "HEALTHCHECK_URL=http://127.0.0.1:1/health",
    )  # fmt: skip
    containers.wait_until(name, lambda: "listening" in containers.logs(name))
    assert not containers.healthy(name)
    assert containers.health_status(name) != "healthy"


def test_router_engine_sim_and_conductor_from_the_image_serve_a_completion(
    containers: Containers, tmp_path: Path
) -> None:
    _, conductor_port = _conductor(containers, tmp_path)
    engine, engine_port = _engine_sim(containers, conductor_port)

    def connected() -> bool:
        _, body = _get(f"http://{HOST}:{conductor_port}/services")
        services = json.loads(body or b'{"services": []}')["services"]
        return any(s["InstanceID"] == "engine-0" and s["State"] == "connected" for s in services)

    containers.wait_until(engine, connected)
    _, router_port = _router(containers, conductor_port, engine_port)
    request = urllib.request.Request(
        f"http://{HOST}:{router_port}/v1/completions",
        data=json.dumps({"model": MODEL, "prompt": "cache prefix " * 40, "max_tokens": 4}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        answer = json.loads(response.read())
    assert answer["choices"][0]["text"], answer

    def indexed() -> bool:  # the engine's KV events reached the conductor's index
        _, body = _get(f"http://{HOST}:{conductor_port}/health")
        return bool(body) and json.loads(body)["blocks"] > 0

    containers.wait_until(engine, indexed, timeout=10)


@pytest.mark.parametrize("command", ["conductor", "engine-sim", "router"])
def test_sigterm_stops_each_command_cleanly_and_in_time(
    containers: Containers, tmp_path: Path, command: str
) -> None:
    conductor, conductor_port = _conductor(containers, tmp_path)
    name = conductor
    if command != "conductor":
        name, engine_port = _engine_sim(containers, conductor_port)
    if command == "router":
        name, _ = _router(containers, conductor_port, engine_port)
    took, code = _stop_time(containers, name)
    assert code == 0, f"{command} exited {code} on SIGTERM:\n{containers.logs(name)}"
    assert took < STOP_BOUND_S, f"{command} took {took:.2f} s to stop"
