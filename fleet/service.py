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
    kind: str  # conductor, router, vllm, sglang, sim, master or store
    argv: list[str]
    url: str
    env: dict[str, str | None] = field(default_factory=dict)  # None: unset the variable
    events_endpoint: str = ""
    replay_endpoint: str = ""
    tmp_dir: Path | None = None  # the process's TMPDIR, removed when the fleet stops
    cpus: tuple[int, ...] = ()  # the CPUs it and its children may run on (empty: any)
    # SIGTERM to the main process alone, which stops its children (SGLang: to them too, it
    # takes its crash path, waits 5 s and kills them)
    stop_main_only: bool = False
    # files in /dev/shm that it leaves behind: those its processes hold open or mapped with
    # these prefixes are removed once it has stopped
    shm_prefixes: tuple[str, ...] = ()
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
