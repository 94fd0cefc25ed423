"""The project's services as subprocesses on loopback: for the demo, benchmarks and tests.

One place knows how to start ``python -m <module> --host 127.0.0.1 --port P ...``, wait
until it listens, and stop it; a port chosen free that another process takes before the
service binds it (an ephemeral bind or connect) is retried on a fresh one.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

HOST = "127.0.0.1"
STARTUP_TIMEOUT_S = 20.0


# Ports handed out: below Linux's ephemeral range (32768 on), whose ports any outgoing
# connection may take as its source port before a service binds one (a vLLM engine binds its
# replay port a minute after the plan; a store fleet's many connections took it), and above
# 17000, below which Mooncake's transfer engine picks its own. A port is never handed out
# twice in one process: the OS's own "free port" (bind to 0) can be given again before the
# service that was told it binds it.
SERVICE_PORTS = range(20000, 32768)
_handed_out: set[int] = set()


def free_port() -> int:
    """A loopback port of ``SERVICE_PORTS`` that is free now and not handed out before."""
    for _ in range(1000):
        port = random.choice(SERVICE_PORTS)
        if port in _handed_out:
            continue
        with socket.socket() as sock:
            try:
                sock.bind((HOST, port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise OSError(f"no free port in {SERVICE_PORTS.start}-{SERVICE_PORTS.stop - 1}")


class LocalService:
    """One service process; its output goes to ``<log_dir>/<name>-<port>.log``."""

    def __init__(
        self,
        log_dir: Path,
        name: str,
        module: str,
        *args: str,
        port: int | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.name, self.module = name, module
        self._log_dir, self._args, self._env = log_dir, args, dict(env or {})
        self._port_chosen = port is None
        self._spawn(port or free_port())

    def _spawn(self, port: int) -> None:
        self.port = port
        self.url = f"http://{HOST}:{port}"
        self.log_path = self._log_dir / f"{self.name}-{port}.log"
        command = [sys.executable, "-m", self.module, "--host", HOST, "--port", str(port)]
        with self.log_path.open("wb") as log:  # the child keeps its own descriptor
            self.process = subprocess.Popen(
                [*command, *self._args],
                env={**os.environ, **self._env},
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT_S, attempts: int = 3) -> None:
        """Until it accepts connections; raises with the log when it exits or hangs."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                if self._port_chosen and attempts > 1 and "already in use" in self.log():
                    self._spawn(free_port())
                    return self.wait_ready(timeout, attempts - 1)
                raise RuntimeError(f"{self.name} exited at start-up:\n{self.log_tail()}")
            try:
                with socket.create_connection((HOST, self.port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.05)
        raise TimeoutError(f"{self.name} did not listen within {timeout:.0f} s")

    def stop(self, timeout: float = 5.0) -> float:
        """SIGTERM, then SIGKILL if it does not exit in time; returns how long it took."""
        started = time.monotonic()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout)
        return time.monotonic() - started

    def kill(self) -> None:
        """SIGKILL: the process dies without any chance to clean up."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(5)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_tail(self, lines: int = 20) -> str:
        return "\n".join(self.log().splitlines()[-lines:])
