"""The project's services as real subprocesses on 127.0.0.1, stopped with SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT = 15.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServiceProcess:
    """``python -m <module> --host 127.0.0.1 --port P ...`` with its output in a log file."""

    module = ""

    def __init__(
        self,
        log_dir: Path,
        name: str,
        *args: str,
        port: int | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", self.module, "--host", "127.0.0.1"]
        command += ["--port", str(self.port), *args]
        self.log_path = log_dir / f"{name}-{self.port}.log"
        self._log = self.log_path.open("wb")
        self.process = subprocess.Popen(
            command,
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    def wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.module} exited: {self.log()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.05)
        raise TimeoutError(f"{self.module} did not start listening")

    def stop(self, timeout: float = 5.0) -> float:
        """SIGTERM and wait; returns how long the shutdown took."""
        started = time.monotonic()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout)
        self._log.close()
        return time.monotonic() - started

    def kill(self) -> None:
        """SIGKILL: the process dies without any chance to clean up."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(5)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


class ConductorProcess(ServiceProcess):
    """The conductor, with a config file (absent unless ``config`` is given)."""

    module = "conductor"

    def __init__(
        self,
        tmp_path: Path,
        *args: str,
        config: dict[str, Any] | None = None,
        port: int | None = None,
    ) -> None:
        config_path = tmp_path / "conductor_config.json"
        if config is not None:
            config_path.write_text(json.dumps(config))
        super().__init__(
            tmp_path,
            "conductor",
            "--config",
            str(config_path),
            *args,
            port=port,
            env={"CONDUCTOR_LOG_LEVEL": "DEBUG"},
        )


class EngineSim(ServiceProcess):
    """The engine simulator (``publishers.engine``) serving model ``model``."""

    module = "publishers.engine"

    def __init__(
        self,
        log_dir: Path,
        instance_id: str,
        *args: str,
        model: str = "m",
        block_size: int = 4,
        time_scale: float = 0.01,
        port: int | None = None,
    ) -> None:
        self.instance_id = instance_id
        super().__init__(
            log_dir,
            f"engine-{instance_id}",
            "--served-model-name",
            model,
            "--block-size",
            str(block_size),
            "--sim-instance-id",
            instance_id,
            "--sim-time-scale",
            str(time_scale),
            *args,
            port=port,
        )


class RouterProcess(ServiceProcess):
    """``mooncake-router`` with a config file written from ``config``."""

    module = "router"

    def __init__(self, tmp_path: Path, config: dict[str, Any], *args: str) -> None:
        config_path = tmp_path / f"router-{free_port()}.json"
        config_path.write_text(json.dumps(config))
        super().__init__(tmp_path, "router", "--config", str(config_path), *args)
