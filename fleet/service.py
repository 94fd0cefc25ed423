"""One process of the fleet, as the plan describes it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


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
