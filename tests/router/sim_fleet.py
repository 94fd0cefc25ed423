"""Engine simulators with their KV events, a real conductor and a router process: the
fleet the router's service tests run in front of (``fleet`` fixture, conftest)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp

from tests.router.inprocess import MODEL, ServedRouter
from tests.support.processes import ConductorProcess, EngineSim, RouterProcess, free_port

BLOCK_SIZE = 4
AnyRouter = RouterProcess | ServedRouter  # a router process, or one in this process


class Fleet:
    """A conductor, engine simulators whose event streams the router registers, a router."""

    def __init__(self, tmp_path: Path, conductor_config: dict[str, Any] | None = None) -> None:
        self.tmp_path = tmp_path
        self.conductor = ConductorProcess(tmp_path, config=conductor_config)
        self.conductor.wait_ready()  # its URL is final once it listens
        self.engines: dict[str, EngineSim] = {}
        self.kv_ports: dict[str, tuple[int, int]] = {}
        self.router: RouterProcess | None = None

    def engine(
        self, name: str, *args: str, time_scale: float = 0.05, env: dict[str, str] | None = None
    ) -> EngineSim:
        pub, replay = self.kv_ports.setdefault(name, (free_port(), free_port()))
        events = {
            "enable_kv_cache_events": True,
            "endpoint": f"tcp://127.0.0.1:{pub}",
            "replay_endpoint": f"tcp://127.0.0.1:{replay}",
        }
        engine = EngineSim(
            self.tmp_path,
            name,
            "--kv-events-config",
            json.dumps(events),
            "--sim-kv-bind",
            "--num-gpu-blocks-override",
            "512",
            *args,
            time_scale=time_scale,
            port=self.engines[name].port if name in self.engines else None,
            env=env,
        )
        engine.wait_ready()  # its URL is final once it listens
        self.engines[name] = engine
        return engine

    def config(self, prefill: list[str], decode: list[str] = (), **routing: Any) -> dict:
        """The upstream layout: one model served by the ``prefill`` engines."""
        return {
            "conductor": self.conductor_section(),
            "prefill": {
                "config": {"modelname": MODEL, "block_size": BLOCK_SIZE},
                "instances": [self.instance(name) for name in prefill],
            },
            "decode": {
                "instances": [
                    {"instance_id": name, "http_endpoint": self.engines[name].url}
                    for name in decode
                ]
            },
            "routing": routing,
        }

    def models_config(self, models: dict[str, dict[str, Any]], **sections: Any) -> dict:
        """Several models: each name's ``{"engines": [...], ...its other settings}``."""
        return {
            "conductor": self.conductor_section(),
            "models": [
                {
                    "modelname": name,
                    "block_size": BLOCK_SIZE,
                    "instances": [self.instance(engine) for engine in model["engines"]],
                    **{k: v for k, v in model.items() if k != "engines"},
                }
                for name, model in models.items()
            ],
            **sections,
        }

    def conductor_section(self) -> dict[str, Any]:
        return {
            "address": self.conductor.url,
            "query_timeout_seconds": 0.5,
            "reregister_interval_seconds": 0.5,
        }

    def instance(self, name: str) -> dict[str, Any]:
        """Engine ``name`` as a prefill instance, with its event stream."""
        pub, replay = self.kv_ports[name]
        return {
            "instance_id": name,
            "http_endpoint": self.engines[name].url,
            "registrations": [
                {
                    "endpoint": f"tcp://127.0.0.1:{pub}",
                    "replay_endpoint": f"tcp://127.0.0.1:{replay}",
                    "dp_rank": 0,
                }
            ],
        }

    def start_router(self, config: dict[str, Any], *args: str) -> RouterProcess:
        self.router = RouterProcess(self.tmp_path, config, *args)
        self.router.wait_ready()
        return self.router

    def stop(self) -> None:
        for process in (self.router, *self.engines.values(), self.conductor):
            if process is not None:
                process.stop()


async def complete(
    http: aiohttp.ClientSession, router: AnyRouter, prompt: str | list[int], **body: Any
) -> tuple[int, dict[str, str], Any]:
    request = {"model": MODEL, "prompt": prompt, "max_tokens": 4, **body}
    async with http.post(f"{router.url}/v1/completions", json=request) as response:
        return response.status, dict(response.headers), await response.json(content_type=None)
