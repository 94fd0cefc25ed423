"""``mooncake-fleet up`` as a real subprocess, for the fleet tests and the real-engine suite."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil

READY_LINE = "fleet ready in"
LOOPBACK_HOSTS = {"127.0.0.1", "[::ffff:127.0.0.1]"}  # the second: on a dual-stack socket


class FleetProcess:
    """The fleet command on a fleet file written from ``spec``; output in ``output.log``.

    ``own_run_dir``: no ``--run-dir``, the fleet makes its own (in ``env``'s TMPDIR) and
    ``run_dir`` holds only the fleet file and the output; ``flags`` go to ``up``."""

    def __init__(
        self,
        run_dir: Path,
        spec: dict[str, Any],
        env: dict[str, str] | None = None,
        *,
        own_run_dir: bool = False,
        flags: tuple[str, ...] = (),
    ):
        self.run_dir = run_dir
        self.own_run_dir = own_run_dir
        run_dir_flag = () if own_run_dir else ("--run-dir", str(run_dir))
        run_dir.mkdir(parents=True, exist_ok=True)
        self.fleet_file = run_dir / "fleet-file.json"
        self.fleet_file.write_text(json.dumps(spec))
        self.output_path = run_dir / "output.log"
        with self.output_path.open("wb") as output:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "fleet",
                    "up",
                    str(self.fleet_file),
                    *run_dir_flag,
                    *flags,
                ],
                stdout=output,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})},
            )

    def output(self) -> str:
        return self.output_path.read_text(errors="replace")

    def wait_ready(self, timeout: float) -> dict[str, Any]:
        """The services (``fleet.json``) once the fleet says it is ready."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if READY_LINE in self.output():
                return json.loads((self.fleet_run_dir() / "fleet.json").read_text())
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"the fleet exited ({self.process.returncode}):\n{self.output()}"
                )
            time.sleep(0.2)
        raise TimeoutError(f"the fleet was not ready in {timeout:.0f} s:\n{self.output()}")

    def fleet_run_dir(self) -> Path:
        """Where the fleet writes: ``--run-dir``, or the directory it announced."""
        if not self.own_run_dir:
            return self.run_dir
        announced = re.search(r"^run directory: (\S+)", self.output(), re.MULTILINE)
        if announced is None:
            raise RuntimeError(f"the fleet named no run directory:\n{self.output()}")
        return Path(announced.group(1))

    def wait_exit(self, timeout: float) -> int:
        return self.process.wait(timeout)

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM, as an operator's Ctrl-C would; SIGKILL if it does not exit in time."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                return self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        return self.process.returncode


def fleet_pids(services: dict[str, Any]) -> set[int]:
    """Every process of a running fleet (``fleet.json``): its services and what they forked."""
    pids = set()
    for service in services.values():
        try:
            process = psutil.Process(service["pid"])
            pids |= {process.pid, *(child.pid for child in process.children(recursive=True))}
        except psutil.NoSuchProcess:
            continue
    return pids


def established_tcp(pids: set[int]) -> list[tuple[str, str, str]]:
    """(process name, local address, peer address) of every established TCP connection the
    processes ``pids`` hold, as iproute2's ``ss`` sees them."""
    command = ["ss", "-tanpH", "state", "established"]
    output = subprocess.run(command, capture_output=True, text=True, timeout=10, check=True)
    connections = []
    for line in output.stdout.splitlines():
        fields = line.split()  # Recv-Q Send-Q local peer users:(("name",pid=N,fd=M),...)
        for name, pid in re.findall(r'\("([^"]*)",pid=(\d+)', line):
            if int(pid) in pids:
                connections.append((name, fields[2], fields[3]))
    return connections


def is_loopback(address: str) -> bool:
    return address.rsplit(":", 1)[0] in LOOPBACK_HOSTS
