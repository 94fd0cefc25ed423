"""One process of the fleet, as the plan describes it, and the ports the fleet chooses."""

from __future__ import annotations

import random
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Ports the fleet chooses: below Linux's ephemeral range (32768 on), whose ports any
# outgoing connection may take as its source port before a service binds one (a vLLM engine
# binds its replay port a minute after the plan; a store fleet's many connections took it),
# and above 17000, below which Mooncake's transfer engine picks its own.
SERVICE_PORTS = range(20000, 32768)
_handed_out: set[int] = set()


@dataclass(frozen=True)
class ServicePlan:
    """One process of the fleet, ready to start."""

    name: str
    kind: str  # conductor, router, vllm, sim, master or store
    argv: list[str]
    url: str
    env: dict[str, str | None] = field(default_factory=dict)  # None: unset the variable
    events_endpoint: str = ""
    replay_endpoint: str = ""
    tmp_dir: Path | None = None  # the process's TMPDIR, removed when the fleet stops
    health_url: str = ""  # where readiness is asked (default: the service's /health) ...
    ready_when: Callable[[str], bool] | None = None  # ... and what its answer must say
    details: dict[str, Any] = field(default_factory=dict)  # more about it for fleet.json

    @property
    def health_endpoint(self) -> str:
        return self.health_url or f"{self.url}/health"

    @property
    def socket_path(self) -> Path | None:
        """The unix socket behind an ``ipc://`` events endpoint, removed when it stops."""
        prefix = "ipc://"
        if self.events_endpoint.startswith(prefix):
            return Path(self.events_endpoint.removeprefix(prefix))
        return None


def free_port() -> int:
    """A loopback port of ``SERVICE_PORTS`` that is free now and not handed out before."""
    for _ in range(1000):
        port = random.choice(SERVICE_PORTS)
        if port in _handed_out:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise OSError(f"no free port in {SERVICE_PORTS.start}-{SERVICE_PORTS.stop - 1}")
