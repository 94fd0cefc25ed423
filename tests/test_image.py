"""The Docker image, checked without a Docker engine (none runs on CI machines): its pins
cover every dependency, it runs as a non-root user, it ships every command, and its
HEALTHCHECK and entrypoint commands work when run as the image would run them."""

from __future__ import annotations

import fnmatch
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from publishers.local import HOST, LocalService, free_port

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = (REPO / "Dockerfile").read_text()
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def _instruction(name: str) -> str:
    """The argument of the last ``name`` instruction, continuation lines joined."""
    text = DOCKERFILE.replace("\\\n", " ")
    found = re.findall(rf"^{name}\s+(.+)$", text, re.MULTILINE)
    assert found, f"no {name} in the Dockerfile"
    return found[-1].strip()


def _pins() -> dict[str, str]:
    lines = (REPO / "constraints.txt").read_text().splitlines()
    pins = {}
    for line in lines:
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version, f"constraints.txt: {line!r} is not an exact pin"
            pins[canonicalize_name(name)] = version
    return pins


def _env() -> dict[str, str]:
    return dict(re.findall(r"(\w+)=(\S+)", _instruction("ENV")))


def test_every_dependency_is_pinned_to_a_version_it_accepts() -> None:
    pins = _pins()
    for spec in PYPROJECT["project"]["dependencies"]:
        requirement = Requirement(spec)
        name = canonicalize_name(requirement.name)
        assert name in pins, f"{name} is not pinned in constraints.txt"
        assert requirement.specifier.contains(pins[name]), f"{name}=={pins[name]} vs {spec}"
    assert "pip install --no-cache-dir -c constraints.txt /wheels/*.whl" in DOCKERFILE


def test_the_image_runs_as_a_user_and_ships_every_command() -> None:
    user = _instruction("USER")
    assert user not in ("root", "0")
    assert "--uid 10001" in DOCKERFILE and user in DOCKERFILE.split("useradd", 1)[1]
    packages = {script.split(".")[0] for script in PYPROJECT["project"]["scripts"].values()}
    for package in packages:
        assert f"COPY {package} ./{package}" in DOCKERFILE, f"{package} is not in the image"
    entrypoint = json.loads(_instruction("ENTRYPOINT"))
    assert entrypoint[0] in PYPROJECT["project"]["scripts"]


def _healthcheck(url: str) -> int:
    command = json.loads(_instruction("HEALTHCHECK").split("CMD", 1)[1])
    assert command[0] == "python"
    return subprocess.run(
        [sys.executable, *command[1:]], env={**os.environ, "HEALTHCHECK_URL": url}, timeout=10
    ).returncode


def test_the_entrypoint_serves_the_mounted_config_and_the_healthcheck_sees_it(tmp_path) -> None:
    """``docker run -v $PWD/config:/etc/mooncake conductor``, with the image's environment
    pointed at the repository's config directory and bound to loopback (tests never bind
    elsewhere)."""
    env = _env()
    mounted = env["CONDUCTOR_CONFIG_PATH"].replace("/etc/mooncake", str(REPO / "config"))
    entrypoint = json.loads(_instruction("ENTRYPOINT"))
    assert entrypoint[1:] == ["--host", "0.0.0.0"]
    port = free_port()
    service = LocalService(
        tmp_path,
        "image",
        PYPROJECT["project"]["scripts"][entrypoint[0]].split(":")[0].removesuffix(".__main__"),
        port=port,
        env={**env, "CONDUCTOR_CONFIG_PATH": mounted, "CONDUCTOR_STATE_FILE": str(tmp_path / "s")},
    )
    try:
        service.wait_ready()
        assert _healthcheck(f"http://{HOST}:{port}/health") == 0
        services = json.loads(
            subprocess.run(
                [sys.executable, "-c", f"import urllib.request; print(urllib.request.urlopen("
                 f"'http://{HOST}:{port}/services').read().decode())"],
                capture_output=True, text=True, timeout=10, check=True,
            ).stdout
        )  # fmt: skip
        assert {s["InstanceID"] for s in services["services"]} == {"engine-0", "engine-1"}
    finally:
        service.stop()
    assert _healthcheck(f"http://{HOST}:{free_port()}/health") != 0


def _in_build_context(path: str) -> bool:
    """Whether ``.dockerignore`` lets ``path`` into the build context: its patterns in
    order, the last that matches decides, ``!`` letting in (Docker's rule; a pattern also
    covers what lies below a matched directory)."""
    included = True
    for line in (REPO / ".dockerignore").read_text().splitlines():
        pattern = line.strip()
        if not pattern or pattern.startswith("#"):
            continue
        allow = pattern.startswith("!")
        pattern = pattern.removeprefix("!")
        parts = Path(path).parts
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        bare = pattern.removeprefix("**/")
        if any(fnmatch.fnmatchcase(p, pattern) for p in prefixes) or (
            pattern.startswith("**/") and any(fnmatch.fnmatchcase(part, bare) for part in parts)
        ):
            included = allow
    return included


def test_the_build_context_holds_what_the_dockerfile_copies_and_nothing_local() -> None:
    text = DOCKERFILE.replace("\\\n", " ")
    sources = [
        source
        for arguments in re.findall(r"^COPY\s+(?!--from)(.+)$", text, re.MULTILINE)
        for source in arguments.split()[:-1]
    ]
    assert "conductor" in sources and "constraints.txt" in sources
    for source in sources:
        assert _in_build_context(source), f"{source} is copied but .dockerignore leaves it out"
        assert _in_build_context(f"{source}/x.py") or (REPO / source).is_file(), source
    for local in (".git/HEAD", ".venv/bin/python", "tests/conftest.py", "bench/results/a.json",
                  "conductor/__pycache__/index.cpython-311.pyc", "conductor/_native.so",
                  "mooncake_conductor_py.egg-info/PKG-INFO"):  # fmt: skip
        assert not _in_build_context(local), f"{local} would be sent to the Docker daemon"
