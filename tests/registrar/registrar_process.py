"""``mooncake-register`` as a real process next to an engine, for the registrar's tests (the
simulator's in tests/registrar, real vLLM's in tests/real)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

from publishers.local import HOST, free_port
from tests.support.processes import REPO


class RegistrarProcess:
    """``python -m fleet.registrar ARGS`` with its ``/health`` on a free loopback port;
    ``env`` adds ``REGISTRAR_*`` variables."""

    def __init__(self, log_dir: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.health_port = free_port()
        self.health_url = f"http://{HOST}:{self.health_port}/health"
        self.log_path = log_dir / f"registrar-{self.health_port}.log"
        command = [sys.executable, "-m", "fleet.registrar", "--health-port", str(self.health_port)]
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                [*command, *args],
                cwd=REPO,
                env={**os.environ, "REGISTRAR_LOG_LEVEL": "DEBUG", **(env or {})},
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    async def health(self, http: aiohttp.ClientSession) -> tuple[int, dict]:
        """``/health``'s status and body ((0, {}) while it does not answer)."""
        try:
            async with http.get(self.health_url) as response:
                return response.status, await response.json()
        except (aiohttp.ClientError, OSError):
            return 0, {}

    def terminate(self, timeout: float = 15.0) -> int:
        """SIGTERM, as a pod's shutdown sends it; the exit code (SIGKILL past ``timeout``)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(5)
            raise AssertionError(f"the registrar ignored SIGTERM:\n{self.log_tail()}") from None

    def wait_exit(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while self.process.poll() is None:
            if time.monotonic() > deadline:
                self.process.kill()
                self.process.wait(5)
                raise AssertionError(f"the registrar did not exit:\n{self.log_tail()}")
            time.sleep(0.05)
        return self.process.returncode

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log().splitlines()[-lines:])
