"""The project's image run with podman, for tests/container/: which image, why it cannot be
run here (the "podman" part of tests/support/parts.py), and containers that go away after
each test. Every container uses the host's network on 127.0.0.1 (in CI's second phase the
"host" is scripts/isolated-net.sh's namespace) or a network of its own (--network none)."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
IMAGE = os.environ.get("MOONCAKE_IMAGE") or "localhost/mooncake-conductor:ci"
PREPARE = "scripts/container/prepare.sh"
# podman reads the repository's settings (runc, cgroupfs, limits root may set) unless the
# caller chose a file of its own
ENV = {
    **os.environ,
    "CONTAINERS_CONF": os.environ.get("CONTAINERS_CONF")
    or str(REPO / "scripts/container/containers.conf"),
}


def podman(*args: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(
        ["podman", *args], env=ENV, capture_output=True, text=True, timeout=timeout
    )
    if check and result.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)}: exit {result.returncode}\n{result.stderr}")
    return result


def _context_digest() -> str:
    result = subprocess.run(
        ["python3", str(REPO / "scripts/container/context_digest.py"), str(REPO)],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    return result.stdout.strip()


def image_missing() -> str | None:
    """Why the image cannot be tested here: no podman, no image, or one built from another
    tree than this one (it would test other code)."""
    if shutil.which("podman") is None:
        return f"podman is not installed (bash {PREPARE} installs it and builds {IMAGE})"
    try:
        found = podman(
            "image", "inspect", "--format", '{{index .Labels "mooncake.context"}}', IMAGE,
            check=False,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return "podman did not answer within 60 s"
    if found.returncode != 0:
        return f"no image {IMAGE} (bash {PREPARE})"
    if found.stdout.strip() != _context_digest():
        return f"{IMAGE} was built from another tree than this one (bash {PREPARE})"
    return None


class Containers:
    """Containers of one test, each removed with its anonymous volumes at the end."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def run(self, *options: str, args: tuple[str, ...] = ()) -> str:
        name = f"mooncake-test-{uuid.uuid4().hex[:10]}"
        self.names.append(name)
        podman("run", "--detach", "--pull=never", "--name", name, *options, IMAGE, *args)
        return name

    def remove_all(self) -> None:
        for name in self.names:
            podman("rm", "--force", "--volumes", "--time", "2", name, check=False)

    def running(self, name: str) -> bool:
        state = podman("inspect", "--format", "{{.State.Running}}", name, check=False)
        return state.stdout.strip() == "true"

    def logs(self, name: str) -> str:
        result = podman("logs", name, check=False)
        return result.stdout + result.stderr

    def wait_until(self, name: str, ready: Callable[[], bool], timeout: float = 30) -> None:
        """Until ``ready()``; fails, with the container's output, if it exits or ``timeout``
        seconds pass first."""
        deadline = time.monotonic() + timeout
        while not ready():
            assert self.running(name), f"{name} exited:\n{self.logs(name)}"
            assert time.monotonic() < deadline, (
                f"{name}: not ready in {timeout} s:\n{self.logs(name)}"
            )
            time.sleep(0.3)

    def healthy(self, name: str) -> bool:
        """The image's HEALTHCHECK, run now (podman runs it on no timer without systemd)."""
        result = podman("healthcheck", "run", name, check=False, timeout=30)
        return result.returncode == 0 and result.stdout.strip() in ("", "healthy")

    def health_status(self, name: str) -> str:
        return podman("inspect", "--format", "{{.State.Health.Status}}", name).stdout.strip()
