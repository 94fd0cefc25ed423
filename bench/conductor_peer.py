"""The conductor benchmark's peer: another conductor, started from a command line.

The peer is meant to be the Go Mooncake Conductor (``mooncake-conductor/conductor-ctrl``),
built by whoever reruns the comparison. The Go service has no command-line flags: it reads a
JSON file named by ``CONDUCTOR_CONFIG_PATH``, whose ``http_server_port`` is the only way to
choose its port, and ``CONDUCTOR_LOG_LEVEL``. This module writes such a file (no
``kvevent_instance``: an empty service on a free port), starts the command with those two
variables set, waits until ``GET /services`` answers like a conductor and always stops it.
This project's ``python -m conductor`` reads the same variables, so it can stand in as a
peer (the tests do that).

The log level defaults to ERROR: at INFO the Go service writes three log lines per event
batch and two per event, and the benchmark would time its logging.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from bench.harness import stop_group
from publishers.local import HOST, free_port

PEER_ENV = {"CONDUCTOR_LOG_LEVEL": "ERROR"}
STARTUP_TIMEOUT_S = 20.0
STOP_TIMEOUT_S = 5.0


class PeerError(RuntimeError):
    """The peer did not start, or exited; the message ends with its log."""


@dataclass(frozen=True)
class PeerSpec:
    """How to start the peer: a command (it must exec the service: its pid is measured)."""

    command: tuple[str, ...]
    env: Mapping[str, str]


def parse_env(pairs: Sequence[str]) -> dict[str, str]:
    """``KEY=VALUE`` strings, as ``--peer-env`` takes them."""
    env = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--peer-env wants KEY=VALUE, got {pair!r}")
        env[key] = value
    return env


@dataclass
class PeerProcess:
    process: subprocess.Popen[bytes]
    port: int
    log_path: Path

    def log_tail(self, lines: int = 20) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT_S) -> None:
        """Until ``/services`` answers with a service list (not just any open port)."""
        deadline = time.monotonic() + timeout
        url = f"http://{HOST}:{self.port}/services"
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise PeerError(
                    f"the peer exited with {self.process.returncode}:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(url, timeout=1.0) as response:
                    if "services" in json.loads(response.read()):
                        return
            except (OSError, ValueError, urllib.error.URLError):
                pass
            time.sleep(0.05)
        raise PeerError(f"the peer did not answer {url} within {timeout:.0f} s:\n{self.log_tail()}")

    def stop(self) -> None:
        stop_group(self.process, STOP_TIMEOUT_S)


@contextmanager
def running_peer(spec: PeerSpec, run_dir: Path) -> Iterator[PeerProcess]:
    """Start the peer empty on a free port; always stop it on the way out."""
    port = free_port()
    config = run_dir / "peer_config.json"
    config.write_text(json.dumps({"http_server_port": port}))
    env = {**os.environ, **PEER_ENV, "CONDUCTOR_CONFIG_PATH": str(config), **spec.env}
    log_path = run_dir / "peer.log"
    with log_path.open("wb") as log:  # the child keeps its own descriptor
        try:
            process = subprocess.Popen(
                list(spec.command),
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        except OSError as error:
            raise PeerError(f"cannot start the peer {spec.command[0]!r}: {error}") from None
    peer = PeerProcess(process, port, log_path)
    try:
        peer.wait_ready()
        yield peer
    finally:
        peer.stop()
