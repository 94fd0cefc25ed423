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
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from bench.harness import BenchError, ServiceProcess
from publishers.local import free_port

PEER_ENV = {"CONDUCTOR_LOG_LEVEL": "ERROR"}
STARTUP_TIMEOUT_S = 20.0


class PeerError(RuntimeError):
    """The peer did not start, or exited; the message ends with its log."""


@dataclass(frozen=True)
class PeerSpec:
    """How to start the peer: a command (it must exec the service: its pid is measured)."""

    command: tuple[str, ...]
    env: Mapping[str, str]


def parse_env(pairs: Sequence[str], flag: str = "--peer-env") -> dict[str, str]:
    """``KEY=VALUE`` strings, as ``flag`` takes them; ValueError naming the flag if not."""
    env = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"{flag} wants KEY=VALUE, got {pair!r}")
        env[key] = value
    return env


def _lists_services(body: bytes) -> bool:
    return "services" in json.loads(body)


@contextmanager
def running_peer(spec: PeerSpec, run_dir: Path) -> Iterator[ServiceProcess]:
    """Start the peer empty on a free port; always stop it on the way out."""
    port = free_port()
    config = run_dir / "peer_config.json"
    config.write_text(json.dumps({"http_server_port": port}))
    env = {**PEER_ENV, "CONDUCTOR_CONFIG_PATH": str(config), **spec.env}
    try:
        peer = ServiceProcess.start(
            spec.command, port, run_dir / "peer.log", env=env, name="the peer"
        )
    except BenchError as error:
        raise PeerError(str(error)) from None
    try:
        try:  # a service list, not just any open port
            peer.wait_ready("/services", STARTUP_TIMEOUT_S, _lists_services)
        except BenchError as error:
            raise PeerError(str(error)) from None
        yield peer
    finally:
        peer.stop()
