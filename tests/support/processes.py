"""The project's services as real subprocesses on 127.0.0.1 (``publishers.local``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from publishers.local import LocalService, free_port

REPO = Path(__file__).resolve().parents[2]

__all__ = ["REPO", "ConductorProcess", "EngineSim", "RouterProcess", "free_port"]


class ConductorProcess(LocalService):
    """The conductor, with a config file (absent unless ``config`` is given)."""

    def __init__(
        self,
        tmp_path: Path,
        *args: str,
        config: dict[str, Any] | None = None,
        port: int | None = None,
    ) -> None:
        config_path = tmp_path / "conductor_config.json"
        config_path.write_text(json.dumps(config or {}))
        super().__init__(
            tmp_path,
            "conductor",
            "conductor",
            "--config",
            str(config_path),
            *args,
            port=port,
            env={"CONDUCTOR_LOG_LEVEL": "DEBUG"},
        )


class EngineSim(LocalService):
    """The engine simulator (``publishers.engine``) serving model ``model``."""

    def __init__(
        self,
        log_dir: Path,
        instance_id: str,
        *args: str,
        model: str = "m",
        block_size: int = 4,
        time_scale: float = 0.01,
        port: int | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.instance_id = instance_id
        super().__init__(
            log_dir,
            f"engine-{instance_id}",
            "publishers.engine",
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
            env=env,
        )


class RouterProcess(LocalService):
    """``mooncake-router`` with a config file written from ``config``."""

    def __init__(self, tmp_path: Path, config: dict[str, Any], *args: str) -> None:
        config_path = tmp_path / f"router-{free_port()}.json"
        config_path.write_text(json.dumps(config))
        super().__init__(tmp_path, "router", "router", "--config", str(config_path), *args)
